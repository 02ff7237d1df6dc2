//! Confinement of the shim, applied in this order by `main`:
//! 1. [`join_cgroup`] (optional `--cgroup NAME`): creates the cgroup if needed, sets the
//!    shape's limits (CPU quota = vCPUs, memory = guest MiB + overhead) and moves the shim in.
//!    Works on cgroup v2 (unified) and on v1 (`cpu` + `memory` hierarchies).
//! 2. With `--jail-root DIR` (cubelet's default), while the process has a single thread:
//!    * [`enter_mount_jail`]: a private mount namespace whose root is an empty tmpfs at `DIR`
//!      (`pivot_root`, the old root detached: nothing of the host tree stays reachable, not even
//!      through `..` of an open directory) holding only `/dev/kvm` and `/dev/net/tun` (device
//!      nodes made for this jail), `/sys/module/kvm_pvm` (PVM hosts), an empty `/proc` and the
//!      paths cubelet names: `--jail-own` (the shim's own work directory, read-write, handed to
//!      its uid), `--jail-bind-ro` (the template it restores, read-only) and `--jail-bind`
//!      (read-write, for tests and debugging). Each is bound at its own path so that request
//!      paths mean the same inside. The tmpfs root is read-only once set up.
//!    * [`enter_pid_ns`]: a new PID namespace; the process cubelet spawned stays in the host's
//!      namespace as a small supervisor ([`enter_pid_ns`] explains why) and the VMM continues
//!      as PID 1 of the new one, which then mounts its own `/proc` ([`mount_proc`]): `/proc/1`
//!      is the shim itself and no host process is visible.
//!    * `/dev/kvm` is opened ([`cube_hypervisor::Vmm::new`]), then `/proc` is narrowed to the
//!      per-process entries ([`restrict_proc`]; `/proc/cpuinfo` was needed until then).
//!    * [`drop_privileges`]: the shim's own uid and gid ([`shim_id`]), no supplementary
//!      groups, every capability set empty (effective, permitted, inheritable, bounding,
//!      ambient), parent-death signal re-armed.
//! 3. VM shell creation (memslot, vCPU threads), template preparation, control socket.
//! 4. [`no_new_privs`]: `PR_SET_NO_NEW_PRIVS`, so nothing the shim execs can gain privileges
//!    (and so seccomp can be installed without `CAP_SYS_ADMIN`).
//! 5. [`apply_seccomp`]: an allow-list of the syscalls the control loop, the vCPU threads and
//!    snapshot I/O and the virtio backends (tap reads/writes, the vsock unix sockets) use,
//!    installed on **all threads** (TSYNC) — the vCPU threads already exist; device worker
//!    threads started later inherit it. Arguments are filtered where a syscall is a door to
//!    more: `socket` for `AF_UNIX` only, `ioctl` for the KVM and tun requests the hypervisor
//!    makes ([`ALLOWED_IOCTLS`]), `clone` for threads only (no new process, no namespace),
//!    and `clone3` (whose flags live in memory, out of a filter's reach) fails with `ENOSYS`
//!    so that glibc falls back to `clone`. Anything else kills the process
//!    (`SECCOMP_RET_KILL_PROCESS`, logged by the audit subsystem). `--no-seccomp` skips it
//!    for debugging.
//!
//! Without `--jail-root` only the cgroup, no-new-privs and seccomp apply (tests, debugging).

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

mod cgroup;
mod creds;
mod mount;
mod pidns;
mod seccomp;

pub use cgroup::{cgroup_dirs, join_cgroup, CgroupLimits};
pub use creds::{
    bounding_and_ambient, capabilities, drop_privileges, ensure_single_threaded, no_new_privs,
    shim_id, SHIM_ID_BASE, SHIM_ID_COUNT,
};
pub use mount::{
    enter_mount_jail, mount_proc, restrict_proc, JailSpec, JAIL_DEVICES, JAIL_IF_PRESENT,
};
pub use pidns::{enter_pid_ns, PidNs};
pub use seccomp::{
    apply_seccomp, clone3_program, seccomp_program, ALLOWED_IOCTLS, ALLOWED_SYSCALLS,
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
    #[error("pid namespace: {what}: {source}")]
    PidNs {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("dropping privileges: {what}: {source}")]
    Privileges {
        what: String,
        source: std::io::Error,
    },
}

fn cstr(p: &Path) -> Result<std::ffi::CString, JailError> {
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

fn priv_sys(r: libc::c_long, what: impl FnOnce() -> String) -> Result<(), JailError> {
    if r != 0 {
        return Err(JailError::Privileges {
            what: what(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}
