; Benchmark guest. Phase A: writes one qword to each 4 KiB page of [DATA, DATA+params+0)
; (the template's working set), stops at pause point 1 (snapshot here). On resume its very
; next instruction reports checkpoint 2 (the "first guest instruction" after a restore).
; Phase B: writes one qword to each page of [params+16, params+16+params+8) (dirtying memory),
; stops at pause point 3, then reports done 0.
%include "abi.inc"
org LOAD
start:
    PARK_APS
    mov rcx, [PARAMS]
    mov r8, DATA
    xor r10, r10
.touch:
    cmp r10, rcx
    jae .touched
    mov [r8 + r10], r10
    add r10, 4096
    jmp .touch
.touched:
    SIGNAL PORT_PAUSE_POINT, 1
    SIGNAL PORT_CHECKPOINT, 2
    mov rcx, [PARAMS + 8]
    mov r8, [PARAMS + 16]
    xor r10, r10
.dirty:
    cmp r10, rcx
    jae .dirtied
    mov [r8 + r10], r10
    add r10, 4096
    jmp .dirty
.dirtied:
    SIGNAL PORT_PAUSE_POINT, 3
    SIGNAL PORT_DONE, 0
