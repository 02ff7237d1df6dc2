//! End-to-end tests of the real `cube-shim` binary with the hypervisor's test guests.
//! Every shim here runs with its seccomp filter on (the default) unless a test says otherwise,
//! which is what proves the allow-list complete for these code paths.

mod common;

use std::time::{Duration, Instant};

use common::*;
use cube_hypervisor::{test_guests, Shape};
use cube_shim::protocol::{ErrorKind, GuestStatus, Reply, SandboxState};
use cube_shim::{ClientError, Op};

const DATA: u64 = test_guests::DATA_ADDR;

fn kind(r: Result<Reply, ClientError>) -> ErrorKind {
    match r {
        Err(e) => e.kind().unwrap_or_else(|| panic!("not a shim error: {e}")),
        Ok(r) => panic!("expected an error, got {r:?}"),
    }
}

#[test]
fn restore_runs_the_guest_from_the_snapshot_state() {
    cube_testkit::require_kvm!("shim_restore_runs_the_guest");
    let shape = Shape::new(1, 64);
    let t = tmpdir("tpl");
    let seed = 0x5eed_0000_1234;
    pattern_template(t.path(), shape, 1 << 20, seed);
    let shim = Shim::spawn(shape);
    let mut c = shim.client();
    match c.call(Op::Ping).unwrap() {
        Reply::Pong {
            pid,
            state,
            seccomp,
            shape: s,
        } => {
            assert_eq!(pid, shim.pid());
            assert_eq!(state, SandboxState::Ready);
            assert!(seccomp, "seccomp must be on by default");
            assert_eq!((s.vcpus, s.mem_mib), (1, 64));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(kind(c.call(Op::Pause)), ErrorKind::WrongState);
    assert!(matches!(restore(&mut c, t.path()), Reply::Restored { .. }));
    // The guest verifies the seeded pattern and its registers (exit 1/2 otherwise), then
    // rewrites the region with address ^ clone id (0).
    let (state, guest, _) = wait_guest(&mut c, 30_000);
    assert_eq!(state, SandboxState::Running);
    assert_eq!(guest, GuestStatus::Done { code: 0 });
    assert_eq!(
        peek(&mut c, DATA, 4),
        vec![DATA, DATA + 8, DATA + 16, DATA + 24]
    );
    let s = stats(&mut c);
    // It wrote 1 MiB: those pages are private copies now; the rest stays the template's.
    assert!(s.guest_anon_kib >= 1024, "{s:?}");
    assert!(s.guest_anon_kib < 4096, "{s:?}");
    assert!(s.guest_rss_kib >= s.guest_anon_kib, "{s:?}");
    assert!(s.cpu_user_us + s.cpu_system_us > 0, "{s:?}");
    // A second restore into the same shim is refused: one shell serves one restore.
    assert_eq!(
        kind(c.call(Op::Restore {
            snapshot: t.path().into(),
            disk: None,
            tap: None,
            vsock: None
        })),
        ErrorKind::WrongState
    );
    shim.stop();
}

#[test]
fn pause_and_resume_in_memory() {
    cube_testkit::require_kvm!("shim_pause_resume");
    let shape = Shape::new(2, 64);
    let t = tmpdir("spin");
    spin_template(t.path(), shape);
    let shim = Shim::spawn(shape);
    let mut c = shim.client();
    restore(&mut c, t.path());
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(c.call(Op::Pause).unwrap(), Reply::Paused);
    let a = peek(&mut c, DATA, 9);
    std::thread::sleep(Duration::from_millis(50));
    let b = peek(&mut c, DATA, 9);
    assert_eq!(a, b, "a paused guest must not run");
    assert!(a[0] > 0 && a[8] > 0, "both vCPUs counted: {a:?}");
    assert_eq!(kind(c.call(Op::Pause)), ErrorKind::WrongState);
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
    std::thread::sleep(Duration::from_millis(50));
    let d = peek(&mut c, DATA, 9);
    assert!(
        d[0] > a[0] && d[8] > a[8],
        "resumed guest counts on: {a:?} -> {d:?}"
    );
    shim.stop();
}

/// Counter of vCPU 0 of the spin guest in a paused shim.
fn paused_count(c: &mut cube_shim::Client) -> u64 {
    peek(c, DATA, 1)[0]
}

#[test]
fn pause_to_disk_then_resume_in_a_new_shim_continues() {
    cube_testkit::require_kvm!("shim_pause_to_disk_resume");
    let shape = Shape::new(1, 64);
    let t = tmpdir("spin");
    spin_template(t.path(), shape);
    let template_count = {
        let shim = Shim::spawn(shape);
        let mut c = shim.client();
        restore(&mut c, t.path());
        c.call(Op::Pause).unwrap();
        paused_count(&mut c)
    };
    let p = tmpdir("paused");
    let a = Shim::spawn(shape);
    let mut ca = a.client();
    restore(&mut ca, t.path());
    std::thread::sleep(Duration::from_millis(300));
    ca.call(Op::Pause).unwrap();
    let at_pause = paused_count(&mut ca);
    assert!(at_pause > template_count);
    let r = ca
        .call(Op::PauseToDisk {
            dir: p.path().into(),
        })
        .unwrap();
    assert!(matches!(r, Reply::PausedToDisk { .. }));
    assert!(p.path().join("manifest.json").exists());
    // Memory released: no VM left to read.
    assert_eq!(
        kind(ca.call(Op::Peek {
            gpa: DATA,
            count: 1,
            stride: None
        })),
        ErrorKind::WrongState
    );
    assert_eq!(stats(&mut ca).guest_rss_kib, 0);
    // The same shim can take it back (a new shell, created under seccomp).
    assert_eq!(
        ca.call(Op::Resume {
            dir: Some(p.path().into()),
            disk: None,
            tap: None,
            vsock: None,
        })
        .unwrap(),
        Reply::Resumed
    );
    ca.call(Op::Pause).unwrap();
    let again = paused_count(&mut ca);
    assert!(again >= at_pause && again - at_pause < at_pause - template_count);
    a.stop();

    let b = Shim::spawn(shape);
    let mut cb = b.client();
    assert_eq!(
        cb.call(Op::Resume {
            dir: Some(p.path().into()),
            disk: None,
            tap: None,
            vsock: None,
        })
        .unwrap(),
        Reply::Resumed
    );
    cb.call(Op::Pause).unwrap();
    let resumed = paused_count(&mut cb);
    // It continued from the paused count (memory from the diff, registers from vmstate):
    // had either come from the template, the count would be far below (A ran 300 ms,
    // B only for the resume → pause round trip).
    assert!(resumed >= at_pause, "{resumed} < {at_pause}");
    assert!(
        resumed - at_pause < at_pause - template_count,
        "B ran too long to tell"
    );
    cb.call(Op::Resume {
        dir: None,
        disk: None,
        tap: None,
        vsock: None,
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    cb.call(Op::Pause).unwrap();
    assert!(paused_count(&mut cb) > resumed);
    b.stop();
}

#[test]
fn a_snapshot_of_a_running_sandbox_restores_as_a_clone() {
    cube_testkit::require_kvm!("shim_snapshot_clone");
    let shape = Shape::new(1, 64);
    let t = tmpdir("spin");
    spin_template(t.path(), shape);
    let clone_dir = tmpdir("clone");
    let a = Shim::spawn(shape);
    let mut ca = a.client();
    restore(&mut ca, t.path());
    std::thread::sleep(Duration::from_millis(300));
    ca.call(Op::Pause).unwrap();
    let before = paused_count(&mut ca);
    ca.call(Op::Resume {
        dir: None,
        disk: None,
        tap: None,
        vsock: None,
    })
    .unwrap();
    let r = ca
        .call(Op::Snapshot {
            dir: clone_dir.path().into(),
        })
        .unwrap();
    assert!(matches!(r, Reply::Snapshotted { .. }));
    // The source keeps running after its snapshot.
    std::thread::sleep(Duration::from_millis(20));
    ca.call(Op::Pause).unwrap();
    let after = paused_count(&mut ca);
    assert!(after > before);

    let b = Shim::spawn(shape);
    let mut cb = b.client();
    restore(&mut cb, clone_dir.path());
    cb.call(Op::Pause).unwrap();
    let cloned = paused_count(&mut cb);
    assert!(
        cloned >= before,
        "the clone starts from the snapshot: {cloned} < {before}"
    );
    // And it is independent: A's memory did not move while B ran.
    assert_eq!(paused_count(&mut ca), after);
    a.stop();
    b.stop();
}

#[test]
fn bad_requests_get_clear_errors_and_the_connection_stays_usable() {
    cube_testkit::require_kvm!("shim_bad_requests");
    let shape = Shape::new(1, 64);
    let t = tmpdir("tpl");
    pattern_template(t.path(), shape, 4096, 7);
    let other = tmpdir("tpl128");
    pattern_template(other.path(), Shape::new(1, 128), 4096, 7);
    let shim = Shim::spawn(shape);
    let mut c = shim.client();
    let err_kind = |line: &str| -> String {
        let v: serde_json::Value = serde_json::from_str(line).expect("response is JSON");
        v["err"]["kind"].as_str().unwrap_or("none").to_string()
    };
    assert_eq!(err_kind(&c.raw("garbage{").unwrap()), "malformed");
    assert_eq!(err_kind(&c.raw("\u{0}\u{1}").unwrap()), "malformed");
    assert_eq!(err_kind(&c.raw(&"x".repeat(200_000)).unwrap()), "malformed");
    assert_eq!(
        err_kind(&c.raw(r#"{"v":1,"op":"launch"}"#).unwrap()),
        "bad_request"
    );
    assert_eq!(
        err_kind(&c.raw(r#"{"v":9,"op":"ping"}"#).unwrap()),
        "unsupported_version"
    );
    assert_eq!(
        err_kind(&c.raw(r#"{"op":"ping"}"#).unwrap()),
        "unsupported_version"
    );
    assert_eq!(
        err_kind(&c.raw(r#"{"v":1,"op":"pause_to_disk"}"#).unwrap()),
        "bad_request"
    );
    let missing = Op::Restore {
        snapshot: "/nonexistent/cube-template".into(),
        disk: None,
        tap: None,
        vsock: None,
    };
    let e = c.call(missing).unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::Snapshot));
    assert!(e.to_string().contains("manifest.json"), "{e}");
    let e = c
        .call(Op::Restore {
            snapshot: other.path().into(),
            disk: None,
            tap: None,
            vsock: None,
        })
        .unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::Snapshot));
    assert!(
        e.to_string().contains("128 MiB") && e.to_string().contains("64 MiB"),
        "{e}"
    );
    let e = c
        .call(Op::Restore {
            snapshot: t.path().into(),
            disk: None,
            tap: Some("tap-x".into()),
            vsock: None,
        })
        .unwrap_err();
    // The template has no virtio-net device to put on a tap.
    assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    // Backends only go with a resume from a pause-to-disk directory.
    assert_eq!(
        kind(c.call(Op::Resume {
            dir: None,
            disk: None,
            tap: Some("tap-x".into()),
            vsock: None,
        })),
        ErrorKind::BadRequest
    );
    assert_eq!(
        kind(c.call(Op::Resume {
            dir: None,
            disk: None,
            tap: None,
            vsock: None,
        })),
        ErrorKind::WrongState
    );
    assert_eq!(
        kind(c.call(Op::Snapshot {
            dir: "/tmp/never".into()
        })),
        ErrorKind::WrongState
    );
    assert_eq!(
        kind(c.call(Op::Peek {
            gpa: 0,
            count: 100_000,
            stride: None
        })),
        ErrorKind::BadRequest
    );
    // After all that the shell is intact and the right template restores.
    assert!(matches!(
        c.call(Op::Ping).unwrap(),
        Reply::Pong {
            state: SandboxState::Ready,
            ..
        }
    ));
    restore(&mut c, t.path());
    assert_eq!(wait_guest(&mut c, 30_000).1, GuestStatus::Done { code: 0 });
    assert_eq!(
        kind(c.call(Op::Peek {
            gpa: u64::MAX - 8,
            count: 4,
            stride: None
        })),
        ErrorKind::BadRequest
    );
    shim.stop();
}

#[test]
fn a_killed_shim_is_seen_by_its_client_and_leaves_nothing_running() {
    cube_testkit::require_kvm!("shim_sigkill");
    let shape = Shape::new(1, 64);
    let t = tmpdir("spin");
    spin_template(t.path(), shape);
    let mut shim = Shim::spawn(shape);
    let mut c = shim.client();
    restore(&mut c, t.path());
    let pid = shim.pid();
    let mut other = shim.client();
    let waiting = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let still = waiting.clone();
    let killer = std::thread::spawn(move || {
        // (Gives the main thread's Wait time to be sent first; were it not, the check below
        // would only be weaker.)
        std::thread::sleep(Duration::from_millis(100));
        // A long wait on one connection does not block the others: the ping is answered while
        // the wait is still pending (it ends only with the shim).
        assert!(matches!(other.call(Op::Ping).unwrap(), Reply::Pong { .. }));
        assert!(
            still.load(std::sync::atomic::Ordering::SeqCst),
            "ping waited for the wait"
        );
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    });
    // Blocked in a long wait when the shim dies: the client sees EOF, not a hang until the
    // wait's own 20 s timeout.
    let t0 = Instant::now();
    let e = c.call(Op::Wait { timeout_ms: 20_000 }).unwrap_err();
    waiting.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(matches!(e, ClientError::Closed | ClientError::Io(_)), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(20));
    killer.join().unwrap();
    let st = shim.child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&st),
        Some(libc::SIGKILL)
    );
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
    // Only the socket file remains (the kernel freed the VM); nobody answers on it, and the
    // owner (cubelet) removes it.
    let e = std::os::unix::net::UnixStream::connect(&shim.socket).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
}

#[test]
fn the_shim_joins_its_cgroup_with_the_shape_limits() {
    cube_testkit::require_kvm!("shim_cgroup");
    cube_testkit::require_priv!("shim_cgroup");
    let shape = Shape::new(2, 64);
    let name = format!("cube-shim-test-{}", std::process::id());
    let root = std::path::Path::new("/sys/fs/cgroup");
    let dirs = cube_shim::jail::cgroup_dirs(root, &name).unwrap();
    let shim = Shim::spawn_with(shape, &["--cgroup", &name, "--mem-overhead-mib", "64"]);
    let pid = shim.pid().to_string();
    let check = || {
        for d in &dirs {
            let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap();
            assert!(
                procs.lines().any(|l| l == pid),
                "{} lacks the shim",
                d.display()
            );
            let rd = |f: &str| {
                std::fs::read_to_string(d.join(f))
                    .ok()
                    .map(|s| s.trim().to_string())
            };
            if let Some(q) = rd("cpu.cfs_quota_us") {
                assert_eq!(q, "200000");
            }
            if let Some(m) = rd("memory.limit_in_bytes") {
                assert_eq!(m, ((128u64) << 20).to_string());
            }
            if let Some(m) = rd("cpu.max") {
                assert_eq!(m, "200000 100000");
            }
            if let Some(m) = rd("memory.max") {
                assert_eq!(m, ((128u64) << 20).to_string());
            }
        }
    };
    let result = std::panic::catch_unwind(check);
    shim.stop();
    for d in &dirs {
        let _ = std::fs::remove_dir(d);
    }
    result.unwrap();
}

#[test]
fn without_seccomp_flag_the_filter_is_off() {
    cube_testkit::require_kvm!("shim_no_seccomp");
    let shim = Shim::spawn_with(Shape::new(1, 64), &["--no-seccomp"]);
    let mut c = shim.client();
    assert!(matches!(
        c.call(Op::Ping).unwrap(),
        Reply::Pong { seccomp: false, .. }
    ));
    let status = std::fs::read_to_string(format!("/proc/{}/status", shim.pid())).unwrap();
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("Seccomp:") && l.ends_with('0')),
        "{status}"
    );
    assert!(status
        .lines()
        .any(|l| l.starts_with("NoNewPrivs:") && l.ends_with('1')));
    shim.stop();
    let on = Shim::spawn(Shape::new(1, 64));
    // The socket is bound before the filter goes on; the first answer comes after it.
    assert!(matches!(
        on.client().call(Op::Ping).unwrap(),
        Reply::Pong { seccomp: true, .. }
    ));
    let status = std::fs::read_to_string(format!("/proc/{}/status", on.pid())).unwrap();
    // Mode 2 = filter, on every thread (TSYNC): check the vCPU thread too.
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("Seccomp:") && l.ends_with('2')),
        "{status}"
    );
    for task in std::fs::read_dir(format!("/proc/{}/task", on.pid())).unwrap() {
        // A short-lived thread may exit between listing and reading.
        let Ok(s) = std::fs::read_to_string(task.unwrap().path().join("status")) else {
            continue;
        };
        assert!(s
            .lines()
            .any(|l| l.starts_with("Seccomp:") && l.ends_with('2')));
    }
    on.stop();
}

#[test]
fn a_shim_prepared_for_a_template_restores_it_and_still_restores_others() {
    cube_testkit::require_kvm!("shim_prepared_template");
    let shape = Shape::new(1, 64);
    let (t1, t2) = (tmpdir("tpl1"), tmpdir("tpl2"));
    pattern_template(t1.path(), shape, 8192, 1);
    pattern_template(t2.path(), shape, 8192, 2);
    for (tpl, seed) in [(t1.path(), 1u64), (t2.path(), 2u64)] {
        let shim = Shim::spawn_with(shape, &["--template", t1.path().to_str().unwrap()]);
        let mut c = shim.client();
        // Before the restore, the template's pattern is not visible: no VM yet.
        assert_eq!(
            kind(c.call(Op::Peek {
                gpa: DATA,
                count: 1,
                stride: None
            })),
            ErrorKind::WrongState
        );
        restore(&mut c, tpl);
        assert_eq!(
            wait_guest(&mut c, 30_000).1,
            GuestStatus::Done { code: 0 },
            "seed {seed}"
        );
        shim.stop();
    }
    // A template that does not fit is refused at start-up with a clear message.
    let bad = Shim::try_spawn(
        Shape::new(1, 128),
        &["--template", t1.path().to_str().unwrap()],
    );
    assert!(bad.is_err());
}
