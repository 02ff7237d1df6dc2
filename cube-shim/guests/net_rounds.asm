; virtio-net guest for the shim's tap tests, driven from CPL3 by polling (device window at
; PARAMS+0). Sets the device up, posts three rx buffers, then stops at pause point 1 (the
; template is taken there). After that, three rounds k = 1..3: send a 60-byte broadcast frame
; (ethertype 0x88b5) whose payload dword is 0xc0be0000 + k, wait for the k-th rx frame and
; report its payload dword (after the 12-byte virtio_net_hdr and the 14-byte ethernet header)
; as a checkpoint. Done 0. Uses the hypervisor's test-guest ABI and driver macros.
%include "abi.inc"
%include "virtio_driver.inc"

%define RXD  0x200000
%define RXA  0x201000
%define RXU  0x202000
%define TXD  0x204000
%define TXA  0x205000
%define TXU  0x206000
%define RXB  0x220000
%define TXB  0x230000

; ROUND k: send frame k on tx slot k-1, wait for tx used k and rx used k, report rx frame k.
%macro ROUND 1
    mov dword [TXB + 26], 0xc0be0000 + %1
    PUBLISH TXA, (%1 - 1), 0, %1
    NOTIFY 1
    WAIT_USED TXU, %1
    WAIT_USED RXU, %1
    mov ebx, [RXB + (%1 - 1) * 0x1000 + 12 + 14]
    SIGNAL PORT_CHECKPOINT, ebx
%endmacro

org LOAD
start:
    VIRTIO_START 1
    SETUP_QUEUE 0, 8, RXD, RXA, RXU
    SETUP_QUEUE 1, 8, TXD, TXA, TXU
    DRIVER_OK

    ; three rx buffers, published at once
    DESC RXD, 0, RXB, 2048, D_WRITE, 0
    DESC RXD, 1, RXB + 0x1000, 2048, D_WRITE, 0
    DESC RXD, 2, RXB + 0x2000, 2048, D_WRITE, 0
    mov dword [RXA + 4], 0x00010000
    mov word [RXA + 8], 2
    mov word [RXA + 2], 3
    NOTIFY 0

    ; tx frame: 12 zero header bytes, dst broadcast, src 02:00:00:00:00:01, type 0x88b5
    mov rdi, TXB
    xor eax, eax
    mov rcx, 12 + 60
    rep stosb
    mov dword [TXB + 12], 0xffffffff
    mov word [TXB + 16], 0xffff
    mov dword [TXB + 18], 0x00000002
    mov word [TXB + 22], 0x0100
    mov word [TXB + 24], 0xb588
    DESC TXD, 0, TXB, 12 + 60, 0, 0

    SIGNAL PORT_PAUSE_POINT, 1

    ROUND 1
    ROUND 2
    ROUND 3
    SIGNAL PORT_DONE, 0
    jmp $
