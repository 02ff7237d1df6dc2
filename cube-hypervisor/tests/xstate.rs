//! Extended (XSAVE) register state across a snapshot: a guest whose user-mode code fills the
//! widest vector registers it may use (AVX-512 zmm0-31 and k0-7 where the host has them) must
//! find every bit of them again after a restore into a new VM.

mod common;

use std::collections::BTreeMap;

use common::*;
use cube_hypervisor::{restore_into, test_guests, RunOutcome, Shape, Snapshot, VmShell, Vmm};

const LEVELS: [&str; 3] = ["SSE (xmm0-15)", "AVX (ymm0-15)", "AVX-512 (zmm0-31, k0-7)"];

/// The widest vector state this process may use, by the same test the guest makes.
fn host_level() -> u64 {
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        2
    } else if std::arch::is_x86_feature_detected!("avx") {
        1
    } else {
        0
    }
}

#[test]
fn a_restored_guest_keeps_its_widest_vector_registers() {
    cube_testkit::require_kvm!("a_restored_guest_keeps_its_widest_vector_registers");
    let vmm = Vmm::new().unwrap();
    let shape = Shape::new(1, 16);
    let seed = 0x5eed_0000_d00d_f00d_u64;
    let mut vm = vmm.create_vm(shape).unwrap();
    vm.load_test_guest(test_guests::XSTATE).unwrap();
    vm.write_u64(test_guests::PARAMS_ADDR, seed).unwrap();
    let r = vm.run_until(TIMEOUT).unwrap();
    assert_eq!(r.outcome, RunOutcome::PausePoint(1), "{r:?}");
    let d = test_guests::DATA_ADDR;
    let (ecx1, ebx7, xcr0, level) = (
        vm.read_u64(d).unwrap(),
        vm.read_u64(d + 8).unwrap(),
        vm.read_u64(d + 16).unwrap(),
        vm.read_u64(d + 24).unwrap(),
    );
    let seen = format!(
        "guest CPUID.1:ECX {ecx1:#x}, CPUID.7:EBX {ebx7:#x}, XCR0 {xcr0:#x}: uses {}",
        LEVELS.get(level as usize).unwrap_or(&"?")
    );
    eprintln!("{seen}");
    // The guest must exercise the widest state the host has, or this test proves nothing
    // about it: a guest kernel enables it (test guests get CR4.OSXSAVE and the VMM's XCR0).
    assert_eq!(level, host_level(), "{seen}");

    let dir = tmpdir("xstate");
    vm.snapshot(dir.path(), &BTreeMap::new()).unwrap();
    drop(vm);
    let snap = Snapshot::open(dir.path()).unwrap();
    let mut vm = restore_into(VmShell::new(&vmm, shape).unwrap(), &snap).unwrap();
    let r = vm.run_until(TIMEOUT).unwrap();
    let why = match r.outcome {
        RunOutcome::Done(1) => "a vector register changed",
        RunOutcome::Done(2) => "an opmask register changed",
        RunOutcome::Done(3) => "a general register was lost",
        _ => "",
    };
    assert_eq!(r.outcome, RunOutcome::Done(0), "{why} ({seen})");
}
