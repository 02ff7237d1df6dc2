//! Extended (XSAVE) register state: which components a guest can use, which ones KVM saves in
//! a snapshot, and the paravirtual save/restore that guest kernels use on PVM hosts.
//!
//! On PVM a guest's user mode runs natively with the host's CPUID and XCR0, so guest programs
//! use every vector register the host has (AVX-512 on this project's hosts), whatever the
//! CPUID table the VMM gives KVM says. The guest's kernel mode is emulated by KVM's instruction
//! emulator, which has no XSAVE/XRSTOR, so a guest kernel can context-switch only the legacy
//! x87/SSE area (FXSAVE): the upper halves of ymm/zmm, zmm16-31 and k0-7 then pass from one
//! guest process to the next. KVM itself holds the vCPU's complete register state, so the
//! guest kernel (its `cube_pvm` patch, `deploy/guest-kernel/patches/`) asks the VMM to copy
//! that state to and from the task's buffer in guest memory through three I/O ports:
//!
//! * `in` [`SIZE_PORT`] (32-bit): the size in bytes of the image the VMM writes (a standard,
//!   non-compacted XSAVE image); an unclaimed port reads all ones, so a guest on another VMM
//!   keeps FXSAVE.
//! * `out` [`SAVE_PORT`], `gpa >> 6`: the vCPU's state as an XSAVE image at `gpa`.
//! * `out` [`RESTORE_PORT`], `gpa >> 6`: loads the image at `gpa`: the legacy area always (the
//!   guest kernel keeps it in FXSAVE form), the other components as its XSTATE_BV says.

use kvm_bindings::{kvm_xsave, CpuId};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};

use crate::vstate::memory::GuestMemory;

pub const SIZE_PORT: u16 = 0x510;
pub const SAVE_PORT: u16 = 0x510;
pub const RESTORE_PORT: u16 = 0x511;

/// x87 and SSE: the legacy area, always valid in a guest kernel's FXSAVE-form buffer.
pub const XFEATURE_FPSSE: u64 = 0x3;
/// Protection-key rights (PKRU), bit 9 of XCR0.
const XFEATURE_PKRU: u64 = 1 << 9;
/// Legacy area and XSAVE header (XSTATE_BV, XCOMP_BV, reserved).
const LEGACY_AND_HEADER: usize = 576;
const XSTATE_BV: usize = 512;
/// `kvm_xsave` (KVM_GET/SET_XSAVE) holds 4 KiB; larger states need KVM_GET_XSAVE2.
const KVM_XSAVE_BYTES: usize = std::mem::size_of::<[u32; 1024]>();

/// What the CPUID table given to KVM says about XSAVE state: the components KVM saves and
/// restores for the guest (its leaf 0xD) and the size of a standard image of all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XsaveLayout {
    pub features: u64,
    pub size: u32,
}

impl XsaveLayout {
    pub fn of(cpuid: &CpuId) -> XsaveLayout {
        cpuid
            .as_slice()
            .iter()
            .find(|e| e.function == 0xd && e.index == 0)
            .map(|e| XsaveLayout {
                features: e.eax as u64 | (e.edx as u64) << 32,
                size: e.ecx,
            })
            .unwrap_or(XsaveLayout {
                features: XFEATURE_FPSSE,
                size: 512,
            })
    }
}

/// XCR0 of this process: on PVM, the components a guest's user mode can use.
pub fn host_xcr0() -> u64 {
    let osxsave = std::arch::x86_64::__cpuid(1).ecx & (1 << 27) != 0;
    if !osxsave {
        return XFEATURE_FPSSE;
    }
    let (lo, hi): (u32, u32);
    // SAFETY: XGETBV(0) is valid whenever CR4.OSXSAVE is set, which CPUID.1:ECX.OSXSAVE says.
    unsafe {
        std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi,
            options(nomem, nostack, preserves_flags));
    }
    lo as u64 | (hi as u64) << 32
}

/// AMX tile configuration and tile data (XCR0 bits 17 and 18).
const XFEATURE_XTILECFG: u64 = 1 << 17;
const XFEATURE_XTILEDATA: u64 = 1 << 18;

/// `arch_prctl` code: the XSAVE components this process may use (Linux 5.16+).
const ARCH_GET_XCOMP_PERM: libc::c_ulong = 0x1022;

/// The components guest user mode can really use on PVM: the host's XCR0 less the ones the
/// kernel gates per process with XFD (AMX) and has not granted this one. XCR0 has AMX's bits
/// set on every AMX host, but until a process asks (`ARCH_REQ_XCOMP_PERM`), its AMX
/// instructions fault (XFD arms tile data, and every AMX instruction, LDTILECFG included,
/// checks it), so no tile register can be live to be lost in a snapshot.
pub fn user_usable_xfeatures() -> u64 {
    let mut perm: u64 = 0;
    // SAFETY: ARCH_GET_XCOMP_PERM writes one u64 through the pointer, which is valid.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut perm as *mut u64,
        )
    };
    usable_with_permission(host_xcr0(), (rc == 0).then_some(perm))
}

/// `xcr0` less what `perm` (this process's permitted components; `None` = a kernel without
/// dynamic features, where XCR0 is the whole story) withholds.
fn usable_with_permission(xcr0: u64, perm: Option<u64>) -> u64 {
    let Some(perm) = perm else {
        return xcr0;
    };
    let mut usable = xcr0 & perm;
    if usable & XFEATURE_XTILEDATA == 0 {
        usable &= !XFEATURE_XTILECFG;
    }
    usable
}

/// Checks that every component the guest can use is one KVM saves, and that a snapshot's
/// `kvm_xsave` holds all of them: otherwise a restored guest would find registers reset.
/// `usable` is what the guest can use: the host's XCR0 on PVM (native user mode), the table's
/// own leaf 0xD elsewhere.
pub fn check(layout: XsaveLayout, usable: u64) -> Result<(), String> {
    // PKRU aside: guest kernels have no protection keys for their programs to use.
    let unsaved = usable & !layout.features & !XFEATURE_PKRU;
    if unsaved != 0 {
        return Err(format!(
            "the guest can use XSAVE components {unsaved:#x} (XCR0 {usable:#x}) that KVM does not \
             save for it (CPUID 0xD: {:#x}): their registers would be lost on every snapshot",
            layout.features
        ));
    }
    if layout.size as usize > KVM_XSAVE_BYTES {
        return Err(format!(
            "the guest's XSAVE state is {} bytes, more than the {KVM_XSAVE_BYTES} that \
             KVM_GET_XSAVE returns",
            layout.size
        ));
    }
    Ok(())
}

/// The paravirtual save/restore of one VM (on PVM hosts only).
#[derive(Clone, Copy, Debug)]
pub struct PvXstate {
    layout: XsaveLayout,
}

/// One request from the guest kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PvOp {
    Save(u64),
    Restore(u64),
}

impl PvXstate {
    /// Offered when the layout is one the guest kernel can hold (at least the legacy area and
    /// header, at most a page: the kernel's `union fpregs_state`).
    /// The size offered is rounded up to 64 bytes (the guest kernel's buffers are multiples of
    /// 64; with PKRU the state ends 8 bytes past one): the tail is zeros.
    pub fn new(layout: XsaveLayout) -> Option<PvXstate> {
        let size = (layout.size as usize).next_multiple_of(64);
        (LEGACY_AND_HEADER..=KVM_XSAVE_BYTES)
            .contains(&size)
            .then_some(PvXstate {
                layout: XsaveLayout {
                    size: size as u32,
                    ..layout
                },
            })
    }

    pub fn size(&self) -> u32 {
        self.layout.size
    }

    /// The request an `out` to `port` with `value` makes, if it is one.
    pub fn op(port: u16, value: u32) -> Option<PvOp> {
        let gpa = (value as u64) << 6;
        match port {
            SAVE_PORT => Some(PvOp::Save(gpa)),
            RESTORE_PORT => Some(PvOp::Restore(gpa)),
            _ => None,
        }
    }

    /// Serves one request on the vCPU's own thread, between two KVM_RUNs. A bad address or
    /// image is the guest's own problem: it is reported, and the vCPU's state stays as it was.
    pub fn serve(&self, fd: &VcpuFd, mem: &GuestMemory, op: PvOp) -> Result<(), String> {
        let size = self.layout.size as usize;
        match op {
            PvOp::Save(gpa) => {
                let x = fd.get_xsave().map_err(|e| format!("KVM_GET_XSAVE: {e}"))?;
                mem.write_slice(&region_bytes(&x)[..size], GuestAddress(gpa))
                    .map_err(|e| format!("writing the XSAVE image at {gpa:#x}: {e}"))
            }
            PvOp::Restore(gpa) => {
                let mut x = kvm_xsave::default();
                let img = region_bytes_mut(&mut x);
                mem.read_slice(&mut img[..size], GuestAddress(gpa))
                    .map_err(|e| format!("reading the XSAVE image at {gpa:#x}: {e}"))?;
                sanitize(img, self.layout.features);
                // SAFETY: `x` is a complete 4 KiB kvm_xsave; KVM validates its contents.
                unsafe { fd.set_xsave(&x) }.map_err(|e| format!("KVM_SET_XSAVE: {e}"))
            }
        }
    }
}

/// Makes a guest-written image one KVM accepts: the legacy area counts, only components KVM
/// saves for this guest, standard format (XCOMP_BV 0), reserved header bytes zero.
fn sanitize(img: &mut [u8], features: u64) {
    let mut bv = [0u8; 8];
    bv.copy_from_slice(&img[XSTATE_BV..XSTATE_BV + 8]);
    let bv = (u64::from_le_bytes(bv) | XFEATURE_FPSSE) & features;
    img[XSTATE_BV..XSTATE_BV + 8].copy_from_slice(&bv.to_le_bytes());
    img[XSTATE_BV + 8..LEGACY_AND_HEADER].fill(0);
}

fn region_bytes(x: &kvm_xsave) -> &[u8] {
    // SAFETY: `region` is 1024 plain u32s; viewing them as bytes is always valid.
    unsafe { std::slice::from_raw_parts(x.region.as_ptr().cast::<u8>(), KVM_XSAVE_BYTES) }
}

fn region_bytes_mut(x: &mut kvm_xsave) -> &mut [u8] {
    // SAFETY: as above, and any byte pattern is a valid u32.
    unsafe { std::slice::from_raw_parts_mut(x.region.as_mut_ptr().cast::<u8>(), KVM_XSAVE_BYTES) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amx_counts_only_when_this_process_may_use_it() {
        // An AMX host's XCR0 (x87, SSE, AVX, AVX-512, PKRU, tiles) and its default permission.
        let xcr0 = 0x602e7;
        let default_perm = 0x202e7 | (1 << 17);
        assert_eq!(usable_with_permission(xcr0, Some(default_perm)), 0x2e7);
        // Granted (ARCH_REQ_XCOMP_PERM): the tiles count, and the check then refuses a table
        // that does not save them.
        assert_eq!(usable_with_permission(xcr0, Some(xcr0)), xcr0);
        assert!(check(
            XsaveLayout {
                features: 0x2e7,
                size: 2696
            },
            xcr0
        )
        .is_err());
        assert!(check(
            XsaveLayout {
                features: 0x2e7,
                size: 2696
            },
            0x2e7
        )
        .is_ok());
        // A kernel without dynamic features: XCR0 as it is.
        assert_eq!(usable_with_permission(0x2e7, None), 0x2e7);
        // This host, whatever it has: never more than its XCR0.
        assert_eq!(user_usable_xfeatures() & !host_xcr0(), 0);
    }

    fn layout(features: u64, size: u32) -> XsaveLayout {
        XsaveLayout { features, size }
    }

    #[test]
    fn a_component_the_guest_uses_but_kvm_does_not_save_is_refused() {
        // AVX-512 in XCR0, AVX only in the table: zmm state would be lost.
        let e = check(layout(0x7, 832), 0xe7).unwrap_err();
        assert!(e.contains("0xe0"), "{e}");
        assert!(check(layout(0xe7, 2432), 0xe7).is_ok());
        assert!(check(layout(0x2e7, 2696), 0xe7).is_ok());
        // PKRU in XCR0 alone is not refused (guest kernels give their programs no pkeys).
        assert!(check(layout(0xe7, 2432), 0x2e7).is_ok());
        assert!(check(layout(0x7, 832), 0x2e7).is_err());
    }

    #[test]
    fn a_state_larger_than_kvm_xsave_is_refused() {
        // AMX tile data (8 KiB) cannot go through the 4 KiB KVM_GET_XSAVE.
        let e = check(layout(0x600e7, 11008), 0x600e7).unwrap_err();
        assert!(e.contains("11008"), "{e}");
    }

    #[test]
    fn the_layout_comes_from_leaf_0xd() {
        let mut entries = vec![kvm_bindings::kvm_cpuid_entry2::default(); 2];
        entries[0].function = 1;
        entries[1].function = 0xd;
        entries[1].eax = 0xe7;
        entries[1].edx = 0x1;
        entries[1].ecx = 2432;
        let cpuid = CpuId::from_entries(&entries).unwrap();
        assert_eq!(XsaveLayout::of(&cpuid), layout(0x1_0000_00e7, 2432));
        let none = CpuId::from_entries(&entries[..1]).unwrap();
        assert_eq!(XsaveLayout::of(&none).features, XFEATURE_FPSSE);
    }

    #[test]
    fn only_sizes_a_guest_kernel_can_hold_are_offered() {
        assert!(PvXstate::new(layout(0x3, 512)).is_none());
        assert!(PvXstate::new(layout(0x600e7, 11008)).is_none());
        assert_eq!(PvXstate::new(layout(0xe7, 2432)).unwrap().size(), 2432);
        // With PKRU (8 bytes at 2688) the image is offered as a multiple of 64.
        assert_eq!(PvXstate::new(layout(0x2e7, 2696)).unwrap().size(), 2752);
    }

    #[test]
    fn requests_carry_64_byte_aligned_addresses() {
        assert_eq!(
            PvXstate::op(SAVE_PORT, 0x1234),
            Some(PvOp::Save(0x1234 << 6))
        );
        assert_eq!(
            PvXstate::op(RESTORE_PORT, u32::MAX),
            Some(PvOp::Restore((u32::MAX as u64) << 6))
        );
        assert_eq!(PvXstate::op(0x3f8, 1), None);
    }

    #[test]
    fn a_guest_written_header_is_made_valid() {
        let mut img = vec![0xffu8; 2432];
        sanitize(&mut img, 0xe7);
        assert_eq!(u64::from_le_bytes(img[512..520].try_into().unwrap()), 0xe7);
        assert!(img[520..576].iter().all(|&b| b == 0));
        // A zero header (a fresh task) still loads the legacy area.
        let mut img = vec![0u8; 2432];
        sanitize(&mut img, 0xe7);
        assert_eq!(u64::from_le_bytes(img[512..520].try_into().unwrap()), 0x3);
        // Legacy and extended data are left alone.
        assert!(img[..512].iter().all(|&b| b == 0));
    }
}
