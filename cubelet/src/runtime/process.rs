//! A sandbox's host process, identified across pid reuse by its pid and start time.

use crate::cgroup::{CgroupError, Cgroups};
use std::time::{Duration, Instant};

/// Start time of a process in clock ticks since boot (field 22 of /proc/PID/stat): with the
/// pid it identifies a process across pid reuse.
pub fn proc_start_time(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &s[s.rfind(')')? + 2..];
    after.split(' ').nth(19)?.parse().ok()
}

/// True when `pid` is alive (not a zombie) and is the process that started at `start`.
pub fn is_alive(pid: i32, start: u64) -> bool {
    if pid <= 0 {
        return false;
    }
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some(close) = s.rfind(')') else {
        return false;
    };
    let mut f = s[close + 2..].split(' ');
    let state = f.next().unwrap_or("");
    let started: Option<u64> = f.nth(18).and_then(|x| x.parse().ok());
    state != "Z" && started == Some(start)
}

/// Waits for `pid` to exit: waitpid when it is our child (re-parented to us as subreaper),
/// else polls /proc until it is gone or a zombie of someone else.
pub fn reap(pid: i32, timeout: Duration) {
    let start = Instant::now();
    loop {
        let mut st = 0;
        // SAFETY: waitpid on a specific pid with WNOHANG.
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        if r == pid {
            return;
        }
        if r < 0 {
            // Not our child: done when it no longer runs.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rfind(')')
                .and_then(|i| stat.get(i + 2..i + 3))
                .unwrap_or("");
            if stat.is_empty() || state == "Z" {
                return;
            }
        }
        if start.elapsed() > timeout {
            tracing::warn!(pid, "sandbox init did not exit in time");
            return;
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// Kills every process of the sandbox, reaps PID 1 when it is our child, and removes the
/// cgroup. Idempotent.
pub fn kill(cg: &Cgroups, key: &str, pid: i32, start: u64) -> Result<(), CgroupError> {
    if is_alive(pid, start) {
        if cg.is_frozen(key) {
            let _ = cg.set_frozen(key, false);
        }
        // SIGKILL to a pid namespace's init kills the whole namespace.
        // SAFETY: kill(2); pid identity checked just above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    if pid > 0 {
        reap(pid, Duration::from_secs(10));
    }
    cg.destroy(key)?;
    Ok(())
}

/// [`kill`] off the async threads for a sandbox's state; logs and returns false on failure.
pub async fn kill_sandbox(cg: &Cgroups, st: &crate::sandbox::SandboxState) -> bool {
    let (cg, key, pid, start) = (cg.clone(), st.key.clone(), st.pid, st.pid_start);
    match tokio::task::spawn_blocking(move || kill(&cg, &key, pid, start)).await {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::error!(id = %st.id, error = %e, "killing sandbox");
            false
        }
        Err(e) => {
            tracing::error!(id = %st.id, error = %e, "kill task");
            false
        }
    }
}
