//! The sandbox launcher. cubelet re-executes itself as `cubelet sandbox-init` (a fresh,
//! single-threaded process, so forking is safe) with a JSON [`InitSpec`] in the environment.
//! The launcher joins the sandbox cgroups and network namespace, unshares mount, UTS, IPC,
//! PID and cgroup namespaces, and forks the sandbox's PID 1, which mounts the disk, prepares
//! `/proc`, `/sys`, a minimal `/dev`, `/run` and `/tmp`, pivots into the root, drops
//! capabilities to the agent's set, installs the seccomp filter and execs cube-agent. The
//! launcher prints the PID 1 pid and exits, so sandboxes do not depend on cubelet staying up.

use serde::{Deserialize, Serialize};
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// Environment variable carrying the spec.
pub const SPEC_ENV: &str = "CUBE_SANDBOX_INIT_SPEC";

/// What the launcher needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitSpec {
    pub disk: PathBuf,
    pub root: PathBuf,
    pub netns: PathBuf,
    pub cgroup_procs: Vec<PathBuf>,
    /// The devices cgroup (an allow-list), joined by the sandbox's init once its disk is
    /// mounted.
    #[serde(default)]
    pub devices_procs: Vec<PathBuf>,
    pub hostname: String,
    pub agent_path: String,
    /// The node's agent binary. When set it is bind-mounted read-only at `agent_path` on the
    /// sandbox's fresh `/run` and executed from there instead of the image's copy: every
    /// sandbox then maps the same host page cache instead of reading ~20 MB through its own
    /// loop device (a quarter of the CPU of a create burst), and the sandbox still cannot
    /// write to it (read-only mount, no CAP_SYS_ADMIN to remount).
    #[serde(default)]
    pub agent_host: Option<PathBuf>,
    pub agent_args: Vec<String>,
    pub log: PathBuf,
    pub keep_caps: Vec<u32>,
    pub seccomp: bool,
    /// The sandbox's user namespace: its ids 0..count are host ids base.. .
    #[serde(default)]
    pub ids: Option<IdMap>,
    pub run_size_mib: u64,
    pub tmp_size_mib: u64,
}

/// Sandbox ids 0..count are host ids base..base+count (uids and gids alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdMap {
    pub base: u32,
    pub count: u32,
}

impl IdMap {
    /// The host id of sandbox id `id`.
    pub fn host(&self, id: u32) -> u32 {
        self.base + id
    }
}

/// What the launcher prints on success.
#[derive(Debug, Serialize, Deserialize)]
pub struct InitResult {
    pub pid: i32,
}

/// Capabilities the agent keeps (Docker's default set less CAP_MKNOD): enough to run
/// processes as other users, own files and bind low ports; no CAP_SYS_ADMIN, NET_ADMIN,
/// SYS_TIME, SYS_MODULE, MKNOD, ...
pub const AGENT_CAPS: &[u32] = &[0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 29, 31];

/// OCI's default masked paths (under the sandbox root): an empty read-only tmpfs over a
/// directory, /dev/null over a file. They expose host kernel memory, keys, timers and
/// hardware.
pub const MASKED_PATHS: &[&str] = &[
    "proc/acpi",
    "proc/asound",
    "proc/kcore",
    "proc/keys",
    "proc/latency_stats",
    "proc/timer_list",
    "proc/timer_stats",
    "proc/sched_debug",
    "proc/scsi",
    "sys/firmware",
    "sys/devices/virtual/powercap",
];

/// OCI's default read-only paths: host-wide kernel settings (core_pattern, modprobe, sysrq).
pub const READ_ONLY_PATHS: &[&str] = &[
    "proc/bus",
    "proc/fs",
    "proc/irq",
    "proc/sys",
    "proc/sysrq-trigger",
];

fn err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap_or_default()
}

fn cp(p: &Path) -> CString {
    crate::storage::cstr(p)
}

fn mount(
    src: &str,
    target: &Path,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), String> {
    let (s, t, f, d) = (c(src), cp(target), c(fstype), c(data));
    // SAFETY: all pointers are valid C strings for the duration of the call.
    let r = unsafe {
        libc::mount(
            s.as_ptr(),
            t.as_ptr(),
            f.as_ptr(),
            flags,
            if data.is_empty() {
                std::ptr::null()
            } else {
                d.as_ptr() as *const libc::c_void
            },
        )
    };
    if r != 0 {
        return Err(err(&format!("mount {fstype} on {}", target.display())));
    }
    Ok(())
}

/// Entry point of `cubelet sandbox-init`. Returns the process exit code.
pub fn main() -> i32 {
    let spec: InitSpec = match std::env::var(SPEC_ENV)
        .map_err(|e| e.to_string())
        .and_then(|s| serde_json::from_str(&s).map_err(|e| e.to_string()))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("sandbox-init: bad spec: {e}");
            return 2;
        }
    };
    match launch(&spec) {
        Ok(pid) => {
            let out = serde_json::to_string(&InitResult { pid }).unwrap_or_default();
            println!("{out}");
            0
        }
        Err(e) => {
            eprintln!("sandbox-init: {e}");
            1
        }
    }
}

/// Moves the calling (single-threaded launcher) process into the sandbox's cgroups and
/// network namespace, whatever starts the sandbox's PID 1 from there.
pub(crate) fn enter(cgroup_procs: &[PathBuf], netns: &Path) -> Result<(), String> {
    let me = std::process::id().to_string();
    for f in cgroup_procs {
        std::fs::write(f, &me).map_err(|e| format!("join cgroup {}: {e}", f.display()))?;
    }
    let ns =
        std::fs::File::open(netns).map_err(|e| format!("open netns {}: {e}", netns.display()))?;
    // SAFETY: setns with an fd we own.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(err("setns(net)"));
    }
    drop(ns);
    // ICMP echo sockets for every uid of the sandbox (as Docker does), so `ping` works
    // without CAP_NET_RAW or a setuid/file-capability binary (no_new_privs ignores both).
    // /proc/sys/net is the namespace of the writer: the sandbox's.
    let _ = std::fs::write("/proc/sys/net/ipv4/ping_group_range", "0 2147483647");
    Ok(())
}

fn launch(spec: &InitSpec) -> Result<i32, String> {
    enter(&spec.cgroup_procs, &spec.netns)?;
    // Forked before the new PID namespace, so they stay outside the sandbox's.
    let log_pipe = spawn_log_writer(&spec.log)?;
    let userns = match spec.ids {
        Some(ids) => {
            // Root of a user namespace holds no capability over the network namespace (the
            // host's user namespace owns it): low ports must be open to every uid.
            let _ = std::fs::write("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0");
            Some(make_userns(ids)?)
        }
        None => None,
    };
    let flags = libc::CLONE_NEWNS
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWCGROUP;
    // SAFETY: single-threaded process.
    if unsafe { libc::unshare(flags) } != 0 {
        return Err(err("unshare"));
    }
    let filter = if spec.seccomp {
        Some(super::seccomp::compile()?)
    } else {
        None
    };
    let (rd, wr) = pipe()?;
    // SAFETY: this process is single-threaded (sandbox-init runs before any runtime starts).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(err("fork"));
    }
    if pid == 0 {
        drop(rd);
        let msg = match child(spec, filter.as_deref(), &log_pipe, userns.as_ref()) {
            Ok(never) => match never {},
            Err(m) => m,
        };
        let mut w = std::fs::File::from(wr);
        let _ = w.write_all(msg.as_bytes());
        // SAFETY: terminate the child without running the parent's atexit handlers.
        unsafe { libc::_exit(1) };
    }
    drop(wr);
    drop(log_pipe);
    let mut msg = String::new();
    let _ = std::fs::File::from(rd).read_to_string(&mut msg);
    if !msg.is_empty() {
        let mut st = 0;
        // SAFETY: reap our failed child.
        unsafe { libc::waitpid(pid, &mut st, 0) };
        return Err(msg);
    }
    Ok(pid)
}

enum Never {}

/// A user namespace whose ids 0..count are host ids base.. : a helper process unshares it and
/// waits while this one (root in the host's namespace) writes its maps; the namespace stays
/// alive through the returned fd.
fn make_userns(ids: IdMap) -> Result<OwnedFd, String> {
    make_userns_with(ids, false).map(|(user, _)| user)
}

/// [`make_userns`], and with `net` a network namespace that the new user namespace owns (made
/// by the helper as its root once the maps are written): only a process privileged in its
/// owner may join a network namespace, and gVisor's runsc, run as root of the sandbox's user
/// namespace, must join the sandbox's.
pub(crate) fn make_userns_with(
    ids: IdMap,
    net: bool,
) -> Result<(OwnedFd, Option<OwnedFd>), String> {
    let (ready_r, ready_w) = pipe()?;
    let (hold_r, hold_w) = pipe()?;
    // SAFETY: single-threaded process.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(err("fork"));
    }
    if pid == 0 {
        drop((ready_r, hold_w));
        // SAFETY: unshare, then plain reads and writes on our own pipes.
        unsafe {
            let say = |ok: bool| {
                let b: u8 = ok.into();
                libc::write(
                    ready_w.as_raw_fd(),
                    &b as *const u8 as *const libc::c_void,
                    1,
                );
            };
            let hear = || {
                let mut b = 0u8;
                libc::read(
                    hold_r.as_raw_fd(),
                    &mut b as *mut u8 as *mut libc::c_void,
                    1,
                ) == 1
            };
            say(libc::unshare(libc::CLONE_NEWUSER) == 0);
            // The maps are written: make the network namespace as the new namespace's root.
            if hear() {
                say(libc::unshare(libc::CLONE_NEWNET) == 0);
                hear();
            }
            libc::_exit(0);
        }
    }
    drop((ready_w, hold_r));
    let mut ready = std::fs::File::from(ready_r);
    let mut hold = std::fs::File::from(hold_w);
    let result = (|| {
        let mut ok = [0u8; 1];
        ready
            .read_exact(&mut ok)
            .map_err(|e| format!("user namespace helper: {e}"))?;
        if ok[0] != 1 {
            return Err("unshare(CLONE_NEWUSER) failed in the helper".to_string());
        }
        let map = format!("0 {} {}", ids.base, ids.count);
        for f in ["uid_map", "gid_map"] {
            std::fs::write(format!("/proc/{pid}/{f}"), &map)
                .map_err(|e| format!("write {f} of the user namespace ({map}): {e}"))?;
        }
        let open = |ns: &str| {
            std::fs::File::open(format!("/proc/{pid}/ns/{ns}"))
                .map(OwnedFd::from)
                .map_err(|e| format!("open the helper's {ns} namespace: {e}"))
        };
        let user = open("user")?;
        if !net {
            return Ok((user, None));
        }
        hold.write_all(&[1])
            .map_err(|e| format!("user namespace helper: {e}"))?;
        ready
            .read_exact(&mut ok)
            .map_err(|e| format!("user namespace helper: {e}"))?;
        if ok[0] != 1 {
            return Err("unshare(CLONE_NEWNET) failed in the user namespace".to_string());
        }
        Ok((user, Some(open("net")?)))
    })();
    drop(hold);
    let mut st = 0;
    // SAFETY: reap the helper (it exits once `hold` closes).
    unsafe { libc::waitpid(pid, &mut st, 0) };
    result
}

/// Replaces the mount at `root` with an idmapped copy: files the image owns as uid/gid N are
/// the sandbox's N, that is host id base+N, and what the sandbox writes lands on disk as N.
pub(crate) fn idmap_mount(root: &Path, userns: &OwnedFd) -> Result<(), String> {
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
    let rp = cp(root);
    let empty = c("");
    // SAFETY: valid C strings; the returned fd is checked and owned.
    let tree = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            rp.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if tree < 0 {
        return Err(err("open_tree of the sandbox root"));
    }
    // SAFETY: open_tree returned a new fd.
    let tree = unsafe { OwnedFd::from_raw_fd(tree as i32) };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    // SAFETY: a valid fd, an empty path with AT_EMPTY_PATH, and a mount_attr of its size.
    if unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    } != 0
    {
        return Err(err("idmap the sandbox root (mount_setattr)"));
    }
    // SAFETY: detach the plain mount; the idmapped clone takes its place.
    if unsafe { libc::umount2(rp.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(err("detach the sandbox root"));
    }
    // SAFETY: valid fd and C strings.
    if unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            rp.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    } != 0
    {
        return Err(err("attach the idmapped sandbox root"));
    }
    Ok(())
}

/// Joins the sandbox's user namespace as its root (full capabilities there, none over the
/// host; the bounding set is cut right after).
pub(crate) fn enter_userns(userns: &OwnedFd) -> Result<(), String> {
    // SAFETY: setns with an fd we own, then credential calls with integer arguments.
    unsafe {
        if libc::setns(userns.as_raw_fd(), libc::CLONE_NEWUSER) != 0 {
            return Err(err("setns(user)"));
        }
        if libc::setgroups(0, std::ptr::null()) != 0 {
            return Err(err("setgroups in the user namespace"));
        }
        if libc::setresgid(0, 0, 0) != 0 || libc::setresuid(0, 0, 0) != 0 {
            return Err(err("become root of the user namespace"));
        }
    }
    Ok(())
}

/// Most bytes of a sandbox init's stdout/stderr kept in its log file; the rest is read and
/// dropped, so a sandbox cannot fill the host's disk through `/proc/1/fd/1`.
pub const LOG_CAP_BYTES: u64 = 8 << 20;

/// Starts the process that copies the sandbox init's output into `log` (at most
/// [`LOG_CAP_BYTES`]) and returns the write end of its pipe. The writer runs as nobody with no
/// capabilities and `no_new_privs`, in the sandbox's cgroups (so it goes with the sandbox), and
/// ends when the last writer closes the pipe.
pub(crate) fn spawn_log_writer(log: &Path) -> Result<OwnedFd, String> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("open log {}: {e}", log.display()))?;
    let (rd, wr) = pipe()?;
    // SAFETY: single-threaded process.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(err("fork"));
    }
    if pid == 0 {
        drop(wr);
        // Off the launcher's stdout/stderr: cubelet reads those to their end.
        if let Ok(null) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
        {
            // SAFETY: dup2 onto the standard fds.
            unsafe {
                libc::dup2(null.as_raw_fd(), 0);
                libc::dup2(null.as_raw_fd(), 1);
                libc::dup2(null.as_raw_fd(), 2);
            }
        }
        // nobody: leaving uid 0 clears every capability; the log file is already open.
        // SAFETY: plain credential and prctl calls with integer arguments.
        unsafe {
            libc::setgroups(0, std::ptr::null());
            libc::setresgid(65534, 65534, 65534);
            libc::setresuid(65534, 65534, 65534);
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
        }
        copy_capped(std::fs::File::from(rd), file, LOG_CAP_BYTES);
        // SAFETY: leave without the parent's atexit handlers.
        unsafe { libc::_exit(0) };
    }
    Ok(wr)
}

/// Copies `from` to `to` until EOF, at most `cap` bytes, then one note, then drains.
fn copy_capped(mut from: impl Read, mut to: impl Write, cap: u64) {
    let mut buf = vec![0u8; 64 << 10];
    let mut kept = 0u64;
    let mut noted = false;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        let room = cap.saturating_sub(kept).min(n as u64) as usize;
        if room > 0 {
            let _ = to.write_all(&buf[..room]);
            kept += room as u64;
        }
        if room < n && !noted {
            let _ = writeln!(to, "\n[cube: sandbox output beyond {cap} bytes dropped]");
            noted = true;
        }
    }
}

/// Bind-mounts the host's agent binary read-only at `target` (a path on the sandbox's own
/// `/run` tmpfs, so no symlink in the image can redirect it).
fn bind_agent(host: &Path, target: &Path) -> Result<(), String> {
    if let Some(dir) = target.parent() {
        mkdirs(dir)?;
    }
    std::fs::File::create(target).map_err(|e| format!("create {}: {e}", target.display()))?;
    let host_s = host.to_string_lossy();
    mount(&host_s, target, "", libc::MS_BIND, "")?;
    // The read-only flag of a bind mount takes a remount.
    mount(
        "",
        target,
        "",
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        "",
    )
}

/// Applies [`MASKED_PATHS`] and [`READ_ONLY_PATHS`] beneath `root` (which has its /proc,
/// /sys and /dev mounted). Paths this kernel does not have are skipped.
fn mask_paths(root: &Path) -> Result<(), String> {
    let ro = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | libc::MS_RDONLY;
    let null = root.join("dev/null");
    for rel in MASKED_PATHS {
        let p = root.join(rel);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => mount("tmpfs", &p, "tmpfs", ro, "size=0,mode=555")?,
            Ok(_) => mount(&null.to_string_lossy(), &p, "", libc::MS_BIND, "")?,
            Err(_) => {}
        }
    }
    for rel in READ_ONLY_PATHS {
        let p = root.join(rel);
        if std::fs::symlink_metadata(&p).is_err() {
            continue;
        }
        let ps = p.to_string_lossy();
        mount(&ps, &p, "", libc::MS_BIND | libc::MS_REC, "")?;
        mount(&ps, &p, "", libc::MS_BIND | libc::MS_REMOUNT | ro, "")?;
    }
    Ok(())
}

/// A close-on-exec pipe: (read end, write end).
fn pipe() -> Result<(OwnedFd, OwnedFd), String> {
    let mut fds = [0i32; 2];
    // SAFETY: fds is a valid 2-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(err("pipe"));
    }
    // SAFETY: fresh fds from pipe2, owned here.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn mkdirs(p: &Path) -> Result<(), String> {
    std::fs::create_dir_all(p).map_err(|e| format!("mkdir {}: {e}", p.display()))
}

fn child(
    spec: &InitSpec,
    filter: Option<&[seccompiler::BpfProgram]>,
    log: &OwnedFd,
    userns: Option<&OwnedFd>,
) -> Result<Never, String> {
    let root = &spec.root;
    mount(
        "none",
        Path::new("/"),
        "",
        libc::MS_REC | libc::MS_PRIVATE,
        "",
    )?;
    let dev = crate::storage::LoopDevice::attach(&spec.disk).map_err(|e| e.to_string())?;
    // noinit_itable: no background inode-table zeroing thread per sandbox mount.
    // nosuid, nodev: no setuid program or device node of the image counts.
    if let Err(e) = crate::storage::mount_dev(
        &dev.path,
        root,
        "ext4",
        libc::MS_NOATIME | libc::MS_NOSUID | libc::MS_NODEV,
        "noinit_itable",
    ) {
        dev.detach();
        return Err(e.to_string());
    }
    dev.release();
    if let Some(ns) = userns {
        idmap_mount(root, ns)?;
    }
    // tmpfs and devpts owned by the sandbox's root (and tty group) where it has its own ids.
    let owner = spec
        .ids
        .map(|m| format!(",uid={},gid={}", m.host(0), m.host(0)))
        .unwrap_or_default();
    let tty_gid = spec.ids.map_or(5, |m| m.host(5));
    let nosuid = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    for d in ["proc", "sys", "dev", "run", "tmp", "sbin"] {
        mkdirs(&root.join(d))?;
    }
    mount("proc", &root.join("proc"), "proc", nosuid, "")?;
    mount(
        "sysfs",
        &root.join("sys"),
        "sysfs",
        nosuid | libc::MS_RDONLY,
        "",
    )?;
    let devd = root.join("dev");
    mount(
        "tmpfs",
        &devd,
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        &format!("mode=755,size=64k{owner}"),
    )?;
    for (name, major, minor) in [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ] {
        let p = cp(&devd.join(name));
        // SAFETY: valid path; we are root in the initial user namespace.
        if unsafe {
            libc::mknod(
                p.as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(major, minor),
            )
        } != 0
        {
            return Err(err(&format!("mknod /dev/{name}")));
        }
        // SAFETY: as above (mknod applies the umask).
        unsafe { libc::chmod(p.as_ptr(), 0o666) };
    }
    for d in ["pts", "shm"] {
        mkdirs(&devd.join(d))?;
    }
    mount(
        "devpts",
        &devd.join("pts"),
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        &format!("newinstance,ptmxmode=0666,mode=0620,gid={tty_gid}"),
    )?;
    mount(
        "shm",
        &devd.join("shm"),
        "tmpfs",
        nosuid,
        &format!("mode=1777,size=65536k{owner}"),
    )?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(target, devd.join(link))
            .map_err(|e| format!("symlink /dev/{link}: {e}"))?;
    }
    mount(
        "tmpfs",
        &root.join("run"),
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        &format!("mode=755,size={}m{owner}", spec.run_size_mib),
    )?;
    if let Some(host) = &spec.agent_host {
        bind_agent(host, &root.join(spec.agent_path.trim_start_matches('/')))?;
    }
    mount(
        "tmpfs",
        &root.join("tmp"),
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        &format!("mode=1777,size={}m{owner}", spec.tmp_size_mib),
    )?;
    mask_paths(root)?;
    // Devices beyond the allow-list are closed from here on (the loop device is mounted).
    for f in &spec.devices_procs {
        std::fs::write(f, std::process::id().to_string())
            .map_err(|e| format!("join devices cgroup {}: {e}", f.display()))?;
    }
    let hn = spec.hostname.as_bytes();
    // SAFETY: valid buffer and length.
    if unsafe { libc::sethostname(hn.as_ptr() as *const libc::c_char, hn.len()) } != 0 {
        return Err(err("sethostname"));
    }
    // pivot_root(".", ".") stacks the old root on top of the new one; detach it right away.
    let rc = cp(root);
    let dot = c(".");
    // SAFETY: valid C strings.
    unsafe {
        if libc::chdir(rc.as_ptr()) != 0 {
            return Err(err("chdir root"));
        }
        if libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) != 0 {
            return Err(err("pivot_root"));
        }
        if libc::umount2(dot.as_ptr(), libc::MNT_DETACH) != 0 {
            return Err(err("detach old root"));
        }
        let slash = c("/");
        if libc::chdir(slash.as_ptr()) != 0 {
            return Err(err("chdir /"));
        }
    }
    let null = std::fs::File::open("/dev/null").map_err(|e| format!("open /dev/null: {e}"))?;
    // SAFETY: dup2 onto the standard fds.
    unsafe {
        libc::dup2(null.as_raw_fd(), 0);
        libc::dup2(log.as_raw_fd(), 1);
        libc::dup2(log.as_raw_fd(), 2);
    }
    drop(null);
    // Nothing of cubelet's may leak into the sandbox: close-on-exec for every other fd.
    // SAFETY: close_range with the CLOEXEC flag only marks fds.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            4u32, /* CLOSE_RANGE_CLOEXEC */
        )
    };
    if let Some(ns) = userns {
        enter_userns(ns)?;
    }
    drop_caps(&spec.keep_caps)?;
    match filter {
        Some(f) => super::seccomp::install(f).map_err(|e| format!("seccomp: {e}"))?,
        // Without seccomp (a test setting) no_new_privs still holds.
        // SAFETY: prctl with integer arguments.
        None if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 => {
            return Err(err("no_new_privs"));
        }
        None => {}
    }
    let prog = c(&spec.agent_path);
    let mut argv: Vec<CString> = vec![prog.clone()];
    argv.extend(spec.agent_args.iter().map(|a| c(a)));
    let mut argp: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argp.push(std::ptr::null());
    let env: Vec<CString> = [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME=/root",
        "TERM=xterm",
        "container=cube-namespace",
    ]
    .iter()
    .map(|s| c(s))
    .collect();
    let mut envp: Vec<*const libc::c_char> = env.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());
    // SAFETY: argv/envp are NULL-terminated arrays of valid C strings.
    unsafe { libc::execve(prog.as_ptr(), argp.as_ptr(), envp.as_ptr()) };
    Err(err(&format!("exec {}", spec.agent_path)))
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Shrinks the bounding set and the inheritable set to `keep`; after exec, root's permitted
/// set is the bounding set, so the agent ends with exactly `keep`.
fn drop_caps(keep: &[u32]) -> Result<(), String> {
    let last: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40);
    for cap in 0..=last {
        if !keep.contains(&cap) {
            // SAFETY: prctl with integer arguments.
            if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0 {
                return Err(err(&format!("drop capability {cap}")));
            }
        }
    }
    // SAFETY: prctl with integer arguments.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    let mut hdr = CapHeader {
        version: 0x2008_0522,
        pid: 0,
    };
    let mut data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: header and 2-element data array as the v3 ABI requires.
    if unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut hdr as *mut CapHeader,
            data.as_mut_ptr(),
        )
    } != 0
    {
        return Err(err("capget"));
    }
    let mut inh = [0u32; 2];
    for &k in keep {
        inh[(k / 32) as usize % 2] |= 1 << (k % 32);
    }
    for i in 0..2 {
        data[i].inheritable &= inh[i];
    }
    // SAFETY: as above.
    if unsafe { libc::syscall(libc::SYS_capset, &mut hdr as *mut CapHeader, data.as_ptr()) } != 0 {
        return Err(err("capset"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_beyond_the_cap_is_dropped_with_one_note() {
        let input = vec![b'x'; 200_000];
        let mut out = Vec::new();
        copy_capped(&input[..], &mut out, 150_000);
        let text = String::from_utf8(out).unwrap();
        let (kept, rest) = text.split_at(150_000);
        assert!(kept.bytes().all(|b| b == b'x'));
        assert_eq!(
            rest,
            "\n[cube: sandbox output beyond 150000 bytes dropped]\n"
        );
        let mut out = Vec::new();
        copy_capped(&b"short\n"[..], &mut out, 150_000);
        assert_eq!(out, b"short\n");
    }
}
