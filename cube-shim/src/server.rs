//! The control socket: one thread per connection, requests serialized on the sandbox.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::protocol::{
    parse_request, Body, ErrorKind, GuestStatus, Op, Reply, Request, Response, SandboxState,
};
use crate::sandbox::Sandbox;

/// Longest request line accepted (a request is a few hundred bytes).
const MAX_LINE: usize = 64 * 1024;

pub struct Server {
    listener: UnixListener,
    path: PathBuf,
    sandbox: Arc<Mutex<Sandbox>>,
}

fn lock(s: &Mutex<Sandbox>) -> MutexGuard<'_, Sandbox> {
    // A panic elsewhere must not take the control API down with it.
    s.lock().unwrap_or_else(|e| e.into_inner())
}

impl Server {
    /// Binds `path` (replacing a stale socket file), owner-only.
    pub fn bind(path: &Path, sandbox: Sandbox) -> std::io::Result<Server> {
        use std::os::unix::fs::FileTypeExt;
        match std::fs::symlink_metadata(path) {
            // A stale socket of an earlier shim: replace it. Anything else is not ours.
            Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
            Ok(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        Ok(Server {
            listener,
            path: path.to_path_buf(),
            sandbox: Arc::new(Mutex::new(sandbox)),
        })
    }

    pub fn sandbox(&self) -> &Arc<Mutex<Sandbox>> {
        &self.sandbox
    }

    /// Serves until a `stop` request; returns then (the caller exits the process).
    pub fn run(self) -> std::io::Result<()> {
        // Drains vCPU events now and then so that a chatty guest cannot grow the queue.
        let pump = self.sandbox.clone();
        std::thread::Builder::new()
            .name("events".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(250));
                lock(&pump).drain_events();
            })?;
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let path = self.path.clone();
        let listener = self.listener;
        let sandbox = self.sandbox;
        std::thread::Builder::new()
            .name("accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    let conn = match conn {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::warn!("accept: {e}");
                            continue;
                        }
                    };
                    let sb = sandbox.clone();
                    let done = done_tx.clone();
                    let spawned =
                        std::thread::Builder::new()
                            .name("conn".into())
                            .spawn(move || {
                                if let Err(e) = serve(conn, &sb, &done) {
                                    tracing::debug!("connection ended: {e}");
                                }
                            });
                    if let Err(e) = spawned {
                        tracing::warn!("spawn connection thread: {e}");
                    }
                }
            })?;
        // Wait for `stop`.
        let _ = done_rx.recv();
        let _ = std::fs::remove_file(&path);
        Ok(())
    }
}

/// Longest `wait` honoured; longer ones are cut to this (clients loop).
const MAX_WAIT: Duration = Duration::from_secs(3600);

/// Requests queued for the sandbox lock: a `wait` steps aside for them between slices
/// (std's mutex is not fair, so re-locking at once could starve them).
static QUEUED: AtomicUsize = AtomicUsize::new(0);

/// Locks the sandbox for one request (counted in [`QUEUED`] until it holds the lock).
fn lock_for_request(s: &Mutex<Sandbox>) -> MutexGuard<'_, Sandbox> {
    QUEUED.fetch_add(1, Ordering::SeqCst);
    let g = lock(s);
    QUEUED.fetch_sub(1, Ordering::SeqCst);
    g
}

/// `wait` in slices of 20 ms (an event ends a slice at once), releasing the sandbox in
/// between so that other connections (cubelet's `stop`, `stats`) are not blocked.
fn wait_in_slices(sandbox: &Mutex<Sandbox>, timeout_ms: u64) -> Response {
    let timeout = Duration::from_millis(timeout_ms).min(MAX_WAIT);
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        while QUEUED.load(Ordering::SeqCst) > 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
        let resp = lock(sandbox).handle(Op::Wait {
            timeout_ms: left.min(Duration::from_millis(20)).as_millis() as u64,
        });
        let settled = match &resp.body {
            Body::Ok(Reply::Guest { state, guest, .. }) => {
                *state != SandboxState::Running || *guest != GuestStatus::Active
            }
            _ => true,
        };
        if settled || left.is_zero() {
            return resp;
        }
    }
}

fn serve(
    conn: UnixStream,
    sandbox: &Mutex<Sandbox>,
    done: &std::sync::mpsc::Sender<()>,
) -> std::io::Result<()> {
    let mut writer = conn.try_clone()?;
    let mut reader = BufReader::new(conn);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut buf)?;
        if n == 0 {
            return Ok(());
        }
        let (resp, stop) = if buf.len() > MAX_LINE && !buf.ends_with(b"\n") {
            // Skip the rest of the over-long line, then answer.
            let mut rest = Vec::new();
            reader.read_until(b'\n', &mut rest)?;
            (
                Response::err(
                    ErrorKind::Malformed,
                    format!("request line over {MAX_LINE} bytes"),
                ),
                false,
            )
        } else {
            match std::str::from_utf8(&buf) {
                Err(_) => (
                    Response::err(ErrorKind::Malformed, "request is not UTF-8"),
                    false,
                ),
                Ok(line) if line.trim().is_empty() => continue,
                Ok(line) => match parse_request(line.trim()) {
                    Err(e) => (Response::from(e), false),
                    Ok(Request {
                        op: Op::Wait { timeout_ms },
                        ..
                    }) => (wait_in_slices(sandbox, timeout_ms), false),
                    Ok(req) => {
                        let name = req.op.name();
                        let mut sb = lock_for_request(sandbox);
                        let resp = sb.handle(req.op);
                        tracing::debug!(op = name, "handled");
                        (resp, sb.stopping)
                    }
                },
            }
        };
        let mut line = serde_json::to_vec(&resp).unwrap_or_else(|e| {
            format!(r#"{{"v":1,"err":{{"kind":"internal","message":"encode response: {e}"}}}}"#)
                .into_bytes()
        });
        line.push(b'\n');
        writer.write_all(&line)?;
        if stop {
            let _ = done.send(());
            return Ok(());
        }
    }
}
