//! The jail from inside: a real shim, set up exactly as cubelet starts it (mount namespace
//! with `pivot_root`, PID namespace, own uid, no capabilities, seccomp), runs its escape
//! probes (`--self-test-escapes`, see `cube_shim::probe`) against a node-like data directory,
//! and every attempt must fail; the attempts the filter answers with a kill must kill it.

mod common;

use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixListener;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use common::*;
use cube_hypervisor::Shape;
use serde_json::Value;

/// A node's data directory in miniature: another sandbox's disk, the node secret, another
/// shim's live control socket, this shim's work directory and its template.
struct Node {
    _dir: tempfile::TempDir,
    root: PathBuf,
    own: PathBuf,
    template: PathBuf,
    /// A template's disk image, the one thing besides its work directory a build shim sees.
    disk: PathBuf,
    secrets: Vec<PathBuf>,
    other_socket: PathBuf,
    _listener: UnixListener,
}

impl Node {
    fn new() -> Node {
        let dir = tempfile::Builder::new()
            .prefix("cube-shim-escape-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let data = dir.path().join("data");
        let other_disk = data.join("sandboxes/other/disk.ext4");
        let secret = data.join("master-link.json");
        let template = data.join("templates/t/b1/microvm-1c32m");
        let own = data.join("shim-work/me");
        let other_work = data.join("shim-work/other");
        for d in [other_disk.parent().unwrap(), &template, &own, &other_work] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(&other_disk, b"another tenant's disk").unwrap();
        std::fs::write(&secret, b"{\"node_secret\":\"s3cr3t\"}").unwrap();
        std::fs::write(template.join("manifest.json"), b"{}").unwrap();
        let disk = data.join("templates/t/b1/rootfs.img");
        std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
        // Writable by anyone: only the read-only bind may stop the build shim.
        std::fs::set_permissions(&disk, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .unwrap();
        let other_socket = other_work.join("ctl.sock");
        let listener = UnixListener::bind(&other_socket).unwrap();
        Node {
            root: dir.path().join("root"),
            _dir: dir,
            own,
            template,
            disk,
            secrets: vec![other_disk, secret, data.join("sandboxes/other")],
            other_socket,
            _listener: listener,
        }
    }

    /// Runs the jailed shim's probes (and fatal probe `fatal`, if any): a serving shim, or a
    /// template build (as cubelet runs it: its work directory and the disk, read-only) at the
    /// point where its guest would start.
    fn probe(&self, mode: Mode, fatal: Option<&str>) -> (Output, u32) {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cube-shim"));
        cmd.args(["--vcpus", "1", "--mem-mib", "32"])
            .arg("--jail-root")
            .arg(&self.root)
            .arg("--jail-own")
            .arg(&self.own);
        match mode {
            Mode::Serve => cmd
                .arg("--socket")
                .arg(self.own.join("ctl.sock"))
                .arg("--jail-bind-ro")
                .arg(&self.template),
            Mode::Build => cmd
                .arg("--build-template")
                .arg(self.own.join("snapshot"))
                .arg("--build-scratch")
                .arg(&self.own)
                .arg("--net-mac")
                .arg("02:cb:e0:00:00:02")
                .arg("--disk")
                .arg(&self.disk)
                .arg("--jail-bind-ro")
                .arg(&self.disk),
        };
        cmd.arg("--self-test-escapes")
            .arg("--self-test-socket")
            .arg(&self.other_socket);
        for p in &self.secrets {
            cmd.arg("--self-test-path").arg(p);
        }
        if let Some(f) = fatal {
            cmd.arg("--self-test-fatal").arg(f);
        }
        let child = cmd
            .env_clear()
            .env("RUST_LOG", "warn")
            .env("CUBE_PROBE_MARKER", "shim-env")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        (child.wait_with_output().unwrap(), pid)
    }
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    Serve,
    Build,
}

fn report(o: &Output) -> Value {
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out.lines().next().unwrap_or_else(|| {
        panic!(
            "no report ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        )
    });
    serde_json::from_str(line).unwrap()
}

fn assert_unprivileged(ids: &Value, uid: u32, who: &str) {
    for k in ["uid", "euid", "gid", "egid"] {
        assert_eq!(ids[k], uid, "{who}: {k} in {ids}");
    }
    for k in [
        "effective",
        "permitted",
        "inheritable",
        "bounding",
        "ambient",
    ] {
        assert_eq!(ids[k], 0, "{who}: capability set {k} in {ids}");
    }
    assert_eq!(ids["no_new_privs"], 1, "{who}: {ids}");
}

#[test]
fn a_jailed_shim_cannot_reach_the_host_other_sandboxes_or_privileges() {
    cube_testkit::require_kvm!("shim_jail_escapes");
    cube_testkit::require_priv!("shim_jail_escapes");
    escapes_fail(Mode::Serve);
}

#[test]
fn a_jailed_template_build_cannot_reach_the_host_other_sandboxes_or_privileges() {
    cube_testkit::require_kvm!("shim_build_jail_escapes");
    cube_testkit::require_priv!("shim_build_jail_escapes");
    escapes_fail(Mode::Build);
}

fn escapes_fail(mode: Mode) {
    let node = Node::new();
    // From the host the targets are there: the probes below fail because of the jail.
    for p in &node.secrets {
        assert!(p.exists(), "{}", p.display());
    }
    std::os::unix::net::UnixStream::connect(&node.other_socket).expect("other shim answers");

    let (o, pid) = node.probe(mode, None);
    assert!(
        o.status.success(),
        "{}: {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    let r = report(&o);
    let uid = cube_shim::jail::shim_id(pid);
    assert_ne!(uid, 0);

    // Its own PID namespace, with its own /proc: pid 1 is the shim, nothing else is visible,
    // and /proc/1/root is the jail's root, not the host's.
    assert_eq!(r["pid"], 1, "{r}");
    assert_eq!(r["procs"], serde_json::json!(["1"]), "{r}");
    assert_eq!(r["proc1_root"], "/", "{r}");
    let cmdline = r["proc1_cmdline"]["text"].as_str().unwrap_or("");
    assert!(cmdline.contains("--self-test-escapes"), "{r}");
    let host_init = std::fs::read("/proc/1/cmdline").unwrap();
    assert_ne!(
        cmdline.as_bytes(),
        String::from_utf8_lossy(&host_init)
            .replace('\0', " ")
            .as_bytes()
    );
    // /proc/1/environ, when readable at all, is the shim's own environment.
    if r["proc1_environ"]["ok"] == true {
        let env = r["proc1_environ"]["text"].as_str().unwrap_or("");
        assert!(env.contains("CUBE_PROBE_MARKER=shim-env"), "{r}");
    }
    // Nothing of the host's tree at the top: no /etc, /root, /home, /usr, /var/lib.
    let top: Vec<&str> = r["root_entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for bad in ["etc", "root", "home", "usr", "bin", "lib", "run"] {
        assert!(!top.contains(&bad), "/{bad} in the jail: {top:?}");
    }

    // Other sandboxes' files, the node secret (also by /proc/1/root) and other shims'
    // sockets are not there.
    for k in ["paths", "paths_via_proc1"] {
        let v = r[k].as_array().unwrap();
        assert_eq!(v.len(), node.secrets.len());
        for p in v {
            assert_eq!(p["opened"], false, "{k}: {p}");
        }
    }
    let socks = r["sockets"].as_array().unwrap();
    assert_eq!(socks.len(), 1);
    assert_eq!(socks[0]["connected"], false, "{r}");
    // The template (a build: the template's disk) is read-only.
    let ro = r["read_only"].as_array().unwrap();
    assert_eq!(ro.len(), 1);
    assert_eq!(ro[0]["opened"], false, "{r}");
    assert_eq!(ro[0]["errno"], libc::EROFS, "{r}");
    assert!(!node.template.join(".cube-probe").exists());
    assert_eq!(std::fs::read(&node.disk).unwrap(), vec![0u8; 1 << 20]);

    // Its own uid, no capabilities in any set, on the main thread and on a new thread
    // (created through the clone filter), and clone3 refused with ENOSYS.
    assert_unprivileged(&r["ids"], uid, "main thread");
    assert_unprivileged(&r["thread"], uid, "new thread");
    assert_eq!(r["clone3"]["errno"], libc::ENOSYS, "{r}");
    // The work directory was handed to that uid; the host's files were not.
    assert_eq!(std::fs::metadata(&node.own).unwrap().uid(), uid);
    assert_eq!(std::fs::metadata(&node.secrets[1]).unwrap().uid(), 0);
    // The jail left no mount behind on the host.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(node.root.to_str().unwrap()), "{mounts}");
}

#[test]
fn a_jailed_shim_is_killed_for_calls_off_the_allow_list() {
    cube_testkit::require_kvm!("shim_jail_fatal_probes");
    cube_testkit::require_priv!("shim_jail_fatal_probes");
    fatal_probes_kill(Mode::Serve);
}

#[test]
fn a_jailed_template_build_is_killed_for_calls_off_the_allow_list() {
    cube_testkit::require_kvm!("shim_build_jail_fatal_probes");
    cube_testkit::require_priv!("shim_build_jail_fatal_probes");
    fatal_probes_kill(Mode::Build);
}

fn fatal_probes_kill(mode: Mode) {
    // An ioctl the hypervisor never makes (terminal injection, tap ownership, an unused KVM
    // one), a new process or user namespace, unshare, setuid(0), mount. A node each: a killed
    // shim leaves its work directory to its uid, as cubelet would discard it.
    for probe in cube_shim::probe::FATAL {
        let node = Node::new();
        let (o, _) = node.probe(mode, Some(probe));
        // The report came first: the shim got through its setup before the attempt.
        let _ = report(&o);
        assert_eq!(
            o.status.signal(),
            Some(libc::SIGSYS),
            "{mode:?} {probe}: {} {}",
            o.status,
            String::from_utf8_lossy(&o.stdout)
        );
    }
}

#[test]
fn the_escape_probes_are_hidden_from_help() {
    let o = Command::new(env!("CARGO_BIN_EXE_cube-shim"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(help.contains("--jail-own"), "{help}");
    assert!(!help.contains("self-test"), "{help}");
}

#[test]
fn a_jailed_shim_still_serves_and_stops_cleanly() {
    cube_testkit::require_kvm!("shim_jail_serves");
    cube_testkit::require_priv!("shim_jail_serves");
    let node = Node::new();
    let shape = Shape::new(1, 32);
    let shim = Shim::try_spawn_at(
        shape,
        &node.own.join("ctl.sock"),
        &[
            "--jail-root",
            node.root.to_str().unwrap(),
            "--jail-own",
            node.own.to_str().unwrap(),
            "--jail-bind-ro",
            node.template.to_str().unwrap(),
        ],
    )
    .expect("jailed shim starts");
    let mut c = shim.client();
    // `ping` reports the pid cubelet tracks (the supervisor's), with seccomp on.
    match c.call(cube_shim::Op::Ping).unwrap() {
        cube_shim::protocol::Reply::Pong { pid, seccomp, .. } => {
            assert_eq!(pid, shim.pid());
            assert!(seccomp);
        }
        r => panic!("{r:?}"),
    }
    // The process cubelet tracks is in the jail's mount namespace, at the shim's uid.
    let status = std::fs::read_to_string(format!("/proc/{}/status", shim.pid())).unwrap();
    let uid = cube_shim::jail::shim_id(shim.pid());
    assert!(
        status.contains(&format!("Uid:\t{uid}\t{uid}\t{uid}\t{uid}")),
        "{status}"
    );
    assert!(status.contains("CapEff:\t0000000000000000"), "{status}");
    assert!(status.contains("CapBnd:\t0000000000000000"), "{status}");
    drop(c);
    shim.stop();
}
