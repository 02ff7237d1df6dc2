; A minimal bzImage for testing the loader's 64-bit boot protocol path: one setup sector with
; the setup header (boot protocol 2.12, XLF_KERNEL_64), then the "protected-mode kernel" loaded
; at 1 MiB whose 64-bit entry (load address + 0x200) runs at CPL0 (emulated on PVM) with
; rsi = zero page. Reports the number of e820 entries, the first command line byte and the last
; e820 entry's type as checkpoints, then done 0.
%define PORT_DONE        0x500
%define PORT_CHECKPOINT  0x501
org 0
    times 0x1f1 db 0
    db 1                    ; 0x1f1 setup_sects
    dw 0                    ; root_flags
    dd 0                    ; syssize
    dw 0, 0, 0              ; ram_size, vid_mode, root_dev
    dw 0xaa55               ; 0x1fe boot_flag
    dw 0                    ; 0x200 jump
    db "HdrS"               ; 0x202 header
    dw 0x020f               ; 0x206 version
    dd 0                    ; realmode_swtch
    dw 0, 0                 ; start_sys_seg, kernel_version
    db 0                    ; 0x210 type_of_loader
    db 1                    ; 0x211 loadflags: LOADED_HIGH
    dw 0                    ; setup_move_size
    dd 0x100000             ; 0x214 code32_start
    dd 0, 0, 0              ; ramdisk_image, ramdisk_size, bootsect_kludge
    dw 0                    ; 0x224 heap_end_ptr
    db 0, 0                 ; ext_loader_ver, ext_loader_type
    dd 0                    ; 0x228 cmd_line_ptr
    dd 0x7fffffff           ; initrd_addr_max
    dd 0x200000             ; 0x230 kernel_alignment
    db 0, 0                 ; relocatable, min_alignment
    dw 1                    ; 0x236 xloadflags: XLF_KERNEL_64
    dd 255                  ; 0x238 cmdline_size
    times 1024 - ($ - $$) db 0
kernel:                     ; loaded at 0x100000
    times 0x200 db 0xf4
bits 64
entry64:
    movzx eax, byte [rsi + 0x1e8]
    mov ebx, eax
    mov dx, PORT_CHECKPOINT
    out dx, eax
    mov ecx, [rsi + 0x228]
    movzx eax, byte [rcx]
    out dx, eax
    lea ecx, [ebx - 1]
    imul ecx, ecx, 20
    mov eax, [rsi + rcx + 0x2d0 + 16]
    out dx, eax
    xor eax, eax
    mov dx, PORT_DONE
    out dx, eax
