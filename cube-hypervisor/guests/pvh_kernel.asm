; A minimal ELF "kernel" with a PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY), for testing the
; loader's PVH path. Entered in 32-bit protected mode at CPL0 (emulated on PVM: keep it short)
; with ebx = hvm_start_info. Reports, as checkpoints: the first byte of the command line, the
; number of memory map entries and the type of the last entry; done 0, or done 1 on a bad magic.
%define PORT_DONE        0x500
%define PORT_CHECKPOINT  0x501
%define BASE 0x100000
bits 32
org 0
ehdr:
    db 0x7f, "ELF", 2, 1, 1, 0
    times 8 db 0
    dw 2                    ; ET_EXEC
    dw 0x3e                 ; EM_X86_64
    dd 1
    dq BASE + entry32       ; e_entry (unused by PVH)
    dq phdrs - ehdr         ; e_phoff
    dq 0                    ; e_shoff
    dd 0
    dw 64                   ; e_ehsize
    dw 56                   ; e_phentsize
    dw 2                    ; e_phnum
    dw 64, 0, 0
phdrs:
    dd 1, 7                 ; PT_LOAD, RWX
    dq 0, BASE, BASE
    dq file_end, file_end
    dq 0x1000
    dd 4, 4                 ; PT_NOTE, R
    dq note, BASE + note, BASE + note
    dq note_end - note, note_end - note
    dq 4
note:
    dd 4, 4, 18
    db "Xen", 0
    dd BASE + entry32
note_end:
entry32:
    cmp dword [ebx], 0x336ec578
    jne .bad
    mov esi, [ebx + 24]     ; cmdline_paddr (low half)
    movzx eax, byte [esi]
    mov dx, PORT_CHECKPOINT
    out dx, eax
    mov eax, [ebx + 48]     ; memmap_entries
    out dx, eax
    mov ecx, eax
    dec ecx
    imul ecx, ecx, 24
    add ecx, [ebx + 40]     ; memmap_paddr + 24 * (n - 1)
    mov eax, [ecx + 16]     ; type
    out dx, eax
    mov eax, 0
    mov dx, PORT_DONE
    out dx, eax
.bad:
    mov eax, 1
    mov dx, PORT_DONE
    out dx, eax
file_end:
