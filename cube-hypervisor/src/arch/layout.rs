//! Guest physical memory layout shared by the loader, the test guests and the kernel boot.
//!
//! ```text
//! 0x0000_1000  GDT                     0x0000_2000  IDT (256 x 16 bytes, empty at start)
//! 0x0000_3000  TSS (rsp0 = KERNEL_STACK_TOP) + I/O bitmap allowing every port, up to 0x5069
//! 0x0000_8000  test guest parameters (4 KiB)
//! 0x0000_6000  PVH start info          0x0000_7000  zero page (bzImage) / PVH memory map
//! 0x0000_9000  PML4  0xa000 PDPT  0xb000..0xefff  4 page directories: 0-4 GiB identity, 2 MiB pages
//! 0x0002_0000  kernel command line (up to 64 KiB)
//! 0x0007_f000  top of the ring-0 stack (interrupt handlers, kernel boot)
//! 0x0009_fc00  MP table (kernel boot only)
//! 0x000f_f000  top of the vCPU 0 user stack (vCPU n: minus n * 16 KiB)
//! 0x0010_0000  test guest load address and entry / kernel load address
//! 0xc000_0000  start of the MMIO hole (virtio-mmio windows), RAM must end below it
//! ```

pub const GDT_ADDR: u64 = 0x1000;
pub const IDT_ADDR: u64 = 0x2000;
pub const TSS_ADDR: u64 = 0x3000;
/// 104-byte TSS + an all-zero I/O permission bitmap for ports 0..0xffff + the 0xff end byte:
/// PVM runs the guest with hardware IOPL 0, so ring-3 port access is allowed by the bitmap.
pub const TSS_LIMIT: u64 = 104 + 8192;
pub const PVH_INFO_ADDR: u64 = 0x6000;
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
pub const PVH_MEMMAP_ADDR: u64 = 0x7000;
pub const PML4_ADDR: u64 = 0x9000;
pub const PDPT_ADDR: u64 = 0xa000;
pub const PD_ADDR: u64 = 0xb000;
pub const CMDLINE_ADDR: u64 = 0x2_0000;
pub const CMDLINE_MAX: usize = 0x1_0000;
pub const KERNEL_STACK_TOP: u64 = 0x7_f000;
pub const MPTABLE_ADDR: u64 = 0x9_fc00;
pub const EBDA_START: u64 = 0x9_fc00;
pub const USER_STACK_TOP: u64 = 0xf_f000;
pub const USER_STACK_PER_VCPU: u64 = 0x4000;
pub const GUEST_LOAD_ADDR: u64 = 0x10_0000;
pub const HIGH_MEM_START: u64 = 0x10_0000;
pub const MMIO_START: u64 = 0xc000_0000;
pub const IOAPIC_ADDR: u64 = 0xfec0_0000;
pub const LAPIC_ADDR: u64 = 0xfee0_0000;
