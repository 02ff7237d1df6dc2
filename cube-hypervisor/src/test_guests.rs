//! Flat test guests (nasm sources in `guests/`, assembled by `build.rs`) and their ABI.
//!
//! # Guest ABI
//! * The image is loaded at [`LOAD_ADDR`] (1 MiB) and every vCPU starts there, in 64-bit long
//!   mode at **CPL3** (user mode runs natively on PVM hosts, kernel mode is emulated), with
//!   `rdi` = vCPU index, `rsi` = vCPU count, `rsp` = 0xff000 − index × 16 KiB, and
//!   **interrupts enabled** (RFLAGS.IF = 1): on PVM the guest runs with hardware IOPL 0, so
//!   `cli`/`sti` fault at CPL3; nothing interrupts until the guest programs a source (PIC, PIT,
//!   LAPIC), and it masks the source to stop. All ports are allowed by the TSS I/O bitmap.
//! * CR4.OSXSAVE with XCR0 = every XSAVE component KVM offers (where it takes them), as a guest
//!   kernel would set up, so user code may use the widest vector state (on PVM user mode has
//!   the host's XCR0 anyway).
//! * 0–4 GiB is identity-mapped with 2 MiB user-writable pages; addresses beyond guest RAM reach
//!   the MMIO bus (virtio-mmio windows from 0xc000_0000, the LAPIC at 0xfee0_0000).
//! * GDT at 0x1000 (kernel code 0x10, kernel data 0x18, user data 0x23, user code 0x2b), an empty
//!   IDT at 0x2000 (256 gates; a guest fills in the ones it needs, gates run at CPL0 on the
//!   stack ending at 0x7f000, emulated and slow), TSS at 0x3000.
//! * [`PARAMS_ADDR`]: 4 KiB the host may fill before starting (e.g. with [`crate::Vm::write_u64`]).
//! * [`DATA_ADDR`] (2 MiB) up to the end of RAM: free for the guest.
//! * Signals to the VMM, all `out` instructions with the value in `eax`:
//!   [`ports::DONE`] (exit code, 0 = success; the vCPU stops), [`ports::CHECKPOINT`] (value
//!   recorded, the vCPU continues), [`ports::PAUSE_POINT`] (the vCPU stops right after the
//!   `out`; resuming continues with the next instruction — the place to snapshot),
//!   [`ports::PARK`] (the vCPU stops silently; secondary vCPUs of single-threaded guests loop on it).

/// Debug ports the VMM itself handles.
pub mod ports {
    pub const DONE: u16 = 0x500;
    pub const CHECKPOINT: u16 = 0x501;
    pub const PAUSE_POINT: u16 = 0x502;
    pub const PARK: u16 = 0x503;
}

pub const LOAD_ADDR: u64 = crate::arch::layout::GUEST_LOAD_ADDR;
pub const PARAMS_ADDR: u64 = 0x8000;
pub const DATA_ADDR: u64 = 0x20_0000;

include!(concat!(env!("OUT_DIR"), "/test_guests.rs"));
