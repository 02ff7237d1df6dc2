; virtio-vsock driven from CPL3 by polling (device window at PARAMS+0, host port at PARAMS+8).
; Guest CID 3 connects from port 1000 to the host (CID 2) port from PARAMS+8, expects a
; RESPONSE, sends "ping", waits for the host's data and reports its length and first dword,
; then shuts the connection down and expects RST. Checkpoints: guest CID (low dword from config),
; rx op codes, data length, data dword. Fails: 0x40+n = unexpected op in rx packet n.
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
%define RXB  0x240000
%define TXB  0x230000

; header field offsets
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

; TXPKT addr, op, len, flags, fwd_cnt
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

; CHECK_RX n, op: rx packet n (in buffer n) must carry op.
%macro CHECK_RX 2
    WAIT_USED RXU, %1 + 1
    movzx ebx, word [RXB + %1 * 0x1000 + H_OP]
    SIGNAL PORT_CHECKPOINT, ebx
    cmp ebx, %2
    je %%ok
    FAIL 0x40 + %1
%%ok:
%endmacro

org LOAD
start:
    VIRTIO_START 19
    SETUP_QUEUE 0, 8, RXD, RXA, RXU
    SETUP_QUEUE 1, 8, TXD, TXA, TXU
    SETUP_QUEUE 2, 8, EVD, EVA, EVU
    DRIVER_OK
    mov ebx, [r15 + R_CONFIG]
    SIGNAL PORT_CHECKPOINT, ebx

    ; four rx buffers of 4 KiB
    DESC RXD, 0, RXB, 4096, D_WRITE, 0
    DESC RXD, 1, RXB + 0x1000, 4096, D_WRITE, 0
    DESC RXD, 2, RXB + 0x2000, 4096, D_WRITE, 0
    DESC RXD, 3, RXB + 0x3000, 4096, D_WRITE, 0
    mov dword [RXA + 4], 0x00010000
    mov dword [RXA + 8], 0x00030002
    mov word [RXA + 2], 4
    NOTIFY 0

    ; REQUEST
    TXPKT TXB, 1, 0, 0, 0
    DESC TXD, 0, TXB, 44, 0, 0
    PUBLISH TXA, 0, 0, 1
    NOTIFY 1
    CHECK_RX 0, 2

    ; RW "ping"
    TXPKT TXB + 0x100, 5, 4, 0, 0
    mov dword [TXB + 0x100 + 44], 0x676e6970   ; "ping"
    DESC TXD, 1, TXB + 0x100, 48, 0, 0
    PUBLISH TXA, 1, 1, 2
    NOTIFY 1

    ; the host answers; the device's backend worker delivers it
    CHECK_RX 1, 5
    mov ebx, [RXB + 0x1000 + H_LEN]
    SIGNAL PORT_CHECKPOINT, ebx
    mov ebx, [RXB + 0x1000 + 44]
    SIGNAL PORT_CHECKPOINT, ebx

    ; SHUTDOWN (both directions), acknowledging the bytes received
    mov ebx, [RXB + 0x1000 + H_LEN]
    TXPKT TXB + 0x200, 4, 0, 3, 0
    mov [TXB + 0x200 + H_FWD], ebx
    DESC TXD, 2, TXB + 0x200, 44, 0, 0
    PUBLISH TXA, 2, 2, 3
    NOTIFY 1
    CHECK_RX 2, 3
    SIGNAL PORT_DONE, 0
    jmp $
