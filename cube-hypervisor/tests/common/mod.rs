//! Helpers shared by the KVM integration tests.
#![allow(dead_code)]

use std::time::Duration;

use cube_hypervisor::{test_guests, RunOutcome, Shape, Vm, Vmm};

pub const TIMEOUT: Duration = Duration::from_secs(30);

/// Boots the pattern guest over `size` bytes with `seed` and runs it to its pause point.
pub fn pattern_vm_at_pause_point(vmm: &Vmm, shape: Shape, size: u64, seed: u64) -> Vm {
    let mut vm = vmm.create_vm(shape).expect("create VM");
    vm.load_test_guest(test_guests::PATTERN)
        .expect("load guest");
    vm.write_u64(test_guests::PARAMS_ADDR, size).unwrap();
    vm.write_u64(test_guests::PARAMS_ADDR + 8, seed).unwrap();
    let r = vm.run_until(TIMEOUT).expect("run to pause point");
    assert_eq!(r.outcome, RunOutcome::PausePoint(1));
    vm
}

/// Sum of the pattern the guest writes: qword at a = a ^ key.
pub fn pattern_sum(size: u64, key: u64) -> u64 {
    (0..size / 8)
        .map(|i| (test_guests::DATA_ADDR + i * 8) ^ key)
        .fold(0u64, |a, x| a.wrapping_add(x))
}

pub fn tmpdir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("cube-hv-{tag}-"))
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::Builder::new().prefix(tag).tempdir())
        .expect("temp dir")
}
