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

/// Waits while the spin guest runs until each vCPU's counter (DATA + 64 × vCPU) is past
/// `past[i]`: progress is asserted, not how far it gets in some milliseconds (this machine
/// may be slow or nested).
pub fn until_counted_past(vm: &Vm, past: &[u64]) {
    let deadline = std::time::Instant::now() + TIMEOUT;
    for (i, &c) in past.iter().enumerate() {
        let addr = test_guests::DATA_ADDR + 64 * i as u64;
        while vm.read_u64(addr).unwrap() <= c {
            assert!(
                std::time::Instant::now() < deadline,
                "vCPU {i} did not count past {c}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
