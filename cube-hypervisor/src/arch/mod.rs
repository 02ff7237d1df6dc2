//! x86_64 machine setup done from the VMM side: guest physical layout, GDT/IDT/TSS, identity
//! page tables, segment and control registers for the three ways a vCPU starts (a CPL3 test
//! guest, a 64-bit Linux kernel from a bzImage, a 32-bit PVH entry), LAPIC LINT pins, CPUID.

pub mod layout;
pub mod mptable;

use kvm_bindings::{kvm_lapic_state, kvm_regs, kvm_segment, kvm_sregs, CpuId};
use vm_memory::{Bytes, GuestAddress};

use crate::error::{Error, Result};
use crate::vstate::memory::GuestMemory;
use layout::*;

// GDT selectors. Linux's 64-bit boot protocol wants __BOOT_CS = 0x10 and __BOOT_DS = 0x18.
pub const SEL_CODE32: u16 = 0x08;
pub const SEL_KCODE64: u16 = 0x10;
pub const SEL_KDATA: u16 = 0x18;
pub const SEL_UDATA: u16 = 0x20 | 3;
pub const SEL_UCODE64: u16 = 0x28 | 3;
pub const SEL_TSS: u16 = 0x30;

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_OSXMMEXCPT: u64 = 1 << 10;
pub const CR4_OSXSAVE: u64 = 1 << 18;
const EFER_SCE: u64 = 1;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
const EFER_NXE: u64 = 1 << 11;

fn gdt_entry(flags: u64, base: u64, limit: u64) -> u64 {
    ((base & 0xff00_0000) << 32)
        | ((flags & 0xf0ff) << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0x0000_ffff)
}

fn segment(sel: u16, entry: u64) -> kvm_segment {
    let flags = (entry >> 40) & 0xf0ff;
    kvm_segment {
        base: ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000),
        limit: {
            let l = (entry & 0xffff) | ((entry >> 32) & 0xf_0000);
            if flags & 0x8000 != 0 {
                ((l << 12) | 0xfff) as u32
            } else {
                l as u32
            }
        },
        selector: sel,
        type_: (flags & 0xf) as u8,
        present: ((flags >> 7) & 1) as u8,
        dpl: ((flags >> 5) & 3) as u8,
        db: ((flags >> 14) & 1) as u8,
        s: ((flags >> 4) & 1) as u8,
        l: ((flags >> 13) & 1) as u8,
        g: ((flags >> 15) & 1) as u8,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

fn gdt_table() -> [u64; 8] {
    [
        0,
        gdt_entry(0xc09b, 0, 0xfffff), // 0x08 32-bit code (PVH entry)
        gdt_entry(0xa09b, 0, 0xfffff), // 0x10 64-bit kernel code
        gdt_entry(0xc093, 0, 0xfffff), // 0x18 kernel data
        gdt_entry(0xc0f3, 0, 0xfffff), // 0x20 user data (DPL3)
        gdt_entry(0xa0fb, 0, 0xfffff), // 0x28 64-bit user code (DPL3)
        // 0x30 + 0x38: 64-bit TSS descriptor (16 bytes), type 0x9 (available), present.
        gdt_entry(0x0089, TSS_ADDR, TSS_LIMIT),
        TSS_ADDR >> 32,
    ]
}

fn write_u64s(mem: &GuestMemory, at: u64, vals: &[u64]) -> Result<()> {
    for (i, v) in vals.iter().enumerate() {
        mem.write_obj(*v, GuestAddress(at + 8 * i as u64))
            .map_err(|e| Error::Load(format!("write system table at {at:#x}: {e}")))?;
    }
    Ok(())
}

/// Writes the GDT, an empty IDT, the TSS (with the ring-0 stack used by interrupt handlers)
/// and identity page tables mapping 0–4 GiB with 2 MiB user-accessible pages.
pub fn write_system_tables(mem: &GuestMemory) -> Result<()> {
    write_u64s(mem, GDT_ADDR, &gdt_table())?;
    // TSS: rsp0 at offset 4, I/O bitmap right after the 104-byte TSS, all ports allowed.
    let mut tss = vec![0u8; TSS_LIMIT as usize + 1];
    tss[4..12].copy_from_slice(&KERNEL_STACK_TOP.to_le_bytes());
    tss[102..104].copy_from_slice(&104u16.to_le_bytes());
    tss[TSS_LIMIT as usize] = 0xff;
    mem.write_slice(&tss, GuestAddress(TSS_ADDR))
        .map_err(|e| Error::Load(format!("write TSS: {e}")))?;
    mem.write_slice(&[0u8; 4096], GuestAddress(IDT_ADDR))
        .map_err(|e| Error::Load(format!("write IDT: {e}")))?;
    // PML4[0] -> PDPT; PDPT[0..4] -> PD0..PD3; PDs: 2 MiB pages, present|rw|user|PS.
    write_u64s(mem, PML4_ADDR, &[PDPT_ADDR | 0x7])?;
    let pdpt: Vec<u64> = (0..4).map(|i| (PD_ADDR + i * 0x1000) | 0x7).collect();
    write_u64s(mem, PDPT_ADDR, &pdpt)?;
    let pds: Vec<u64> = (0..2048u64).map(|i| (i << 21) | 0x87).collect();
    write_u64s(mem, PD_ADDR, &pds)?;
    Ok(())
}

fn long_mode_sregs(sregs: &mut kvm_sregs, user: bool) {
    let gdt = gdt_table();
    let (cs_sel, ds_sel) = if user {
        (SEL_UCODE64, SEL_UDATA)
    } else {
        (SEL_KCODE64, SEL_KDATA)
    };
    let code = segment(cs_sel, gdt[(cs_sel >> 3) as usize]);
    let data = segment(ds_sel, gdt[(ds_sel >> 3) as usize]);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    let mut tr = segment(SEL_TSS, gdt[6]);
    tr.type_ = 0xb; // busy 64-bit TSS, as after LTR
    tr.s = 0;
    sregs.tr = tr;
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = IDT_ADDR;
    sregs.idt.limit = 0xfff;
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 |= CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT;
    sregs.cr0 |= CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG;
    sregs.cr0 &= !((1 << 30) | (1 << 29)); // caches on (CD, NW off)
    sregs.efer |= EFER_LME | EFER_LMA | EFER_SCE | EFER_NXE;
}

/// Registers/sregs for a CPL3 test guest (see the guest ABI in [`crate::test_guests`]).
pub fn setup_user_entry(
    sregs: &mut kvm_sregs,
    regs: &mut kvm_regs,
    entry: u64,
    vcpu: usize,
    vcpus: usize,
) {
    long_mode_sregs(sregs, true);
    *regs = kvm_regs {
        rip: entry,
        rsp: USER_STACK_TOP - vcpu as u64 * USER_STACK_PER_VCPU,
        rdi: vcpu as u64,
        rsi: vcpus as u64,
        // bit 1 reserved, IF on: PVM runs the guest with hardware IOPL 0, so a CPL3 guest can
        // neither `sti` nor `cli`; it masks interrupt sources (PIC/LAPIC) instead. Ports are
        // granted by the TSS I/O bitmap. IOPL=3 is still requested for VMX hosts.
        rflags: 0x2 | 0x200 | 0x3000,
        ..Default::default()
    };
}

/// Registers/sregs for the 64-bit Linux boot protocol (bzImage): paging on, zero page in rsi.
pub fn setup_linux64_entry(sregs: &mut kvm_sregs, regs: &mut kvm_regs, entry: u64) {
    long_mode_sregs(sregs, false);
    *regs = kvm_regs {
        rip: entry,
        rsp: KERNEL_STACK_TOP,
        rbp: KERNEL_STACK_TOP,
        rsi: ZERO_PAGE_ADDR,
        rflags: 0x2,
        ..Default::default()
    };
}

/// Registers/sregs for a PVH entry: 32-bit protected mode, paging off, start info in rbx.
pub fn setup_pvh_entry(sregs: &mut kvm_sregs, regs: &mut kvm_regs, entry: u64) {
    let gdt = gdt_table();
    let code = segment(SEL_CODE32, gdt[1]);
    let data = segment(SEL_KDATA, gdt[3]);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    let mut tr = segment(SEL_TSS, gdt[6]);
    tr.type_ = 0xb;
    tr.s = 0;
    sregs.tr = tr;
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.cr0 = CR0_PE | CR0_ET;
    sregs.cr4 = 0;
    sregs.efer = 0;
    *regs = kvm_regs {
        rip: entry,
        rbx: PVH_INFO_ADDR,
        rflags: 0x2,
        ..Default::default()
    };
}

/// Routes the PIC through LINT0 (ExtINT) and NMI through LINT1, as a PC's BIOS would.
pub fn set_lint(lapic: &mut kvm_lapic_state) {
    fn patch(lapic: &mut kvm_lapic_state, off: usize, mode: u32) {
        let mut b = [0u8; 4];
        for (i, x) in b.iter_mut().enumerate() {
            *x = lapic.regs[off + i] as u8;
        }
        let v = u32::from_le_bytes(b);
        // delivery mode bits 8..10, clear mask bit 16
        let v = (v & !0x0001_0700) | (mode << 8);
        for (i, x) in v.to_le_bytes().iter().enumerate() {
            lapic.regs[off + i] = *x as _;
        }
    }
    patch(lapic, 0x350, 0x7); // LVT LINT0: ExtINT
    patch(lapic, 0x360, 0x4); // LVT LINT1: NMI
}

/// KVM's paravirtual features (CPUID 0x4000_0001 EAX) a guest may use on a PVM host: the
/// clock only. The others call into KVM with `VMCALL`/`VMMCALL` (PV spinlock kicks, IPIs,
/// sched yield, page-state hypercalls), which PVM's emulation of guest kernel mode cannot run,
/// or rely on async page faults; without a clock of its own a guest on a host whose CPUID gives
/// no TSC frequency (AMD) cannot calibrate its TSC, falls back to jiffies and keeps a periodic
/// tick, which there costs about a host core per idle guest.
pub const PVM_KVM_FEATURES: u32 = (1 << 0) // KVM_FEATURE_CLOCKSOURCE
    | (1 << 3) // KVM_FEATURE_CLOCKSOURCE2
    | (1 << 24); // KVM_FEATURE_CLOCKSOURCE_STABLE_BIT

/// Restricts the KVM paravirtual features offered to a guest on a PVM host to
/// [`PVM_KVM_FEATURES`].
pub fn restrict_pv_features(cpuid: &mut CpuId) {
    for e in cpuid.as_mut_slice() {
        if e.function == 0x4000_0001 {
            e.eax &= PVM_KVM_FEATURES;
            e.edx = 0; // hints (realtime, ...)
        }
    }
}

/// Adapts the host-supported CPUID for vCPU `id` (APIC ids, hypervisor bit).
pub fn patch_cpuid(cpuid: &mut CpuId, id: usize, vcpus: usize) {
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | ((id as u32) << 24) | ((vcpus as u32 & 0xff) << 16);
                e.ecx |= 1 << 31; // running under a hypervisor
                if vcpus > 1 {
                    e.edx |= 1 << 28; // HTT: the count in ebx[23:16] is valid
                }
            }
            0xb | 0x1f => e.edx = id as u32,
            // AMD's extended APIC id (and core id: one thread per core), which its guests read
            // for their topology.
            0x8000_001e => {
                e.eax = id as u32;
                e.ebx = (e.ebx & !0xff) | (id as u32 & 0xff);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn leaf(function: u32, eax: u32, ebx: u32, edx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            eax,
            ebx,
            edx,
            ..Default::default()
        }
    }

    #[test]
    fn a_pvm_guest_is_offered_the_kvm_clock_and_nothing_that_needs_a_hypercall() {
        // What KVM offers: clock (0, 3, 24), PV EOI (6), unhalt (7), send-IPI (11),
        // sched-yield (13), async PF (4, 14), steal time (5); a realtime hint in EDX.
        let offered = (1 << 0)
            | (1 << 3)
            | (1 << 4)
            | (1 << 5)
            | (1 << 6)
            | (1 << 7)
            | (1 << 11)
            | (1 << 13)
            | (1 << 14)
            | (1 << 24);
        let mut c =
            CpuId::from_entries(&[leaf(0x4000_0001, offered, 0, 1), leaf(1, !0, 0, 0)]).unwrap();
        restrict_pv_features(&mut c);
        let e = c.as_slice();
        assert_eq!(e[0].eax, (1 << 0) | (1 << 3) | (1 << 24));
        assert_eq!(e[0].edx, 0);
        assert_eq!(e[1].eax, !0, "other leaves untouched");
    }

    fn sub(function: u32, index: u32, eax: u32, ebx: u32, edx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            index,
            ..leaf(function, eax, ebx, edx)
        }
    }

    // Intel hosts describe their topology in leaves 0xB and 0x1F (one entry per level), which
    // TCG's SVM cannot show: every subleaf must carry the vCPU's x2APIC id, and nothing else of
    // the table may change; no AMD leaf may appear on an Intel table.
    #[test]
    fn an_intel_table_gets_the_x2apic_id_in_every_level_of_0xb_and_0x1f_and_nothing_amd() {
        let intel = [
            sub(1, 0, 0x0009_06ea, 0x0010_0800, 0xbfeb_fbff),
            sub(0xb, 0, 1, 2, 7),
            sub(0xb, 1, 4, 8, 7),
            sub(0x1f, 0, 1, 2, 7),
            sub(0x1f, 1, 4, 8, 7),
            sub(0x1f, 2, 5, 8, 7),
            sub(0x8000_0001, 0, 0, 0, 0x2c10_0800),
        ];
        for id in [0usize, 5] {
            let mut c = CpuId::from_entries(&intel).unwrap();
            patch_cpuid(&mut c, id, 8);
            let e = c.as_slice();
            assert_eq!(e.len(), intel.len(), "no leaf added");
            assert!(e.iter().all(|x| x.function != 0x8000_001e));
            for (got, was) in e.iter().zip(&intel).filter(|(x, _)| x.function >= 0xb) {
                if got.function == 0xb || got.function == 0x1f {
                    assert_eq!(
                        got.edx, id as u32,
                        "x2APIC id in {:#x}.{}",
                        got.function, got.index
                    );
                    assert_eq!((got.eax, got.ebx, got.ecx), (was.eax, was.ebx, was.ecx));
                } else {
                    assert_eq!(got.edx, was.edx, "{:#x} untouched", got.function);
                }
            }
            assert_eq!(e[0].ebx >> 24, id as u32, "initial APIC id");
            assert_eq!(e[0].edx & (1 << 28), 1 << 28, "HTT with 8 vCPUs");
        }
    }

    #[test]
    fn each_vcpu_gets_its_own_apic_id_in_every_topology_leaf() {
        for id in 0..3usize {
            let mut c = CpuId::from_entries(&[
                leaf(1, 0, 0x00ff_1234, 0),
                leaf(0xb, 0, 0, 0),
                leaf(0x8000_001e, 0, 0x0000_0100, 0),
            ])
            .unwrap();
            patch_cpuid(&mut c, id, 3);
            let e = c.as_slice();
            assert_eq!(e[0].ebx >> 24, id as u32);
            assert_eq!((e[0].ebx >> 16) & 0xff, 3);
            assert_eq!(e[1].edx, id as u32);
            assert_eq!(e[2].eax, id as u32, "AMD extended APIC id");
            assert_eq!(
                e[2].ebx,
                0x100 | id as u32,
                "core id, threads per core kept"
            );
        }
    }
}
