//! Linux kernel loading: a PVH ELF `vmlinux` (entered through its PVH note, 32-bit protected
//! mode, `hvm_start_info` in rbx) first, a bzImage (64-bit boot protocol, zero page in rsi)
//! second; command line, optional initramfs, memory map (e820 / PVH memmap) and MP table.
//!
//! Note for this PVM host: a stock kernel starts at CPL0, which PVM emulates (~3000× slower);
//! a PVM-enlightened guest kernel is needed for useful boots (see the KVM notes).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bootparam::{boot_params, XLF_KERNEL_64};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{load_cmdline, BzImage, KernelLoader};
use sha2::{Digest, Sha256};
use vm_memory::{Bytes, GuestAddress};

use crate::arch::layout::*;
use crate::arch::mptable;
use crate::error::{io, Error, Result};
use crate::vmm::Shape;
use crate::vstate::memory::GuestMemory;

const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;
const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
const PVH_MODLIST_ADDR: u64 = 0x6800;

/// What to boot.
#[derive(Clone, Debug)]
pub struct KernelConfig {
    pub kernel: PathBuf,
    pub cmdline: String,
    pub initramfs: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryMode {
    /// 32-bit PVH entry.
    Pvh,
    /// 64-bit Linux boot protocol entry.
    Linux64,
}

/// Where and how the boot vCPU starts.
#[derive(Clone, Debug)]
pub struct KernelEntry {
    pub entry: u64,
    pub mode: EntryMode,
    /// sha256 of the kernel file (recorded in snapshot manifests).
    pub digest: String,
}

fn kerr(what: &str) -> impl FnOnce(linux_loader::loader::Error) -> Error + '_ {
    move |e| Error::Kernel(format!("{what}: {e}"))
}

fn digest_file(f: &mut File) -> Result<String> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    f.seek(SeekFrom::Start(0))
        .map_err(|e| Error::Kernel(e.to_string()))?;
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::Kernel(e.to_string()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    f.seek(SeekFrom::Start(0))
        .map_err(|e| Error::Kernel(e.to_string()))?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn memory_map(mem_size: u64) -> Vec<(u64, u64, u32)> {
    vec![
        (0, EBDA_START, E820_RAM),
        (EBDA_START, HIGH_MEM_START - EBDA_START, E820_RESERVED),
        (HIGH_MEM_START, mem_size - HIGH_MEM_START, E820_RAM),
    ]
}

fn wr<T: vm_memory::ByteValued>(mem: &GuestMemory, v: T, at: u64, what: &str) -> Result<()> {
    mem.write_obj(v, GuestAddress(at))
        .map_err(|e| Error::Kernel(format!("write {what}: {e}")))
}

/// Loads the kernel, command line and initramfs and writes the boot tables.
pub fn load_kernel(mem: &GuestMemory, shape: Shape, cfg: &KernelConfig) -> Result<KernelEntry> {
    let mem_size = shape.mem_bytes();
    let mut kf = File::open(&cfg.kernel).map_err(io("open kernel", &cfg.kernel))?;
    let digest = digest_file(&mut kf)?;
    let mut cmdline =
        Cmdline::new(CMDLINE_MAX).map_err(|e| Error::Kernel(format!("cmdline: {e}")))?;
    cmdline
        .insert_str(&cfg.cmdline)
        .map_err(|e| Error::Kernel(format!("cmdline {:?}: {e}", cfg.cmdline)))?;

    let (entry, mode, kernel_end, setup_header) =
        match Elf::load(mem, None, &mut kf, Some(GuestAddress(HIGH_MEM_START))) {
            Ok(r) => match r.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(a) => (a.0, EntryMode::Pvh, r.kernel_end, None),
                _ => {
                    // ELF without a PVH note: enter at e_entry with the 64-bit protocol.
                    let mut hdr = [0u8; 32];
                    kf.seek(SeekFrom::Start(0))
                        .map_err(|e| Error::Kernel(e.to_string()))?;
                    kf.read_exact(&mut hdr)
                        .map_err(|e| Error::Kernel(e.to_string()))?;
                    let e_entry = u64::from_le_bytes(hdr[24..32].try_into().unwrap_or_default());
                    (e_entry, EntryMode::Linux64, r.kernel_end, None)
                }
            },
            Err(linux_loader::loader::Error::Elf(
                linux_loader::loader::elf::Error::InvalidElfMagicNumber,
            )) => {
                kf.seek(SeekFrom::Start(0))
                    .map_err(|e| Error::Kernel(e.to_string()))?;
                let r = BzImage::load(mem, None, &mut kf, Some(GuestAddress(HIGH_MEM_START)))
                    .map_err(kerr("neither an ELF vmlinux nor a bzImage"))?;
                let hdr = r
                    .setup_header
                    .ok_or_else(|| Error::Kernel("bzImage without a setup header".into()))?;
                if hdr.version < 0x020c || hdr.xloadflags & XLF_KERNEL_64 == 0 {
                    return Err(Error::Kernel(format!(
                        "bzImage boot protocol {:#x} lacks the 64-bit entry",
                        { hdr.version }
                    )));
                }
                (
                    r.kernel_load.0 + 0x200,
                    EntryMode::Linux64,
                    r.kernel_end,
                    Some(hdr),
                )
            }
            Err(e) => return Err(Error::Kernel(format!("ELF kernel: {e}"))),
        };

    load_cmdline(mem, GuestAddress(CMDLINE_ADDR), &cmdline).map_err(kerr("command line"))?;
    let cmdline_len = cmdline
        .as_cstring()
        .map(|c| c.as_bytes().len())
        .unwrap_or(0) as u32;

    // Initramfs: page-aligned, as high as possible below the end of RAM.
    let mut initrd = None;
    if let Some(p) = &cfg.initramfs {
        let mut f = File::open(p).map_err(io("open initramfs", p))?;
        let size = f.metadata().map_err(io("stat initramfs", p))?.len();
        let addr = mem_size
            .checked_sub(size)
            .map(|a| a & !0xfff)
            .filter(|&a| a > kernel_end);
        let addr = addr.ok_or_else(|| {
            Error::Kernel(format!(
                "initramfs of {size} bytes does not fit in {} MiB",
                shape.mem_mib
            ))
        })?;
        mem.read_volatile_from(GuestAddress(addr), &mut f, size as usize)
            .map_err(|e| Error::Kernel(format!("read initramfs: {e}")))?;
        initrd = Some((addr, size));
    }

    mptable::write(mem, shape.vcpus)?;
    let map = memory_map(mem_size);
    match mode {
        EntryMode::Pvh => {
            for (i, (addr, size, t)) in map.iter().enumerate() {
                let e = hvm_memmap_table_entry {
                    addr: *addr,
                    size: *size,
                    type_: *t,
                    reserved: 0,
                };
                wr(mem, e, PVH_MEMMAP_ADDR + 24 * i as u64, "PVH memmap")?;
            }
            let mut si = hvm_start_info {
                magic: XEN_HVM_START_MAGIC,
                version: 1,
                cmdline_paddr: CMDLINE_ADDR,
                memmap_paddr: PVH_MEMMAP_ADDR,
                memmap_entries: map.len() as u32,
                ..Default::default()
            };
            if let Some((addr, size)) = initrd {
                wr(
                    mem,
                    hvm_modlist_entry {
                        paddr: addr,
                        size,
                        ..Default::default()
                    },
                    PVH_MODLIST_ADDR,
                    "PVH module list",
                )?;
                si.nr_modules = 1;
                si.modlist_paddr = PVH_MODLIST_ADDR;
            }
            wr(mem, si, PVH_INFO_ADDR, "PVH start info")?;
        }
        EntryMode::Linux64 => {
            let mut bp = boot_params::default();
            if let Some(h) = setup_header {
                bp.hdr = h;
            }
            bp.hdr.type_of_loader = 0xff;
            bp.hdr.boot_flag = 0xaa55;
            bp.hdr.header = 0x5372_6448; // "HdrS"
            bp.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
            bp.hdr.cmdline_size = cmdline_len;
            bp.hdr.kernel_alignment = 0x0100_0000;
            if let Some((addr, size)) = initrd {
                bp.hdr.ramdisk_image = addr as u32;
                bp.hdr.ramdisk_size = size as u32;
            }
            for (i, (addr, size, t)) in map.iter().enumerate() {
                bp.e820_table[i].addr = *addr;
                bp.e820_table[i].size = *size;
                bp.e820_table[i].r#type = *t;
            }
            bp.e820_entries = map.len() as u8;
            wr(mem, bp, ZERO_PAGE_ADDR, "zero page")?;
        }
    }
    Ok(KernelEntry {
        entry,
        mode,
        digest,
    })
}
