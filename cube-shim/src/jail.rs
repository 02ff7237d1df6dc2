//! Best-effort confinement of the shim, applied in this order by `main`:
//! 1. [`join_cgroup`] (optional `--cgroup NAME`): creates the cgroup if needed, sets the
//!    shape's limits (CPU quota = vCPUs, memory = guest MiB + overhead) and moves the shim in.
//!    Works on cgroup v2 (unified) and on v1 (`cpu` + `memory` hierarchies).
//! 2. VM shell creation (needs `/dev/kvm`, thread creation, large mappings).
//! 3. [`no_new_privs`]: `PR_SET_NO_NEW_PRIVS`, so nothing the shim execs can gain privileges
//!    (and so seccomp can be installed without `CAP_SYS_ADMIN`).
//! 4. [`apply_seccomp`]: an allow-list of the syscalls the control loop, the vCPU threads and
//!    snapshot I/O and the virtio backends (tap reads/writes, the vsock unix sockets) use,
//!    installed on **all threads** (TSYNC) — the vCPU threads already exist; device worker
//!    threads started later inherit it. `socket` is allowed for `AF_UNIX` only.
//!    Anything else kills the process (`SECCOMP_RET_KILL_PROCESS`, logged by the audit
//!    subsystem). `--no-seccomp` skips it for debugging.
//!
//!
//! Optional (`--jail-root DIR`, applied right after the cgroup, before any thread exists):
//! [`enter_mount_jail`] moves the shim into a private mount namespace whose root is an empty
//! tmpfs at `DIR` holding only `/dev/kvm`, `/dev/net/tun`, `/sys/module/kvm_pvm` (PVM hosts),
//! a fresh `/proc` and the directories
//! named with `--jail-bind` (cubelet's template, sandbox and socket directories), each at its
//! own path so request paths mean the same inside; then `chroot`s there. Nothing else of the
//! host filesystem is reachable from the shim.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("prctl(PR_SET_NO_NEW_PRIVS): {0}")]
    NoNewPrivs(std::io::Error),
    #[error("seccomp filter: {0}")]
    Seccomp(String),
    #[error("cgroup {path}: {source}")]
    Cgroup {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid cgroup name {0:?} (a relative path without '..')")]
    CgroupName(String),
    #[error("mount jail: {what}: {source}")]
    Mount {
        what: String,
        source: std::io::Error,
    },
}

fn cstr(p: &Path) -> Result<std::ffi::CString, JailError> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| JailError::Mount {
        what: format!("path {} has a NUL byte", p.display()),
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })
}

fn sys(r: libc::c_int, what: impl FnOnce() -> String) -> Result<(), JailError> {
    if r != 0 {
        return Err(JailError::Mount {
            what: what(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn mount(
    src: Option<&Path>,
    dst: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), JailError> {
    let src_c = src.map(cstr).transpose()?;
    let dst_c = cstr(dst)?;
    let fs_c = fstype.map(|f| std::ffi::CString::new(f).unwrap_or_default());
    let data_c = data.map(|d| std::ffi::CString::new(d).unwrap_or_default());
    let p = |c: &Option<std::ffi::CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is a valid NUL-terminated string or null.
    let r = unsafe {
        libc::mount(
            p(&src_c),
            dst_c.as_ptr(),
            p(&fs_c),
            flags,
            p(&data_c) as *const libc::c_void,
        )
    };
    sys(r, || {
        format!(
            "mount {} on {}",
            src.map(|s| s.display().to_string())
                .or(fstype.map(String::from))
                .unwrap_or_default(),
            dst.display()
        )
    })
}

/// Device nodes every shim needs inside its jail.
pub const JAIL_DEVICES: &[&str] = &["/dev/kvm", "/dev/net/tun"];
/// Host facts the hypervisor reads, bound when the host has them.
pub const JAIL_IF_PRESENT: &[&str] = &["/sys/module/kvm_pvm"];

/// Enters a private mount namespace rooted at an empty tmpfs on `root` that holds only
/// [`JAIL_DEVICES`], `/proc` and `binds` (absolute paths, bound at the same path), and chroots
/// there. Must run while the process has a single thread (mount namespaces are per thread
/// until then shared by the threads created afterwards).
pub fn enter_mount_jail(root: &Path, binds: &[PathBuf]) -> Result<(), JailError> {
    for b in binds {
        if !b.is_absolute() {
            return Err(JailError::Mount {
                what: format!("bind path {} is not absolute", b.display()),
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            });
        }
    }
    let io = |what: String| move |e: std::io::Error| JailError::Mount { what, source: e };
    std::fs::create_dir_all(root).map_err(io(format!("mkdir {}", root.display())))?;
    // SAFETY: unshare with a flag constant.
    sys(unsafe { libc::unshare(libc::CLONE_NEWNS) }, || {
        "unshare(CLONE_NEWNS)".into()
    })?;
    // Nothing mounted here may leak back to the host's namespace.
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;
    mount(
        None,
        root,
        Some("tmpfs"),
        libc::MS_NOSUID,
        Some("mode=0755,size=1m"),
    )?;
    let mut all: Vec<PathBuf> = JAIL_DEVICES.iter().map(PathBuf::from).collect();
    // The hypervisor tells PVM hosts by this directory (it shapes the vCPU state and the CPU
    // model hash snapshots are checked against).
    all.extend(
        JAIL_IF_PRESENT
            .iter()
            .map(PathBuf::from)
            .filter(|p| p.exists()),
    );
    all.extend(binds.iter().cloned());
    for src in &all {
        let rel = src.strip_prefix("/").unwrap_or(src);
        let dst = root.join(rel);
        let meta = std::fs::metadata(src).map_err(io(format!("bind source {}", src.display())))?;
        if meta.is_dir() {
            std::fs::create_dir_all(&dst).map_err(io(format!("mkdir {}", dst.display())))?;
        } else {
            if let Some(p) = dst.parent() {
                std::fs::create_dir_all(p).map_err(io(format!("mkdir {}", p.display())))?;
            }
            std::fs::File::create(&dst).map_err(io(format!("create {}", dst.display())))?;
        }
        mount(Some(src), &dst, None, libc::MS_BIND | libc::MS_REC, None)?;
    }
    let proc_dir = root.join("proc");
    std::fs::create_dir_all(&proc_dir).map_err(io(format!("mkdir {}", proc_dir.display())))?;
    mount(
        None,
        &proc_dir,
        Some("proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )?;
    let root_c = cstr(root)?;
    // SAFETY: chdir/chroot with valid NUL-terminated paths.
    sys(unsafe { libc::chdir(root_c.as_ptr()) }, || {
        format!("chdir {}", root.display())
    })?;
    sys(unsafe { libc::chroot(c".".as_ptr()) }, || "chroot".into())?;
    sys(unsafe { libc::chdir(c"/".as_ptr()) }, || "chdir /".into())?;
    Ok(())
}

pub fn no_new_privs() -> Result<(), JailError> {
    // SAFETY: plain prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(JailError::NoNewPrivs(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Syscalls the shim needs after setup. Built from the code paths (control socket, vCPU run
/// loop and kick signal, snapshot and pause-to-disk file I/O, new shells after a
/// pause-to-disk, std thread spawning) and checked by running the test suite with the filter on.
pub const ALLOWED_SYSCALLS: &[i64] = &[
    // memory
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_mincore,
    libc::SYS_memfd_create,
    // KVM and devices
    libc::SYS_ioctl,
    libc::SYS_eventfd2,
    // threads, signals, time
    libc::SYS_futex,
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_tgkill,
    libc::SYS_tkill,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_gettimeofday,
    libc::SYS_getrusage,
    libc::SYS_prctl,
    libc::SYS_getrandom,
    // files: snapshots, pause-to-disk, /proc/self for stats
    libc::SYS_openat,
    libc::SYS_open,
    libc::SYS_close,
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_lseek,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_fstatfs,
    libc::SYS_statfs,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_getcwd,
    libc::SYS_getdents64,
    libc::SYS_fcntl,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_dup,
    libc::SYS_dup3,
    // control socket
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    // virtio-vsock host side: the shim binds the sandbox's socket on restore and connects to
    // `<path>_<port>` for guest-initiated connections (`socket` itself is limited to
    // AF_UNIX, see [`seccomp_program`]).
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_connect,
];

/// Allowed only with their first argument equal to the given value.
const ALLOWED_WITH_ARG0: &[(i64, u64)] = &[(libc::SYS_socket, libc::AF_UNIX as u64)];

/// Compiles the allow-list into a BPF program.
pub fn seccomp_program() -> Result<BpfProgram, JailError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED_SYSCALLS.iter().map(|&n| (n, Vec::new())).collect();
    for &(nr, arg0) in ALLOWED_WITH_ARG0 {
        let cond = SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, arg0)
            .map_err(|e| JailError::Seccomp(e.to_string()))?;
        let rule = SeccompRule::new(vec![cond]).map_err(|e| JailError::Seccomp(e.to_string()))?;
        rules.insert(nr, vec![rule]);
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::KillProcess,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| JailError::Seccomp(e.to_string()))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| JailError::Seccomp(e.to_string()))
}

/// Installs the allow-list on every thread of the process.
pub fn apply_seccomp() -> Result<(), JailError> {
    let prog = seccomp_program()?;
    seccompiler::apply_filter_all_threads(&prog).map_err(|e| JailError::Seccomp(e.to_string()))
}

/// Limits for the shim's cgroup, derived from the shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupLimits {
    pub vcpus: u8,
    pub memory_bytes: u64,
}

fn write(path: &Path, value: &str) -> Result<(), JailError> {
    std::fs::write(path, value).map_err(|e| JailError::Cgroup {
        path: path.to_path_buf(),
        source: e,
    })
}

/// The cgroup directories `name` maps to under `root` (normally `/sys/fs/cgroup`): the
/// unified one on v2, the `cpu` and `memory` ones on v1.
pub fn cgroup_dirs(root: &Path, name: &str) -> Result<Vec<PathBuf>, JailError> {
    let rel = Path::new(name);
    if name.is_empty()
        || rel.is_absolute()
        || rel
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(JailError::CgroupName(name.to_string()));
    }
    if root.join("cgroup.controllers").exists() {
        Ok(vec![root.join(rel)])
    } else {
        // cpu and memory carry the limits; pids and freezer (when mounted) are joined too, so
        // that whoever manages the cgroup (cubelet) finds and can kill the shim in each.
        let mut v = vec![root.join("cpu").join(rel), root.join("memory").join(rel)];
        for extra in ["pids", "freezer"] {
            if root.join(extra).join("cgroup.procs").exists() {
                v.push(root.join(extra).join(rel));
            }
        }
        Ok(v)
    }
}

/// Creates (if needed) and joins cgroup `name` with `limits`. Returns the directories joined.
pub fn join_cgroup(
    root: &Path,
    name: &str,
    limits: CgroupLimits,
) -> Result<Vec<PathBuf>, JailError> {
    let dirs = cgroup_dirs(root, name)?;
    let period = 100_000u64;
    let quota = period * limits.vcpus as u64;
    for d in &dirs {
        std::fs::create_dir_all(d).map_err(|e| JailError::Cgroup {
            path: d.clone(),
            source: e,
        })?;
        if d.join("cgroup.controllers").exists() {
            write(&d.join("cpu.max"), &format!("{quota} {period}"))?;
            write(&d.join("memory.max"), &limits.memory_bytes.to_string())?;
        } else if d.join("cpu.cfs_quota_us").exists() {
            write(&d.join("cpu.cfs_period_us"), &period.to_string())?;
            write(&d.join("cpu.cfs_quota_us"), &quota.to_string())?;
        } else if d.join("memory.limit_in_bytes").exists() {
            write(
                &d.join("memory.limit_in_bytes"),
                &limits.memory_bytes.to_string(),
            )?;
        }
        write(&d.join("cgroup.procs"), &std::process::id().to_string())?;
    }
    Ok(dirs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allow_list_compiles_and_has_no_duplicates() {
        let prog = seccomp_program().unwrap();
        assert!(prog.len() > ALLOWED_SYSCALLS.len());
        let mut v = ALLOWED_SYSCALLS.to_vec();
        v.sort();
        v.dedup();
        assert_eq!(v.len(), ALLOWED_SYSCALLS.len());
        // Things a compromised VMM would want must stay out.
        for bad in [
            libc::SYS_execve,
            libc::SYS_ptrace,
            libc::SYS_socket,
            libc::SYS_mount,
        ] {
            assert!(
                !ALLOWED_SYSCALLS.contains(&bad),
                "syscall {bad} must not be allowed"
            );
        }
    }

    #[test]
    fn the_filter_kills_a_process_that_leaves_the_allow_list() {
        for inet in [false, true] {
            killed_by_filter(inet);
        }
    }

    /// Forks a child that installs the filter, opens an AF_UNIX socket, then makes a call
    /// outside the list (`getppid`, or an AF_INET socket when `inet`).
    fn killed_by_filter(inet: bool) {
        let prog = seccomp_program().unwrap();
        // SAFETY: the child only makes raw syscalls and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            unsafe {
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
                if seccompiler::apply_filter(&prog).is_err() {
                    libc::_exit(3);
                }
                libc::syscall(libc::SYS_getpid); // allowed
                let fd = libc::syscall(libc::SYS_socket, libc::AF_UNIX, libc::SOCK_STREAM, 0);
                if fd < 0 {
                    libc::_exit(4); // AF_UNIX sockets (vsock backend) must stay possible
                }
                if inet {
                    libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_DGRAM, 0);
                } else {
                    libc::syscall(libc::SYS_getppid); // not allowed: killed here
                }
                libc::_exit(0);
            }
        }
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFSIGNALED(status), "child status {status:#x}");
        assert_eq!(libc::WTERMSIG(status), libc::SIGSYS);
    }

    #[test]
    fn cgroup_names_are_confined() {
        let root = Path::new("/nonexistent-root");
        for bad in ["", "/abs", "../up", "a/../../b", "."] {
            assert!(cgroup_dirs(root, bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            cgroup_dirs(root, "cube/s1").unwrap(),
            vec![root.join("cpu/cube/s1"), root.join("memory/cube/s1")]
        );
    }
}
