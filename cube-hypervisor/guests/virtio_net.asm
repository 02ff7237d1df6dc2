; virtio-net driven from CPL3 by polling (device window at PARAMS+0).
; Reports the first 4 MAC bytes, posts one rx buffer, sends one 60-byte broadcast frame whose
; payload starts with "CUBE", waits for a frame from the host (the test answers on the tap
; side), then reports the rx used length and the dword at payload offset 0 (after the 12-byte
; virtio_net_hdr and the 14-byte ethernet header). Done 0.
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

org LOAD
start:
    VIRTIO_START 1
    SETUP_QUEUE 0, 8, RXD, RXA, RXU
    SETUP_QUEUE 1, 8, TXD, TXA, TXU
    DRIVER_OK
    mov ebx, [r15 + R_CONFIG]
    SIGNAL PORT_CHECKPOINT, ebx

    ; rx buffer
    DESC RXD, 0, RXB, 2048, D_WRITE, 0
    PUBLISH RXA, 0, 0, 1
    NOTIFY 0

    ; tx: 12 zero header bytes, then dst ff:ff:ff:ff:ff:ff, src 02:00:00:00:00:01, type 0x88b5
    mov rdi, TXB
    xor eax, eax
    mov rcx, 12 + 60
    rep stosb
    mov dword [TXB + 12], 0xffffffff
    mov word [TXB + 16], 0xffff
    mov dword [TXB + 18], 0x00000002
    mov word [TXB + 22], 0x0100
    mov word [TXB + 24], 0xb588
    mov dword [TXB + 26], 0x45425543      ; "CUBE"
    DESC TXD, 0, TXB, 12 + 60, 0, 0
    PUBLISH TXA, 0, 0, 1
    NOTIFY 1
    WAIT_USED TXU, 1

    ; wait for the host's answer
    WAIT_USED RXU, 1
    mov ebx, [RXU + 4 + 4]
    SIGNAL PORT_CHECKPOINT, ebx
    mov ebx, [RXB + 12 + 14]
    SIGNAL PORT_CHECKPOINT, ebx
    SIGNAL PORT_DONE, 0
    jmp $
