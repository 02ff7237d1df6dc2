//! One Python worker process per context: spawning it as the sandbox user, the pipes between it
//! and the agent, and interrupting or killing it.
//!
//! Pipes: fd 3 carries commands to the worker, fd 4 carries its events back (see `worker.py`),
//! and its stdout/stderr are pipes whose bytes are forwarded as the running cell's output
//! (subprocesses and C extensions write there, not through `sys.stdout`).

use super::protocol::{parse_worker_line, WorkerMsg};
use crate::reaper;
use crate::users::User;
use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

/// The worker program, run with `python3 -c`.
pub const WORKER_PY: &str = include_str!("worker.py");

/// Longest event line accepted from a worker (a large PNG or DataFrame HTML fits easily).
const MAX_EVENT_LINE: usize = 256 << 20;

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Errors starting or talking to a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("creating pipes: {0}")]
    Pipe(std::io::Error),
    #[error("starting {python} (cwd {cwd}): {source}")]
    Spawn {
        python: String,
        cwd: String,
        source: std::io::Error,
    },
    #[error("invalid working directory {0:?}")]
    Cwd(String),
    #[error("the worker is gone: {0}")]
    Gone(String),
}

/// What the reader tasks deliver.
#[derive(Debug)]
pub enum WorkerEvent {
    Msg(Option<u64>, WorkerMsg),
    /// Raw output on the worker's fd 1 / fd 2.
    Raw {
        stderr: bool,
        text: String,
    },
    /// The event pipe closed: the worker exited or was killed.
    Exited(String),
}

/// How to start workers.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    pub python: PathBuf,
    /// `-S`: skip `site` (.pth files, sitecustomize) and add the site directories directly.
    pub fast_start: bool,
    pub user: User,
    pub cwd: PathBuf,
    pub env: HashMap<String, String>,
}

/// A running worker.
pub struct Worker {
    pub pid: i32,
    cmd: tokio::net::unix::pipe::Sender,
    pub events: mpsc::Receiver<WorkerEvent>,
    /// Fires when the reaper has collected the worker; until then its pid cannot be reused,
    /// so signalling it is safe.
    exit: tokio::sync::oneshot::Receiver<reaper::WaitStatus>,
    next_id: u64,
    dead: bool,
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two valid descriptors on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Finds `python3` the way the worker's PATH would.
pub fn find_python() -> Option<PathBuf> {
    DEFAULT_PATH
        .split(':')
        .map(|d| Path::new(d).join("python3"))
        .find(|p| p.exists())
}

impl Worker {
    /// Starts a worker. It becomes ready asynchronously (a `Ready` message).
    pub fn spawn(spec: &SpawnSpec) -> Result<Worker, WorkerError> {
        let (cmd_r, cmd_w) = pipe().map_err(WorkerError::Pipe)?;
        let (ev_r, ev_w) = pipe().map_err(WorkerError::Pipe)?;
        let user = &spec.user;
        let mut env: HashMap<String, String> = HashMap::new();
        env.insert("PATH".into(), DEFAULT_PATH.into());
        env.insert("HOME".into(), user.home.display().to_string());
        env.insert("USER".into(), user.name.clone());
        env.insert("LOGNAME".into(), user.name.clone());
        env.insert("LANG".into(), "C.UTF-8".into());
        env.insert("PYTHONIOENCODING".into(), "utf-8".into());
        // plt.show() and figures left open at the end of a cell become PNG results.
        env.insert("MPLBACKEND".into(), "module://cube_inline".into());
        for (k, v) in &spec.env {
            env.insert(k.clone(), v.clone());
        }
        env.insert("PWD".into(), spec.cwd.display().to_string());

        let mut cmd = Command::new(&spec.python);
        if spec.fast_start {
            cmd.arg("-S");
        }
        cmd.arg("-c")
            .arg(WORKER_PY)
            .env_clear()
            .envs(&env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let cwd = CString::new(spec.cwd.as_os_str().as_bytes())
            .map_err(|_| WorkerError::Cwd(spec.cwd.display().to_string()))?;
        // SAFETY: geteuid cannot fail.
        let switch_user = unsafe { libc::geteuid() } == 0;
        let (uid, gid, groups) = (user.uid, user.gid, user.groups.clone());
        let (cr, ew) = (cmd_r.as_raw_fd(), ev_w.as_raw_fd());
        // SAFETY: the closure only makes async-signal-safe syscalls on pre-built data.
        unsafe {
            cmd.pre_exec(move || {
                crate::process::reset_signal_dispositions();
                // Own session and process group: a restart kills the cell's subprocesses too.
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Move the pipe ends out of the way first so that neither dup2 clobbers the other;
                // dup2 clears close-on-exec on the targets.
                let a = libc::fcntl(cr, libc::F_DUPFD, 10);
                let b = libc::fcntl(ew, libc::F_DUPFD, 10);
                if a < 0 || b < 0 || libc::dup2(a, 3) < 0 || libc::dup2(b, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(a);
                libc::close(b);
                if switch_user
                    && (libc::setgroups(groups.len(), groups.as_ptr()) != 0
                        || libc::setgid(gid) != 0
                        || libc::setuid(uid) != 0)
                {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::chdir(cwd.as_ptr()) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (mut child, exit) = reaper::spawn(&mut cmd).map_err(|source| WorkerError::Spawn {
            python: spec.python.display().to_string(),
            cwd: spec.cwd.display().to_string(),
            source,
        })?;
        drop(cmd);
        drop(cmd_r);
        drop(ev_w);
        let pid = child.id() as i32;
        let (tx, rx) = mpsc::channel(256);

        let io = |e: std::io::Error| WorkerError::Gone(e.to_string());
        let cmd_tx = tokio::net::unix::pipe::Sender::from_owned_fd(cmd_w).map_err(io)?;
        let ev_rx = tokio::net::unix::pipe::Receiver::from_owned_fd(ev_r).map_err(io)?;
        tokio::spawn(read_events(ev_rx, tx.clone()));
        if let Some(out) = child.stdout.take() {
            if let Ok(r) = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(out)) {
                tokio::spawn(read_raw(r, tx.clone(), false));
            }
        }
        if let Some(err) = child.stderr.take() {
            if let Ok(r) = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(err)) {
                tokio::spawn(read_raw(r, tx, true));
            }
        }
        Ok(Worker {
            pid,
            cmd: cmd_tx,
            events: rx,
            exit,
            next_id: 1,
            dead: false,
        })
    }

    pub fn is_dead(&self) -> bool {
        self.dead
    }

    pub fn mark_dead(&mut self) {
        self.dead = true;
    }

    /// Drops events left over from earlier cells (late raw output of background processes).
    pub fn drain_stale(&mut self) {
        while let Ok(ev) = self.events.try_recv() {
            if let WorkerEvent::Exited(_) = ev {
                self.dead = true;
            }
        }
    }

    /// Waits for the worker's `ready` message: the interpreter is up and the worker code loaded.
    pub async fn wait_ready(&mut self, timeout: std::time::Duration) -> Result<(), WorkerError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Err(_) => return Err(WorkerError::Gone(format!("not ready after {timeout:?}"))),
                Ok(None) | Ok(Some(WorkerEvent::Exited(_))) => {
                    self.dead = true;
                    return Err(WorkerError::Gone("exited while starting".into()));
                }
                Ok(Some(WorkerEvent::Msg(_, WorkerMsg::Ready))) => return Ok(()),
                // Start-up noise (warnings on stderr) belongs to no cell.
                Ok(Some(_)) => {}
            }
        }
    }

    /// Sends one execution; returns its id.
    pub async fn send_execute(
        &mut self,
        code: &str,
        env: &HashMap<String, String>,
        call_env: &HashMap<String, String>,
    ) -> Result<u64, WorkerError> {
        let id = self.next_id;
        self.next_id += 1;
        let line = super::protocol::execute_command(id, code, env, call_env);
        if let Err(e) = self.cmd.write_all(&line).await {
            self.dead = true;
            return Err(WorkerError::Gone(e.to_string()));
        }
        Ok(id)
    }

    /// Interrupts the running cell (KeyboardInterrupt in the worker).
    pub fn interrupt(&mut self) {
        if self.unreaped() {
            // SAFETY: plain kill(2) on our unreaped child.
            unsafe { libc::kill(self.pid, libc::SIGINT) };
        }
    }

    /// True until the reaper has collected the process.
    fn unreaped(&mut self) -> bool {
        matches!(
            self.exit.try_recv(),
            Err(tokio::sync::oneshot::error::TryRecvError::Empty)
        )
    }

    /// Kills the worker and everything it started.
    pub fn kill(&mut self) {
        if self.unreaped() {
            kill_group(self.pid);
        }
        self.dead = true;
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // A worker nobody can talk to any more must not linger (its subprocesses neither).
        if self.unreaped() {
            kill_group(self.pid);
        }
    }
}

/// SIGKILL to the worker's process group (it is a session leader, so pgid = pid).
pub fn kill_group(pid: i32) {
    if pid > 1 {
        // SAFETY: plain kill(2) on a process group we created.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

async fn read_events(r: tokio::net::unix::pipe::Receiver, tx: mpsc::Sender<WorkerEvent>) {
    let mut r = BufReader::with_capacity(64 << 10, r);
    let mut buf = Vec::new();
    let why = loop {
        buf.clear();
        match (&mut r)
            .take(MAX_EVENT_LINE as u64 + 1)
            .read_until(b'\n', &mut buf)
            .await
        {
            Ok(0) => break "the interpreter exited".to_string(),
            Ok(_) if buf.last() != Some(&b'\n') => {
                break if buf.len() > MAX_EVENT_LINE {
                    format!("the interpreter sent an event over {MAX_EVENT_LINE} bytes")
                } else {
                    "the interpreter exited".to_string()
                };
            }
            Ok(_) => match parse_worker_line(&buf) {
                Ok((id, msg)) => {
                    if tx.send(WorkerEvent::Msg(id, msg)).await.is_err() {
                        return;
                    }
                }
                Err(e) => tracing::warn!("interpreter worker: {e}"),
            },
            Err(e) => break format!("reading interpreter events: {e}"),
        }
    };
    let _ = tx.send(WorkerEvent::Exited(why)).await;
}

async fn read_raw(
    mut r: tokio::net::unix::pipe::Receiver,
    tx: mpsc::Sender<WorkerEvent>,
    stderr: bool,
) {
    let mut buf = vec![0u8; 32 << 10];
    let mut carry: Vec<u8> = Vec::new();
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        carry.extend_from_slice(&buf[..n]);
        let text = take_utf8(&mut carry);
        if !text.is_empty() && tx.send(WorkerEvent::Raw { stderr, text }).await.is_err() {
            return;
        }
    }
    if !carry.is_empty() {
        let text = String::from_utf8_lossy(&carry).into_owned();
        let _ = tx.send(WorkerEvent::Raw { stderr, text }).await;
    }
}

/// Takes the longest decodable prefix of `buf` as text, keeping an incomplete UTF-8 sequence
/// at the end for the next read; invalid bytes become U+FFFD.
pub fn take_utf8(buf: &mut Vec<u8>) -> String {
    match std::str::from_utf8(buf) {
        Ok(s) => {
            let s = s.to_string();
            buf.clear();
            s
        }
        Err(e) => {
            let valid = e.valid_up_to();
            match e.error_len() {
                // Incomplete sequence at the end: keep it for the next read.
                None => {
                    let s = String::from_utf8_lossy(&buf[..valid]).into_owned();
                    buf.drain(..valid);
                    s
                }
                Some(_) => {
                    let s = String::from_utf8_lossy(buf).into_owned();
                    buf.clear();
                    s
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_split_across_reads_is_kept_whole() {
        let snow = "☃".as_bytes();
        let mut b = b"ab".to_vec();
        b.extend_from_slice(&snow[..2]);
        assert_eq!(take_utf8(&mut b), "ab");
        assert_eq!(b, &snow[..2]);
        b.extend_from_slice(&snow[2..]);
        assert_eq!(take_utf8(&mut b), "☃");
        assert!(b.is_empty());
        let mut bad = vec![b'x', 0xff, b'y'];
        assert_eq!(take_utf8(&mut bad), "x\u{fffd}y");
        assert!(bad.is_empty());
    }
}
