//! Sandboxes that are a process tree on the host: a reflinked disk, a cgroup with the shape's
//! limits and a network namespace on cube-vs, with PID 1 started by a [`Launcher`]: Linux
//! namespaces and seccomp (`namespace`) or a `runsc` sandbox (`gvisor`). Everything else is
//! the same for both and lives here: cold starts with the disk, endpoint and cgroup built at
//! once, the pre-started pool (`started.rs`), claiming a pooled sandbox, pause by freezing the
//! cgroup, snapshots (the filesystem, or with a launcher that can checkpoint, memory too:
//! creating from such a snapshot restores its processes), release and refill.

mod started;

use super::host::{new_key, timed, Host, PoolLevel};
use super::{CreateSpec, Created, Runtime, SnapshotKind};
use crate::cgroup::Cgroups;
use crate::error::{internal, task, NodeError};
use crate::network::Policy;
use crate::sandbox::{Phase, RuntimeState, SandboxPaths, SandboxState};
use crate::template::Source;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a container runtime starts and stops its sandboxes' PID 1. Blocking methods run off
/// the async threads.
pub trait Launcher: Send + Sync + 'static {
    /// The runtime's name.
    fn name(&self) -> &'static str;

    /// The runtime part of a new sandbox's state.
    fn new_state(&self) -> RuntimeState;

    /// Starts PID 1 of the sandbox `key` whose disk, cgroup (limits set) and network namespace
    /// exist; returns its host pid and start time. Blocking.
    fn launch(
        &self,
        cg: &Cgroups,
        key: &str,
        paths: &SandboxPaths,
        netns: &Path,
    ) -> Result<(i32, u64), String>;

    /// Flushes what the sandbox's processes wrote and the runtime still holds in memory to
    /// the disk's filesystem; called while the sandbox runs, before it is frozen. Blocking.
    fn flush(&self, _st: &SandboxState) -> Result<(), String> {
        Ok(())
    }

    /// Flushes the sandbox's filesystem to its disk image (the sandbox is frozen). Blocking.
    fn sync_fs(&self, st: &SandboxState, paths: &SandboxPaths) -> Result<(), String>;

    /// Releases what the launcher holds once every process of the sandbox is gone; with
    /// `keep_endpoint` the sandbox starts again on its endpoint later, which must then be as
    /// it was given. Blocking.
    fn cleanup(&self, _st: &SandboxState, _paths: &SandboxPaths, _keep_endpoint: bool) {}

    /// At restart: whether the launcher can take a live sandbox back.
    fn readopt(&self, _st: &SandboxState) -> bool {
        true
    }

    /// At restart: removes launcher leftovers no live sandbox refers to.
    fn reap_leftovers(&self, _live: &[SandboxState]) {}

    /// Whether PID 1 may start only once the sandbox's veth is wired (a user-space network
    /// stack takes the namespace's interface, addresses and routes when it starts).
    fn needs_wired_network(&self) -> bool {
        false
    }

    /// Whether a dead sandbox's network endpoint may serve another sandbox as it is.
    fn endpoint_reusable(&self) -> bool {
        true
    }

    /// What a snapshot keeps: with `Full`, [`Launcher::checkpoint`] and
    /// [`Launcher::restore`] work.
    fn snapshot_kind(&self) -> SnapshotKind {
        SnapshotKind::Filesystem
    }

    /// Saves the running sandbox's processes and memory into the directory `image`: stops
    /// them, saves, runs `stopped` (the disk is cloned there, so disk and memory are of one
    /// instant), and lets them run again. Blocking.
    fn checkpoint(
        &self,
        _st: &SandboxState,
        _image: &Path,
        _stopped: &mut dyn FnMut() -> Result<(), String>,
    ) -> Result<(), String> {
        Err(format!(
            "{} snapshots keep the filesystem only",
            self.name()
        ))
    }

    /// Whether pause saves the sandbox's processes and memory to an image and stops them
    /// ([`Launcher::checkpoint_and_stop`]; resume is a [`Launcher::restore`]) rather than
    /// freezing them in RAM.
    fn pauses_to_disk(&self) -> bool {
        false
    }

    /// Saves the running sandbox's processes and memory into the directory `image` and stops
    /// it, releasing everything of it but its disk, cgroup and network endpoint. Blocking.
    fn checkpoint_and_stop(&self, _st: &SandboxState, _image: &Path) -> Result<(), String> {
        Err(format!("{} sandboxes do not pause to disk", self.name()))
    }

    /// Like [`Launcher::launch`], but PID 1 and everything it ran continue from the
    /// checkpoint `image`. Blocking.
    fn restore(
        &self,
        _cg: &Cgroups,
        _key: &str,
        _paths: &SandboxPaths,
        _netns: &Path,
        _image: &Path,
    ) -> Result<(i32, u64), String> {
        Err(format!("{} cannot restore a checkpoint", self.name()))
    }
}

/// Where a sandbox paused to disk keeps its checkpoint: in its own directory.
const PAUSED_IMAGE: &str = "paused";

/// Where a template build made from a memory snapshot keeps its checkpoint: beside its rootfs.
pub fn checkpoint_dir(build_dir: &Path) -> std::path::PathBuf {
    build_dir.join("checkpoint")
}

/// The token the checkpointed agent holds (absent: none), in [`checkpoint_dir`].
const CHECKPOINT_TOKEN: &str = "agent-token";

/// Where the node's agent appears in every container sandbox: bind-mounted read-only on its
/// own `/run` (one host page cache for all sandboxes; no symlink in an image can redirect it).
pub const AGENT_PATH: &str = "/run/cube-agent";

/// The node's agent binary and the command line it runs with as a sandbox's PID 1.
pub fn agent_command(
    cfg: &crate::config::Config,
) -> anyhow::Result<(std::path::PathBuf, Vec<String>)> {
    use anyhow::Context;
    let host = cfg
        .agent_binary
        .canonicalize()
        .with_context(|| format!("agent binary {}", cfg.agent_binary.display()))?;
    let mut args = vec![
        "--addr".to_string(),
        format!("0.0.0.0:{}", cfg.sandbox.agent_port),
        "--init".into(),
        "auto".into(),
    ];
    args.extend(cfg.sandbox.agent_args.iter().cloned());
    Ok((host, args))
}

pub struct Container<L: Launcher> {
    host: Arc<Host>,
    launcher: Arc<L>,
    started: started::StartedPool,
}

impl<L: Launcher> Container<L> {
    pub fn new(host: Arc<Host>, launcher: L) -> Container<L> {
        Container {
            host,
            launcher: Arc::new(launcher),
            started: started::StartedPool::default(),
        }
    }

    /// Starts PID 1 of a sandbox whose disk, cgroup and namespace exist: afresh, or restored
    /// from the checkpoint `restore`.
    async fn launch(
        &self,
        st: &SandboxState,
        dirname: &str,
        netns: std::path::PathBuf,
        restore: Option<std::path::PathBuf>,
    ) -> (Result<(i32, u64), NodeError>, Duration) {
        let (launcher, cg, key, paths) = (
            self.launcher.clone(),
            self.host.cg.clone(),
            st.key.clone(),
            self.host.paths_for(dirname),
        );
        let t = Instant::now();
        let r = tokio::task::spawn_blocking(move || match restore {
            Some(image) => launcher.restore(&cg, &key, &paths, &netns, &image),
            None => launcher.launch(&cg, &key, &paths, &netns),
        })
        .await
        .map_err(task)
        .and_then(|r| r.map_err(|e| NodeError::Internal(format!("starting sandbox: {e}"))));
        (r, t.elapsed())
    }

    /// Builds a sandbox from scratch: disk, namespace, cgroup, then PID 1 (afresh or from the
    /// checkpoint `restore`) while the veth and the switch binding are wired, or after them
    /// when the launcher needs them.
    async fn cold_start(
        &self,
        spec: &CreateSpec,
        st: &mut SandboxState,
        restore: Option<std::path::PathBuf>,
    ) -> Result<(), NodeError> {
        let h = &self.host;
        let id = st.id.clone();
        let paths = h.paths_for(&id);
        std::fs::create_dir(&paths.dir)
            .map_err(|e| NodeError::Internal(format!("creating {}: {e}", paths.dir.display())))?;
        h.save(&id, st)?;
        // Disk clone, network endpoint and cgroup are independent: build them at once.
        let disk_path = paths.disk();
        let disk = timed(h.prepare_disk(
            &st.template,
            &st.build,
            &spec.rootfs,
            &disk_path,
            st.shape.disk_mib,
        ));
        // A pooled endpoint when there is one; else only the namespace now, and the veth
        // while the sandbox starts in it.
        let endpoint = timed(async {
            match h.pooled_endpoint().await {
                Some(ep) => Ok((ep, None)),
                None => {
                    let ep = h.net.endpoint_for(&new_key());
                    match h.net.create_netns_only(&ep).await {
                        Ok(nsh) => Ok((ep, Some(nsh))),
                        Err(e) => {
                            h.net.destroy(&ep).await;
                            Err(NodeError::Internal(format!("network namespace: {e}")))
                        }
                    }
                }
            }
        });
        let (cg, key, limits) = (h.cg.clone(), st.key.clone(), h.limits(st.shape, 0));
        let cgroup = timed(async move {
            tokio::task::spawn_blocking(move || {
                cg.create(&key)?;
                cg.set_limits(&key, limits)
            })
            .await
            .map_err(task)
            .and_then(|r| r.map_err(|e| NodeError::Internal(format!("cgroup: {e}"))))
        });
        let tp = Instant::now();
        let ((disk_r, disk_t), (ep_r, ep_t), (cg_r, cg_t)) = tokio::join!(disk, endpoint, cgroup);
        h.phase("disk", disk_t);
        h.phase("endpoint", ep_t);
        h.phase("cgroup", cg_t);
        h.phase("prepare", tp.elapsed());
        // Record the endpoint before failing on anything else, so cleanup releases it.
        if let Ok((ep, _)) = ep_r.as_ref() {
            st.endpoint = Some(ep.clone());
        }
        let (ep, nsh) = ep_r?;
        disk_r?;
        cg_r?;
        h.save(&id, st)?;
        let launch = self.launch(st, &id, ep.netns_path.clone(), restore);
        // The veth and the switch binding need only the namespace: build them while the
        // launcher runs (the agent listens on 0.0.0.0 and is reached only after this).
        let wire = async {
            let (wired, veth_t) = timed(async {
                match nsh {
                    Some(nsh) => h
                        .net
                        .wire_netns(ep, nsh)
                        .await
                        .map_err(|e| NodeError::Internal(format!("network endpoint: {e}"))),
                    None => Ok(ep),
                }
            })
            .await;
            h.phase("veth", veth_t);
            let tpol = Instant::now();
            let r = wired.and_then(|ep| {
                let addr = h
                    .net
                    .hook()
                    .apply_policy(&ep, &st.policy)
                    .map_err(internal("network policy"))?;
                Ok((ep, addr))
            });
            h.phase("policy", tpol.elapsed());
            r
        };
        let ((launched, launch_t), wired) = if self.launcher.needs_wired_network() {
            let wired = wire.await;
            if wired.is_err() {
                let _ = h.save(&id, st);
                return wired.map(|_| ());
            }
            (launch.await, wired)
        } else {
            tokio::join!(launch, wire)
        };
        h.phase("launch", launch_t);
        // Record the pid first: a network error must still kill the started sandbox.
        let (pid, start) = launched?;
        st.pid = pid;
        st.pid_start = start;
        match wired {
            Ok((ep, addr)) => {
                st.endpoint = Some(ep);
                st.host_addr = addr;
            }
            Err(e) => {
                let _ = h.save(&id, st);
                return Err(e);
            }
        }
        h.save(&id, st)?;
        let th = Instant::now();
        let ep = st
            .endpoint
            .as_ref()
            .ok_or_else(|| NodeError::Internal("sandbox has no network endpoint".into()))?;
        h.agent(ep, st.host_addr)
            .wait_healthy(spec.ready_timeout)
            .await
            .map_err(|e| {
                let log = std::fs::read_to_string(paths.log()).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(5).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                NodeError::DeadlineExceeded(format!(
                    "sandbox {id}: {e}; agent log: {}",
                    tail.join(" | ")
                ))
            })?;
        h.phase("healthy", th.elapsed());
        Ok(())
    }

    /// Takes over a pre-started sandbox: its directory, processes and endpoint become `st`'s,
    /// with `st`'s shape and policy.
    fn adopt_pooled(&self, p: SandboxState, st: &mut SandboxState) -> Result<(), NodeError> {
        let h = &self.host;
        let from = h.paths_for(&started::dirname(&p.key)).dir;
        let to = h.paths_for(&st.id).dir;
        std::fs::rename(&from, &to)
            .map_err(|e| NodeError::Internal(format!("claiming pooled sandbox: {e}")))?;
        st.key = p.key.clone();
        st.pid = p.pid;
        st.pid_start = p.pid_start;
        st.endpoint = p.endpoint.clone();
        st.host_addr = p.host_addr;
        h.save(&st.id, st)?;
        h.cg.set_limits(&st.key, h.limits(st.shape, 0))
            .map_err(|e| NodeError::Internal(e.to_string()))?;
        let ep = st
            .endpoint
            .clone()
            .ok_or_else(|| NodeError::Internal("sandbox has no network endpoint".into()))?;
        let addr = h
            .net
            .hook()
            .apply_policy(&ep, &st.policy)
            .map_err(internal("network policy"))?;
        if addr != st.host_addr {
            st.host_addr = addr;
            h.save(&st.id, st)?;
        }
        Ok(())
    }

    /// Releases a sandbox that never became the node's (a pool entry).
    async fn discard(&self, st: &SandboxState) {
        let reusable = self.release(st).await;
        self.host
            .release_rest(&started::dirname(&st.key), st, reusable)
            .await;
    }

    /// Freezes or thaws the sandbox's cgroup.
    async fn freeze(&self, st: &SandboxState, freeze: bool) -> Result<(), NodeError> {
        let (cg, key) = (self.host.cg.clone(), st.key.clone());
        tokio::task::spawn_blocking(move || cg.set_frozen(&key, freeze))
            .await
            .map_err(task)?
            .map_err(|e| NodeError::Internal(e.to_string()))
    }
}

#[async_trait::async_trait]
impl<L: Launcher> Runtime for Container<L> {
    fn name(&self) -> &'static str {
        self.launcher.name()
    }

    fn snapshot_kind(&self) -> SnapshotKind {
        self.launcher.snapshot_kind()
    }

    fn new_state(&self) -> RuntimeState {
        self.launcher.new_state()
    }

    async fn create(&self, spec: &CreateSpec, st: &mut SandboxState) -> Result<Created, NodeError> {
        let h = &self.host;
        let t0 = Instant::now();
        // A build made from a memory snapshot is restored, never taken from the pool.
        let restore = self.checkpoint_of(&spec.rootfs);
        let prior_token = restore.as_ref().and_then(|d| {
            std::fs::read_to_string(d.join(CHECKPOINT_TOKEN))
                .ok()
                .filter(|t| !t.is_empty())
        });
        // Pool entries have the template image's disk size: a larger disk starts cold.
        let pooled = if restore.is_none() && st.shape.disk_mib == spec.image_mib {
            self.started.claim(h, &st.template, &st.build).await
        } else {
            None
        };
        let from_pool = pooled.is_some();
        let claim_t = t0.elapsed();
        match pooled {
            Some(p) => self.adopt_pooled(p, st)?,
            None => self.cold_start(spec, st, restore).await?,
        }
        let adopt_t = t0.elapsed() - claim_t;
        let ep = st
            .endpoint
            .clone()
            .ok_or_else(|| NodeError::Internal("sandbox has no network endpoint".into()))?;
        let init = cube_init::HttpInit::of(
            &spec.init,
            prior_token.is_some(),
            std::time::SystemTime::now(),
        );
        let ti = Instant::now();
        h.agent(&ep, st.host_addr)
            .init_as(&init, prior_token.as_deref())
            .await
            .map_err(|e| NodeError::Internal(format!("sandbox {}: /init: {e}", st.id)))?;
        // Kept for a start afresh (a resume after a pause without memory).
        st.init = Some(spec.init.clone());
        if from_pool {
            h.phase("pool_claim", claim_t);
            h.phase("pool_adopt", adopt_t);
            h.phase("pool_init", ti.elapsed());
        } else {
            h.phase("init", ti.elapsed());
            h.phase("total", t0.elapsed());
        }
        Ok(Created { from_pool })
    }

    async fn pause(&self, st: &mut SandboxState, memory: bool) -> Result<(), NodeError> {
        if !memory {
            return self.stop(st, true).await;
        }
        if !self.launcher.pauses_to_disk() {
            return self.freeze(st, true).await;
        }
        self.pause_to_disk(st).await
    }

    async fn resume(&self, st: &mut SandboxState, reboot: bool) -> Result<(), NodeError> {
        if reboot || st.stopped {
            if !st.stopped {
                // Its memory goes: the saved image, or the frozen processes.
                if let Some(image) = st.runtime.paused_image().map(Path::to_path_buf) {
                    let _ = std::fs::remove_dir_all(&image);
                    st.runtime
                        .set_paused_image(None)
                        .map_err(NodeError::Internal)?;
                    st.stopped = true;
                } else {
                    self.stop(st, false).await?;
                }
            }
            return self.start_afresh(st).await;
        }
        match st.runtime.paused_image().map(Path::to_path_buf) {
            Some(image) => self.resume_from_disk(st, image).await,
            None => self.freeze(st, false).await,
        }
    }

    /// The filesystem is flushed and the disk cloned while the sandbox is stopped (frozen, or
    /// for a memory snapshot stopped and checkpointed by the launcher), then put back as it
    /// was. A memory snapshot's checkpoint goes beside the new build's rootfs.
    async fn snapshot(
        &self,
        st: &SandboxState,
        template: &str,
        agent_token: Option<&str>,
    ) -> Result<(crate::template::Manifest, bool), NodeError> {
        let h = &self.host;
        let was_running = st.phase == Phase::Running;
        let full = self.launcher.snapshot_kind() == SnapshotKind::Full;
        let staging = h.templates.dir().join(".staging");
        let tag = new_key();
        let tmp = staging.join(format!("snap-{}-{tag}.ext4", st.id));
        // A sandbox paused without memory has only its disk to give.
        let image = (full && !st.stopped).then(|| staging.join(format!("ckpt-{}-{tag}", st.id)));
        let (cg, key, disk, tmp2, launcher, paths, st2, image2) = (
            h.cg.clone(),
            st.key.clone(),
            h.paths_for(&st.id).disk(),
            tmp.clone(),
            self.launcher.clone(),
            h.paths_for(&st.id),
            st.clone(),
            image.clone(),
        );
        let token = agent_token.map(str::to_string);
        let paused_image = st.runtime.paused_image().map(Path::to_path_buf);
        let stopped = st.stopped;
        let r = tokio::task::spawn_blocking(move || -> Result<(), String> {
            // Paused without memory: the disk is all there is, and nothing runs.
            if stopped {
                return crate::storage::clone_file(&disk, &tmp2)
                    .map(|_| ())
                    .map_err(|e| e.to_string());
            }
            // Paused to disk: disk and image are of one instant already and nothing runs.
            if let (Some(from), Some(image)) = (&paused_image, &image2) {
                crate::storage::clone_file(&disk, &tmp2).map_err(|e| e.to_string())?;
                copy_private_dir(from, image)?;
                return write_private(
                    &image.join(CHECKPOINT_TOKEN),
                    token.as_deref().unwrap_or(""),
                );
            }
            // What the runtime caches is written out while the sandbox runs (a paused one is
            // thawed for it), then the sandbox is stopped while its disk is synced and cloned.
            if !was_running {
                cg.set_frozen(&key, false).map_err(|e| e.to_string())?;
            }
            let mut clone = || {
                launcher.sync_fs(&st2, &paths).and_then(|_| {
                    crate::storage::clone_file(&disk, &tmp2)
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                })
            };
            let r = launcher.flush(&st2).and_then(|_| match &image2 {
                Some(image) => {
                    use std::os::unix::fs::DirBuilderExt;
                    // The sandbox's memory: root's alone.
                    std::fs::DirBuilder::new()
                        .mode(0o700)
                        .create(image)
                        .map_err(|e| format!("{}: {e}", image.display()))?;
                    launcher.checkpoint(&st2, image, &mut clone)?;
                    write_private(
                        &image.join(CHECKPOINT_TOKEN),
                        token.as_deref().unwrap_or(""),
                    )
                }
                None => {
                    cg.set_frozen(&key, true).map_err(|e| e.to_string())?;
                    clone()
                }
            });
            cg.set_frozen(&key, !was_running)
                .map_err(|e| e.to_string())?;
            r
        })
        .await
        .map_err(task)
        .and_then(|r| r.map_err(internal("snapshot")));
        let cleanup = |image: &Option<std::path::PathBuf>| {
            let _ = std::fs::remove_file(&tmp);
            if let Some(i) = image {
                let _ = std::fs::remove_dir_all(i);
            }
        };
        if let Err(e) = r {
            cleanup(&image);
            return Err(e);
        }
        let store = h.templates.clone();
        let (t, sid, tmp3) = (template.to_string(), st.id.clone(), tmp.clone());
        let built = tokio::task::spawn_blocking(move || {
            store.build(
                &t,
                &Source::Snapshot {
                    sandbox_id: sid,
                    disk: tmp3,
                },
                0,
                &|_| {},
            )
        })
        .await
        .map_err(task)
        .and_then(|r| r.map_err(NodeError::from));
        let (m, reused) = match built {
            Ok(x) => x,
            Err(e) => {
                cleanup(&image);
                return Err(e);
            }
        };
        let _ = std::fs::remove_file(&tmp);
        if let Some(image) = image {
            if let Err(e) = self.install_checkpoint(&m, &image, &tag) {
                let _ = std::fs::remove_dir_all(&image);
                return Err(e);
            }
        }
        Ok((m, reused))
    }

    async fn release(&self, st: &SandboxState) -> bool {
        let killed = crate::runtime::process::kill_sandbox(&self.host.cg, st).await;
        let (launcher, st2, paths) = (
            self.launcher.clone(),
            st.clone(),
            self.host.paths_for(&st.id),
        );
        if let Err(e) =
            tokio::task::spawn_blocking(move || launcher.cleanup(&st2, &paths, false)).await
        {
            tracing::error!(id = %st.id, error = %e, "launcher cleanup task");
        }
        killed && self.launcher.endpoint_reusable()
    }

    fn readopt(&self, st: &SandboxState) -> bool {
        // Paused without memory: nothing of it runs for the launcher to find.
        st.stopped || self.launcher.readopt(st)
    }

    fn reap_leftovers(&self, live: &[SandboxState]) {
        self.launcher.reap_leftovers(live)
    }

    fn failure(&self, _st: &mut SandboxState) -> Option<String> {
        None
    }

    async fn refill(&self) {
        let h = &self.host;
        h.refill_network().await;
        if h.shutting_down() {
            return;
        }
        let mut tmpls: Vec<String> = h.cfg.pools.disk_templates.clone();
        tmpls.extend(h.cfg.pools.started.keys().cloned());
        tmpls.sort();
        tmpls.dedup();
        for t in &tmpls {
            h.refill_disks(t).await;
        }
        for (t, n) in h.cfg.pools.started.clone() {
            let Ok((m, rootfs)) = h.templates.get(&t, None) else {
                continue;
            };
            for p in self.started.stale(&t, &m.build) {
                self.discard(&p).await;
            }
            self.started
                .refill(h, &t, n as usize, || {
                    self.prestart(&t, &m.build, &rootfs, m.rootfs.bytes)
                })
                .await;
        }
    }

    fn pool_levels(&self) -> Vec<PoolLevel> {
        self.started.levels(&self.host.cfg.pools.started)
    }

    async fn drain_pools(&self, template: Option<&str>, _live: &[SandboxState]) {
        for p in self.started.drain(template) {
            self.discard(&p).await;
        }
    }

    async fn sample(
        &self,
        st: &SandboxState,
    ) -> Result<cube_proto::nodev1::SandboxStatsResponse, NodeError> {
        crate::stats::sample(&self.host, st)
    }
}

impl<L: Launcher> Container<L> {
    /// Ends every process of the sandbox (after flushing what its runtime caches, when
    /// `flush`: it runs) and keeps its disk, endpoint and an empty cgroup with its limits (for
    /// a start again, and the sampler). Its pid is 0 after.
    async fn end_processes(&self, st: &mut SandboxState, flush: bool) -> Result<(), NodeError> {
        let h = &self.host;
        let (launcher, cg, st2, paths, limits) = (
            self.launcher.clone(),
            h.cg.clone(),
            st.clone(),
            h.paths_for(&st.id),
            h.limits(st.shape, 0),
        );
        tokio::task::spawn_blocking(move || -> Result<(), String> {
            if flush {
                launcher.flush(&st2)?;
            }
            crate::runtime::process::kill(&cg, &st2.key, st2.pid, st2.pid_start)
                .map_err(|e| e.to_string())?;
            launcher.cleanup(&st2, &paths, true);
            cg.create(&st2.key)
                .and_then(|_| cg.set_limits(&st2.key, limits))
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(task)?
        .map_err(internal("stopping the sandbox"))?;
        st.pid = 0;
        st.pid_start = 0;
        Ok(())
    }

    /// Paused without memory (`st.stopped`): its processes end, and it starts afresh on
    /// resume.
    async fn stop(&self, st: &mut SandboxState, flush: bool) -> Result<(), NodeError> {
        self.end_processes(st, flush).await?;
        st.stopped = true;
        Ok(())
    }

    /// Starts PID 1 of a sandbox that has none again, afresh or from the checkpoint
    /// `restore`, on its own endpoint and cgroup, and waits for its agent. On failure its
    /// processes are ended again.
    async fn relaunch(
        &self,
        st: &mut SandboxState,
        restore: Option<std::path::PathBuf>,
    ) -> Result<crate::agent::AgentClient, NodeError> {
        let h = &self.host;
        let id = st.id.clone();
        let ep = st
            .endpoint
            .clone()
            .ok_or_else(|| NodeError::Internal("sandbox has no network endpoint".into()))?;
        let what = if restore.is_some() {
            "restore"
        } else {
            "restart"
        };
        let (r, t) = self.launch(st, &id, ep.netns_path.clone(), restore).await;
        h.phase(what, t);
        let (pid, start) = r?;
        st.pid = pid;
        st.pid_start = start;
        let timeout = Duration::from_millis(u64::from(h.cfg.sandbox.ready_timeout_ms));
        let agent = h.agent(&ep, st.host_addr);
        if let Err(e) = agent.wait_healthy(timeout).await {
            self.end_processes(st, false).await?;
            return Err(NodeError::Internal(format!(
                "sandbox {id}: {what}, but its agent did not answer: {e}"
            )));
        }
        Ok(agent)
    }

    /// Starts a stopped sandbox afresh from its disk and initialises its agent as at its
    /// create. On failure it stays stopped.
    async fn start_afresh(&self, st: &mut SandboxState) -> Result<(), NodeError> {
        let id = st.id.clone();
        let init = st.init.clone().ok_or_else(|| {
            NodeError::FailedPrecondition(format!(
                "sandbox {id} was created before its init was kept, so it cannot start afresh"
            ))
        })?;
        let agent = self.relaunch(st, None).await?;
        let init = cube_init::HttpInit::of(&init, false, std::time::SystemTime::now());
        if let Err(e) = agent.init_as(&init, None).await {
            self.end_processes(st, false).await?;
            return Err(NodeError::Internal(format!(
                "sandbox {id}: started afresh, but /init: {e}"
            )));
        }
        st.stopped = false;
        Ok(())
    }

    /// Saves the sandbox's processes and memory under its directory and stops it: it then
    /// holds its disk, cgroup and endpoint, and no host memory.
    async fn pause_to_disk(&self, st: &mut SandboxState) -> Result<(), NodeError> {
        let image = self.host.paths_for(&st.id).dir.join(PAUSED_IMAGE);
        let (launcher, st2, image2) = (self.launcher.clone(), st.clone(), image.clone());
        tokio::task::spawn_blocking(move || -> Result<(), String> {
            use std::os::unix::fs::DirBuilderExt;
            // What an earlier, failed pause left.
            let _ = std::fs::remove_dir_all(&image2);
            launcher.flush(&st2)?;
            // The sandbox's memory: root's alone.
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&image2)
                .map_err(|e| format!("{}: {e}", image2.display()))?;
            let r = launcher.checkpoint_and_stop(&st2, &image2);
            if r.is_err() {
                // A half-written image (the disk filled up) is no pause: the sandbox runs on.
                let _ = std::fs::remove_dir_all(&image2);
            }
            r
        })
        .await
        .map_err(task)?
        .map_err(internal("pause to disk"))?;
        // No host process is left: pid 0 is never signalled.
        st.pid = 0;
        st.pid_start = 0;
        st.runtime
            .set_paused_image(Some(image))
            .map_err(NodeError::Internal)
    }

    /// Restores a sandbox paused to disk with its processes. On failure the image is kept, so
    /// a resume can be tried again.
    async fn resume_from_disk(
        &self,
        st: &mut SandboxState,
        image: std::path::PathBuf,
    ) -> Result<(), NodeError> {
        self.relaunch(st, Some(image.clone())).await?;
        st.runtime
            .set_paused_image(None)
            .map_err(NodeError::Internal)?;
        let _ = std::fs::remove_dir_all(&image);
        Ok(())
    }

    /// The checkpoint of the template build whose rootfs is `rootfs`, when it has one and this
    /// launcher can restore it.
    fn checkpoint_of(&self, rootfs: &Path) -> Option<std::path::PathBuf> {
        if self.launcher.snapshot_kind() != SnapshotKind::Full {
            return None;
        }
        let dir = checkpoint_dir(rootfs.parent()?);
        dir.is_dir().then_some(dir)
    }

    /// Puts a snapshot's checkpoint beside its build's rootfs, replacing an older one (a
    /// reused build has the same disk but other memory).
    fn install_checkpoint(
        &self,
        m: &crate::template::Manifest,
        image: &Path,
        tag: &str,
    ) -> Result<(), NodeError> {
        let (_, rootfs) = self.host.templates.get(&m.name, Some(&m.build))?;
        let build_dir = rootfs
            .parent()
            .ok_or_else(|| NodeError::Internal("template rootfs has no directory".into()))?;
        crate::storage::replace_dir(image, &checkpoint_dir(build_dir), tag)
            .map_err(|e| NodeError::Internal(format!("install checkpoint: {e}")))?;
        tracing::info!(template = %m.name, build = %m.build, "memory snapshot installed");
        Ok(())
    }

    /// Starts a sandbox that waits in the pool, warm, for its /init.
    async fn prestart(
        &self,
        template: &str,
        build: &str,
        rootfs: &std::path::Path,
        bytes: u64,
    ) -> Result<SandboxState, NodeError> {
        let h = &self.host;
        let key = new_key();
        let dirname = started::dirname(&key);
        let paths = h.paths_for(&dirname);
        let shape = crate::sandbox::Shape {
            vcpus: h.cfg.sandbox.default_vcpus,
            memory_mib: h.cfg.sandbox.default_memory_mib,
            disk_mib: bytes.div_ceil(1 << 20),
        };
        let mut st = SandboxState {
            id: dirname.clone(),
            key: key.clone(),
            phase: Phase::Creating,
            template: template.into(),
            build: build.into(),
            shape,
            pid: 0,
            pid_start: 0,
            endpoint: None,
            metadata: Default::default(),
            policy: Policy::default(),
            created_at_ms: crate::template::now_ms(),
            create_latency_us: 0,
            from_pool: true,
            envd_version: String::new(),
            end_at_ms: 0,
            stopped: false,
            init: None,
            host_addr: None,
            runtime: self.launcher.new_state(),
        };
        let r: Result<(), NodeError> = async {
            std::fs::create_dir(&paths.dir).map_err(|e| NodeError::Internal(e.to_string()))?;
            h.save(&dirname, &st)?;
            h.prepare_disk(template, build, rootfs, &paths.disk(), 0)
                .await?;
            let ep = h.take_endpoint().await?;
            st.endpoint = Some(ep.clone());
            h.save(&dirname, &st)?;
            let (cg, k, limits) = (h.cg.clone(), key.clone(), h.limits(shape, 0));
            tokio::task::spawn_blocking(move || {
                cg.create(&k)?;
                cg.set_limits(&k, limits)
            })
            .await
            .map_err(task)?
            .map_err(|e| NodeError::Internal(format!("cgroup: {e}")))?;
            let (pid, start) = self
                .launch(&st, &dirname, ep.netns_path.clone(), None)
                .await
                .0?;
            st.pid = pid;
            st.pid_start = start;
            st.phase = Phase::Pooled;
            // Bound with the default (no internet) policy until a create claims it, so its
            // agent can be health-checked at its host address.
            st.host_addr = h
                .net
                .hook()
                .apply_policy(&ep, &Policy::default())
                .map_err(internal("network policy"))?;
            h.save(&dirname, &st)?;
            // Pooled only once warm (a code-interpreter template's Python worker is up), so the
            // create that takes it finds nothing left to start.
            h.agent(&ep, st.host_addr)
                .wait_warm(Duration::from_millis(u64::from(
                    h.cfg.sandbox.ready_timeout_ms,
                )))
                .await
                .map_err(|e| NodeError::DeadlineExceeded(e.to_string()))?;
            Ok(())
        }
        .await;
        match r {
            Ok(()) => Ok(st),
            Err(e) => {
                self.discard(&st).await;
                Err(e)
            }
        }
    }
}

/// Writes `text` to a new file only root can read (the checkpoint's memory holds the token
/// anyway, and it is as closed).
/// Copies the files of the directory `from` into the new directory `to` (root's alone),
/// sharing their blocks where the filesystem can.
fn copy_private_dir(from: &Path, to: &Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(to)
        .map_err(|e| format!("{}: {e}", to.display()))?;
    let rd = std::fs::read_dir(from).map_err(|e| format!("{}: {e}", from.display()))?;
    for e in rd {
        let e = e.map_err(|e| format!("{}: {e}", from.display()))?;
        if e.file_type().map(|t| t.is_file()).unwrap_or(false) {
            crate::storage::clone_file(&e.path(), &to.join(e.file_name()))
                .map_err(|err| format!("{}: {err}", e.path().display()))?;
        }
    }
    Ok(())
}

fn write_private(path: &Path, text: &str) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| format!("{}: {e}", path.display()))
}
