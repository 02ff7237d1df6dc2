//! Guest RAM: one host mapping at a fixed host address for the whole life of a VM.
//!
//! The mapping starts as anonymous memory (fresh boot, or a pre-created shell's placeholder) and
//! can later be replaced in place with `MAP_FIXED` by a `MAP_PRIVATE` mapping of a snapshot's
//! memory file: the host address never changes, so KVM's memslot and every device's
//! [`GuestMemory`] handle stay valid (KVM follows the remap through its MMU notifier).

use std::fs::File;
use std::os::fd::AsRawFd;

use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::error::{sys, Error, Result};

/// The memory type shared with devices.
pub type GuestMemory = GuestMemoryMmap<()>;

/// Host page size assumed for dirty tracking and file layout.
pub const PAGE_SIZE: u64 = 4096;

/// Guest RAM is one region at guest physical 0; it must end below the MMIO hole.
pub const MMIO_HOLE_START: u64 = 0xc000_0000;

/// One contiguous guest RAM mapping.
pub struct GuestRam {
    addr: usize,
    size: usize,
    mem: GuestMemory,
    /// Page ranges `(first_page, pages)` currently mapped from a pause-to-disk diff file; they
    /// differ from the base snapshot file although pagemap reports them as file pages.
    overlay: Vec<(u64, u64)>,
    /// Whether any part is mapped from a file (then pages absent from pagemap are not zero).
    file_backed: bool,
}

// SAFETY: the raw address is only used for mmap/munmap/pagemap bookkeeping; all guest memory
// access goes through `GuestMemoryMmap`, which is Send + Sync.
unsafe impl Send for GuestRam {}
unsafe impl Sync for GuestRam {}

impl GuestRam {
    /// Reserves `size` bytes of anonymous, lazily-allocated memory.
    pub fn anonymous(size: u64) -> Result<Self> {
        if size == 0 || !size.is_multiple_of(2 << 20) {
            return Err(Error::InvalidConfig(format!(
                "guest memory size {size} must be a non-zero multiple of 2 MiB"
            )));
        }
        if size > MMIO_HOLE_START {
            return Err(Error::InvalidConfig(format!(
                "guest memory size {} MiB exceeds the {} MiB below the MMIO hole",
                size >> 20,
                MMIO_HOLE_START >> 20
            )));
        }
        // SAFETY: a fresh anonymous mapping; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(sys("mmap guest memory"));
        }
        let addr = ptr as usize;
        match Self::wrap(addr, size as usize) {
            Ok(mem) => Ok(GuestRam {
                addr,
                size: size as usize,
                mem,
                overlay: Vec::new(),
                file_backed: false,
            }),
            Err(e) => {
                // SAFETY: unmapping what we just mapped.
                unsafe { libc::munmap(ptr, size as usize) };
                Err(e)
            }
        }
    }

    fn wrap(addr: usize, size: usize) -> Result<GuestMemory> {
        // SAFETY: [addr, addr+size) is a mapping owned by the GuestRam that outlives `mem`
        // handles only as long as the VM does; MmapRegion built raw never unmaps it.
        let region = unsafe {
            MmapRegion::<()>::build_raw(
                addr as *mut u8,
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_NORESERVE,
            )
        }
        .map_err(|e| Error::Memory(format!("wrap mapping: {e}")))?;
        let region = GuestRegionMmap::new(region, GuestAddress(0))
            .ok_or_else(|| Error::Memory("region overflows the guest address space".into()))?;
        GuestMemoryMmap::from_regions(vec![region]).map_err(|e| Error::Memory(e.to_string()))
    }

    /// Replaces `[guest_off, guest_off+len)` of the mapping with a private (copy-on-write)
    /// mapping of `file` at `file_off`. Pages load on demand from the page cache; guest writes
    /// stay private to this process.
    pub fn map_file(&mut self, file: &File, file_off: u64, guest_off: u64, len: u64) -> Result<()> {
        if !guest_off.is_multiple_of(PAGE_SIZE)
            || !len.is_multiple_of(PAGE_SIZE)
            || !file_off.is_multiple_of(PAGE_SIZE)
        {
            return Err(Error::Memory("unaligned file mapping".into()));
        }
        if guest_off
            .checked_add(len)
            .is_none_or(|end| end > self.size as u64)
        {
            return Err(Error::Memory(format!(
                "file mapping {guest_off:#x}+{len:#x} is outside guest RAM"
            )));
        }
        // SAFETY: MAP_FIXED over a range of our own mapping; checked above to lie inside it.
        let ptr = unsafe {
            libc::mmap(
                (self.addr + guest_off as usize) as *mut libc::c_void,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                file_off as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(sys("mmap memory file"));
        }
        self.file_backed = true;
        Ok(())
    }

    /// Records that a range now comes from a diff file (see [`GuestRam::dirty_pages`]).
    pub(crate) fn add_overlay(&mut self, first_page: u64, pages: u64) {
        self.overlay.push((first_page, pages));
    }

    pub(crate) fn clear_overlay(&mut self) {
        self.overlay.clear();
    }

    /// The memory handle devices use.
    pub fn memory(&self) -> &GuestMemory {
        &self.mem
    }

    /// Host virtual address of guest physical 0.
    pub fn host_addr(&self) -> u64 {
        self.addr as u64
    }

    pub fn size(&self) -> u64 {
        self.size as u64
    }

    /// The whole guest RAM as a byte slice (for dumping to a file).
    ///
    /// # Safety
    /// The guest (vCPUs and devices) must be paused while the slice is alive.
    pub(crate) unsafe fn as_slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.addr as *const u8, self.size)
    }

    /// Pages that differ from the file this memory was restored from: pages that became
    /// anonymous (guest or device DMA writes on a `MAP_PRIVATE` file mapping are copied into
    /// anonymous pages, so pagemap bit 61 "file-page or shared-anon" is clear for them) or
    /// swapped out, plus pages mapped from a diff file. Returns a bitmap, one bit per page.
    pub fn dirty_pages(&self) -> Result<Vec<u64>> {
        let mut bitmap = self.scan_pagemap(|e| {
            let present = e & (1 << 63) != 0;
            let swapped = e & (1 << 62) != 0;
            let file_or_shared = e & (1 << 61) != 0;
            swapped || (present && !file_or_shared)
        })?;
        let pages = self.size / PAGE_SIZE as usize;
        for &(first, count) in &self.overlay {
            for p in first..first + count {
                let p = p as usize;
                if p < pages {
                    bitmap[p / 64] |= 1 << (p % 64);
                }
            }
        }
        Ok(bitmap)
    }

    /// Pages that may hold non-zero data: all of them once a file is mapped, otherwise the
    /// pages present or swapped (untouched anonymous pages read as zero).
    pub fn possibly_nonzero_pages(&self) -> Result<Vec<u64>> {
        if self.file_backed {
            let pages = self.size / PAGE_SIZE as usize;
            let mut bm = vec![u64::MAX; pages.div_ceil(64)];
            if !pages.is_multiple_of(64) {
                *bm.last_mut().unwrap_or(&mut 0) = (1u64 << (pages % 64)) - 1;
            }
            return Ok(bm);
        }
        self.scan_pagemap(|e| e & (3 << 62) != 0)
    }

    fn scan_pagemap(&self, pick: impl Fn(u64) -> bool) -> Result<Vec<u64>> {
        let pages = self.size / PAGE_SIZE as usize;
        let mut bitmap = vec![0u64; pages.div_ceil(64)];
        let file = File::open("/proc/self/pagemap")
            .map_err(crate::error::io("open", "/proc/self/pagemap"))?;
        let mut buf = vec![0u64; 65536];
        let mut page = 0usize;
        while page < pages {
            let n = (pages - page).min(buf.len());
            let off = ((self.addr / PAGE_SIZE as usize + page) * 8) as u64;
            // SAFETY: reading into a u64 buffer viewed as bytes.
            let bytes =
                unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, n * 8) };
            read_exact_at(&file, bytes, off)?;
            for (i, &e) in buf[..n].iter().enumerate() {
                if pick(e) {
                    let p = page + i;
                    bitmap[p / 64] |= 1 << (p % 64);
                }
            }
            page += n;
        }
        Ok(bitmap)
    }
}

fn read_exact_at(file: &File, buf: &mut [u8], off: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, off)
        .map_err(crate::error::io("read", "/proc/self/pagemap"))
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // SAFETY: the mapping is owned by us; vCPUs are stopped before the VM drops its RAM.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.size) };
    }
}

/// Runs of set bits of a page bitmap as `(first_page, pages)`.
pub fn bitmap_runs(bitmap: &[u64], pages: u64) -> Vec<(u64, u64)> {
    let mut runs = Vec::new();
    let mut p = 0u64;
    while p < pages {
        let w = bitmap[(p / 64) as usize];
        if w == 0 && p.is_multiple_of(64) {
            p += 64;
            continue;
        }
        if w & (1 << (p % 64)) != 0 {
            let start = p;
            while p < pages && bitmap[(p / 64) as usize] & (1 << (p % 64)) != 0 {
                p += 1;
            }
            runs.push((start, p - start));
        } else {
            p += 1;
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_a_bitmap() {
        let mut bm = vec![0u64; 3];
        for p in [0u64, 1, 2, 63, 64, 65, 130] {
            bm[(p / 64) as usize] |= 1 << (p % 64);
        }
        assert_eq!(bitmap_runs(&bm, 192), vec![(0, 3), (63, 3), (130, 1)]);
        assert!(bitmap_runs(&[0, 0], 128).is_empty());
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(GuestRam::anonymous(0).is_err());
        assert!(GuestRam::anonymous(3 << 20).is_err());
        assert!(GuestRam::anonymous(4 << 30).is_err());
    }

    #[test]
    fn private_file_mapping_writes_show_as_dirty() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![7u8; 4 << 20]).unwrap();
        let mut ram = GuestRam::anonymous(4 << 20).unwrap();
        ram.map_file(&f, 0, 0, 4 << 20).unwrap();
        use vm_memory::Bytes;
        let v: u8 = ram.memory().read_obj(GuestAddress(8192)).unwrap();
        assert_eq!(v, 7);
        ram.memory()
            .write_obj(1u8, GuestAddress(3 * 4096 + 5))
            .unwrap();
        let bm = ram.dirty_pages().unwrap();
        assert_eq!(bitmap_runs(&bm, 1024), vec![(3, 1)]);
        // The file is untouched by the private write.
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, 3 * 4096 + 5).unwrap();
        assert_eq!(b[0], 7);
    }
}
