//! virtio-net on a real tap and virtio-vsock on a host unix socket, rebuilt by the shim from a
//! template and rebound to new backends after a pause-to-disk.

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use cube_hypervisor::devices::irq::IrqLine;
use cube_hypervisor::devices::virtio::{MmioTransport, Net, Vsock, MMIO_WINDOW_SIZE};
use cube_hypervisor::{test_guests, DeviceStates, RunOutcome, Shape, Snapshot, Vm, Vmm};
use cube_shim::devices::{
    NET_GSI, NET_MMIO_BASE, NET_NAME, VSOCK_GSI, VSOCK_MMIO_BASE, VSOCK_NAME,
};
use cube_shim::protocol::{ErrorKind, GuestStatus, Reply, SandboxState};
use cube_shim::{Client, Op};

use cube_shim::template::guests as shim_guests;

const ETH_TYPE: u16 = 0x88b5;
const GUEST_MAC: [u8; 6] = [0x02, 0xcb, 0x5e, 0x00, 0x00, 0x07];

/// These polling test guests have an empty IDT: mask the PIC as a real guest's interrupt setup
/// would, so that the irqfds the shim registers leave interrupts pending instead of delivering
/// them. The mask travels in the snapshot.
fn mask_pic(vm: &Vm) {
    let mut pic = kvm_bindings::kvm_irqchip {
        chip_id: kvm_bindings::KVM_IRQCHIP_PIC_MASTER,
        ..Default::default()
    };
    vm.vm_fd().get_irqchip(&mut pic).unwrap();
    // Writing a union field is safe; KVM filled the PIC variant for this chip id.
    pic.chip.pic.imr = 0xff;
    vm.vm_fd().set_irqchip(&pic).unwrap();
}

/// A persistent tap with a unique name, up, IPv6 off (so the kernel sends nothing on it by
/// itself); deleted on drop.
struct Tap {
    name: String,
}

impl Tap {
    fn new() -> Tap {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "csn{}x{}",
            std::process::id() % 10_000_000,
            N.fetch_add(1, Ordering::Relaxed)
        );
        assert!(name.len() <= 15);
        let tap = Tap { name };
        tap.ip(&["tuntap", "add", "dev", &tap.name, "mode", "tap"]);
        let _ = std::fs::write(
            format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", tap.name),
            "1",
        );
        tap.ip(&["link", "set", "dev", &tap.name, "up"]);
        tap
    }

    /// Waits until the kernel has the link up after a shim attached to the tap: before the
    /// carrier change is processed (link watch, up to a second) frames sent to the tap are
    /// dropped by its not yet activated queue.
    fn wait_up(&self) {
        let path = format!("/sys/class/net/{}/operstate", self.name);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(&path).unwrap_or_default().trim() != "up" {
            assert!(
                std::time::Instant::now() < deadline,
                "tap {} never came up",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn ip(&self, args: &[&str]) {
        let st = Command::new("ip").args(args).status().expect("run ip");
        assert!(st.success(), "ip {args:?} failed");
    }

    fn ifindex(&self) -> u32 {
        let c = std::ffi::CString::new(self.name.as_str()).unwrap();
        // SAFETY: valid NUL-terminated string.
        let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
        assert!(i > 0, "no interface {}", self.name);
        i
    }

    /// A packet socket on the tap for our ethertype (what the "network" sees and sends).
    fn packet_socket(&self) -> OwnedFd {
        let proto = ETH_TYPE.to_be();
        // SAFETY: plain socket call.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto as i32) };
        assert!(
            fd >= 0,
            "packet socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: fresh fd, owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_ll is plain data.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = self.ifindex() as i32;
        // SAFETY: valid sockaddr_ll of the given length.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, 0, "bind: {}", std::io::Error::last_os_error());
        let tv = libc::timeval {
            tv_sec: 20,
            tv_usec: 0,
        };
        // SAFETY: setsockopt with a valid timeval.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        fd
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", "dev", &self.name])
            .status();
    }
}

/// Next frame the guest sent on the tap (our own outgoing frames are skipped); its payload dword.
fn recv_guest_frame(sock: &OwnedFd) -> u32 {
    loop {
        let mut buf = [0u8; 2048];
        // SAFETY: sockaddr_ll is plain data.
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
        // SAFETY: valid buffers of the given lengths.
        let n = unsafe {
            libc::recvfrom(
                sock.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                (&mut from as *mut libc::sockaddr_ll).cast(),
                &mut len,
            )
        };
        assert!(
            n > 0,
            "no frame from the guest: {}",
            std::io::Error::last_os_error()
        );
        if from.sll_pkttype == libc::PACKET_OUTGOING {
            continue;
        }
        let f = &buf[..n as usize];
        assert_eq!(f.len(), 60, "bare ethernet frame, no virtio_net_hdr");
        assert_eq!(&f[0..6], &[0xff; 6]);
        assert_eq!(&f[6..12], &[0x02, 0, 0, 0, 0, 1]);
        return u32::from_le_bytes(f[14..18].try_into().unwrap());
    }
}

/// Sends a frame to the guest's MAC with payload dword `v`.
fn send_to_guest(sock: &OwnedFd, v: u32) {
    let mut f = [0u8; 60];
    f[0..6].copy_from_slice(&GUEST_MAC);
    f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x0f]);
    f[12..14].copy_from_slice(&ETH_TYPE.to_be_bytes());
    f[14..18].copy_from_slice(&v.to_le_bytes());
    // SAFETY: valid buffer.
    let n = unsafe { libc::send(sock.as_raw_fd(), f.as_ptr().cast(), f.len(), 0) };
    assert_eq!(n, 60, "send: {}", std::io::Error::last_os_error());
}

/// Net guest at its pause point (device up, three rx buffers posted), snapshotted into `dir`.
fn net_template(dir: &Path, shape: Shape) {
    let vmm = Vmm::new().unwrap();
    let mut vm = vmm.create_vm(shape).unwrap();
    vm.load_test_guest(shim_guests::NET_ROUNDS).unwrap();
    vm.write_u64(test_guests::PARAMS_ADDR, NET_MMIO_BASE)
        .unwrap();
    mask_pic(&vm);
    let mut fds = [0; 2];
    // SAFETY: socketpair fills the two-element array.
    let r = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0, fds.as_mut_ptr()) };
    assert_eq!(r, 0);
    // SAFETY: fresh fds, owned here.
    let (dev_end, _peer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let irq = IrqLine::new(NET_GSI).unwrap();
    vm.register_irq(&irq).unwrap();
    let t = MmioTransport::new(
        Net::new(dev_end, GUEST_MAC).unwrap(),
        vm.memory().clone(),
        irq,
    )
    .unwrap();
    let t = Arc::new(Mutex::new(t));
    vm.add_mmio_device(NET_MMIO_BASE, MMIO_WINDOW_SIZE, t.clone())
        .unwrap();
    let r = vm.run_until(Duration::from_secs(30)).unwrap();
    assert_eq!(
        r.outcome,
        RunOutcome::PausePoint(1),
        "checkpoints {:x?}",
        r.checkpoints
    );
    assert!(t.lock().unwrap().is_active());
    let mut devices = DeviceStates::new();
    devices.insert(
        NET_NAME.into(),
        serde_json::to_vec(&t.lock().unwrap().state()).unwrap(),
    );
    vm.snapshot(dir, &devices).unwrap();
}

fn checkpoints(c: &mut Client) -> Vec<u32> {
    match c.call(Op::Stats).expect("stats") {
        Reply::Stats { checkpoints, .. } => checkpoints,
        other => panic!("stats: {other:?}"),
    }
}

#[test]
fn a_sandbox_talks_over_a_real_tap_and_keeps_talking_on_a_new_tap_after_pause_to_disk() {
    cube_testkit::require_kvm!("shim_virtio_net_tap");
    cube_testkit::require_priv!("shim_virtio_net_tap");
    let shape = Shape::new(1, 32);
    let work = tmpdir("net");
    let tpl = work.path().join("tpl");
    net_template(&tpl, shape);

    let tap_a = Tap::new();
    let sock_a = tap_a.packet_socket();
    let shim_a = Shim::spawn(shape);
    let mut c = shim_a.client();
    // The snapshot has a net device: no tap, or a tap name the kernel cannot have, is refused
    // and the shell stays usable.
    let missing = format!("csn{}none", std::process::id() % 10_000_000);
    for tap in [
        None,
        Some("bad/name".to_string()),
        Some("x".repeat(16)),
        Some(missing.clone()),
    ] {
        let e = c
            .call(Op::Restore {
                snapshot: tpl.clone(),
                disk: None,
                tap,
                vsock: None,
            })
            .unwrap_err();
        assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    }
    let e = c
        .call(Op::Restore {
            snapshot: tpl.clone(),
            disk: None,
            tap: Some(tap_a.name.clone()),
            vsock: Some(work.path().join("v.sock")),
        })
        .unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    assert!(
        !Path::new("/sys/class/net").join(&missing).exists(),
        "a refused tap name left no interface behind"
    );
    let r = c
        .call(Op::Restore {
            snapshot: tpl.clone(),
            disk: None,
            tap: Some(tap_a.name.clone()),
            vsock: None,
        })
        .unwrap();
    assert!(matches!(r, Reply::Restored { .. }));

    // Round 1 on tap A: the guest's frame comes out, our answer gets in (the guest only sends
    // frame 2 after it received answer 1).
    assert_eq!(recv_guest_frame(&sock_a), 0xc0be_0001);
    tap_a.wait_up();
    send_to_guest(&sock_a, 0x7e57_0001);
    assert_eq!(recv_guest_frame(&sock_a), 0xc0be_0002);
    assert_eq!(checkpoints(&mut c), vec![0x7e57_0001]);

    // The guest now waits for answer 2: park it on disk and drop shim A and tap A.
    let pdir = work.path().join("paused");
    c.call(Op::PauseToDisk { dir: pdir.clone() }).unwrap();
    let snap = Snapshot::open(&pdir).unwrap();
    assert!(snap.device_state(NET_NAME).is_some());
    drop(snap);
    shim_a.stop();
    drop(sock_a);
    drop(tap_a);

    // A new shim resumes it on a new tap.
    let tap_b = Tap::new();
    let sock_b = tap_b.packet_socket();
    let shim_b = Shim::spawn(shape);
    let mut c = shim_b.client();
    let e = c
        .call(Op::Resume {
            dir: Some(pdir.clone()),
            disk: None,
            tap: None,
            vsock: None,
        })
        .unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    let r = c
        .call(Op::Resume {
            dir: Some(pdir.clone()),
            disk: None,
            tap: Some(tap_b.name.clone()),
            vsock: None,
        })
        .unwrap();
    assert_eq!(r, Reply::Resumed);
    tap_b.wait_up();
    send_to_guest(&sock_b, 0x7e57_0002);
    assert_eq!(recv_guest_frame(&sock_b), 0xc0be_0003);
    // While the sandbox is paused the backend worker stays off the device: answer 3 waits in
    // the tap and the rx used index (RXU + 2 in the guest) stays at 2 until `resume`.
    assert_eq!(c.call(Op::Pause).unwrap(), Reply::Paused);
    send_to_guest(&sock_b, 0x7e57_0003);
    std::thread::sleep(Duration::from_millis(200));
    let used_idx = |c: &mut Client| match c
        .call(Op::Peek {
            gpa: 0x202000,
            count: 1,
            stride: None,
        })
        .unwrap()
    {
        Reply::Values { values } => (values[0] >> 16) & 0xffff,
        other => panic!("peek: {other:?}"),
    };
    assert_eq!(used_idx(&mut c), 2);
    assert_eq!(
        c.call(Op::Resume {
            dir: None,
            disk: None,
            tap: None,
            vsock: None,
        })
        .unwrap(),
        Reply::Resumed
    );
    let (state, guest, cps) = wait_guest(&mut c, 30_000);
    assert_eq!(state, SandboxState::Running);
    assert_eq!(guest, GuestStatus::Done { code: 0 }, "checkpoints {cps:x?}");
    assert_eq!(cps, vec![0x7e57_0002, 0x7e57_0003]);
    assert_eq!(used_idx(&mut c), 3);
    // All of it ran under the seccomp filter (workers, tap, socket binds included).
    assert!(matches!(
        c.call(Op::Ping).unwrap(),
        Reply::Pong { seccomp: true, .. }
    ));
    shim_b.stop();
}

#[test]
fn a_sandbox_connects_to_the_host_over_vsock_through_the_shim() {
    cube_testkit::require_kvm!("shim_virtio_vsock");
    let shape = Shape::new(1, 32);
    let work = tmpdir("vsock");
    let tpl = work.path().join("tpl");
    {
        // Template: the hypervisor's vsock guest before its first instruction, with a device
        // (guest CID 3) the guest will set up after the restore.
        let vmm = Vmm::new().unwrap();
        let mut vm = vmm.create_vm(shape).unwrap();
        vm.load_test_guest(test_guests::VIRTIO_VSOCK).unwrap();
        vm.write_u64(test_guests::PARAMS_ADDR, VSOCK_MMIO_BASE)
            .unwrap();
        vm.write_u64(test_guests::PARAMS_ADDR + 8, 5000).unwrap();
        mask_pic(&vm);
        let irq = IrqLine::new(VSOCK_GSI).unwrap();
        vm.register_irq(&irq).unwrap();
        let t = MmioTransport::new(
            Vsock::new(3, &work.path().join("tpl-vsock.sock")).unwrap(),
            vm.memory().clone(),
            irq,
        )
        .unwrap();
        let mut devices = DeviceStates::new();
        devices.insert(VSOCK_NAME.into(), serde_json::to_vec(&t.state()).unwrap());
        vm.snapshot(&tpl, &devices).unwrap();
    }

    let uds = work.path().join("sandbox-vsock.sock");
    let listener = UnixListener::bind(format!("{}_5000", uds.display())).unwrap();
    let host = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut ping = [0u8; 4];
        s.read_exact(&mut ping).unwrap();
        s.write_all(b"pong!").unwrap();
        // The guest's SHUTDOWN shows up as EOF.
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        (ping, rest)
    });

    let shim = Shim::spawn(shape);
    let mut c = shim.client();
    // No socket path, or one the shim cannot bind, is refused before the shell is spent.
    for vsock in [
        None,
        Some(work.path().join("no-such-dir/v.sock")),
        Some(work.path().to_path_buf()),
        Some(work.path().join("x".repeat(120))),
    ] {
        let e = c
            .call(Op::Restore {
                snapshot: tpl.clone(),
                disk: None,
                tap: None,
                vsock,
            })
            .unwrap_err();
        assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    }
    let r = c
        .call(Op::Restore {
            snapshot: tpl.clone(),
            disk: None,
            tap: None,
            vsock: Some(uds.clone()),
        })
        .unwrap();
    assert!(matches!(r, Reply::Restored { .. }));
    let (_, guest, cps) = wait_guest(&mut c, 30_000);
    assert_eq!(guest, GuestStatus::Done { code: 0 }, "checkpoints {cps:x?}");
    let (ping, rest) = host.join().unwrap();
    assert_eq!(&ping, b"ping");
    assert!(rest.is_empty());
    // CID, RESPONSE, RW, its length and data, RST after the full shutdown.
    assert_eq!(cps, vec![3, 2, 5, 5, u32::from_le_bytes(*b"pong"), 3]);
    // The shim bound the sandbox's host socket (host-initiated connections land there).
    assert!(uds.exists());

    // A snapshot of the sandbox carries the device again.
    let snap_dir = work.path().join("snap");
    c.call(Op::Snapshot {
        dir: snap_dir.clone(),
    })
    .unwrap();
    let snap = Snapshot::open(&snap_dir).unwrap();
    assert!(snap.device_state(VSOCK_NAME).is_some());
    shim.stop();
    assert!(!uds.exists(), "the shim removes its vsock socket");
}
