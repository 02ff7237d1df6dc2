//! The agent stand-in guest (`guests/agent_standin.asm`) built into a template by
//! [`cube_shim::template::build`], restored by a real shim confined to its mount-namespace jail:
//! it asks the host for its init payload over vsock after every restore and resume.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

use common::*;
use cube_hypervisor::{Shape, Snapshot};
use cube_shim::devices::{BLOCK_NAME, NET_NAME, VSOCK_NAME};
use cube_shim::protocol::{Reply, SandboxState};
use cube_shim::template::{
    self, BuildSpec, GuestKind, STANDIN_INIT_DATA, STANDIN_INIT_DONE, STANDIN_INIT_PORT,
    STANDIN_WOKEN,
};
use cube_shim::{Client, Op};

fn checkpoints(c: &mut Client) -> (SandboxState, Vec<u32>) {
    match c.call(Op::Stats).expect("stats") {
        Reply::Stats {
            state, checkpoints, ..
        } => (state, checkpoints),
        r => panic!("{r:?}"),
    }
}

/// Waits until the guest reported `n` acknowledged inits.
fn wait_inits(c: &mut Client, n: usize) -> Vec<u32> {
    let t0 = Instant::now();
    loop {
        let (_, cps) = checkpoints(c);
        if cps.iter().filter(|&&x| x == STANDIN_INIT_DONE).count() >= n {
            return cps;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "checkpoints {cps:x?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Serves `rounds` init requests, each with entropy filled with the round number.
fn serve(listener: UnixListener, rounds: u8) -> std::thread::JoinHandle<Vec<[u8; 4]>> {
    std::thread::spawn(move || {
        let mut hellos = Vec::new();
        for r in 0..rounds {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut hello = [0u8; 4];
            s.read_exact(&mut hello).unwrap();
            hellos.push(hello);
            let mut p = b"CUBI".to_vec();
            p.extend_from_slice(&[0u8; 12]);
            p.extend_from_slice(&[0xa0 + r; 32]);
            p.extend_from_slice(&0u32.to_le_bytes());
            s.write_all(&p).unwrap();
            let mut rest = Vec::new();
            s.read_to_end(&mut rest).unwrap();
        }
        hellos
    })
}

#[test]
fn the_standin_template_restores_in_a_jailed_shim_and_asks_for_fresh_inits() {
    cube_testkit::require_kvm!("shim_standin_jail");
    cube_testkit::require_priv!("shim_standin_jail");
    let shape = Shape::new(1, 32);
    let work = tmpdir("standin");
    let tpl = work.path().join("tpl");
    let disk = work.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    template::build(
        BuildSpec {
            kind: GuestKind::AgentStandin,
            shape,
            disk: Some(template::open_disk(&disk, &GuestKind::AgentStandin).unwrap()),
            net_mac: Some([2, 0xcb, 0xe0, 0, 0, 2]),
            timeout: Duration::from_secs(30),
            scratch: None,
        },
        &tpl,
    )
    .expect("template build");
    let snap = Snapshot::open(&tpl).unwrap();
    for d in [BLOCK_NAME, NET_NAME, VSOCK_NAME] {
        assert!(snap.device_state(d).is_some(), "{d} in the template");
    }
    // No scratch left beside the template.
    let names: Vec<String> = std::fs::read_dir(work.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    assert!(!names.iter().any(|n| n.starts_with(".build")), "{names:?}");

    // A jailed shim: only /dev/kvm, /dev/net/tun, its /proc, its own work directory (socket,
    // disk, vsock, pause output) and the template (read-only) inside; its own uid.
    let jail = tempfile::Builder::new()
        .prefix("cube-shim-jail-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let root = jail.path().join("root");
    let own = work.path().join("own");
    std::fs::create_dir(&own).unwrap();
    let shim = Shim::try_spawn_at(
        shape,
        &own.join("ctl.sock"),
        &[
            "--jail-root",
            root.to_str().unwrap(),
            "--jail-own",
            own.to_str().unwrap(),
            "--jail-bind-ro",
            tpl.to_str().unwrap(),
        ],
    )
    .expect("jailed shim starts");
    let pid = shim.pid();
    let uid = cube_shim::jail::shim_id(pid);
    let mut top: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    top.sort();
    let mut want = vec!["dev", "proc"];
    if std::path::Path::new("/sys/module/kvm_pvm").exists() {
        want.push("sys");
    }
    assert_eq!(top, want);
    let mut dev: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root/dev"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    dev.sort();
    assert_eq!(dev, vec!["kvm", "net", "shm"]);
    // The host's mount table is untouched by the jail.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(root.to_str().unwrap()),
        "jail leaked a mount"
    );
    // The work directory is the shim's; the VMM runs as that uid.
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(&own).unwrap().uid(), uid);
    let chown = |p: &std::path::Path| std::os::unix::fs::chown(p, Some(uid), Some(uid)).unwrap();

    let vsock = own.join("v.sock");
    let init_sock = format!("{}_{STANDIN_INIT_PORT}", vsock.display());
    let listener = UnixListener::bind(&init_sock).unwrap();
    chown(std::path::Path::new(&init_sock));
    let host = serve(listener, 2);
    let sandbox_disk = own.join("sandbox.img");
    std::fs::copy(&disk, &sandbox_disk).unwrap();
    chown(&sandbox_disk);
    let mut c = shim.client();
    // The template has a net device: without a tap the restore is refused, shell kept.
    let e = c
        .call(Op::Restore {
            snapshot: tpl.clone(),
            disk: Some(sandbox_disk.clone()),
            tap: None,
            vsock: Some(vsock.clone()),
        })
        .unwrap_err();
    assert!(e.to_string().contains("tap"), "{e}");
    // A persistent tap for the net device.
    let tap = format!("cst{}", std::process::id() % 1_000_000);
    let ok = std::process::Command::new("ip")
        .args(["tuntap", "add", "dev", &tap, "mode", "tap", "user"])
        .arg(uid.to_string())
        .status()
        .unwrap()
        .success();
    assert!(ok);
    struct DelTap(String);
    impl Drop for DelTap {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["link", "del", &self.0])
                .status();
        }
    }
    let _del = DelTap(tap.clone());
    let r = c
        .call(Op::Restore {
            snapshot: tpl.clone(),
            disk: Some(sandbox_disk.clone()),
            tap: Some(tap.clone()),
            vsock: Some(vsock.clone()),
        })
        .unwrap();
    assert!(matches!(r, Reply::Restored { .. }));
    let cps = wait_inits(&mut c, 1);
    // Length 52, magic, first entropy dword, done; no wake-up before the first init.
    assert_eq!(
        cps,
        vec![
            52,
            u32::from_le_bytes(*b"CUBI"),
            0xa0a0a0a0,
            STANDIN_INIT_DONE
        ]
    );
    let w = peek(&mut c, STANDIN_INIT_DATA, 4);
    assert_eq!(w[0] as u32, u32::from_le_bytes(*b"CUBI"));
    assert_eq!(w[2], 0xa0a0_a0a0_a0a0_a0a0);

    // Pause to disk inside the jail, resume: the guest wakes and takes a second init.
    let pause = own.join("pause");
    c.call(Op::PauseToDisk { dir: pause.clone() }).unwrap();
    c.call(Op::Resume {
        dir: Some(pause),
        disk: Some(sandbox_disk),
        tap: Some(tap.clone()),
        vsock: Some(vsock),
    })
    .unwrap();
    let cps = wait_inits(&mut c, 1);
    assert_eq!(cps[0], STANDIN_WOKEN, "{cps:x?}");
    assert_eq!(cps.last(), Some(&STANDIN_INIT_DONE));
    assert_eq!(peek(&mut c, STANDIN_INIT_DATA, 4)[2], 0xa1a1_a1a1_a1a1_a1a1);
    assert_eq!(host.join().unwrap(), vec![*b"redy"; 2]);
    shim.stop();
}
