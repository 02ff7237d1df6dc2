; Stand-in for cube-agent on hosts where Linux cannot boot (PVM): a CPL3 test guest that does
; what the microvm runtime needs from an agent, over virtio-vsock driven by polling (device window
; at PARAMS+0, host init port at PARAMS+8).
;
; Round: (re)set the vsock device up and post four rx buffers. The very first round then stops at
; pause point 0xa9e7 ("agent ready"): template builds snapshot the VM there. Every restored or
; resumed copy continues by connecting from port 1000 to the host's init port, sending "redy",
; receiving the init payload (one RW packet, kept in rx buffer 1 at INIT_DATA, its length at
; INIT_LEN), shutting the connection down (host sees EOF = init applied) and expecting RST.
; Checkpoints per round: payload length, its first dword (magic), its dword at offset 16
; (first entropy dword), then 0xd0e. Then the vCPU parks (idle sandbox, no CPU used). When a
; resume or restore runs it again it reports checkpoint 0x77 and does a new round: every copy
; of a snapshot asks for a fresh init (new entropy, clock). Fails: 0x40+n = unexpected op in
; rx packet n of a round.
%include "abi.inc"
%include "virtio_driver.inc"

%define RXD  0x200000
%define RXA  0x201000
%define RXU  0x202000
%define TXD  0x204000
%define TXA  0x205000
%define TXU  0x206000
%define EVD  0x208000
%define EVA  0x209000
%define EVU  0x20a000
%define TXB  0x230000
%define RXB  0x240000
%define FIRST_DONE 0x250000

%define H_SRC_CID  0
%define H_DST_CID  8
%define H_SRC_PORT 16
%define H_DST_PORT 20
%define H_LEN      24
%define H_TYPE     28
%define H_OP       30
%define H_FLAGS    32
%define H_BUF      36
%define H_FWD      40

%macro TXPKT 5
    mov qword [%1 + H_SRC_CID], 3
    mov qword [%1 + H_DST_CID], 2
    mov dword [%1 + H_SRC_PORT], 1000
    mov eax, [PARAMS + 8]
    mov dword [%1 + H_DST_PORT], eax
    mov dword [%1 + H_LEN], %3
    mov word [%1 + H_TYPE], 1
    mov word [%1 + H_OP], %2
    mov dword [%1 + H_FLAGS], %4
    mov dword [%1 + H_BUF], 65536
    mov dword [%1 + H_FWD], %5
%endmacro

%macro CHECK_RX 2
    WAIT_USED RXU, %1 + 1
    movzx ebx, word [RXB + %1 * 0x1000 + H_OP]
    cmp ebx, %2
    je %%ok
    FAIL 0x40 + %1
%%ok:
%endmacro

org LOAD
start:
    PARK_APS
    ; A device reset (status 0 in VIRTIO_START) zeroes its ring indices: start the rings clean.
    xor eax, eax
    mov rcx, 0x1000 / 4
    mov rdi, RXA
    rep stosd
    mov rcx, 0x1000 / 4
    mov rdi, RXU
    rep stosd
    mov rcx, 0x1000 / 4
    mov rdi, TXA
    rep stosd
    mov rcx, 0x1000 / 4
    mov rdi, TXU
    rep stosd
    xor edi, edi                      ; vCPU 0 (rep stosd moved rdi)
    VIRTIO_START 19
    SETUP_QUEUE 0, 8, RXD, RXA, RXU
    SETUP_QUEUE 1, 8, TXD, TXA, TXU
    SETUP_QUEUE 2, 8, EVD, EVA, EVU
    DRIVER_OK
    DESC RXD, 0, RXB, 4096, D_WRITE, 0
    DESC RXD, 1, RXB + 0x1000, 4096, D_WRITE, 0
    DESC RXD, 2, RXB + 0x2000, 4096, D_WRITE, 0
    DESC RXD, 3, RXB + 0x3000, 4096, D_WRITE, 0
    mov dword [RXA + 4], 0x00010000
    mov dword [RXA + 8], 0x00030002
    mov word [RXA + 2], 4
    NOTIFY 0

    cmp dword [FIRST_DONE], 0
    jne connect
    mov dword [FIRST_DONE], 1
    SIGNAL PORT_PAUSE_POINT, 0xa9e7

connect:
    ; REQUEST
    TXPKT TXB, 1, 0, 0, 0
    DESC TXD, 0, TXB, 44, 0, 0
    PUBLISH TXA, 0, 0, 1
    NOTIFY 1
    CHECK_RX 0, 2

    ; RW "redy"
    TXPKT TXB + 0x100, 5, 4, 0, 0
    mov dword [TXB + 0x100 + 44], 0x79646572
    DESC TXD, 1, TXB + 0x100, 48, 0, 0
    PUBLISH TXA, 1, 1, 2
    NOTIFY 1

    ; the init payload
    CHECK_RX 1, 5
    mov ebx, [RXB + 0x1000 + H_LEN]
    SIGNAL PORT_CHECKPOINT, ebx
    mov ebx, [RXB + 0x1000 + 44]
    SIGNAL PORT_CHECKPOINT, ebx
    mov ebx, [RXB + 0x1000 + 44 + 16]
    SIGNAL PORT_CHECKPOINT, ebx

    ; SHUTDOWN both ways, acknowledging the payload; the host sees EOF
    mov ebx, [RXB + 0x1000 + H_LEN]
    TXPKT TXB + 0x200, 4, 0, 3, 0
    mov [TXB + 0x200 + H_FWD], ebx
    DESC TXD, 2, TXB + 0x200, 44, 0, 0
    PUBLISH TXA, 2, 2, 3
    NOTIFY 1
    CHECK_RX 2, 3
    SIGNAL PORT_CHECKPOINT, 0xd0e

idle:
    mov dx, PORT_PARK
    out dx, eax
    SIGNAL PORT_CHECKPOINT, 0x77
    jmp start
