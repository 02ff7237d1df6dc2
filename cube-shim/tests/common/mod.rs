//! Helpers for the shim tests: templates made with the hypervisor library in the test
//! process, and real `cube-shim` processes.
#![allow(dead_code)]

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cube_hypervisor::{test_guests, DeviceStates, RunOutcome, Shape, VcpuEvent, Vmm};
use cube_shim::protocol::{GuestStatus, Reply, SandboxState};
use cube_shim::{Client, Op};

/// The project's guest kernel: `CUBE_GUEST_KERNEL`, else deploy/guest-kernel/out/vmlinux.
/// Missing, the test skips, or fails under `CUBE_REQUIRE_KVM=1`.
pub fn guest_kernel() -> Option<PathBuf> {
    let kernel = std::env::var_os("CUBE_GUEST_KERNEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/guest-kernel/out/vmlinux")
        });
    if kernel.exists() {
        return Some(kernel);
    }
    missing_input(
        "linux guest test",
        &format!("guest kernel {} not built", kernel.display()),
    )
}

/// An input a KVM test needs is missing: skip with the reason, or fail under
/// `CUBE_REQUIRE_KVM=1`.
pub fn missing_input<T>(test: &str, why: &str) -> Option<T> {
    if std::env::var("CUBE_REQUIRE_KVM").as_deref() == Ok("1") {
        panic!("{test}: {why} (CUBE_REQUIRE_KVM=1)");
    }
    // The test's gate logs SKIPPED, not RAN, when it returns.
    cube_testkit::skip(&format!("{test}: {why}"));
    None
}

/// Runs a command that must succeed.
pub fn run(cmd: &mut Command) {
    let o = cmd.output().expect("run");
    assert!(
        o.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

pub fn tmpdir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("cube-shim-{tag}-"))
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::Builder::new().prefix(tag).tempdir())
        .expect("temp dir")
}

/// Pattern guest (params: size, seed) at its pause point, snapshotted into `dir`.
pub fn pattern_template(dir: &Path, shape: Shape, size: u64, seed: u64) {
    let vmm = Vmm::new().expect("kvm");
    let mut vm = vmm.create_vm(shape).expect("create VM");
    vm.load_test_guest(test_guests::PATTERN).unwrap();
    vm.write_u64(test_guests::PARAMS_ADDR, size).unwrap();
    vm.write_u64(test_guests::PARAMS_ADDR + 8, seed).unwrap();
    let r = vm.run_until(Duration::from_secs(30)).unwrap();
    assert_eq!(r.outcome, RunOutcome::PausePoint(1));
    vm.snapshot(dir, &DeviceStates::new()).expect("snapshot");
}

/// Bench guest that wrote one qword per page of `working_set` bytes at DATA, at pause point 1;
/// on resume it writes nothing more (phase B size 0) and stops at pause point 3.
pub fn bench_template(dir: &Path, shape: Shape, working_set: u64) {
    let vmm = Vmm::new().expect("kvm");
    let mut vm = vmm.create_vm(shape).expect("create VM");
    vm.load_test_guest(test_guests::BENCH).unwrap();
    vm.write_u64(test_guests::PARAMS_ADDR, working_set).unwrap();
    vm.write_u64(test_guests::PARAMS_ADDR + 8, 0).unwrap();
    vm.write_u64(test_guests::PARAMS_ADDR + 16, test_guests::DATA_ADDR)
        .unwrap();
    let r = vm.run_until(Duration::from_secs(30)).unwrap();
    assert_eq!(r.outcome, RunOutcome::PausePoint(1));
    vm.snapshot(dir, &DeviceStates::new()).expect("snapshot");
}

/// Spin guest (counts forever at DATA + 64 × vCPU), snapshotted shortly after it started.
pub fn spin_template(dir: &Path, shape: Shape) {
    let vmm = Vmm::new().expect("kvm");
    let mut vm = vmm.create_vm(shape).expect("create VM");
    vm.load_test_guest(test_guests::SPIN).unwrap();
    vm.resume().unwrap();
    loop {
        match vm.next_event(Duration::from_secs(30)).unwrap() {
            Some((_, VcpuEvent::Checkpoint(0x5b1))) => break,
            Some((_, VcpuEvent::Checkpoint(_))) => {}
            other => panic!("spin guest: {other:?}"),
        }
    }
    std::thread::sleep(Duration::from_millis(5));
    vm.pause().unwrap();
    vm.snapshot(dir, &DeviceStates::new()).expect("snapshot");
}

pub struct Shim {
    pub child: Child,
    pub socket: PathBuf,
    _dir: Option<tempfile::TempDir>,
}

impl Shim {
    pub fn spawn(shape: Shape) -> Shim {
        Self::spawn_with(shape, &[])
    }

    pub fn spawn_with(shape: Shape, extra: &[&str]) -> Shim {
        Self::try_spawn(shape, extra).expect("shim starts")
    }

    pub fn try_spawn(shape: Shape, extra: &[&str]) -> Result<Shim, String> {
        let dir = tmpdir("sock");
        let socket = dir.path().join("shim.sock");
        let mut s = Self::try_spawn_at(shape, &socket, extra)?;
        s._dir = Some(dir);
        Ok(s)
    }

    /// A shim whose control socket is `socket` (for a jailed shim: inside its `--jail-own`
    /// directory, the only place it can create one).
    pub fn try_spawn_at(shape: Shape, socket: &Path, extra: &[&str]) -> Result<Shim, String> {
        let socket = socket.to_path_buf();
        let mut child = Command::new(env!("CARGO_BIN_EXE_cube-shim"))
            .arg("--vcpus")
            .arg(shape.vcpus.to_string())
            .arg("--mem-mib")
            .arg(shape.mem_mib.to_string())
            .arg("--socket")
            .arg(&socket)
            .args(extra)
            .stdin(Stdio::null())
            .env("RUST_LOG", "warn")
            .spawn()
            .map_err(|e| format!("spawn: {e}"))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                return Err(format!("shim exited early: {st}"));
            }
            if UnixStream::connect(&socket).is_ok() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err("shim socket never appeared".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(Shim {
            child,
            socket,
            _dir: None,
        })
    }

    pub fn client(&self) -> Client {
        let c = Client::connect(&self.socket).expect("connect");
        c.set_timeout(Some(Duration::from_secs(60))).unwrap();
        c
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `stop`, then the process must exit 0 and remove its socket.
    pub fn stop(mut self) {
        let r = self.client().call(Op::Stop).expect("stop");
        assert_eq!(r, Reply::Stopped);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(st.success(), "shim exit status {st}");
                break;
            }
            assert!(Instant::now() < deadline, "shim did not exit after stop");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!self.socket.exists(), "socket left behind");
    }
}

impl Drop for Shim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn peek(c: &mut Client, gpa: u64, count: u32) -> Vec<u64> {
    match c
        .call(Op::Peek {
            gpa,
            count,
            stride: None,
        })
        .expect("peek")
    {
        Reply::Values { values } => values,
        other => panic!("peek: {other:?}"),
    }
}

pub fn wait_guest(c: &mut Client, ms: u64) -> (SandboxState, GuestStatus, Vec<u32>) {
    match c.call(Op::Wait { timeout_ms: ms }).expect("wait") {
        Reply::Guest {
            state,
            guest,
            checkpoints,
        } => (state, guest, checkpoints),
        other => panic!("wait: {other:?}"),
    }
}

pub fn stats(c: &mut Client) -> cube_shim::protocol::Stats {
    match c.call(Op::Stats).expect("stats") {
        Reply::Stats { stats, .. } => stats,
        other => panic!("stats: {other:?}"),
    }
}

pub fn restore(c: &mut Client, dir: &Path) -> Reply {
    c.call(Op::Restore {
        snapshot: dir.to_path_buf(),
        disk: None,
        tap: None,
        vsock: None,
    })
    .expect("restore")
}
