; Timer interrupts: programs the PIC (vectors 0x20..) and the PIT (channel 0, ~1 kHz), installs
; an interrupt gate for vector 0x20 whose handler (CPL0, emulated) counts ticks at DATA and
; acknowledges the PIC, and waits (IF is set from the start) for params+0 ticks (default 3).
; Exit code 0 when the ticks arrived, 3 when the wait gave up (params+8 loop budget, in 2^20 units).
%include "abi.inc"
org LOAD
start:
    PARK_APS
    mov qword [DATA], 0
    ; IDT gate 0x20 -> tick (interrupt gate, DPL0, selector 0x10)
    lea rax, [tick]
    mov rbx, IDT + 0x20 * 16
    mov word [rbx], ax
    mov word [rbx + 2], 0x10
    mov word [rbx + 4], 0x8e00
    shr rax, 16
    mov word [rbx + 6], ax
    shr rax, 16
    mov dword [rbx + 8], eax
    mov dword [rbx + 12], 0
    ; PIC: ICW1..4, master vectors 0x20, slave 0x28, only IRQ0 unmasked
    mov al, 0x11
    out 0x20, al
    out 0xa0, al
    mov al, 0x20
    out 0x21, al
    mov al, 0x28
    out 0xa1, al
    mov al, 4
    out 0x21, al
    mov al, 2
    out 0xa1, al
    mov al, 1
    out 0x21, al
    out 0xa1, al
    mov al, 0xfe
    out 0x21, al
    mov al, 0xff
    out 0xa1, al
    ; PIT channel 0, mode 2, divisor 1193 (~1 kHz)
    mov al, 0x34
    out 0x43, al
    mov ax, 1193
    out 0x40, al
    mov al, ah
    out 0x40, al
    mov rcx, [PARAMS]
    test rcx, rcx
    jnz .have_n
    mov rcx, 3
.have_n:
    mov r9, [PARAMS + 8]
    test r9, r9
    jnz .have_budget
    mov r9, 4096
.have_budget:
    shl r9, 20
    ; IF is already set by the VMM (CPL3 cannot sti on PVM)
.wait:
    cmp [DATA], rcx
    jae .ok
    dec r9
    jz .gave_up
    pause
    jmp .wait
.ok:
    mov al, 0xff
    out 0x21, al
    mov rbx, [DATA]
    SIGNAL PORT_CHECKPOINT, ebx
    SIGNAL PORT_DONE, 0
.gave_up:
    mov al, 0xff
    out 0x21, al
    SIGNAL PORT_DONE, 3

tick:
    push rax
    inc qword [DATA]
    mov al, 0x20
    out 0x20, al
    pop rax
    iretq
