; Every vCPU counts forever: r12 and the qword at DATA + 64 * index hold the same count,
; r13 = 0x1111 * (index + 1). Used to snapshot a guest asynchronously, mid-flight.
%include "abi.inc"
org LOAD
start:
    mov rax, rdi
    shl rax, 6
    lea rbx, [DATA + rax]
    lea r13, [rdi + 1]
    imul r13, r13, 0x1111
    xor r12, r12
    SIGNAL PORT_CHECKPOINT, 0x5b1
.loop:
    inc r12
    mov [rbx], r12
    jmp .loop
