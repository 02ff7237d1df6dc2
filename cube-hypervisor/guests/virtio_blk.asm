; virtio-blk driven from CPL3 by polling (device window address at PARAMS+0).
; 1. reads sector 0 and reports its first and last dwords as checkpoints;
; 2. writes sector 1 with 0x5a bytes; 3. GET_ID, first dword as checkpoint;
; 4. reads sector 1 back and checks it; 5. reports InterruptStatus, acks it; done 0.
; Fails: 0x20+n = bad status byte of request n, 0x30 = readback mismatch.
%include "abi.inc"
%include "virtio_driver.inc"

%define QD   0x200000
%define QA   0x201000
%define QU   0x202000
%define HDR  0x203000
%define STAT 0x203100
%define BUF  0x210000
%define WBUF 0x211000

org LOAD
start:
    VIRTIO_START 2
    SETUP_QUEUE 0, 8, QD, QA, QU
    DRIVER_OK

    ; 1. read sector 0
    mov dword [HDR], 0
    mov qword [HDR + 8], 0
    mov byte [STAT], 0xff
    DESC QD, 0, HDR, 16, D_NEXT, 1
    DESC QD, 1, BUF, 512, D_NEXT | D_WRITE, 2
    DESC QD, 2, STAT, 1, D_WRITE, 0
    PUBLISH QA, 0, 0, 1
    NOTIFY 0
    WAIT_USED QU, 1
    cmp byte [STAT], 0
    je .r1
    FAIL 0x21
.r1:
    mov ebx, [BUF]
    SIGNAL PORT_CHECKPOINT, ebx
    mov ebx, [BUF + 508]
    SIGNAL PORT_CHECKPOINT, ebx

    ; 2. write sector 1
    mov rdi, WBUF
    mov al, 0x5a
    mov rcx, 512
    rep stosb
    mov dword [HDR], 1
    mov qword [HDR + 8], 1
    mov byte [STAT], 0xff
    DESC QD, 3, HDR, 16, D_NEXT, 4
    DESC QD, 4, WBUF, 512, D_NEXT, 5
    DESC QD, 5, STAT, 1, D_WRITE, 0
    PUBLISH QA, 1, 3, 2
    NOTIFY 0
    WAIT_USED QU, 2
    cmp byte [STAT], 0
    je .r2
    FAIL 0x22
.r2:
    ; 3. GET_ID into BUF
    mov dword [HDR], 8
    mov qword [HDR + 8], 0
    mov byte [STAT], 0xff
    DESC QD, 6, HDR, 16, D_NEXT, 7
    DESC QD, 7, BUF, 20, D_NEXT | D_WRITE, 0
    mov word [QD + 7 * 16 + 14], 2      ; next = 2 (the status descriptor)
    PUBLISH QA, 2, 6, 3
    NOTIFY 0
    WAIT_USED QU, 3
    cmp byte [STAT], 0
    je .r3
    FAIL 0x23
.r3:
    mov ebx, [BUF]
    SIGNAL PORT_CHECKPOINT, ebx

    ; 4. read sector 1 back (reuse chain 0 with sector 1)
    mov dword [HDR], 0
    mov qword [HDR + 8], 1
    mov byte [STAT], 0xff
    PUBLISH QA, 3, 0, 4
    NOTIFY 0
    WAIT_USED QU, 4
    cmp byte [STAT], 0
    je .r4
    FAIL 0x24
.r4:
    mov rsi, BUF
    mov rcx, 512
.cmp:
    cmp byte [rsi], 0x5a
    je .next
    FAIL 0x30
.next:
    inc rsi
    dec rcx
    jnz .cmp
    ; used length of the readback: 512 data + 1 status
    mov ebx, [QU + 4 + 3 * 8 + 4]
    SIGNAL PORT_CHECKPOINT, ebx

    ; 5. interrupt status, then ack
    mov ebx, [r15 + R_ISR]
    mov [r15 + R_ISRACK], ebx
    SIGNAL PORT_CHECKPOINT, ebx
    mov ebx, [r15 + R_ISR]
    SIGNAL PORT_CHECKPOINT, ebx
    SIGNAL PORT_DONE, 0
    jmp $
