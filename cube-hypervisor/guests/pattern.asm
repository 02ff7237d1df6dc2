; Fills [DATA, DATA+size) with qword (address ^ seed), stops at a pause point (the place to
; snapshot), then on resume verifies the pattern and registers, rewrites the region with
; (address ^ clone_id) and reports done.
; params: +0 size in bytes (multiple of 8), +8 seed, +16 clone id (written by the host after
; a restore). Result: r13 = sum of the region after phase 2, r14 = 0xc0ffee, r15 = phase.
; Exit codes: 0 ok, 1 pattern changed under us, 2 register lost.
%include "abi.inc"
org LOAD
start:
    PARK_APS
    mov rcx, [PARAMS]
    mov rbx, [PARAMS + 8]
    mov r8, DATA
    xor r13, r13
    xor r10, r10
.fill:
    cmp r10, rcx
    jae .filled
    lea r9, [r8 + r10]
    xor r9, rbx
    mov [r8 + r10], r9
    add r13, r9
    add r10, 8
    jmp .fill
.filled:
    mov r14, 0xc0ffee
    mov r15, 1
    SIGNAL PORT_PAUSE_POINT, 1
    ; phase 2: rcx, rbx, r8, r13, r14 must have survived the snapshot/restore
    cmp r14, 0xc0ffee
    jne .lost
    mov r15, 2
    xor r11, r11
    xor r10, r10
.verify:
    cmp r10, rcx
    jae .verified
    add r11, [r8 + r10]
    add r10, 8
    jmp .verify
.verified:
    cmp r11, r13
    jne .changed
    mov rbx, [PARAMS + 16]
    xor r13, r13
    xor r10, r10
.rewrite:
    cmp r10, rcx
    jae .rewritten
    lea r9, [r8 + r10]
    xor r9, rbx
    mov [r8 + r10], r9
    add r13, r9
    add r10, 8
    jmp .rewrite
.rewritten:
    mov r15, 3
    SIGNAL PORT_DONE, 0
.changed:
    SIGNAL PORT_DONE, 1
.lost:
    SIGNAL PORT_DONE, 2
