//! Processes started through `process.Process`: spawning as a user (pipes or a PTY), output
//! fan-out to any number of streams, stdin, signals, and the end event.

use crate::connect::{Code, RpcError};
use crate::reaper::{self, WaitStatus};
use crate::users::User;
use bytes::Bytes;
use serde::Serialize;
use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

const READ_CHUNK: usize = 32 * 1024;
/// After the process exits, how long to wait for its output pipes to reach EOF. Background
/// grandchildren may hold them open forever; the end event must not wait for those.
const OUTPUT_DRAIN_GRACE: Duration = Duration::from_millis(500);
/// Output chunks queued per stream before the process is made to wait (≤ 8 MiB at 32 KiB each).
const SUBSCRIBER_QUEUE: usize = 256;
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The process definition as the client sent it (echoed back by `List`).
#[derive(Debug, Clone, Serialize, Default)]
pub struct ProcConfig {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: HashMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// Output chunks.
#[derive(Debug, Clone)]
pub enum Output {
    Stdout(Bytes),
    Stderr(Bytes),
    Pty(Bytes),
}

/// How a process ended.
#[derive(Debug, Clone)]
pub struct EndInfo {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    pub error: Option<String>,
}

/// What a stream of a process receives.
#[derive(Debug, Clone)]
pub enum ProcEvent {
    Data(Output),
    End(EndInfo),
}

enum Stdin {
    Pipe(tokio::net::unix::pipe::Sender),
    Closed,
    Disabled,
}

#[derive(Default)]
struct Subscribers {
    list: Vec<mpsc::Sender<ProcEvent>>,
    ended: Option<EndInfo>,
}

/// A running (or just finished) process.
pub struct Process {
    pub pid: u32,
    pub tag: Option<String>,
    pub config: ProcConfig,
    stdin: tokio::sync::Mutex<Stdin>,
    pty: Option<Arc<AsyncFd<OwnedFd>>>,
    subs: Mutex<Subscribers>,
    /// Output readers currently handing a chunk to streams (see the driver's drain logic).
    publishing: AtomicUsize,
    /// Output chunks recorded in the journal so far (see [`LOGGED_CHUNKS`]).
    logged: AtomicUsize,
}

/// Output chunks of one process the journal records (stdout and stderr together), so that a
/// chatty process cannot push every other event out of the agent's bounded ring.
const LOGGED_CHUNKS: usize = 64;

impl Process {
    /// A receiver of all events from now on. If the process already ended, it gets the end event.
    pub fn subscribe(&self) -> mpsc::Receiver<ProcEvent> {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE);
        let mut s = self.subs.lock().unwrap_or_else(|p| p.into_inner());
        match &s.ended {
            Some(end) => {
                let _ = tx.try_send(ProcEvent::End(end.clone()));
            }
            None => s.list.push(tx),
        }
        rx
    }

    /// Delivers an event to every stream. A full queue makes the output reader wait (the
    /// process then blocks on its pipe, as with envd), so a slow client cannot make the agent
    /// buffer without bound; a stream whose client went away is dropped and never blocks.
    /// Publishes output from a reader, marking it busy meanwhile.
    async fn publish_output(&self, out: Output) {
        self.publishing.fetch_add(1, Ordering::SeqCst);
        self.publish(ProcEvent::Data(out)).await;
        self.publishing.fetch_sub(1, Ordering::SeqCst);
    }

    async fn publish(&self, ev: ProcEvent) {
        let is_end = matches!(ev, ProcEvent::End(_));
        let targets: Vec<mpsc::Sender<ProcEvent>> = {
            let mut s = self.subs.lock().unwrap_or_else(|p| p.into_inner());
            if let ProcEvent::End(end) = &ev {
                s.ended = Some(end.clone());
                std::mem::take(&mut s.list)
            } else {
                s.list.clone()
            }
        };
        let mut gone = Vec::new();
        for tx in &targets {
            if tx.send(ev.clone()).await.is_err() {
                gone.push(tx.clone());
            }
        }
        if !is_end && !gone.is_empty() {
            let mut s = self.subs.lock().unwrap_or_else(|p| p.into_inner());
            s.list.retain(|t| !gone.iter().any(|g| g.same_channel(t)));
        }
    }

    pub fn has_ended(&self) -> bool {
        self.subs.lock().map(|s| s.ended.is_some()).unwrap_or(true)
    }

    pub fn is_pty(&self) -> bool {
        self.pty.is_some()
    }

    /// Sends a signal to the process's group (it leads its own session), falling back to the pid.
    pub fn signal(&self, sig: i32) -> Result<(), RpcError> {
        let pid = self.pid as i32;
        // SAFETY: kill has no memory-safety preconditions.
        let rc = unsafe { libc::kill(-pid, sig) };
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: as above.
        let rc = unsafe { libc::kill(pid, sig) };
        if rc == 0 {
            Ok(())
        } else {
            let e = std::io::Error::last_os_error();
            Err(RpcError::internal(format!(
                "failed to signal process {pid}: {e}"
            )))
        }
    }

    /// Writes to stdin (pipe) or the terminal (PTY).
    pub async fn write_stdin(&self, data: &[u8], to_pty: bool) -> Result<(), RpcError> {
        if to_pty || self.pty.is_some() {
            let Some(m) = &self.pty else {
                return Err(RpcError::new(
                    Code::FailedPrecondition,
                    "process was not started with a PTY",
                ));
            };
            return write_fd(m, data)
                .await
                .map_err(|e| RpcError::internal(format!("failed to write to pty: {e}")));
        }
        let mut g = self.stdin.lock().await;
        match &mut *g {
            Stdin::Pipe(p) => p
                .write_all(data)
                .await
                .map_err(|e| RpcError::internal(format!("failed to write to stdin: {e}"))),
            Stdin::Closed => Err(RpcError::new(Code::FailedPrecondition, "stdin is closed")),
            Stdin::Disabled => Err(RpcError::new(
                Code::FailedPrecondition,
                "stdin is not enabled for this process",
            )),
        }
    }

    pub async fn close_stdin(&self) -> Result<(), RpcError> {
        if self.pty.is_some() {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                "cannot close stdin of a PTY process; send 0x04 (EOT) instead",
            ));
        }
        let mut g = self.stdin.lock().await;
        if let Stdin::Disabled = *g {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                "stdin is not enabled for this process",
            ));
        }
        *g = Stdin::Closed;
        Ok(())
    }

    pub fn resize(&self, cols: u16, rows: u16) -> Result<(), RpcError> {
        let Some(m) = &self.pty else {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                "process was not started with a PTY",
            ));
        };
        set_winsize(m.as_raw_fd(), cols, rows)
            .map_err(|e| RpcError::internal(format!("failed to resize pty: {e}")))
    }
}

async fn write_fd(fd: &AsyncFd<OwnedFd>, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        let mut guard = fd.writable().await?;
        match guard.try_io(|inner| {
            // SAFETY: writing from a valid buffer to an owned fd.
            let n = unsafe { libc::write(inner.as_raw_fd(), data.as_ptr().cast(), data.len()) };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        }) {
            Ok(Ok(n)) => data = &data[n..],
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
    Ok(())
}

fn set_winsize(fd: i32, cols: u16, rows: u16) -> std::io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize struct.
    if unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn set_nonblocking(fd: i32) -> std::io::Result<()> {
    // SAFETY: fcntl on an fd we own.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Everything needed to start one process.
pub struct SpawnRequest {
    pub config: ProcConfig,
    pub pty: Option<(u16, u16)>,
    pub tag: Option<String>,
    pub stdin: bool,
    pub user: User,
    pub cwd: PathBuf,
    /// Sandbox-wide env vars (from `/init`); request envs are applied on top.
    pub base_env: HashMap<String, String>,
}

/// The table of live processes.
pub struct ProcessManager {
    procs: Mutex<HashMap<u32, Arc<Process>>>,
    trim_pending: std::sync::atomic::AtomicBool,
    /// Process starts and exits, for the node's sandbox logs.
    pub journal: crate::journal::Journal,
}

/// Selects a process by pid or tag.
#[derive(Debug, Clone)]
pub enum Selector {
    Pid(u32),
    Tag(String),
}

impl Default for ProcessManager {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcessManager {
    pub fn new() -> Self {
        ProcessManager {
            procs: Mutex::new(HashMap::new()),
            trim_pending: std::sync::atomic::AtomicBool::new(false),
            journal: crate::journal::Journal::default(),
        }
    }

    /// Once no process has run for a moment, hands freed heap back to the kernel: bursts of
    /// output buffers otherwise stay in malloc's free lists and the idle agent grows.
    fn trim_when_idle(self: &Arc<Self>) {
        if self.trim_pending.swap(true, Ordering::SeqCst) {
            return;
        }
        let mgr = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(250)).await;
            mgr.trim_pending.store(false, Ordering::SeqCst);
            let idle = mgr.procs.lock().map(|m| m.is_empty()).unwrap_or(false);
            if idle {
                // SAFETY: malloc_trim only releases free memory.
                unsafe {
                    libc::malloc_trim(0);
                }
            }
        });
    }

    pub fn list(&self) -> Vec<Arc<Process>> {
        let m = self.procs.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = m.values().cloned().collect();
        v.sort_by_key(|p| p.pid);
        v
    }

    pub fn get(&self, sel: &Selector) -> Result<Arc<Process>, RpcError> {
        let m = self.procs.lock().unwrap_or_else(|p| p.into_inner());
        let found = match sel {
            Selector::Pid(pid) => m.get(pid).cloned(),
            Selector::Tag(tag) => m.values().find(|p| p.tag.as_deref() == Some(tag)).cloned(),
        };
        found.ok_or_else(|| match sel {
            Selector::Pid(pid) => RpcError::not_found(format!("process with pid {pid} not found")),
            Selector::Tag(tag) => RpcError::not_found(format!("process with tag {tag} not found")),
        })
    }

    /// Starts a process. The returned receiver sees every event from the first byte of output.
    pub fn start(
        self: &Arc<Self>,
        req: SpawnRequest,
    ) -> Result<(Arc<Process>, mpsc::Receiver<ProcEvent>), RpcError> {
        let user = &req.user;
        let mut env: HashMap<String, String> = HashMap::new();
        env.insert("PATH".into(), DEFAULT_PATH.into());
        env.insert("HOME".into(), user.home.display().to_string());
        env.insert("USER".into(), user.name.clone());
        env.insert("LOGNAME".into(), user.name.clone());
        if !user.shell.is_empty() {
            env.insert("SHELL".into(), user.shell.clone());
        }
        for (k, v) in req.base_env.iter().chain(req.config.envs.iter()) {
            env.insert(k.clone(), v.clone());
        }
        env.insert("PWD".into(), req.cwd.display().to_string());

        let mut cmd = Command::new(&req.config.cmd);
        cmd.args(&req.config.args).env_clear().envs(&env);

        let cwd = CString::new(req.cwd.as_os_str().as_bytes())
            .map_err(|_| RpcError::invalid("cwd contains a NUL byte"))?;
        // SAFETY: geteuid cannot fail.
        let switch_user = unsafe { libc::geteuid() } == 0;
        let (uid, gid, groups) = (user.uid, user.gid, user.groups.clone());
        let use_pty = req.pty.is_some();

        let mut master: Option<OwnedFd> = None;
        if let Some((cols, rows)) = req.pty {
            let (m, s) = open_pty(cols, rows)
                .map_err(|e| RpcError::internal(format!("failed to open pty: {e}")))?;
            let dup = |fd: &OwnedFd| {
                fd.try_clone()
                    .map_err(|e| RpcError::internal(format!("failed to dup pty: {e}")))
            };
            cmd.stdin(Stdio::from(dup(&s)?))
                .stdout(Stdio::from(dup(&s)?))
                .stderr(Stdio::from(s));
            master = Some(m);
        } else {
            cmd.stdin(if req.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        }

        // SAFETY: the closure only makes async-signal-safe syscalls on pre-built data.
        unsafe {
            cmd.pre_exec(move || {
                reset_signal_dispositions();
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if use_pty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
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

        let (mut child, exit_rx) = reaper::spawn(&mut cmd).map_err(|e| {
            let code = match e.kind() {
                std::io::ErrorKind::NotFound => Code::NotFound,
                std::io::ErrorKind::PermissionDenied => Code::PermissionDenied,
                _ => Code::Internal,
            };
            RpcError::new(
                code,
                format!(
                    "failed to start process {:?} (cwd {}): {e}",
                    req.config.cmd,
                    req.cwd.display()
                ),
            )
        })?;
        // Close our copies of the PTY slave / child ends now, so EOF is seen when the child exits.
        drop(cmd);
        let pid = child.id();
        let mut fields = vec![
            ("logger", "process".to_string()),
            ("pid", pid.to_string()),
            ("user", user.name.clone()),
            (
                "cmd",
                crate::journal::command_line(&req.config.cmd, &req.config.args),
            ),
        ];
        if let Some(t) = &req.tag {
            fields.push(("tag", t.clone()));
        }
        self.journal
            .record(crate::journal::Level::Info, "Process started", &fields);

        let stdin = match child.stdin.take() {
            Some(s) => tokio::net::unix::pipe::Sender::from_owned_fd(OwnedFd::from(s))
                .map(Stdin::Pipe)
                .unwrap_or(Stdin::Closed),
            None => Stdin::Disabled,
        };
        let pty = match master {
            Some(m) => {
                // SAFETY: the OwnedFd is moved into the AsyncFd and stays open for its lifetime.
                let r = set_nonblocking(m.as_raw_fd())
                    .and_then(|_| unsafe { AsyncFd::register(m) }.map_err(std::io::Error::from));
                match r {
                    Ok(a) => Some(Arc::new(a)),
                    Err(e) => {
                        tracing::error!(pid, "pty master unusable: {e}");
                        None
                    }
                }
            }
            None => None,
        };
        let proc_ = Arc::new(Process {
            pid,
            tag: req.tag.clone(),
            config: req.config.clone(),
            stdin: tokio::sync::Mutex::new(if use_pty { Stdin::Disabled } else { stdin }),
            pty: pty.clone(),
            subs: Mutex::new(Subscribers::default()),
            publishing: AtomicUsize::new(0),
            logged: AtomicUsize::new(0),
        });
        let rx = proc_.subscribe();
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(pid, proc_.clone());

        // Output readers.
        let mut readers = Vec::new();
        if let Some(m) = pty {
            let p = proc_.clone();
            readers.push(tokio::spawn(async move { read_pty(m, p).await }));
        }
        if let Some(out) = child.stdout.take() {
            if let Ok(r) = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(out)) {
                let (p, m) = (proc_.clone(), self.clone());
                readers.push(tokio::spawn(async move { read_pipe(r, p, false, m).await }));
            }
        }
        if let Some(err) = child.stderr.take() {
            if let Ok(r) = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(err)) {
                let (p, m) = (proc_.clone(), self.clone());
                readers.push(tokio::spawn(async move { read_pipe(r, p, true, m).await }));
            }
        }
        drop(child);

        // Driver: waits for the exit status and the output, then publishes the end event.
        let mgr = self.clone();
        let p = proc_.clone();
        tokio::spawn(async move {
            let status = exit_rx.await;
            let drain = async {
                for r in readers.iter_mut() {
                    let _ = r.await;
                }
            };
            if tokio::time::timeout(OUTPUT_DRAIN_GRACE, drain)
                .await
                .is_err()
            {
                // Still open after the grace: keep waiting while output is being delivered to a
                // slow client; stop only readers that sit idle on a pipe a background
                // grandchild keeps open.
                while !readers.iter().all(|r| r.is_finished())
                    && p.publishing.load(Ordering::SeqCst) > 0
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                for r in &readers {
                    r.abort();
                }
            }
            let end = match status {
                Ok(st) => end_info(st),
                Err(_) => EndInfo {
                    exit_code: -1,
                    exited: false,
                    status: "unknown".into(),
                    error: Some("exit status was lost".into()),
                },
            };
            mgr.procs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&p.pid);
            let level = if end.exited && end.exit_code == 0 {
                crate::journal::Level::Info
            } else {
                crate::journal::Level::Warn
            };
            mgr.journal.record(
                level,
                "Process exited",
                &[
                    ("logger", "process".to_string()),
                    ("pid", p.pid.to_string()),
                    ("exitCode", end.exit_code.to_string()),
                    ("status", end.status.clone()),
                ],
            );
            p.publish(ProcEvent::End(end)).await;
            // Close our end of stdin now rather than when the last stream lets go.
            *p.stdin.lock().await = Stdin::Closed;
            mgr.trim_when_idle();
        });
        Ok((proc_, rx))
    }
}

fn end_info(st: WaitStatus) -> EndInfo {
    EndInfo {
        exit_code: st.exit_code(),
        exited: st.exited(),
        status: st.describe(),
        error: None,
    }
}

/// Records an output chunk in the journal (E2B's sandbox logs carry stdout and stderr): the
/// text as the message (searchable), cut to the journal's field size; past
/// [`LOGGED_CHUNKS`], one entry says the rest is not recorded.
fn log_output(mgr: &ProcessManager, p: &Process, stderr: bool, data: &[u8]) {
    let n = p.logged.fetch_add(1, Ordering::Relaxed);
    if n > LOGGED_CHUNKS {
        return;
    }
    let stream = if stderr { "stderr" } else { "stdout" };
    let fields = [
        ("logger", "process".to_string()),
        ("pid", p.pid.to_string()),
        ("stream", stream.to_string()),
    ];
    if n == LOGGED_CHUNKS {
        let m = format!("Further output of process {} is not in the log", p.pid);
        mgr.journal.record(crate::journal::Level::Info, &m, &fields);
        return;
    }
    let text = String::from_utf8_lossy(data);
    mgr.journal.record(
        crate::journal::Level::Info,
        &crate::journal::cut_text(&text),
        &fields,
    );
}

async fn read_pipe(
    mut r: tokio::net::unix::pipe::Receiver,
    p: Arc<Process>,
    stderr: bool,
    mgr: Arc<ProcessManager>,
) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                log_output(&mgr, &p, stderr, &buf[..n]);
                let b = Bytes::copy_from_slice(&buf[..n]);
                p.publish_output(if stderr {
                    Output::Stderr(b)
                } else {
                    Output::Stdout(b)
                })
                .await;
            }
        }
    }
}

async fn read_pty(m: Arc<AsyncFd<OwnedFd>>, p: Arc<Process>) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        let Ok(mut guard) = m.readable().await else {
            break;
        };
        match guard.try_io(|inner| {
            // SAFETY: reading into a valid buffer from an owned fd.
            let n = unsafe { libc::read(inner.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        }) {
            // EIO means every slave end is closed: the terminal's EOF.
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => {
                p.publish(ProcEvent::Data(Output::Pty(Bytes::copy_from_slice(
                    &buf[..n],
                ))))
                .await
            }
            Err(_would_block) => continue,
        }
    }
}

fn open_pty(cols: u16, rows: u16) -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut master = -1;
    let mut slave = -1;
    let ws = libc::winsize {
        ws_row: if rows == 0 { 24 } else { rows },
        ws_col: if cols == 0 { 80 } else { cols },
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty writes two fds; we pass a valid winsize.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &ws,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: openpty returned two fresh fds that we now own.
    let (m, s) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    // SAFETY: FD_CLOEXEC on our own fd, so other children do not inherit the master.
    unsafe {
        libc::fcntl(m.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC);
        libc::fcntl(s.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC);
    }
    Ok((m, s))
}

/// Restores the default action of every catchable signal in a freshly forked child. Ignored
/// signals survive exec, so an agent started with SIGINT ignored (e.g. from a non-interactive
/// shell's `&`) would otherwise hand that on and Ctrl-C would never reach a command.
/// Only calls `signal`, which is async-signal-safe, so it may run between fork and exec.
pub(crate) fn reset_signal_dispositions() {
    for sig in 1..32 {
        if sig != libc::SIGKILL && sig != libc::SIGSTOP {
            // SAFETY: setting a default disposition touches no memory of this process.
            unsafe { libc::signal(sig, libc::SIG_DFL) };
        }
    }
}
