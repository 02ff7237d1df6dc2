//! Guest-driven virtio tests: CPL3 nasm guests (`guests/virtio_*.asm`) with a minimal polling
//! virtio-mmio driver talk to the real devices through KVM MMIO exits, and the host checks
//! the other end (disk file, tap-like socket, vsock unix socket).

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cube_hypervisor::devices::irq::IrqLine;
use cube_hypervisor::devices::virtio::{
    BackendWorker, Block, MmioTransport, Net, Vsock, MMIO_WINDOW_SIZE,
};
use cube_hypervisor::{test_guests, RunOutcome, Shape, Vm, Vmm};

const BASE: u64 = 0xc000_1000;
const TIMEOUT: Duration = Duration::from_secs(30);

fn vm_for(guest: &[u8]) -> Vm {
    let vmm = Vmm::new().expect("open /dev/kvm");
    let mut vm = vmm.create_vm(Shape::new(1, 32)).expect("create VM");
    vm.load_test_guest(guest).expect("load guest");
    vm.write_u64(test_guests::PARAMS_ADDR, BASE).unwrap();
    vm
}

#[test]
fn guest_reads_and_writes_a_virtio_block_disk() {
    cube_testkit::require_kvm!("guest_reads_and_writes_a_virtio_block_disk");
    let mut disk = tempfile::NamedTempFile::new().unwrap();
    let mut content = vec![0u8; 64 * 512];
    content[0..4].copy_from_slice(&0x1122_3344u32.to_le_bytes());
    content[508..512].copy_from_slice(&0x5566_7788u32.to_le_bytes());
    disk.write_all(&content).unwrap();

    let mut vm = vm_for(test_guests::VIRTIO_BLK);
    let dev = Block::open(disk.path(), false, "CUBEdisk").unwrap();
    let t = MmioTransport::new(dev, vm.memory().clone(), IrqLine::new(5).unwrap()).unwrap();
    let t = Arc::new(Mutex::new(t));
    vm.add_mmio_device(BASE, MMIO_WINDOW_SIZE, t.clone())
        .unwrap();
    assert_eq!(
        MmioTransport::cmdline(BASE, 5),
        "virtio_mmio.device=4K@0xc0001000:5"
    );

    let r = vm.run_until(TIMEOUT).unwrap();
    assert_eq!(
        r.outcome,
        RunOutcome::Done(0),
        "checkpoints {:x?}",
        r.checkpoints
    );
    let id = u32::from_le_bytes(*b"CUBE");
    // sector 0 first/last dword, disk id, readback used length, ISR (used buffer), ISR after ack
    assert_eq!(r.checkpoints, vec![0x1122_3344, 0x5566_7788, id, 513, 1, 0]);
    let on_disk = std::fs::read(disk.path()).unwrap();
    assert!(
        on_disk[512..1024].iter().all(|&b| b == 0x5a),
        "guest write reached the file"
    );
    assert_eq!(&on_disk[1024..], &content[1024..]);
    assert!(!t.lock().unwrap().needs_reset());
}

#[test]
fn guest_sends_and_receives_a_virtio_net_frame() {
    cube_testkit::require_kvm!("guest_sends_and_receives_a_virtio_net_frame");
    let mut fds = [0; 2];
    // SAFETY: socketpair fills the two-element array.
    assert_eq!(
        unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0, fds.as_mut_ptr()) },
        0
    );
    // SAFETY: fresh fds, owned here.
    let (dev_end, host_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };

    let mut vm = vm_for(test_guests::VIRTIO_NET);
    let mac = [0x02, 0xcb, 0x11, 0x22, 0x33, 0x44];
    let t = MmioTransport::new(
        Net::new(dev_end, mac).unwrap(),
        vm.memory().clone(),
        IrqLine::new(6).unwrap(),
    )
    .unwrap();
    let t = Arc::new(Mutex::new(t));
    vm.add_mmio_device(BASE, MMIO_WINDOW_SIZE, t.clone())
        .unwrap();
    let worker = BackendWorker::spawn(t.clone()).unwrap();

    // The "network": wait for the guest's frame, answer with a frame of our own.
    let peer = std::thread::spawn(move || {
        let tv = libc::timeval {
            tv_sec: 20,
            tv_usec: 0,
        };
        // SAFETY: setsockopt with a valid timeval.
        unsafe {
            libc::setsockopt(
                host_end.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        let mut buf = vec![0u8; 2048];
        // SAFETY: valid buffer.
        let n = unsafe { libc::read(host_end.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        assert!(n > 0, "no frame from the guest");
        buf.truncate(n as usize);
        let mut reply = [0u8; 64];
        reply[0..6].copy_from_slice(&mac);
        reply[12..14].copy_from_slice(&[0x88, 0xb5]);
        reply[14..18].copy_from_slice(b"pong");
        // SAFETY: valid buffer.
        let w = unsafe { libc::write(host_end.as_raw_fd(), reply.as_ptr().cast(), reply.len()) };
        assert_eq!(w, 64);
        buf
    });

    let r = vm.run_until(TIMEOUT).unwrap();
    worker.stop();
    let frame = peer.join().unwrap();
    assert_eq!(
        r.outcome,
        RunOutcome::Done(0),
        "checkpoints {:x?}",
        r.checkpoints
    );
    assert_eq!(frame.len(), 60, "virtio_net_hdr stripped");
    assert_eq!(&frame[0..6], &[0xff; 6]);
    assert_eq!(&frame[14..18], b"CUBE");
    assert_eq!(
        r.checkpoints,
        vec![
            u32::from_le_bytes([0x02, 0xcb, 0x11, 0x22]),
            12 + 64,
            u32::from_le_bytes(*b"pong")
        ]
    );
}

#[test]
fn guest_talks_to_a_host_unix_socket_over_vsock() {
    cube_testkit::require_kvm!("guest_talks_to_a_host_unix_socket_over_vsock");
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vsock.sock");
    let listener = UnixListener::bind(format!("{}_5000", uds.display())).unwrap();

    let mut vm = vm_for(test_guests::VIRTIO_VSOCK);
    vm.write_u64(test_guests::PARAMS_ADDR + 8, 5000).unwrap();
    let t = MmioTransport::new(
        Vsock::new(3, &uds).unwrap(),
        vm.memory().clone(),
        IrqLine::new(7).unwrap(),
    )
    .unwrap();
    let t = Arc::new(Mutex::new(t));
    vm.add_mmio_device(BASE, MMIO_WINDOW_SIZE, t.clone())
        .unwrap();
    let worker = BackendWorker::spawn(t.clone()).unwrap();

    let host = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut ping = [0u8; 4];
        s.read_exact(&mut ping).unwrap();
        s.write_all(b"pong!").unwrap();
        // The guest's SHUTDOWN shows up as EOF; only then close our side.
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        (ping, rest)
    });

    let r = vm.run_until(TIMEOUT).unwrap();
    worker.stop();
    assert_eq!(
        r.outcome,
        RunOutcome::Done(0),
        "checkpoints {:x?}",
        r.checkpoints
    );
    let (ping, rest) = host.join().unwrap();
    assert_eq!(&ping, b"ping");
    assert!(rest.is_empty());
    // CID, RESPONSE, RW, its length and data, RST after the full shutdown.
    assert_eq!(
        r.checkpoints,
        vec![3, 2, 5, 5, u32::from_le_bytes(*b"pong"), 3]
    );
    assert_eq!(t.lock().unwrap().device().connection_count(), 0);
}

#[test]
fn a_block_request_in_flight_at_snapshot_completes_on_the_clone_disk() {
    cube_testkit::require_kvm!("a_block_request_in_flight_at_snapshot_completes_on_the_clone_disk");
    use cube_hypervisor::devices::virtio::{BlockState, MmioState};
    use cube_hypervisor::{restore, DeviceStates, Snapshot};

    let mut disk = tempfile::NamedTempFile::new().unwrap();
    disk.write_all(&vec![0u8; 16 * 512]).unwrap();
    let vmm = Vmm::new().expect("open /dev/kvm");
    let mut vm = vmm.create_vm(Shape::new(1, 32)).expect("create VM");
    vm.load_test_guest(test_guests::VIRTIO_BLK_RESTORE).unwrap();
    vm.write_u64(test_guests::PARAMS_ADDR, BASE).unwrap();
    let t = MmioTransport::new(
        Block::open(disk.path(), false, "orig").unwrap(),
        vm.memory().clone(),
        IrqLine::new(5).unwrap(),
    )
    .unwrap();
    let t = Arc::new(Mutex::new(t));
    vm.add_mmio_device(BASE, MMIO_WINDOW_SIZE, t.clone())
        .unwrap();
    let r = vm.run_until(TIMEOUT).unwrap();
    assert_eq!(
        r.outcome,
        RunOutcome::PausePoint(1),
        "checkpoints {:x?}",
        r.checkpoints
    );

    // Snapshot: VM + device state; the clone gets a copy of the disk as it is now.
    let state = t.lock().unwrap().state();
    assert_eq!(
        (state.queues[0].next_avail, state.queues[0].next_used),
        (1, 1)
    );
    let mut devices = DeviceStates::new();
    devices.insert("virtio-blk".into(), serde_json::to_vec(&state).unwrap());
    let dir = tempfile::tempdir().unwrap();
    vm.snapshot(dir.path(), &devices).unwrap();
    drop(vm);
    drop(t);
    let clone_disk = tempfile::NamedTempFile::new().unwrap();
    std::fs::copy(disk.path(), clone_disk.path()).unwrap();

    let snap = Snapshot::open(dir.path()).unwrap();
    let mut vm2 = restore(&vmm, &snap).unwrap();
    let st: MmioState<BlockState> =
        serde_json::from_slice(snap.device_state("virtio-blk").unwrap()).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(clone_disk.path())
        .unwrap();
    let t2 =
        MmioTransport::<Block>::restore(st, file, vm2.memory().clone(), IrqLine::new(5).unwrap())
            .unwrap();
    vm2.add_mmio_device(BASE, MMIO_WINDOW_SIZE, Arc::new(Mutex::new(t2)))
        .unwrap();
    let r = vm2.run_until(TIMEOUT).unwrap();
    assert_eq!(
        r.outcome,
        RunOutcome::Done(0),
        "checkpoints {:x?}",
        r.checkpoints
    );
    assert_eq!(r.checkpoints, vec![2, 0, 0xa1]);

    let clone = std::fs::read(clone_disk.path()).unwrap();
    assert!(
        clone[3 * 512..4 * 512].iter().all(|&b| b == 0xb2),
        "in-flight write landed on the clone's disk"
    );
    let orig = std::fs::read(disk.path()).unwrap();
    assert!(orig[2 * 512..3 * 512].iter().all(|&b| b == 0xa1));
    assert!(
        orig[3 * 512..4 * 512].iter().all(|&b| b == 0),
        "the original disk never saw it"
    );
}
