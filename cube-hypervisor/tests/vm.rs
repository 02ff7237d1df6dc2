//! Guests run on /dev/kvm: registers, memory, port/MMIO exits, interrupts, pause/resume.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use cube_hypervisor::devices::bus::BusDevice;
use cube_hypervisor::{test_guests, RunOutcome, Shape, VcpuEvent, Vmm};

#[test]
fn pattern_guest_fills_memory_and_stops_at_its_pause_point() {
    cube_testkit::require_kvm!("pattern_guest_fills_memory_and_stops_at_its_pause_point");
    let vmm = Vmm::new().unwrap();
    let size = 1 << 20;
    let mut vm = pattern_vm_at_pause_point(&vmm, Shape::new(1, 32), size, 0x5eed);
    let regs = vm.regs(0).unwrap();
    assert_eq!(regs.r13, pattern_sum(size, 0x5eed));
    assert_eq!(regs.r14, 0xc0ffee);
    assert_eq!(regs.r15, 1);
    assert_eq!(
        vm.read_u64(test_guests::DATA_ADDR + 8).unwrap(),
        (test_guests::DATA_ADDR + 8) ^ 0x5eed
    );
    // Phase 2: the guest checks its pattern and rewrites it with the clone id.
    vm.write_u64(test_guests::PARAMS_ADDR + 16, 77).unwrap();
    let r = vm.run_until(TIMEOUT).unwrap();
    assert_eq!(r.outcome, RunOutcome::Done(0));
    assert_eq!(vm.regs(0).unwrap().r13, pattern_sum(size, 77));
    assert_eq!(vm.regs(0).unwrap().r15, 3);
}

#[test]
fn the_guest_notices_memory_changed_behind_its_back() {
    cube_testkit::require_kvm!("the_guest_notices_memory_changed_behind_its_back");
    let vmm = Vmm::new().unwrap();
    let mut vm = pattern_vm_at_pause_point(&vmm, Shape::new(1, 16), 64 << 10, 1);
    vm.write_u64(test_guests::DATA_ADDR + 4096, 0).unwrap();
    assert_eq!(vm.run_until(TIMEOUT).unwrap().outcome, RunOutcome::Done(1));
}

#[derive(Default)]
struct Recorder {
    writes: Vec<(u64, Vec<u8>)>,
    reads: Vec<(u64, usize)>,
}

impl BusDevice for Recorder {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        self.reads.push((offset, data.len()));
        for (i, b) in data.iter_mut().enumerate() {
            *b = 0x40 + offset as u8 + i as u8;
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        self.writes.push((offset, data.to_vec()));
    }
}

#[test]
fn port_and_mmio_exits_reach_the_buses() {
    cube_testkit::require_kvm!("port_and_mmio_exits_reach_the_buses");
    let vmm = Vmm::new().unwrap();
    let mut vm = vmm.create_vm(Shape::new(1, 8)).unwrap();
    let port = Arc::new(Mutex::new(Recorder::default()));
    let mmio = Arc::new(Mutex::new(Recorder::default()));
    vm.add_pio_device(0x10, 1, port.clone()).unwrap();
    vm.add_mmio_device(0xd000_0000, 0x1000, mmio.clone())
        .unwrap();
    // Overlaps and RAM are refused.
    assert!(vm.add_pio_device(0x10, 4, port.clone()).is_err());
    assert!(vm.add_mmio_device(0x10_0000, 0x1000, mmio.clone()).is_err());
    vm.load_test_guest(test_guests::IO).unwrap();
    let r = vm.run_until(TIMEOUT).unwrap();
    assert_eq!(r.outcome, RunOutcome::Done(0));
    let q = u64::from_le_bytes([0x48, 0x49, 0x4a, 0x4b, 0x4c, 0x4d, 0x4e, 0x4f]);
    assert_eq!(
        r.checkpoints,
        vec![0x40, 0x4746_4544, q as u32, (q >> 32) as u32]
    );
    let p = port.lock().unwrap();
    assert_eq!(p.writes, vec![(0, vec![0xab])]);
    assert_eq!(p.reads, vec![(0, 1)]);
    let m = mmio.lock().unwrap();
    assert_eq!(m.writes, vec![(0, 0x1234_5678u32.to_le_bytes().to_vec())]);
    assert_eq!(m.reads, vec![(4, 4), (8, 8)]);
}

#[test]
fn pause_and_resume_a_spinning_multi_vcpu_guest() {
    cube_testkit::require_kvm!("pause_and_resume_a_spinning_multi_vcpu_guest");
    let vmm = Vmm::new().unwrap();
    let mut vm = vmm.create_vm(Shape::new(2, 8)).unwrap();
    vm.load_test_guest(test_guests::SPIN).unwrap();
    vm.resume().unwrap();
    let mut started = 0;
    while started < 2 {
        match vm.next_event(TIMEOUT).unwrap() {
            Some((_, VcpuEvent::Checkpoint(0x5b1))) => started += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    until_counted_past(&vm, &[0, 0]);
    vm.pause().unwrap();
    let counts: Vec<u64> = (0..2)
        .map(|i| vm.read_u64(test_guests::DATA_ADDR + 64 * i).unwrap())
        .collect();
    for (i, &c) in counts.iter().enumerate() {
        let regs = vm.regs(i).unwrap();
        assert!(c > 0, "vCPU {i} did not count");
        // Paused between `inc r12` and the store, or after it.
        assert!(
            regs.r12 == c || regs.r12 == c + 1,
            "register {} vs memory {c}",
            regs.r12
        );
        assert_eq!(regs.r13, 0x1111 * (i as u64 + 1));
    }
    std::thread::sleep(Duration::from_millis(20));
    // Paused means paused: nothing moves.
    assert_eq!(vm.read_u64(test_guests::DATA_ADDR).unwrap(), counts[0]);
    vm.resume().unwrap();
    until_counted_past(&vm, &counts);
    vm.pause().unwrap();
}

#[test]
fn a_crashing_guest_is_reported_as_shutdown() {
    cube_testkit::require_kvm!("a_crashing_guest_is_reported_as_shutdown");
    let vmm = Vmm::new().unwrap();
    let mut vm = vmm.create_vm(Shape::new(1, 8)).unwrap();
    vm.load_test_guest(test_guests::CRASH).unwrap();
    let r = vm.run_until(TIMEOUT);
    match r {
        Ok(rep) => {
            assert_eq!(rep.checkpoints, vec![1]);
            assert_eq!(rep.outcome, RunOutcome::Shutdown);
        }
        Err(cube_hypervisor::Error::Vcpu { msg, .. }) => {
            // Some KVM flavours report the triple fault as an internal error instead.
            assert!(!msg.is_empty());
        }
        Err(e) => panic!("unexpected error {e}"),
    }
}

#[test]
fn pit_timer_interrupts_reach_the_guest() {
    cube_testkit::require_kvm!("pit_timer_interrupts_reach_the_guest");
    let vmm = Vmm::new().unwrap();
    let mut vm = vmm.create_vm(Shape::new(1, 8)).unwrap();
    vm.load_test_guest(test_guests::TIMER).unwrap();
    vm.write_u64(test_guests::PARAMS_ADDR, 3).unwrap();
    let r = vm.run_until(Duration::from_secs(60)).unwrap();
    assert_eq!(
        r.outcome,
        RunOutcome::Done(0),
        "checkpoints {:?}",
        r.checkpoints
    );
    assert!(r.checkpoints[0] >= 3);
    assert!(vm.read_u64(test_guests::DATA_ADDR).unwrap() >= 3);
}

#[test]
fn bad_shapes_and_images_are_refused() {
    cube_testkit::require_kvm!("bad_shapes_and_images_are_refused");
    let vmm = Vmm::new().unwrap();
    assert!(vmm.create_vm(Shape::new(0, 8)).is_err());
    assert!(vmm.create_vm(Shape::new(1, 3)).is_err());
    assert!(vmm.create_vm(Shape::new(1, 4096)).is_err());
    let mut vm = vmm.create_vm(Shape::new(1, 4)).unwrap();
    assert!(vm.load_test_guest(&[]).is_err());
    assert!(vm.load_test_guest(&vec![0x90; 4 << 20]).is_err());
    assert!(vm.regs(3).is_err());
    let cfg = cube_hypervisor::loader::KernelConfig {
        kernel: "/nonexistent/vmlinux".into(),
        cmdline: "console=ttyS0".into(),
        initramfs: None,
    };
    assert!(vm.load_kernel(&cfg).is_err());
    let junk = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(junk.path(), vec![0x5a; 8192]).unwrap();
    let cfg = cube_hypervisor::loader::KernelConfig {
        kernel: junk.path().into(),
        ..cfg
    };
    assert!(matches!(
        vm.load_kernel(&cfg),
        Err(cube_hypervisor::Error::Kernel(_))
    ));
}

#[test]
fn a_pvh_elf_kernel_is_entered_with_start_info_cmdline_and_memory_map() {
    cube_testkit::require_kvm!(
        "a_pvh_elf_kernel_is_entered_with_start_info_cmdline_and_memory_map"
    );
    let vmm = Vmm::new().unwrap();
    let mut vm = vmm.create_vm(Shape::new(1, 16)).unwrap();
    let kernel = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kernel.path(), test_guests::PVH_KERNEL).unwrap();
    let entry = vm
        .load_kernel(&cube_hypervisor::loader::KernelConfig {
            kernel: kernel.path().into(),
            cmdline: "console=ttyS0 quiet".into(),
            initramfs: None,
        })
        .unwrap();
    assert_eq!(entry.mode, cube_hypervisor::loader::EntryMode::Pvh);
    assert_eq!(entry.entry, 0x10_00c4);
    assert_eq!(entry.digest.len(), 64);
    let r = vm.run_until(Duration::from_secs(60)).unwrap();
    assert_eq!(r.outcome, RunOutcome::Done(0));
    // 'c' of "console", 3 memory map entries, the last one RAM (type 1).
    assert_eq!(r.checkpoints, vec![b'c' as u32, 3, 1]);
    // A snapshot of a kernel-booted VM records the kernel's digest.
    let dir = tmpdir("pvh");
    let m = vm.snapshot(dir.path(), &Default::default()).unwrap();
    assert_eq!(m.kernel_digest.as_deref(), Some(entry.digest.as_str()));
}

#[test]
fn a_bzimage_is_entered_at_its_64_bit_entry_with_a_zero_page() {
    cube_testkit::require_kvm!("a_bzimage_is_entered_at_its_64_bit_entry_with_a_zero_page");
    let vmm = Vmm::new().unwrap();
    let mut vm = vmm.create_vm(Shape::new(1, 16)).unwrap();
    let kernel = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kernel.path(), test_guests::BZIMAGE_KERNEL).unwrap();
    let entry = vm
        .load_kernel(&cube_hypervisor::loader::KernelConfig {
            kernel: kernel.path().into(),
            cmdline: "root=/dev/vda".into(),
            initramfs: None,
        })
        .unwrap();
    assert_eq!(entry.mode, cube_hypervisor::loader::EntryMode::Linux64);
    assert_eq!(entry.entry, 0x10_0200);
    let r = vm.run_until(Duration::from_secs(60)).unwrap();
    assert_eq!(r.outcome, RunOutcome::Done(0));
    assert_eq!(r.checkpoints, vec![3, b'r' as u32, 1]);
}
