; virtio-blk across a VM snapshot (device window at PARAMS+0).
; Before the pause point: writes sector 2 with 0xa1 (completed), then publishes a write of
; sector 3 with 0xb2 WITHOUT notifying, and stops at PAUSE_POINT 1 — the request is in flight
; in the avail ring when the host snapshots. After restore (into a new VM with a new disk and
; a restored device): notifies, waits for the in-flight write, reads sector 2 back and checks
; it. Checkpoints: used idx after resume, status of the in-flight write, first readback byte.
; Fails: 0x50 = readback mismatch, 0x51 = in-flight write failed.
%include "abi.inc"
%include "virtio_driver.inc"

%define QD   0x200000
%define QA   0x201000
%define QU   0x202000
%define HDR  0x203000
%define STAT 0x203100
%define HDR2 0x203200
%define STAT2 0x203300
%define BUF  0x210000
%define WBUF 0x211000
%define WBUF2 0x212000

org LOAD
start:
    VIRTIO_START 2
    SETUP_QUEUE 0, 8, QD, QA, QU
    DRIVER_OK

    ; write sector 2 = 0xa1, completed before the snapshot
    mov rdi, WBUF
    mov al, 0xa1
    mov rcx, 512
    rep stosb
    mov dword [HDR], 1
    mov qword [HDR + 8], 2
    mov byte [STAT], 0xff
    DESC QD, 0, HDR, 16, D_NEXT, 1
    DESC QD, 1, WBUF, 512, D_NEXT, 2
    DESC QD, 2, STAT, 1, D_WRITE, 0
    PUBLISH QA, 0, 0, 1
    NOTIFY 0
    WAIT_USED QU, 1

    ; write sector 3 = 0xb2, published but not notified
    mov rdi, WBUF2
    mov al, 0xb2
    mov rcx, 512
    rep stosb
    mov dword [HDR2], 1
    mov qword [HDR2 + 8], 3
    mov byte [STAT2], 0xff
    DESC QD, 3, HDR2, 16, D_NEXT, 4
    DESC QD, 4, WBUF2, 512, D_NEXT, 5
    DESC QD, 5, STAT2, 1, D_WRITE, 0
    PUBLISH QA, 1, 3, 2
    SIGNAL PORT_PAUSE_POINT, 1

    ; --- possibly in a restored VM from here on ---
    NOTIFY 0
    WAIT_USED QU, 2
    movzx ebx, word [QU + 2]
    SIGNAL PORT_CHECKPOINT, ebx
    movzx ebx, byte [STAT2]
    SIGNAL PORT_CHECKPOINT, ebx
    cmp byte [STAT2], 0
    je .ok
    FAIL 0x51
.ok:
    ; read sector 2 back into BUF (reuse descriptors 0..2 as a read)
    mov dword [HDR], 0
    mov word [QD + 1 * 16 + 12], D_NEXT | D_WRITE
    mov rax, BUF
    mov [QD + 1 * 16], rax
    PUBLISH QA, 2, 0, 3
    NOTIFY 0
    WAIT_USED QU, 3
    movzx ebx, byte [BUF]
    SIGNAL PORT_CHECKPOINT, ebx
    mov rsi, BUF
    mov rcx, 512
.cmp:
    cmp byte [rsi], 0xa1
    je .n
    FAIL 0x50
.n:
    inc rsi
    dec rcx
    jnz .cmp
    SIGNAL PORT_DONE, 0
    jmp $
