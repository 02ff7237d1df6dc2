//! What the node lends every runtime: its configuration, templates, cgroups, network, metrics,
//! sandbox directories and the pools of parts any runtime may use (network endpoints, disk
//! clones). A runtime holds an `Arc<Host>`; the node orchestrates over both.

use crate::cgroup::{Cgroups, Limits};
use crate::config::Config;
use crate::error::{internal, task, NodeError};
use crate::metrics::Metrics;
use crate::network::{Endpoint, GuestIdentity, Network};
use crate::sandbox::{Phase, SandboxPaths, SandboxState, Shape};
use crate::storage::CloneKind;
use crate::template::TemplateStore;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Pools of parts shared by the runtimes; each is refilled by the runtime that uses it.
#[derive(Default)]
pub struct SharedPools {
    pub net: Mutex<Vec<Endpoint>>,
    /// (template, build) → pre-cloned disk files.
    pub disks: Mutex<HashMap<(String, String), Vec<PathBuf>>>,
}

/// One pool's level: what `PoolLevels` and the `cube_pool_*` gauges report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolLevel {
    pub pool: String,
    pub template: String,
    pub ready: u32,
    pub target: u32,
}

pub struct Host {
    pub cfg: Config,
    pub templates: TemplateStore,
    pub cg: Cgroups,
    pub net: Network,
    pub metrics: Metrics,
    pub identity: GuestIdentity,
    pub storage_mode: CloneKind,
    pub sandboxes_dir: PathBuf,
    pub pool_disk_dir: PathBuf,
    pub pools: SharedPools,
    /// Wakes the refiller (a pool entry was taken).
    pub wake: tokio::sync::Notify,
    /// Until when the refiller leaves the pools alone (see [`Host::defer_refill`]).
    pub refill_hold: Mutex<Option<Instant>>,
    pub shutdown: tokio::sync::watch::Sender<bool>,
}

/// A fresh random resource key (cgroup, endpoint, pool directory).
pub fn new_key() -> String {
    let mut b = [0u8; 6];
    // SAFETY: getrandom into a local buffer.
    unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, b.len(), 0) };
    crate::state::hex(&b)
}

/// A reflink clone of a disk image, off the async threads.
pub async fn clone_disk(src: &Path, dst: &Path) -> Result<(), NodeError> {
    let (s, d) = (src.to_path_buf(), dst.to_path_buf());
    tokio::task::spawn_blocking(move || crate::storage::clone_file(&s, &d))
        .await
        .map_err(task)?
        .map(|_| ())
        .map_err(|e| NodeError::Internal(format!("cloning disk: {e}")))
}

impl Host {
    pub fn paths_for(&self, dirname: &str) -> SandboxPaths {
        SandboxPaths {
            dir: self.sandboxes_dir.join(dirname),
        }
    }

    pub fn save(&self, dirname: &str, st: &SandboxState) -> Result<(), NodeError> {
        crate::sandbox::save(&self.paths_for(dirname).state(), st)
            .map_err(|e| NodeError::Internal(e.to_string()))
    }

    pub fn shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// A create took a pooled entry: its replacement starts `pools.refill_delay_ms` later,
    /// so that the start (runsc: about half a second of CPU) does not compete with the rest of
    /// that create's path (its /init, the master's records, the API's answer). Creates during
    /// the hold do not extend it, so a stream of creates cannot keep the pool from refilling.
    pub fn defer_refill(&self) {
        let delay = Duration::from_millis(self.cfg.pools.refill_delay_ms);
        if !delay.is_zero() {
            let now = Instant::now();
            let mut hold = self.refill_hold.lock().unwrap_or_else(|p| p.into_inner());
            if hold.is_none_or(|until| until <= now) {
                *hold = Some(now + delay);
            }
        }
        // The refiller sleeps until the hold ends (see `refill_hold_left`).
        self.wake.notify_one();
    }

    /// How long pool refills are still held (None: not held; an expired hold is cleared).
    pub fn refill_hold_left(&self) -> Option<Duration> {
        let mut hold = self.refill_hold.lock().unwrap_or_else(|p| p.into_inner());
        let left = hold.and_then(|until| until.checked_duration_since(Instant::now()));
        if left.is_none() {
            *hold = None;
        }
        left.filter(|l| !l.is_zero())
    }

    /// Records one phase of a create in `cube_create_phase_seconds{phase}`.
    pub fn phase(&self, name: &str, d: Duration) {
        self.metrics
            .create_phase
            .with_label_values(&[name])
            .observe(d.as_secs_f64());
    }

    /// The cgroup limits of a shape (`extra_mib` on top of its memory: a VMM's own).
    pub fn limits(&self, s: Shape, extra_mib: u64) -> Limits {
        Limits {
            vcpus: s.vcpus,
            memory_mib: s.memory_mib + extra_mib,
            pids: self.cfg.sandbox.pids_max,
        }
    }

    /// The agent of a sandbox: at its host address when the switch gave it one, else (no
    /// switch) at the fixed guest address through its host interface.
    pub fn agent(
        &self,
        ep: &Endpoint,
        host_addr: Option<std::net::Ipv4Addr>,
    ) -> crate::agent::AgentClient {
        match host_addr {
            Some(a) => crate::agent::AgentClient::new(a, self.cfg.sandbox.agent_port, None),
            None => crate::agent::AgentClient::new(
                self.identity.guest_ip,
                self.cfg.sandbox.agent_port,
                Some(&ep.host_if),
            ),
        }
    }

    /// A disk for a sandbox: a pre-cloned one when the pool has it, else a clone now; grown
    /// to `disk_mib` when that is larger than the image.
    pub async fn prepare_disk(
        &self,
        template: &str,
        build: &str,
        rootfs: &Path,
        dst: &Path,
        disk_mib: u64,
    ) -> Result<(), NodeError> {
        let pooled = self.pools.disks.lock().ok().and_then(|mut d| {
            d.get_mut(&(template.to_string(), build.to_string()))
                .and_then(|v| v.pop())
        });
        let mut done = false;
        if let Some(p) = pooled {
            done = std::fs::rename(&p, dst).is_ok();
            self.wake.notify_one();
        }
        if !done {
            clone_disk(rootfs, dst).await?;
        }
        let len = std::fs::metadata(dst).map(|m| m.len()).unwrap_or(0);
        if disk_mib << 20 > len {
            let d = dst.to_path_buf();
            tokio::task::spawn_blocking(move || -> Result<(), String> {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&d)
                    .map_err(|e| e.to_string())?;
                f.set_len(disk_mib << 20).map_err(|e| e.to_string())?;
                let out = std::process::Command::new("resize2fs")
                    .arg("-f")
                    .arg(&d)
                    .output()
                    .map_err(|e| format!("resize2fs: {e}"))?;
                if !out.status.success() {
                    return Err(format!(
                        "resize2fs: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    ));
                }
                Ok(())
            })
            .await
            .map_err(task)?
            .map_err(internal("growing disk"))?;
        }
        Ok(())
    }

    /// A pooled network endpoint that is still whole, or None. One whose namespace file or
    /// host link went away while it waited is deleted, counted, and never handed out.
    pub async fn pooled_endpoint(&self) -> Option<Endpoint> {
        loop {
            let ep = self.pools.net.lock().ok().and_then(|mut v| v.pop())?;
            self.wake.notify_one();
            if Network::intact(&ep) {
                return Some(ep);
            }
            tracing::warn!(host_if = %ep.host_if, netns = %ep.netns_path.display(), "pooled endpoint lost its namespace or link; deleting it");
            self.metrics
                .operations
                .with_label_values(&["pool_endpoint", "discarded"])
                .inc();
            self.net.destroy(&ep).await;
        }
    }

    /// A network endpoint: a pooled one, else a new one.
    pub async fn take_endpoint(&self) -> Result<Endpoint, NodeError> {
        if let Some(ep) = self.pooled_endpoint().await {
            return Ok(ep);
        }
        self.net
            .create(&new_key())
            .await
            .map_err(|e| NodeError::Internal(format!("network endpoint: {e}")))
    }

    /// Releases what every sandbox may hold beyond its runtime's parts: its endpoint (back in
    /// the pool when `reusable` and there is room) and its directory. Never fails.
    pub async fn release_rest(&self, dirname: &str, st: &SandboxState, reusable: bool) {
        if let Some(ep) = &st.endpoint {
            // A sandbox that ran has a fully wired endpoint, and with every process of it gone
            // nothing holds the namespace: reuse it rather than pay for deleting and creating.
            let reusable = reusable && st.phase != Phase::Creating && ep.host_ifindex != 0;
            if !(reusable && self.recycle_endpoint(ep)) {
                self.net.destroy(ep).await;
            }
        }
        let dir = self.paths_for(dirname).dir;
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::error!(dir = %dir.display(), error = %e, "removing sandbox directory");
            }
        }
    }

    /// Puts a dead sandbox's endpoint back in the network pool when there is room.
    fn recycle_endpoint(&self, ep: &Endpoint) -> bool {
        let cap = self.cfg.pools.network.max(self.cfg.pools.network_recycle) as usize;
        if self
            .pools
            .net
            .lock()
            .map(|v| v.len() >= cap)
            .unwrap_or(true)
        {
            return false;
        }
        if let Err(e) = self.net.hook().endpoint_recycled(ep) {
            tracing::warn!(host_if = %ep.host_if, error = %e, "endpoint not reusable; deleting it");
            return false;
        }
        match self.pools.net.lock() {
            Ok(mut v) => {
                v.push(ep.clone());
                true
            }
            Err(_) => false,
        }
    }

    /// Tops the network endpoint pool up to its target.
    pub async fn refill_network(&self) {
        while self.pools.net.lock().map(|v| v.len()).unwrap_or(usize::MAX)
            < self.cfg.pools.network as usize
        {
            match self.net.create(&new_key()).await {
                Ok(ep) => {
                    if let Ok(mut v) = self.pools.net.lock() {
                        v.push(ep)
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "network pool refill");
                    break;
                }
            }
            if self.shutting_down() {
                return;
            }
        }
    }

    /// Tops the disk pool of a template's current build up to its target, dropping disks of
    /// older builds.
    pub async fn refill_disks(&self, template: &str) {
        let Ok((m, rootfs)) = self.templates.get(template, None) else {
            return;
        };
        let k = (template.to_string(), m.build.clone());
        if let Ok(mut d) = self.pools.disks.lock() {
            d.retain(|(t, b), files| {
                if t == template && *b != m.build {
                    remove_files(files);
                    false
                } else {
                    true
                }
            });
        }
        while self
            .pools
            .disks
            .lock()
            .map(|d| d.get(&k).map(|v| v.len()).unwrap_or(0))
            .unwrap_or(usize::MAX)
            < self.cfg.pools.disks as usize
        {
            let dst = self
                .pool_disk_dir
                .join(format!("{template}-{}-{}.ext4", m.build, new_key()));
            let (s, d2) = (rootfs.clone(), dst.clone());
            match tokio::task::spawn_blocking(move || crate::storage::clone_file(&s, &d2)).await {
                Ok(Ok(_)) => {
                    if let Ok(mut d) = self.pools.disks.lock() {
                        d.entry(k.clone()).or_default().push(dst)
                    }
                }
                other => {
                    tracing::warn!(?other, "disk pool refill");
                    break;
                }
            }
        }
    }

    /// Drops pooled disks (of one template, or all) and, with `None`, pooled endpoints.
    pub async fn drain_pools(&self, template: Option<&str>) {
        if let Ok(mut d) = self.pools.disks.lock() {
            d.retain(|(t, _), files| {
                if template.is_none_or(|n| n == t) {
                    remove_files(files);
                    false
                } else {
                    true
                }
            });
        }
        if template.is_none() {
            let eps: Vec<Endpoint> = self
                .pools
                .net
                .lock()
                .map(|mut v| v.drain(..).collect())
                .unwrap_or_default();
            for ep in eps {
                self.net.destroy(&ep).await;
            }
        }
    }

    /// Levels of the shared pools.
    pub fn pool_levels(&self) -> Vec<PoolLevel> {
        let mut v = vec![PoolLevel {
            pool: "network".into(),
            template: String::new(),
            ready: self.pools.net.lock().map(|x| x.len() as u32).unwrap_or(0),
            target: self.cfg.pools.network,
        }];
        if let Ok(d) = self.pools.disks.lock() {
            for ((t, _), f) in d.iter() {
                v.push(PoolLevel {
                    pool: "disk".into(),
                    template: t.clone(),
                    ready: f.len() as u32,
                    target: self.cfg.pools.disks,
                });
            }
        }
        v
    }
}

fn remove_files(files: &[PathBuf]) {
    for f in files {
        let _ = std::fs::remove_file(f);
    }
}

/// Measures a future's wall time.
pub async fn timed<T>(f: impl std::future::Future<Output = T>) -> (T, Duration) {
    let t = Instant::now();
    let r = f.await;
    (r, t.elapsed())
}
