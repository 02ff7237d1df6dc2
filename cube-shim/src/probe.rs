//! Escape probes: a **test aid** behind the hidden `--self-test-escapes` flag. After the shim
//! has set up exactly as in production (jail, PID namespace, privilege drop, seccomp), it
//! attempts from inside its own process what a compromised VMM would try, and prints one JSON
//! object with what each attempt got instead of serving. The probes only read, connect and
//! attempt; each one that works would be a hole in the jail, so they change nothing outside
//! the jail when it holds (a directory created under a read-only bind is the worst a broken
//! jail could get). The tests in `tests/jail.rs` assert on the report.
//!
//! Attempts the seccomp filter answers by killing the process cannot report: they are run one
//! per shim with `--self-test-fatal NAME` ([`FATAL`]) after the report is printed, and the test
//! expects the shim to die of `SIGSYS`.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::jail;

/// What the probes are pointed at (host paths the jail must hide).
#[derive(Debug, Default, Clone)]
pub struct Targets {
    /// Files that must not be openable (another sandbox's disk, the node secret…).
    pub paths: Vec<PathBuf>,
    /// Unix sockets that must not be connectable (another shim's control socket).
    pub sockets: Vec<PathBuf>,
    /// Read-only binds, where creating anything must fail.
    pub read_only: Vec<PathBuf>,
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap_or_default()
}

/// `{"ok": bool, "errno": n}` of an open attempt (ok = it opened).
fn try_open(p: &Path, flags: i32) -> Value {
    let pc = c(p);
    // SAFETY: open/close with a valid path.
    let fd = unsafe { libc::open(pc.as_ptr(), flags | libc::O_CLOEXEC, 0o600) };
    if fd >= 0 {
        unsafe { libc::close(fd) };
        json!({"path": p, "opened": true})
    } else {
        json!({"path": p, "opened": false, "errno": errno()})
    }
}

fn try_connect(p: &Path) -> Value {
    match std::os::unix::net::UnixStream::connect(p) {
        Ok(_) => json!({"path": p, "connected": true}),
        Err(e) => json!({"path": p, "connected": false, "errno": e.raw_os_error()}),
    }
}

fn ids() -> Value {
    // SAFETY: identity getters take no arguments.
    let (uid, euid, gid, egid) = unsafe {
        (
            libc::getuid(),
            libc::geteuid(),
            libc::getgid(),
            libc::getegid(),
        )
    };
    let caps = jail::capabilities().unwrap_or([u64::MAX; 3]);
    let (bounding, ambient) = jail::bounding_and_ambient();
    // SAFETY: prctl read.
    let nnp = unsafe { libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) };
    json!({
        "uid": uid, "euid": euid, "gid": gid, "egid": egid,
        "effective": caps[0], "permitted": caps[1], "inheritable": caps[2],
        "bounding": bounding, "ambient": ambient, "no_new_privs": nnp,
    })
}

/// Runs every non-fatal probe and returns the report.
pub fn run(t: &Targets) -> Value {
    // SAFETY: getpid takes no arguments.
    let pid = unsafe { libc::getpid() };
    let mut procs: Vec<String> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
                .collect()
        })
        .unwrap_or_default();
    procs.sort();
    let read = |p: &str| match std::fs::read(p) {
        Ok(b) => json!({"ok": true, "text": String::from_utf8_lossy(&b).replace('\0', " ")}),
        Err(e) => json!({"ok": false, "errno": e.raw_os_error()}),
    };
    let root_link = std::fs::read_link("/proc/1/root")
        .map(|p| p.display().to_string())
        .unwrap_or_else(|e| format!("error: {e}"));
    // Every target again through /proc/1/root: the way out when /proc/1 is host init.
    let via_proc1: Vec<PathBuf> = t
        .paths
        .iter()
        .map(|p| Path::new("/proc/1/root").join(p.strip_prefix("/").unwrap_or(p)))
        .collect();
    let top: Vec<String> = std::fs::read_dir("/")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default();
    // A thread (through the clone filter: glibc falls back from clone3) reports its own ids.
    let thread = std::thread::Builder::new()
        .name("probe".into())
        .spawn(ids)
        .map_err(|e| e.to_string())
        .and_then(|h| h.join().map_err(|_| "thread panicked".to_string()));
    // clone3 with CLONE_NEWUSER: refused before the kernel reads the flags.
    let mut args = [0u64; 11];
    args[0] = libc::CLONE_NEWUSER as u64;
    // SAFETY: clone3 with a valid argument block; the filter refuses it (else the child
    // exits at once below).
    let r = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            args.as_ptr(),
            std::mem::size_of_val(&args),
        )
    };
    if r == 0 {
        // SAFETY: in a child that must not exist: leave at once.
        unsafe { libc::_exit(0) };
    }
    let clone3 = json!({"ret": r, "errno": if r < 0 { errno() } else { 0 }});
    json!({
        "pid": pid,
        "procs": procs,
        "proc1_root": root_link,
        "proc1_cmdline": read("/proc/1/cmdline"),
        "proc1_environ": read("/proc/1/environ"),
        "root_entries": top,
        "ids": ids(),
        "thread": thread.unwrap_or_else(|e| json!({"error": e})),
        "clone3": clone3,
        "paths": t.paths.iter().map(|p| try_open(p, libc::O_RDONLY)).collect::<Vec<_>>(),
        "paths_via_proc1": via_proc1.iter().map(|p| try_open(p, libc::O_RDONLY)).collect::<Vec<_>>(),
        "sockets": t.sockets.iter().map(|p| try_connect(p)).collect::<Vec<_>>(),
        "read_only": t.read_only.iter()
            .map(|p| if p.is_dir() {
                try_open(&p.join(".cube-probe"), libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL)
            } else {
                try_open(p, libc::O_WRONLY)
            })
            .collect::<Vec<_>>(),
    })
}

/// Probes the filter must kill the process for (one per run).
pub const FATAL: &[&str] = &[
    "ioctl_tiocsti",
    "ioctl_tunsetowner",
    "ioctl_kvm_unlisted",
    "clone_newuser",
    "fork",
    "unshare",
    "setuid0",
    "mount",
];

/// Runs fatal probe `name`; returns only if the process survived it (the attempt's result).
pub fn fatal(name: &str) -> Value {
    // SAFETY: raw syscalls with constant or local arguments; a clone that returns 0 is in a
    // child that exits at once.
    let r = unsafe {
        match name {
            "ioctl_tiocsti" => {
                let ch: u8 = b'x';
                libc::syscall(libc::SYS_ioctl, 2, libc::TIOCSTI, &ch)
            }
            "ioctl_tunsetowner" => libc::syscall(libc::SYS_ioctl, 2, libc::TUNSETOWNER, 0),
            // KVM_SET_GSI_ROUTING: KVM, but not one the hypervisor uses.
            "ioctl_kvm_unlisted" => libc::syscall(libc::SYS_ioctl, 2, 0x4008_ae6a_u64, 0),
            "clone_newuser" | "fork" => {
                let flags = if name == "fork" {
                    libc::SIGCHLD
                } else {
                    libc::CLONE_NEWUSER | libc::SIGCHLD
                };
                let r = libc::syscall(libc::SYS_clone, flags as u64, 0, 0, 0, 0);
                if r == 0 {
                    libc::_exit(0);
                }
                r
            }
            "unshare" => libc::syscall(libc::SYS_unshare, libc::CLONE_NEWNS),
            "setuid0" => libc::syscall(libc::SYS_setuid, 0),
            "mount" => libc::syscall(
                libc::SYS_mount,
                c"none".as_ptr(),
                c"/".as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                0,
            ),
            _ => return json!({"unknown_probe": name}),
        }
    };
    json!({"survived": name, "ret": r, "errno": if r < 0 { errno() } else { 0 }})
}
