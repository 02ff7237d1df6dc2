//! A sandbox with a virtio-blk device: the device state travels in the template and is rebuilt
//! by the shim on the sandbox's own disk.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::*;
use cube_hypervisor::devices::irq::IrqLine;
use cube_hypervisor::devices::virtio::{Block, MmioTransport, MMIO_WINDOW_SIZE};
use cube_hypervisor::{test_guests, DeviceStates, RunOutcome, Shape, Snapshot, Vmm};
use cube_shim::devices::{BLOCK_GSI, BLOCK_MMIO_BASE, BLOCK_NAME};
use cube_shim::protocol::{ErrorKind, GuestStatus, Reply};
use cube_shim::Op;

#[test]
fn a_block_request_in_flight_in_the_template_completes_on_the_sandbox_disk() {
    cube_testkit::require_kvm!("shim_virtio_blk_restore");
    let shape = Shape::new(1, 32);
    let work = tmpdir("blk");
    let tpl = work.path().join("tpl");
    let tpl_disk = work.path().join("tpl.img");
    std::fs::File::create(&tpl_disk)
        .unwrap()
        .write_all(&[0u8; 16 * 512])
        .unwrap();
    {
        // Template: the guest wrote sector 2 and left a write of sector 3 in the avail ring.
        let vmm = Vmm::new().unwrap();
        let mut vm = vmm.create_vm(shape).unwrap();
        vm.load_test_guest(test_guests::VIRTIO_BLK_RESTORE).unwrap();
        vm.write_u64(test_guests::PARAMS_ADDR, BLOCK_MMIO_BASE)
            .unwrap();
        // This polling test guest has an empty IDT: mask the PIC as a real guest's interrupt
        // setup would, so that the irqfd the shim registers (as a Linux guest needs) leaves
        // the interrupt pending instead of delivering it. The mask travels in the snapshot.
        let mut pic = kvm_bindings::kvm_irqchip {
            chip_id: kvm_bindings::KVM_IRQCHIP_PIC_MASTER,
            ..Default::default()
        };
        vm.vm_fd().get_irqchip(&mut pic).unwrap();
        // Writing a union field is safe; KVM filled the PIC variant for this chip id.
        pic.chip.pic.imr = 0xff;
        vm.vm_fd().set_irqchip(&pic).unwrap();
        let irq = IrqLine::new(BLOCK_GSI).unwrap();
        vm.register_irq(&irq).unwrap();
        let t = MmioTransport::new(
            Block::open(&tpl_disk, false, "tpl").unwrap(),
            vm.memory().clone(),
            irq,
        )
        .unwrap();
        let t = Arc::new(Mutex::new(t));
        vm.add_mmio_device(BLOCK_MMIO_BASE, MMIO_WINDOW_SIZE, t.clone())
            .unwrap();
        let r = vm.run_until(std::time::Duration::from_secs(30)).unwrap();
        assert_eq!(
            r.outcome,
            RunOutcome::PausePoint(1),
            "checkpoints {:x?}",
            r.checkpoints
        );
        let mut devices = DeviceStates::new();
        devices.insert(
            BLOCK_NAME.into(),
            serde_json::to_vec(&t.lock().unwrap().state()).unwrap(),
        );
        vm.snapshot(&tpl, &devices).unwrap();
    }
    let disk = work.path().join("sandbox.img");
    std::fs::copy(&tpl_disk, &disk).unwrap();

    let shim = Shim::spawn(shape);
    let mut c = shim.client();
    // Without its disk the restore is refused, and the shell stays usable.
    let e = c
        .call(Op::Restore {
            snapshot: tpl.clone(),
            disk: None,
            tap: None,
            vsock: None,
        })
        .unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    let e = c
        .call(Op::Restore {
            snapshot: tpl.clone(),
            disk: Some(work.path().join("nope.img")),
            tap: None,
            vsock: None,
        })
        .unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    let r = c
        .call(Op::Restore {
            snapshot: tpl.clone(),
            disk: Some(disk.clone()),
            tap: None,
            vsock: None,
        })
        .unwrap();
    assert!(matches!(r, Reply::Restored { .. }));
    let (_, guest, checkpoints) = wait_guest(&mut c, 30_000);
    assert_eq!(
        guest,
        GuestStatus::Done { code: 0 },
        "checkpoints {checkpoints:x?}"
    );
    // used idx after resume, in-flight write status OK, readback of sector 2.
    assert_eq!(checkpoints, vec![2, 0, 0xa1]);
    let sandbox_disk = std::fs::read(&disk).unwrap();
    assert!(sandbox_disk[3 * 512..4 * 512].iter().all(|&b| b == 0xb2));
    let template_disk = std::fs::read(&tpl_disk).unwrap();
    assert!(
        template_disk[3 * 512..4 * 512].iter().all(|&b| b == 0),
        "template disk untouched"
    );

    // A snapshot of the sandbox carries the device again.
    let snap_dir = work.path().join("snap");
    c.call(Op::Pause).unwrap();
    c.call(Op::Snapshot {
        dir: snap_dir.clone(),
    })
    .unwrap();
    let snap = Snapshot::open(&snap_dir).unwrap();
    assert!(snap.device_state(BLOCK_NAME).is_some());
    shim.stop();
}

#[test]
fn backends_without_a_device_in_the_snapshot_are_refused() {
    cube_testkit::require_kvm!("shim_backends_without_device");
    let shape = Shape::new(1, 64);
    let t = tmpdir("tpl");
    pattern_template(t.path(), shape, 4096, 3);
    let shim = Shim::spawn(shape);
    let mut c = shim.client();
    for (tap, vsock) in [
        (Some("tap0".to_string()), None),
        (None, Some("/tmp/v.sock".into())),
    ] {
        let e = c
            .call(Op::Restore {
                snapshot: t.path().into(),
                disk: None,
                tap,
                vsock,
            })
            .unwrap_err();
        assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    }
    // A disk for a snapshot without a block device is a caller error.
    let e = c
        .call(Op::Restore {
            snapshot: t.path().into(),
            disk: Some("/tmp/x.img".into()),
            tap: None,
            vsock: None,
        })
        .unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    restore(&mut c, t.path());
    assert_eq!(wait_guest(&mut c, 30_000).1, GuestStatus::Done { code: 0 });
    shim.stop();
}
