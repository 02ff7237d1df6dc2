; Serial console across a snapshot: sets LCR = 8N1 (0x03) and the scratch register to 0x5a,
; prints "before|", stops at pause point 1, then reads back scratch and LCR (checkpoints),
; prints "after" and reports done 0.
%include "abi.inc"
org LOAD
start:
    PARK_APS
    mov dx, 0x3fb
    mov al, 3
    out dx, al
    mov dx, 0x3ff
    mov al, 0x5a
    out dx, al
    mov rsi, msg1
    call puts
    SIGNAL PORT_PAUSE_POINT, 1
    mov dx, 0x3ff
    in al, dx
    movzx ebx, al
    SIGNAL PORT_CHECKPOINT, ebx
    mov dx, 0x3fb
    in al, dx
    movzx ebx, al
    SIGNAL PORT_CHECKPOINT, ebx
    mov rsi, msg2
    call puts
    SIGNAL PORT_DONE, 0

puts:
    mov al, [rsi]
    test al, al
    jz .end
    mov dx, 0x3f8
    out dx, al
    inc rsi
    jmp puts
.end:
    ret

msg1: db "before|", 0
msg2: db "after", 0
