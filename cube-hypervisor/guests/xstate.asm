; Extended register state across a snapshot. At CPL3 the guest asks the CPU (CPUID, XGETBV: on
; PVM hosts these run natively, so it sees what the host's user mode sees) which vector state it
; may use, fills the widest there is with a pattern, stops at a pause point, and on resume
; checks every register it filled.
;   levels: 0 SSE (xmm0-15), 1 AVX (ymm0-15), 2 AVX-512 (zmm0-31, k0-7)
; Results at DATA: +0 CPUID.1:ECX, +8 CPUID.7.0:EBX, +16 XCR0 (0 when OSXSAVE is clear),
; +24 level used, +32 seed; phase in r15.
; params: +0 seed.
; Exit codes: 0 ok, 1 a vector register changed, 2 an opmask register changed, 3 a GPR lost.
%include "abi.inc"
org LOAD
start:
    PARK_APS
    mov rbp, DATA
    mov eax, 1
    xor ecx, ecx
    cpuid
    mov [rbp], rcx
    mov r8d, ecx
    mov eax, 7
    xor ecx, ecx
    cpuid
    mov [rbp + 8], rbx
    mov r9d, ebx
    xor r10, r10                ; XCR0
    bt r8d, 27                  ; OSXSAVE
    jnc .have_xcr0
    xor ecx, ecx
    xgetbv
    shl rdx, 32
    or rax, rdx
    mov r10, rax
.have_xcr0:
    mov [rbp + 16], r10
    xor r11, r11                ; level
    bt r8d, 28                  ; AVX
    jnc .level_done
    mov rax, r10
    and rax, 0x6
    cmp rax, 0x6                ; XMM | YMM enabled
    jne .level_done
    mov r11, 1
    bt r9d, 16                  ; AVX512F
    jnc .level_done
    bt r9d, 30                  ; AVX512BW (64-bit opmask moves)
    jnc .level_done
    mov rax, r10
    and rax, 0xe6
    cmp rax, 0xe6               ; + opmask, ZMM_Hi256, Hi16_ZMM
    jne .level_done
    mov r11, 2
.level_done:
    mov [rbp + 24], r11
    mov rbx, [PARAMS]
    mov [rbp + 32], rbx
    ; The pattern: 64 bytes per register at PAT + 64*i, qword j = seed ^ (i << 8) ^ j.
    lea rdi, [rbp + 0x1000]
    xor ecx, ecx
.pat:
    cmp ecx, 32 * 8
    jae .pat_done
    mov rax, rcx
    shr rax, 3
    shl rax, 8
    mov rdx, rcx
    and rdx, 7
    or rax, rdx
    xor rax, rbx
    mov [rdi + rcx * 8], rax
    inc ecx
    jmp .pat
.pat_done:
    cmp r11, 2
    je .fill512
    cmp r11, 1
    je .fill256
%assign i 0
%rep 16
    movdqu xmm %+ i, [rdi + i * 64]
%assign i i+1
%endrep
    jmp .filled
.fill256:
%assign i 0
%rep 16
    vmovdqu ymm %+ i, [rdi + i * 64]
%assign i i+1
%endrep
    jmp .filled
.fill512:
%assign i 0
%rep 32
    vmovdqu64 zmm %+ i, [rdi + i * 64]
%assign i i+1
%endrep
%assign i 0
%rep 8
    kmovq k %+ i, [rdi + i * 64]
%assign i i+1
%endrep
.filled:
    mov r14, 0xc0ffee
    mov r15, 1
    mov r12, r11
    mov r13, rdi
    SIGNAL PORT_PAUSE_POINT, 1
    mov r15, 2
    cmp r14, 0xc0ffee
    jne .lost
    ; Store every filled register next to its pattern (OUT = PAT + 0x1000) and compare.
    lea rsi, [r13 + 0x1000]
    cmp r12, 2
    je .store512
    cmp r12, 1
    je .store256
%assign i 0
%rep 16
    movdqu [rsi + i * 64], xmm %+ i
%assign i i+1
%endrep
    mov ecx, 16
    mov edx, 2                  ; qwords per register
    jmp .compare
.store256:
%assign i 0
%rep 16
    vmovdqu [rsi + i * 64], ymm %+ i
%assign i i+1
%endrep
    mov ecx, 16
    mov edx, 4
    jmp .compare
.store512:
%assign i 0
%rep 32
    vmovdqu64 [rsi + i * 64], zmm %+ i
%assign i i+1
%endrep
    ; opmask registers go to OUT2 = OUT + 0x1000, one qword each
%assign i 0
%rep 8
    kmovq [rsi + 0x1000 + i * 8], k %+ i
%assign i i+1
%endrep
    xor ecx, ecx
.kcmp:
    cmp ecx, 8
    jae .kok
    mov rax, rcx
    shl rax, 6
    mov rax, [r13 + rax]
    cmp rax, [rsi + 0x1000 + rcx * 8]
    jne .kchanged
    inc ecx
    jmp .kcmp
.kok:
    mov ecx, 32
    mov edx, 8
.compare:
    ; rcx registers, rdx qwords each
    xor r8, r8                  ; register
.creg:
    cmp r8, rcx
    jae .ok
    xor r9, r9                  ; qword
.cq:
    cmp r9, rdx
    jae .cnext
    mov rax, r8
    shl rax, 3
    add rax, r9
    mov r10, [r13 + rax * 8]
    cmp r10, [rsi + rax * 8]
    jne .vchanged
    inc r9
    jmp .cq
.cnext:
    inc r8
    jmp .creg
.ok:
    mov r15, 3
    SIGNAL PORT_DONE, 0
.vchanged:
    SIGNAL PORT_DONE, 1
.kchanged:
    SIGNAL PORT_DONE, 2
.lost:
    SIGNAL PORT_DONE, 3
