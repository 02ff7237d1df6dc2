//! Code contexts: each owns one worker (its variables and imports), runs one cell at a time,
//! and can be restarted or deleted while a cell runs (the cell ends with an error).

use super::protocol::{self, Language, WorkerMsg};
use super::worker::{SpawnSpec, Worker, WorkerError, WorkerEvent};
use bytes::Bytes;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;

/// How long an interrupted cell may take to stop before its worker is killed (state is lost).
const INTERRUPT_GRACE: Duration = Duration::from_secs(3);

/// One context.
pub struct Context {
    pub id: String,
    pub language: Language,
    pub cwd: PathBuf,
    /// The worker, held by the running cell; `None` until started or after it died.
    slot: tokio::sync::Mutex<Option<Worker>>,
    /// The current worker's pid, readable without waiting for a running cell.
    pid: AtomicI32,
}

impl Context {
    pub fn to_json(&self) -> Value {
        json!({"id": self.id, "language": self.language.as_str(), "cwd": self.cwd.display().to_string()})
    }

    /// Kills the worker now, even mid-cell (the cell then reports an error).
    fn kill_now(&self) {
        let pid = self.pid.swap(0, Ordering::SeqCst);
        super::worker::kill_group(pid);
    }

    /// Starts the worker unless one is running (used to pre-start).
    pub async fn ensure_started(&self, spec: &SpawnSpec) -> Result<(), WorkerError> {
        let mut slot = self.slot.lock().await;
        self.ensure_in(&mut slot, spec).map(|_| ())
    }

    /// Like `ensure_started`, and waits until the worker has said it is ready.
    pub async fn ensure_ready(
        &self,
        spec: &SpawnSpec,
        timeout: std::time::Duration,
    ) -> Result<(), WorkerError> {
        let mut slot = self.slot.lock().await;
        self.ensure_in(&mut slot, spec)?.wait_ready(timeout).await
    }

    fn ensure_in<'a>(
        &self,
        slot: &'a mut Option<Worker>,
        spec: &SpawnSpec,
    ) -> Result<&'a mut Worker, WorkerError> {
        if let Some(w) = slot.as_mut() {
            w.drain_stale();
        }
        if slot.as_ref().is_none_or(|w| w.is_dead()) {
            let mut spec = spec.clone();
            spec.cwd = self.cwd.clone();
            spec.env.insert(
                "CUBE_WORKER_LANG".into(),
                self.language.as_str().to_string(),
            );
            let w = Worker::spawn(&spec)?;
            self.pid.store(w.pid, Ordering::SeqCst);
            *slot = Some(w);
        }
        slot.as_mut()
            .ok_or_else(|| WorkerError::Gone("no worker".into()))
    }
}

/// All contexts of this sandbox.
pub struct Registry {
    contexts: Mutex<HashMap<String, Arc<Context>>>,
    defaults: Mutex<HashMap<Language, String>>,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

/// A random context id (32 hex digits, like a UUID without dashes).
fn new_id() -> String {
    let mut b = [0u8; 16];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        // No entropy syscall: time and a counter still give unique ids in one agent.
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let t = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        b[..8].copy_from_slice(&t.to_le_bytes());
        b[8..].copy_from_slice(&N.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Registry {
    pub fn new() -> Registry {
        Registry {
            contexts: Mutex::new(HashMap::new()),
            defaults: Mutex::new(HashMap::new()),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Context>>> {
        self.contexts.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn create(&self, language: Language, cwd: PathBuf) -> Arc<Context> {
        let ctx = Arc::new(Context {
            id: new_id(),
            language,
            cwd,
            slot: tokio::sync::Mutex::new(None),
            pid: AtomicI32::new(0),
        });
        self.map().insert(ctx.id.clone(), ctx.clone());
        ctx
    }

    pub fn get(&self, id: &str) -> Option<Arc<Context>> {
        self.map().get(id).cloned()
    }

    /// The default context of a language, created on first use.
    pub fn default_for(&self, language: Language, cwd: PathBuf) -> Arc<Context> {
        let mut d = self.defaults.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = d.get(&language).and_then(|id| self.get(id)) {
            return c;
        }
        let c = self.create(language, cwd);
        d.insert(language, c.id.clone());
        c
    }

    pub fn list(&self) -> Vec<Arc<Context>> {
        let mut v: Vec<_> = self.map().values().cloned().collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Removes a context and kills its worker. False if unknown.
    pub fn remove(&self, id: &str) -> bool {
        let Some(c) = self.map().remove(id) else {
            return false;
        };
        let mut d = self.defaults.lock().unwrap_or_else(|p| p.into_inner());
        d.retain(|_, v| v != id);
        c.kill_now();
        true
    }

    /// Kills the context's worker (interrupting a running cell) and starts a fresh one.
    pub async fn restart(&self, id: &str, spec: &SpawnSpec) -> Result<bool, WorkerError> {
        let Some(c) = self.get(id) else {
            return Ok(false);
        };
        c.kill_now();
        let mut slot = c.slot.lock().await;
        if let Some(mut w) = slot.take() {
            w.kill();
        }
        c.ensure_in(&mut slot, spec)?;
        Ok(true)
    }
}

/// One `POST /execute` cell: what to run and how.
pub struct Cell {
    pub code: String,
    pub env: HashMap<String, String>,
    pub call_env: HashMap<String, String>,
    /// Interval of keepalive lines while the cell is silent; `None` = never.
    pub keepalive: Option<Duration>,
}

fn now() -> String {
    crate::pjson::rfc3339(SystemTime::now())
}

/// Runs a cell in `ctx`, streaming NDJSON lines into `out`. Always ends with
/// `end_of_execution` (if the client is still there). A client that goes away interrupts the
/// cell; a cell that ignores the interrupt loses its worker.
pub async fn execute(ctx: Arc<Context>, spec: SpawnSpec, cell: Cell, out: mpsc::Sender<Bytes>) {
    let send = |v: Value| {
        let out = out.clone();
        async move {
            let _ = out.send(protocol::line(&v)).await;
        }
    };
    // One cell at a time per context; later ones queue here (E2B does the same).
    let mut slot = tokio::select! {
        s = ctx.slot.lock() => s,
        _ = out.closed() => return,
    };
    let worker = match ctx.ensure_in(&mut slot, &spec) {
        Ok(w) => w,
        Err(e) => {
            send(protocol::error_line("InterpreterError", &e.to_string(), "")).await;
            send(protocol::end_line()).await;
            return;
        }
    };
    let id = match worker
        .send_execute(&cell.code, &cell.env, &cell.call_env)
        .await
    {
        Ok(id) => id,
        Err(e) => {
            *slot = None;
            send(protocol::error_line(
                "UnexpectedEndOfExecution",
                &e.to_string(),
                "",
            ))
            .await;
            send(protocol::end_line()).await;
            return;
        }
    };
    let mut interrupted: Option<tokio::time::Instant> = None;
    let far = Duration::from_secs(365 * 86400);
    let mut last_sent = tokio::time::Instant::now();
    let mut kill = false;
    loop {
        let keepalive_at = cell.keepalive.map(|k| last_sent + k);
        tokio::select! {
            ev = worker.events.recv() => match ev.unwrap_or_else(|| WorkerEvent::Exited("the interpreter exited".into())) {
                WorkerEvent::Msg(Some(mid), msg) if mid == id => {
                    let line = match msg {
                        WorkerMsg::Count(n) => protocol::count_line(n),
                        WorkerMsg::Stream { stderr, text } => protocol::stream_line(stderr, &text, &now()),
                        WorkerMsg::Result { bundle, main } => protocol::result_line(&bundle, main),
                        WorkerMsg::Error { name, value, traceback } => protocol::error_line(&name, &value, &traceback),
                        WorkerMsg::Done => break,
                        WorkerMsg::Ready => continue,
                    };
                    send(line).await;
                    last_sent = tokio::time::Instant::now();
                }
                WorkerEvent::Msg(..) => {}
                WorkerEvent::Raw { stderr, text } => {
                    send(protocol::stream_line(stderr, &text, &now())).await;
                    last_sent = tokio::time::Instant::now();
                }
                WorkerEvent::Exited(why) => {
                    worker.mark_dead();
                    send(protocol::error_line(
                        "UnexpectedEndOfExecution",
                        &format!("{why} (the context was restarted, or the code ended the interpreter); its state is lost"),
                        "",
                    )).await;
                    break;
                }
            },
            _ = out.closed(), if interrupted.is_none() => {
                tracing::info!(context = %ctx.id, "client went away: interrupting the cell");
                worker.interrupt();
                interrupted = Some(tokio::time::Instant::now() + INTERRUPT_GRACE);
            }
            _ = tokio::time::sleep_until(interrupted.unwrap_or(tokio::time::Instant::now() + far)), if interrupted.is_some() => {
                tracing::warn!(context = %ctx.id, "cell ignored the interrupt: killing its interpreter");
                kill = true;
                break;
            }
            _ = tokio::time::sleep_until(keepalive_at.unwrap_or(tokio::time::Instant::now() + far)), if keepalive_at.is_some() => {
                send(protocol::keepalive_line()).await;
                last_sent = tokio::time::Instant::now();
            }
        }
    }
    if kill {
        worker.kill();
        ctx.pid.store(0, Ordering::SeqCst);
        *slot = None;
        send(protocol::error_line(
            "UnexpectedEndOfExecution",
            "the cell did not stop when interrupted; its interpreter was killed",
            "",
        ))
        .await;
    } else if worker.is_dead() {
        // Its pid may be reused once reaped: restart/delete must not signal it any more.
        ctx.pid.store(0, Ordering::SeqCst);
        *slot = None;
    }
    send(protocol::end_line()).await;
}
