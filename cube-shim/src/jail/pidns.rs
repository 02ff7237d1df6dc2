//! The PID namespace: the VMM continues as PID 1 of a namespace of its own while the process
//! cubelet spawned stays behind as its supervisor.

use super::creds::drop_privileges;
use super::{priv_sys, JailError};

/// The VMM side of [`enter_pid_ns`].
#[derive(Debug)]
pub struct PidNs {
    /// Host pid of the supervisor (the process cubelet spawned and tracks).
    pub host_pid: u32,
    /// Read end of a pipe only the supervisor holds open: EOF means it is gone.
    alive: std::os::fd::OwnedFd,
}

/// Moves the rest of the shim into a new PID namespace, as its PID 1.
///
/// `unshare(CLONE_NEWPID)` only places the caller's *children* in the new namespace, so the
/// shim forks here: the child (PID 1 inside) returns and becomes the VMM; the parent stays in
/// the host's namespace, drops its privileges too and only waits, then exits as the child did
/// (same code, or the same signal). This keeps cubelet's view unchanged — it spawns the shim
/// with `std::process::Command`, tracks that pid (its start time, `/proc/<pid>/root`, its
/// cgroup) and kills it to stop the sandbox — while nothing the VMM can see or signal lies
/// outside its own namespace. (Cloning straight into a new namespace from cubelet would need
/// a raw `clone` in a multi-threaded daemon instead of `Command`, and the VMM could not learn
/// the pid cubelet tracks.) The VMM dies with the supervisor (`PR_SET_PDEATHSIG`, armed in
/// [`drop_privileges`]) and the supervisor with the VMM, so either pid is the sandbox's.
///
/// Must run while the process has a single thread (fork copies only the caller).
pub fn enter_pid_ns(id: u32) -> Result<PidNs, JailError> {
    use std::os::fd::FromRawFd;
    let host_pid = std::process::id();
    let mut fds = [0; 2];
    // SAFETY: pipe2 into a local array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(JailError::PidNs {
            what: "pipe",
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: both fds were just created and are owned here only.
    let (r, w) = unsafe {
        (
            std::os::fd::OwnedFd::from_raw_fd(fds[0]),
            std::os::fd::OwnedFd::from_raw_fd(fds[1]),
        )
    };
    // SAFETY: unshare with a flag constant.
    if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
        return Err(JailError::PidNs {
            what: "unshare(CLONE_NEWPID)",
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: the process is single-threaded (see above), so the child may run Rust code.
    match unsafe { libc::fork() } {
        -1 => Err(JailError::PidNs {
            what: "fork",
            source: std::io::Error::last_os_error(),
        }),
        0 => {
            drop(w);
            Ok(PidNs { host_pid, alive: r })
        }
        child => {
            drop(r);
            supervise(child, id, w)
        }
    }
}

/// The supervisor's life: no privileges, wait for the VMM, leave as it left.
fn supervise(child: libc::pid_t, id: u32, _alive: std::os::fd::OwnedFd) -> ! {
    if let Err(e) = drop_privileges(id, false) {
        eprintln!("cube-shim supervisor: {e}");
        // SAFETY: kill/_exit with plain integers.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::_exit(1);
        }
    }
    let mut status = 0;
    loop {
        // SAFETY: waitpid into a local.
        let r = unsafe { libc::waitpid(child, &mut status, 0) };
        if r == child {
            break;
        }
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            // SAFETY: _exit.
            unsafe { libc::_exit(1) };
        }
    }
    // SAFETY: signal/raise/_exit with plain integers.
    unsafe {
        if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
            libc::_exit(128 + sig);
        }
        libc::_exit(libc::WEXITSTATUS(status))
    }
}

impl PidNs {
    /// Arms the parent-death signal (a credential change clears it, so this comes after
    /// [`drop_privileges`]) and exits if the supervisor is already gone.
    pub fn die_with_supervisor(&self) -> Result<(), JailError> {
        use std::os::fd::AsRawFd;
        // SAFETY: prctl with integer arguments.
        priv_sys(
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) }.into(),
            || "PR_SET_PDEATHSIG".into(),
        )?;
        let mut p = libc::pollfd {
            fd: self.alive.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one valid pollfd, no wait.
        if unsafe { libc::poll(&mut p, 1, 0) } > 0 {
            // Readable means EOF: nobody writes to it.
            // SAFETY: _exit.
            unsafe { libc::_exit(1) };
        }
        Ok(())
    }
}
