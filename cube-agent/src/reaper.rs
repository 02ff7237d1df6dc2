//! Child reaping that works both as PID 1 and as an ordinary process.
//!
//! There is exactly one place that calls `waitpid`: [`reap_all`], which reaps *any* child
//! (`waitpid(-1)`), so orphans re-parented to PID 1 never linger as zombies. Exit statuses of
//! processes the agent spawned itself are not lost to it: each such child is registered in a
//! table under the same lock that `reap_all` holds while it waits, and the registration happens
//! while the lock is held across `spawn`, so a child that exits immediately cannot be reaped
//! before its waiter is in the table. Nothing else in the agent may wait for children
//! (no `tokio::process`, no `std::process::Child::wait`).

use std::collections::HashMap;
use std::process::{Child, Command};
use std::sync::{Mutex, OnceLock};
use tokio::sync::oneshot;

/// A raw wait status as returned by `waitpid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitStatus(pub i32);

impl WaitStatus {
    pub fn exited(self) -> bool {
        libc::WIFEXITED(self.0)
    }
    pub fn exit_code(self) -> i32 {
        if self.exited() {
            libc::WEXITSTATUS(self.0)
        } else {
            -1
        }
    }
    pub fn signal(self) -> Option<i32> {
        libc::WIFSIGNALED(self.0).then(|| libc::WTERMSIG(self.0))
    }
    /// The status text Go's `os.ProcessState.String()` produces, which envd reports.
    pub fn describe(self) -> String {
        if let Some(sig) = self.signal() {
            let mut s = format!("signal: {}", signal_name(sig));
            if libc::WCOREDUMP(self.0) {
                s.push_str(" (core dumped)");
            }
            s
        } else {
            format!("exit status {}", self.exit_code())
        }
    }
}

/// Go's names for signals (`syscall.Signal.String()`).
pub fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGHUP => "hangup".into(),
        libc::SIGINT => "interrupt".into(),
        libc::SIGQUIT => "quit".into(),
        libc::SIGILL => "illegal instruction".into(),
        libc::SIGTRAP => "trace/breakpoint trap".into(),
        libc::SIGABRT => "aborted".into(),
        libc::SIGBUS => "bus error".into(),
        libc::SIGFPE => "floating point exception".into(),
        libc::SIGKILL => "killed".into(),
        libc::SIGUSR1 => "user defined signal 1".into(),
        libc::SIGSEGV => "segmentation fault".into(),
        libc::SIGUSR2 => "user defined signal 2".into(),
        libc::SIGPIPE => "broken pipe".into(),
        libc::SIGALRM => "alarm clock".into(),
        libc::SIGTERM => "terminated".into(),
        other => format!("signal {other}"),
    }
}

type Table = HashMap<i32, oneshot::Sender<WaitStatus>>;

fn table() -> &'static Mutex<Table> {
    static T: OnceLock<Mutex<Table>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

fn lock() -> std::sync::MutexGuard<'static, Table> {
    // A poisoned lock only means a panic elsewhere; the table itself is still consistent.
    table().lock().unwrap_or_else(|p| p.into_inner())
}

/// Spawns `cmd` and registers it, returning the child and a receiver for its exit status.
pub fn spawn(cmd: &mut Command) -> std::io::Result<(Child, oneshot::Receiver<WaitStatus>)> {
    let mut t = lock();
    let child = cmd.spawn()?;
    let (tx, rx) = oneshot::channel();
    t.insert(child.id() as i32, tx);
    Ok((child, rx))
}

/// Reaps every exited child; returns how many were reaped.
pub fn reap_all() -> usize {
    let mut t = lock();
    let mut n = 0;
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid status pointer.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            break;
        }
        n += 1;
        match t.remove(&pid) {
            Some(tx) => {
                let _ = tx.send(WaitStatus(status));
            }
            None => tracing::debug!(pid, status, "reaped orphan"),
        }
    }
    n
}

/// Reaps on every SIGCHLD, forever. Call once, before the first spawn, from inside the runtime.
pub async fn run() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut sig = match signal(SignalKind::child()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!("cannot watch SIGCHLD ({e}); falling back to polling");
            None
        }
    };
    loop {
        match sig.as_mut() {
            Some(s) => {
                // The periodic sweep covers any signal lost before the handler existed.
                let _ = tokio::time::timeout(std::time::Duration::from_secs(5), s.recv()).await;
            }
            None => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
        reap_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_describe_like_go() {
        // exit(3) => status 3<<8
        let s = WaitStatus(3 << 8);
        assert!(s.exited());
        assert_eq!(s.exit_code(), 3);
        assert_eq!(s.describe(), "exit status 3");
        let k = WaitStatus(libc::SIGKILL);
        assert!(!k.exited());
        assert_eq!(k.exit_code(), -1);
        assert_eq!(k.describe(), "signal: killed");
    }

    #[test]
    fn registered_child_status_is_delivered() {
        let (_c, mut rx) = spawn(Command::new("/bin/sh").args(["-c", "exit 7"])).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            reap_all();
            if let Ok(st) = rx.try_recv() {
                assert_eq!(st.exit_code(), 7);
                break;
            }
            assert!(std::time::Instant::now() < deadline, "child never reaped");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
