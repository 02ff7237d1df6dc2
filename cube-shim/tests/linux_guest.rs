//! The Linux-guest path of the microvm runtime with real parts only: the project's guest
//! kernel (deploy/guest-kernel, with its `cube_pvm` patch on PVM hosts) boots an ext4 root
//! whose init is the static cube-agent; the shim's template builder snapshots it once the agent
//! asks for its init over vsock; a jailed-less shim restores it with a reflinked disk and a
//! tap; the host answers the agent's init; envd answers over virtio-net with the env vars that
//! init carried; pause to disk and resume make the agent ask again and take new ones.
//!
//! Needs root and /dev/kvm, plus the guest kernel (`CUBE_GUEST_KERNEL`, else
//! deploy/guest-kernel/out/vmlinux) and the static agent (`CUBE_AGENT_BIN`): missing ones skip
//! the test, or fail it under `CUBE_REQUIRE_KVM=1`.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use cube_hypervisor::{Shape, Snapshot};
use cube_shim::devices::{BLOCK_NAME, NET_NAME, VSOCK_NAME};
use cube_shim::protocol::Reply;
use cube_shim::template::{self, BuildSpec, GuestKind, LinuxBoot, STANDIN_INIT_PORT};
use cube_shim::Op;

/// The guest's address in this test (its own /etc/cube-agent.toml), so the host side of the
/// tap cannot collide with anything else on the host.
const GUEST_IP: &str = "10.213.77.2";
const HOST_CIDR: &str = "10.213.77.1/30";

fn inputs() -> Option<(PathBuf, PathBuf)> {
    let kernel = guest_kernel()?;
    let agent = match std::env::var_os("CUBE_AGENT_BIN").map(PathBuf::from) {
        None => Err("CUBE_AGENT_BIN is not set".to_string()),
        Some(a) if !a.exists() => Err(format!("cube-agent {} not found", a.display())),
        Some(a) => Ok(a),
    };
    match agent {
        Ok(a) => Some((kernel, a)),
        Err(why) => missing_input("linux guest test", &why),
    }
}

/// Prints the template's boot console when the test fails after the build.
struct ConsoleOnPanic(PathBuf);
impl Drop for ConsoleOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.0).unwrap_or_default();
            eprintln!("----- guest console ({}):\n{log}", self.0.display());
        }
    }
}

/// An ext4 root with the agent as /sbin/init and this test's network settings.
fn rootfs(agent: &Path, work: &Path) -> PathBuf {
    let root = work.join("root");
    for d in ["sbin", "etc", "proc", "sys", "dev", "tmp", "run", "root"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy(agent, root.join("sbin/init")).unwrap();
    std::fs::write(
        root.join("etc/cube-agent.toml"),
        format!(
            "hostname = \"linux-guest-test\"\n[network]\ninterface = \"eth0\"\naddress = \"{GUEST_IP}/30\"\ngateway = \"10.213.77.1\"\n"
        ),
    )
    .unwrap();
    let img = work.join("rootfs.ext4");
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&root)
        .arg(&img)
        .arg("96M"));
    img
}

/// One init frame (the init contract's vsock transport) carrying `env`.
fn payload(env: &str, value: &str) -> Vec<u8> {
    let settings = cube_init::Settings {
        env_vars: [(env.to_string(), value.to_string())].into(),
        default_user: "root".into(),
        ..Default::default()
    };
    cube_init::VsockInit::new(settings, std::time::SystemTime::now(), [0x5a; 32])
        .encode()
        .unwrap()
}

/// The host end of the init channel: answers each `redy` with the next value, reports it once
/// the agent acknowledged (half-closed), and keeps the connection open as cubelet does.
fn serve_inits(listener: UnixListener, values: Vec<&'static str>) -> mpsc::Receiver<&'static str> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut held: Vec<UnixStream> = Vec::new();
        let t0 = Instant::now();
        // Each stage is printed, so a failure says how far the guest got.
        let stage = |v: &str, what: &str| eprintln!("init {v:?}: {what} at {:?}", t0.elapsed());
        for v in values {
            let (mut s, _) = listener.accept().unwrap();
            stage(v, "guest connected");
            s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
            let mut hello = [0u8; 4];
            s.read_exact(&mut hello).unwrap();
            assert_eq!(&hello, b"redy");
            s.write_all(&payload("CUBE_LINUX_TEST", v)).unwrap();
            stage(v, "redy answered");
            let mut rest = Vec::new();
            s.read_to_end(&mut rest).unwrap();
            stage(v, "acknowledged");
            held.push(s);
            if tx.send(v).is_err() {
                return;
            }
        }
        // Keep the last connection open until the test is done with the guest.
        std::thread::sleep(Duration::from_secs(600));
    });
    rx
}

/// `GET path` on envd in the guest (retried while the guest's network comes up).
fn envd_get(path: &str, deadline: Duration) -> (u16, String) {
    let t0 = Instant::now();
    loop {
        let r = (|| -> std::io::Result<(u16, String)> {
            let mut s = TcpStream::connect_timeout(
                &format!("{GUEST_IP}:49983").parse().unwrap(),
                Duration::from_secs(20),
            )?;
            s.set_read_timeout(Some(Duration::from_secs(60)))?;
            write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: guest\r\nConnection: close\r\n\r\n"
            )?;
            let mut buf = String::new();
            s.read_to_string(&mut buf)?;
            let code = buf
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            let body = buf
                .split_once("\r\n\r\n")
                .map(|x| x.1)
                .unwrap_or("")
                .to_string();
            Ok((code, body))
        })();
        match r {
            Ok(x) => return x,
            Err(e) if t0.elapsed() < deadline => {
                eprintln!("envd {path}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => panic!("envd {path}: {e}"),
        }
    }
}

struct DelTap(String);
impl Drop for DelTap {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).status();
    }
}

#[test]
fn a_linux_guest_with_cube_agent_is_snapshotted_restored_initialised_and_resumed() {
    cube_testkit::require_kvm!("shim_linux_guest");
    cube_testkit::require_priv!("shim_linux_guest");
    let Some((kernel, agent)) = inputs() else {
        return;
    };
    let shape = Shape::new(1, 256);
    let work = tempfile::Builder::new()
        .prefix("cube-shim-linux-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let img = rootfs(&agent, work.path());
    // The build boots a copy, which becomes the disk every sandbox is cloned from.
    let tpl_disk = work.path().join("template.img");
    std::fs::copy(&img, &tpl_disk).unwrap();
    let tpl = work.path().join("tpl");
    let console = work.path().join("console.log");
    let t0 = Instant::now();
    let kind = GuestKind::Linux(LinuxBoot {
        kernel: kernel.clone(),
        cmdline: "console=ttyS0 reboot=k panic=1 pci=off root=/dev/vda rw init=/sbin/init".into(),
        initramfs: None,
        console: Some(console.clone()),
    });
    let built = template::build(
        BuildSpec {
            disk: Some(template::open_disk(&tpl_disk, &kind).unwrap()),
            kind,
            shape,
            net_mac: Some([2, 0xcb, 0xe0, 0, 0, 2]),
            timeout: Duration::from_secs(300),
            scratch: None,
        },
        &tpl,
    );
    let _console = ConsoleOnPanic(console.clone());
    let log = std::fs::read_to_string(&console).unwrap_or_default();
    let m = built.unwrap_or_else(|e| panic!("{e}"));
    eprintln!("template built in {:?}", t0.elapsed());
    assert!(m.kernel_digest.is_some());
    assert!(log.contains("Linux version"), "{log}");
    assert!(log.contains("cube-agent serving envd"), "{log}");
    let snap = Snapshot::open(&tpl).unwrap();
    for d in [BLOCK_NAME, NET_NAME, VSOCK_NAME] {
        assert!(snap.device_state(d).is_some(), "{d} in the template");
    }

    // A tap whose host side is the guest's gateway.
    let tap = format!("clg{}", std::process::id() % 1_000_000);
    run(Command::new("ip").args(["tuntap", "add", "dev", &tap, "mode", "tap"]));
    let _del = DelTap(tap.clone());
    run(Command::new("ip").args(["addr", "add", HOST_CIDR, "dev", &tap]));
    run(Command::new("ip").args(["link", "set", &tap, "up"]));

    let vsock = work.path().join("v.sock");
    let acks = serve_inits(
        UnixListener::bind(format!("{}_{STANDIN_INIT_PORT}", vsock.display())).unwrap(),
        vec!["first", "after-resume"],
    );
    let disk = work.path().join("sandbox.img");
    run(Command::new("cp")
        .arg("--reflink=auto")
        .arg(&tpl_disk)
        .arg(&disk));
    let shim = Shim::spawn(shape);
    let mut c = shim.client();
    c.set_timeout(Some(Duration::from_secs(120))).unwrap();
    let t1 = Instant::now();
    let r = c
        .call(Op::Restore {
            snapshot: tpl.clone(),
            disk: Some(disk.clone()),
            tap: Some(tap.clone()),
            vsock: Some(vsock.clone()),
        })
        .unwrap();
    assert!(matches!(r, Reply::Restored { .. }), "{r:?}");
    eprintln!("restore returned in {:?}", t1.elapsed());
    // The restored agent finds its vsock connection reset and asks again.
    assert_eq!(
        acks.recv_timeout(Duration::from_secs(120))
            .expect("the restored agent's init (see the init stages above)"),
        "first"
    );
    eprintln!("restored and initialised in {:?}", t1.elapsed());
    let (code, _) = envd_get("/health", Duration::from_secs(120));
    assert_eq!(code, 204);
    let (code, body) = envd_get("/envs", Duration::from_secs(60));
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""CUBE_LINUX_TEST":"first""#), "{body}");
    eprintln!("envd answered over virtio-net at {:?}", t1.elapsed());

    // Pause to disk (memory released) and resume: a fresh init with new settings.
    let pause = work.path().join("pause");
    c.call(Op::PauseToDisk { dir: pause.clone() }).unwrap();
    assert!(acks.try_recv().is_err(), "no init while paused");
    c.call(Op::Resume {
        dir: Some(pause),
        disk: Some(disk),
        tap: Some(tap.clone()),
        vsock: Some(vsock),
    })
    .unwrap();
    assert_eq!(
        acks.recv_timeout(Duration::from_secs(120))
            .expect("the resumed agent's init (see the init stages above)"),
        "after-resume"
    );
    let (code, body) = envd_get("/envs", Duration::from_secs(60));
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains(r#""CUBE_LINUX_TEST":"after-resume""#),
        "{body}"
    );
    shim.stop();
}
