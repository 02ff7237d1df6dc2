; Port and MMIO exits. Writes 0xab to port 0x10, reads port 0x10, writes 0x12345678 to MMIO
; 0xd0000000, reads a dword at 0xd0000004 and a qword at 0xd0000008, reports each value read as
; a checkpoint, and finishes with the sum of the three reads as checkpoint, exit code 0.
%include "abi.inc"
org LOAD
start:
    PARK_APS
    mov al, 0xab
    mov dx, 0x10
    out dx, al
    in al, dx
    movzx ebx, al
    SIGNAL PORT_CHECKPOINT, ebx
    mov r8, 0xd0000000
    mov dword [r8], 0x12345678
    mov ecx, [r8 + 4]
    SIGNAL PORT_CHECKPOINT, ecx
    mov r9, [r8 + 8]
    mov r10, r9
    shr r10, 32
    SIGNAL PORT_CHECKPOINT, r9d
    SIGNAL PORT_CHECKPOINT, r10d
    SIGNAL PORT_DONE, 0
