//! The node's operations on the `microvm` runtime (see [`crate::microvm`]): create from a warm
//! shim, pause to disk / resume, snapshot into a template, death detection, re-adoption.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cube_shim::protocol::{Reply, SandboxState as ShimState};
use cube_shim::Op;

use super::{new_key, CreateRequest, Node, NodeError, Phase, SandboxState};
use crate::config::Config;
use crate::microvm::{
    self, Guest, InitBody, InitResponder, MicroVmError, MicroVmState, ShimSpawner, SpawnedShim,
};
use crate::shim_pool::{Backoff, PoolKey, ShimPool};
use crate::tap_pool::TapPool;

/// How long one shim control call may take (pause-to-disk of a large guest is the slowest).
const SHIM_CALL: Duration = Duration::from_secs(60);
/// How long a fresh shim may take to answer.
const SHIM_START: Duration = Duration::from_secs(10);

/// The runtime's parts held by the node.
pub(crate) struct Parts {
    spawner: ShimSpawner,
    guest: Guest,
    pool: ShimPool,
    taps: TapPool,
    /// Shims this cubelet started (reaped when they exit; absent for re-adopted ones).
    children: Mutex<HashMap<String, std::process::Child>>,
    /// Init channels of live sandboxes, by sandbox id.
    responders: Mutex<HashMap<String, InitResponder>>,
    /// Serializes template snapshot builds.
    build_lock: tokio::sync::Mutex<()>,
    /// Templates whose pool refill (snapshot build or shim spawn) keeps failing.
    backoff: Backoff,
}

impl Parts {
    pub(crate) fn new(cfg: &Config) -> anyhow::Result<Parts> {
        use anyhow::Context;
        let shims_dir = cfg.run_dir.join("shims");
        let roots_dir = cfg.run_dir.join("shim-roots");
        for d in [&shims_dir, &roots_dir, &cfg.data_dir] {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        let abs = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        let spawner = ShimSpawner {
            binary: cfg.microvm.shim_binary.clone(),
            shims_dir: abs(&shims_dir),
            roots_dir: abs(&roots_dir),
            binds: vec![abs(&cfg.data_dir), abs(&shims_dir)],
            jail: cfg.microvm.jail,
            cgroup_root: cfg.cgroup.root.clone(),
            cgroup_parent: cfg.cgroup.parent.clone(),
            mem_overhead_mib: cfg.microvm.mem_overhead_mib,
        };
        Ok(Parts {
            spawner,
            guest: Guest::from_config(&cfg.microvm.guest),
            pool: ShimPool::default(),
            taps: TapPool::new(&cfg.run_dir.join("taps")).context("tap markers")?,
            children: Mutex::new(HashMap::new()),
            responders: Mutex::new(HashMap::new()),
            build_lock: tokio::sync::Mutex::new(()),
            backoff: Backoff::default(),
        })
    }
}

fn mvm_err(ctx: &str) -> impl FnOnce(MicroVmError) -> NodeError + '_ {
    move |e| match e {
        MicroVmError::Shim(ref c) if c.kind() == Some(cube_shim::ErrorKind::WrongState) => {
            NodeError::FailedPrecondition(format!("{ctx}: {e}"))
        }
        MicroVmError::Init(_) => NodeError::DeadlineExceeded(format!("{ctx}: {e}")),
        _ => NodeError::Internal(format!("{ctx}: {e}")),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, MicroVmError> + Send + 'static,
) -> Result<T, MicroVmError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| MicroVmError::Init(format!("task: {e}")))?
}

impl Node {
    fn parts(&self) -> Result<&Parts, NodeError> {
        self.mvm
            .as_ref()
            .ok_or_else(|| NodeError::Internal("the microvm runtime is not active".into()))
    }

    /// The template snapshot for a build and shape, built on first use.
    async fn ensure_snapshot(
        &self,
        rootfs: &Path,
        vcpus: u32,
        mem_mib: u64,
    ) -> Result<PathBuf, NodeError> {
        let p = self.parts()?;
        let build_dir = rootfs
            .parent()
            .ok_or_else(|| NodeError::Internal("template rootfs has no directory".into()))?;
        let dir = microvm::snapshot_dir(build_dir, vcpus, mem_mib);
        if dir.join("manifest.json").exists() {
            return Ok(dir);
        }
        let _g = p.build_lock.lock().await;
        if dir.join("manifest.json").exists() {
            return Ok(dir);
        }
        let (shim, guest, out, disk, mac) = (
            p.spawner.binary.clone(),
            p.guest.clone(),
            dir.clone(),
            rootfs.to_path_buf(),
            self.identity.guest_mac,
        );
        let t0 = Instant::now();
        blocking(move || {
            microvm::build_snapshot(&shim, &guest, &out, vcpus, mem_mib, Some(&disk), mac)
        })
        .await
        .map_err(mvm_err("template snapshot"))?;
        tracing::info!(dir = %dir.display(), ms = t0.elapsed().as_millis() as u64, "template snapshot built");
        Ok(dir)
    }

    /// Spawns a shim (cgroup with the shape's limits first) off the async threads.
    async fn spawn_shim(
        &self,
        vcpus: u32,
        mem_mib: u64,
        template: Option<PathBuf>,
    ) -> Result<SpawnedShim, NodeError> {
        let p = self.parts()?;
        let key = new_key();
        let (cg, limits, k) = (
            self.cg.clone(),
            crate::cgroup::Limits {
                vcpus,
                memory_mib: mem_mib + self.cfg.microvm.mem_overhead_mib,
                pids: self.launch.pids_max,
            },
            key.clone(),
        );
        let spawner = p.spawner.clone();
        let r = tokio::task::spawn_blocking(move || {
            cg.create(&k)
                .and_then(|_| cg.set_limits(&k, limits))
                .map_err(|e| MicroVmError::Spawn(format!("cgroup: {e}")))?;
            let r = spawner.spawn(&k, vcpus, mem_mib, template.as_deref(), SHIM_START);
            if r.is_err() {
                let _ = cg.destroy(&k);
                spawner.cleanup(&k);
            }
            r
        })
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))?;
        r.map_err(mvm_err("shim"))
    }

    /// Kills and forgets a shim that never became a sandbox.
    fn discard_shim(&self, mut s: SpawnedShim) {
        let _ = s.child.kill();
        let _ = s.child.wait();
        if let Err(e) = self.cg.destroy(&s.key) {
            tracing::warn!(key = %s.key, error = %e, "shim cgroup");
        }
        if let Ok(p) = self.parts() {
            p.spawner.cleanup(&s.key);
        }
    }

    pub(super) async fn create_microvm(
        self: &Arc<Self>,
        req: &CreateRequest,
        st: &mut SandboxState,
        rootfs: &Path,
        t0: Instant,
    ) -> Result<(), NodeError> {
        let p = self.parts()?;
        let paths = self.paths_for(&req.id);
        std::fs::create_dir(&paths.dir)
            .map_err(|e| NodeError::Internal(format!("creating {}: {e}", paths.dir.display())))?;
        self.save(&req.id, st)?;
        let (vcpus, mem) = (st.shape.vcpus, st.shape.memory_mib);
        let snap = self.ensure_snapshot(rootfs, vcpus, mem).await?;
        let key = PoolKey {
            snapshot: snap.clone(),
            vcpus,
            mem_mib: mem,
        };
        // The shim, the disk and the tap are independent: get them at once.
        let shim = async {
            let t = Instant::now();
            let (pooled, dead) = p.pool.take(&key);
            for d in dead {
                self.discard_shim(d);
            }
            let from_pool = pooled.is_some();
            let r = match pooled {
                Some(s) => {
                    self.pools.wake.notify_one();
                    Ok(s)
                }
                None => self.spawn_shim(vcpus, mem, Some(snap.clone())).await,
            };
            (r, from_pool, t.elapsed())
        };
        let linux = matches!(p.guest, Guest::Linux(_));
        let snap_disk = snap.join(microvm::SNAPSHOT_DISK);
        let disk = async {
            let t = Instant::now();
            let r = if snap_disk.exists() {
                // A Linux template's snapshot was taken with its own disk: clone that one (not
                // a pooled clone of the template's image, and never grown: the restored guest
                // has it mounted at this size).
                super::clone_disk(&snap_disk, &paths.disk()).await
            } else {
                self.prepare_disk(
                    &st.template,
                    &st.build,
                    rootfs,
                    &paths.disk(),
                    st.shape.disk_mib,
                )
                .await
            };
            (r, t.elapsed())
        };
        let policy = st.policy.clone();
        let tap = async {
            let t = Instant::now();
            let r = match p.taps.take() {
                // A Linux guest talks over its virtio-net: its tap joins the switch like a
                // veth's host end and gets the sandbox's host address.
                Ok(tap) if linux => match self.net.tap_endpoint(&tap).await {
                    Ok(ep) => match self.net.hook().apply_policy(&ep, &policy) {
                        Ok(addr) => Ok((tap, Some((ep, addr)))),
                        Err(e) => {
                            self.net.destroy(&ep).await;
                            p.taps.delete(&tap);
                            Err(format!("network policy: {e}"))
                        }
                    },
                    Err(e) => {
                        p.taps.delete(&tap);
                        Err(format!("tap endpoint: {e}"))
                    }
                },
                Ok(tap) => Ok((tap, None)),
                Err(e) => Err(e.to_string()),
            };
            (r, t.elapsed())
        };
        let ((shim_r, from_pool, shim_t), (disk_r, disk_t), (tap_r, tap_t)) =
            tokio::join!(shim, disk, tap);
        self.phase("shim", shim_t);
        self.phase("disk", disk_t);
        self.phase("tap", tap_t);
        let vsock = paths.dir.join("v.sock");
        let body = InitBody {
            env_vars: req.env_vars.clone(),
            access_token: Some(req.access_token.clone()).filter(|t| !t.is_empty()),
            default_user: if req.default_user.is_empty() {
                "user".into()
            } else {
                req.default_user.clone()
            },
            default_workdir: req.default_workdir.clone(),
        };
        let mut mv = MicroVmState {
            socket: PathBuf::new(),
            jail_root: None,
            snapshot: snap.clone(),
            tap: tap_r.as_ref().ok().map(|(t, _)| t.clone()),
            vsock: vsock.clone(),
            init: body.clone(),
            ..Default::default()
        };
        // Record what we hold before failing on anything, so that cleanup releases it.
        if let Ok(s) = &shim_r {
            st.key = s.key.clone();
            st.pid = s.pid;
            st.pid_start = s.pid_start;
            mv.socket = s.socket.clone();
            mv.jail_root = s.jail_root.clone();
        }
        st.microvm = Some(mv);
        st.from_pool = from_pool;
        if let Ok((_, Some((ep, addr)))) = &tap_r {
            st.endpoint = Some(ep.clone());
            st.host_addr = *addr;
        }
        let shim = match shim_r {
            Ok(s) => s,
            Err(e) => {
                let _ = self.save(&req.id, st);
                return Err(e);
            }
        };
        if let Ok(mut c) = p.children.lock() {
            c.insert(shim.key.clone(), shim.child);
        }
        self.save(&req.id, st)?;
        disk_r?;
        let (tap, _) = tap_r.map_err(|e| NodeError::Internal(format!("tap: {e}")))?;
        let _ = std::os::unix::fs::symlink(&shim.socket, paths.dir.join("shim.sock"));
        let responder = InitResponder::start(&vsock, body).map_err(mvm_err("init channel"))?;
        let tr = Instant::now();
        let (socket, disk_path) = (shim.socket.clone(), paths.disk());
        let restored = blocking(move || {
            microvm::call(
                &socket,
                Op::Restore {
                    snapshot: snap,
                    disk: Some(disk_path),
                    tap: Some(tap),
                    vsock: Some(vsock),
                },
                SHIM_CALL,
            )
        })
        .await
        .map_err(mvm_err("restore"))?;
        self.phase("restore", tr.elapsed());
        tracing::debug!(id = %req.id, ?restored, "restored");
        let timeout = Duration::from_millis(u64::from(if req.ready_timeout_ms == 0 {
            self.cfg.sandbox.ready_timeout_ms
        } else {
            req.ready_timeout_ms
        }));
        let ti = Instant::now();
        let (responder, ack) = tokio::task::spawn_blocking(move || {
            let r = responder.wait_ack(timeout);
            (responder, r)
        })
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))?;
        ack.map_err(mvm_err(&format!("sandbox {}", req.id)))?;
        self.phase("init", ti.elapsed());
        if let Ok(mut r) = p.responders.lock() {
            r.insert(req.id.clone(), responder);
        }
        if let Some(m) = st.microvm.as_mut() {
            m.inits += 1;
        }
        st.phase = Phase::Running;
        st.create_latency_us = t0.elapsed().as_micros() as u64;
        self.save(&req.id, st)?;
        self.phase("total", t0.elapsed());
        self.metrics
            .create_seconds
            .with_label_values(&[if from_pool { "true" } else { "false" }])
            .observe(t0.elapsed().as_secs_f64());
        tracing::info!(id = %req.id, template = %st.template, from_pool, latency_us = st.create_latency_us, "microvm sandbox ready");
        Ok(())
    }

    /// Pause = pause to disk (guest memory released, the shim stays as an empty process);
    /// resume = restore from that directory in the same shim, then a fresh init.
    pub(super) async fn pause_resume_microvm(
        &self,
        st: &mut SandboxState,
        pause: bool,
    ) -> Result<(), NodeError> {
        let p = self.parts()?;
        let id = st.id.clone();
        let want = if pause { Phase::Running } else { Phase::Paused };
        if st.phase != want {
            let why = match (pause, st.phase) {
                (true, Phase::Paused) => "is already paused".to_string(),
                (false, Phase::Running) => "is not paused".to_string(),
                (_, ph) => format!("is {ph:?}"),
            };
            return Err(NodeError::FailedPrecondition(format!("sandbox {id} {why}")));
        }
        let mv = st
            .microvm
            .clone()
            .ok_or_else(|| NodeError::Internal("not a microvm sandbox".into()))?;
        let dir = self.paths_for(&id).dir;
        if pause {
            let pdir = dir.join(format!("pause-{}", mv.inits));
            let _ = std::fs::remove_dir_all(&pdir);
            let (socket, d2, standin) =
                (mv.socket.clone(), pdir.clone(), p.guest == Guest::Standin);
            blocking(move || {
                if standin {
                    microvm::wait_standin_idle(&socket, Duration::from_secs(10))?;
                }
                microvm::call(&socket, Op::PauseToDisk { dir: d2 }, SHIM_CALL)
            })
            .await
            .map_err(mvm_err("pause to disk"))?;
            if let Some(m) = st.microvm.as_mut() {
                m.paused_dir = Some(pdir);
            }
            st.phase = Phase::Paused;
            self.save(&id, st)?;
            return Ok(());
        }
        let pdir = mv
            .paused_dir
            .clone()
            .ok_or_else(|| NodeError::Internal(format!("sandbox {id} has no pause directory")))?;
        // The guest asks for a fresh init (clock, entropy) as soon as it runs again.
        let responder = match p.responders.lock().ok().and_then(|mut r| r.remove(&id)) {
            Some(r) => r,
            None => {
                InitResponder::start(&mv.vsock, mv.init.clone()).map_err(mvm_err("init channel"))?
            }
        };
        responder.drain();
        let (socket, d2, disk, tap, vsock) = (
            mv.socket.clone(),
            pdir.clone(),
            self.paths_for(&id).disk(),
            mv.tap.clone(),
            mv.vsock.clone(),
        );
        let r = blocking(move || {
            microvm::call(
                &socket,
                Op::Resume {
                    dir: Some(d2),
                    disk: Some(disk),
                    tap,
                    vsock: Some(vsock),
                },
                SHIM_CALL,
            )
        })
        .await;
        let timeout = Duration::from_millis(u64::from(self.cfg.sandbox.ready_timeout_ms));
        let (responder, ack) = tokio::task::spawn_blocking(move || {
            let a = r.and_then(|_| responder.wait_ack(timeout));
            (responder, a)
        })
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))?;
        if let Ok(mut m) = p.responders.lock() {
            m.insert(id.clone(), responder);
        }
        ack.map_err(mvm_err("resume"))?;
        if let Some(m) = st.microvm.as_mut() {
            m.paused_dir = None;
            m.inits += 1;
        }
        st.phase = Phase::Running;
        self.save(&id, st)?;
        // Older pause directories are no longer mapped by anything.
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().to_string();
                if n.starts_with("pause-") && e.path() != pdir {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        Ok(())
    }

    /// SnapshotSandbox on microvm: memory + devices + disk of the sandbox become a template
    /// build; creating from it forks the sandbox (each copy gets its own init).
    pub(super) async fn snapshot_microvm(
        &self,
        st: &SandboxState,
        template: &str,
    ) -> Result<(crate::template::Manifest, bool), NodeError> {
        let mv = st
            .microvm
            .clone()
            .ok_or_else(|| NodeError::Internal("not a microvm sandbox".into()))?;
        if st.phase != Phase::Running {
            return Err(NodeError::FailedPrecondition(format!(
                "sandbox {} is {:?}: resume it before taking a snapshot",
                st.id, st.phase
            )));
        }
        let staging = self.templates.dir().join(".staging");
        std::fs::create_dir_all(&staging).map_err(|e| NodeError::Internal(e.to_string()))?;
        let tag = new_key();
        let disk_tmp = staging.join(format!("snap-{}-{tag}.ext4", st.id));
        let mem_tmp = staging.join(format!("snap-{}-{tag}.mem", st.id));
        let (socket, disk, d2, m2) = (
            mv.socket.clone(),
            self.paths_for(&st.id).disk(),
            disk_tmp.clone(),
            mem_tmp.clone(),
        );
        let standin = self.parts()?.guest == Guest::Standin;
        // Paused while the disk is cloned and the memory written: both from the same instant.
        let r = blocking(move || {
            if standin {
                microvm::wait_standin_idle(&socket, Duration::from_secs(10))?;
            }
            microvm::call(&socket, Op::Pause, SHIM_CALL)?;
            let r = crate::storage::clone_file(&disk, &d2)
                .map_err(|e| MicroVmError::Build(format!("clone disk: {e}")))
                .and_then(|_| microvm::call(&socket, Op::Snapshot { dir: m2 }, SHIM_CALL));
            let resumed = microvm::call(
                &socket,
                Op::Resume {
                    dir: None,
                    disk: None,
                    tap: None,
                    vsock: None,
                },
                SHIM_CALL,
            );
            r?;
            resumed
        })
        .await;
        if let Err(e) = r {
            let _ = std::fs::remove_file(&disk_tmp);
            let _ = std::fs::remove_dir_all(&mem_tmp);
            return Err(mvm_err("snapshot")(e));
        }
        let store = self.templates.clone();
        let (t, sid, dt) = (template.to_string(), st.id.clone(), disk_tmp.clone());
        let built = tokio::task::spawn_blocking(move || {
            store.build(
                &t,
                &crate::template::Source::Snapshot {
                    sandbox_id: sid,
                    disk: dt,
                },
                0,
                &|_| {},
            )
        })
        .await
        .map_err(|e| NodeError::Internal(e.to_string()));
        let _ = std::fs::remove_file(&disk_tmp);
        let (m, reused) = match built {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => {
                let _ = std::fs::remove_dir_all(&mem_tmp);
                return Err(e.into());
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&mem_tmp);
                return Err(e);
            }
        };
        let (_, rootfs) = self.templates.get(&m.name, Some(&m.build))?;
        let build_dir = rootfs
            .parent()
            .ok_or_else(|| NodeError::Internal("template rootfs has no directory".into()))?;
        let out = microvm::snapshot_dir(build_dir, st.shape.vcpus, st.shape.memory_mib);
        // Replace (a reused build has the same disk but a different memory image); sandboxes
        // restored from the old one keep its files mapped.
        if out.exists() {
            let old = out.with_extension(format!("old-{tag}"));
            std::fs::rename(&out, &old)
                .map_err(|e| NodeError::Internal(format!("replace snapshot: {e}")))?;
            let _ = std::fs::remove_dir_all(&old);
        }
        std::fs::rename(&mem_tmp, &out)
            .map_err(|e| NodeError::Internal(format!("install snapshot: {e}")))?;
        // Warm shims prepared for a replaced snapshot would restore stale memory.
        for s in self.parts()?.pool.drain(Some(&out)) {
            self.discard_shim(s);
        }
        tracing::info!(sandbox = %st.id, template = %m.name, build = %m.build, "microvm snapshot is a template");
        Ok((m, reused))
    }

    /// Releases a microVM sandbox's parts beyond its cgroup (killed by `destroy`) and directory.
    pub(super) fn release_microvm(&self, st: &SandboxState) {
        let Some(mv) = &st.microvm else { return };
        let Ok(p) = self.parts() else { return };
        if let Ok(mut r) = p.responders.lock() {
            r.remove(&st.id);
        }
        // `destroy` already killed and reaped the shim (by pid, with its start time checked):
        // dropping the handle neither signals nor waits, so a reused pid is never touched.
        drop(p.children.lock().ok().and_then(|mut c| c.remove(&st.key)));
        if let Some(t) = &mv.tap {
            p.taps.delete(t);
        }
        if !st.key.is_empty() {
            p.spawner.cleanup(&st.key);
        }
    }

    /// At restart: whether a live microVM sandbox's shim still answers (then its init channel
    /// is served again).
    pub(super) fn readopt_microvm(&self, st: &SandboxState) -> bool {
        let (Some(mv), Ok(p)) = (&st.microvm, self.parts()) else {
            return false;
        };
        match microvm::call(&mv.socket, Op::Ping, Duration::from_secs(5)) {
            Ok(Reply::Pong { pid, .. }) if pid as i32 == st.pid => {}
            other => {
                tracing::warn!(id = %st.id, ?other, "shim of a microvm sandbox does not answer; reaping it");
                return false;
            }
        }
        match InitResponder::start(&mv.vsock, mv.init.clone()) {
            Ok(r) => {
                if let Ok(mut m) = p.responders.lock() {
                    m.insert(st.id.clone(), r);
                }
                true
            }
            Err(e) => {
                tracing::warn!(id = %st.id, error = %e, "init channel of a re-adopted sandbox");
                false
            }
        }
    }

    /// At restart: taps, sockets and jail roots nothing refers to any more.
    pub(super) async fn recover_microvm_leftovers(&self, keep_keys: &[String]) {
        let Ok(p) = self.parts() else { return };
        let entries: Vec<super::Entry> = self
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        let mut keep_taps = Vec::new();
        for e in entries {
            if let Some(t) = e.lock().await.microvm.as_ref().and_then(|m| m.tap.clone()) {
                keep_taps.push(t);
            }
        }
        p.taps.reap_except(&keep_taps);
        for d in [&p.spawner.shims_dir, &p.spawner.roots_dir] {
            let Ok(rd) = std::fs::read_dir(d) else {
                continue;
            };
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().to_string();
                let key = n.split('.').next().unwrap_or("").to_string();
                if !keep_keys.contains(&key) {
                    let _ = std::fs::remove_file(e.path());
                    let _ = std::fs::remove_dir(e.path());
                }
            }
        }
    }

    /// Detects shims that died: their sandbox becomes `Failed` (reported, kept until killed).
    pub(super) async fn check_shims(&self) {
        let Ok(p) = self.parts() else { return };
        // Reap exited children first (so they are not zombies counted as alive elsewhere).
        let mut exits: HashMap<String, String> = HashMap::new();
        if let Ok(mut c) = p.children.lock() {
            c.retain(|k, ch| match ch.try_wait() {
                Ok(Some(s)) => {
                    exits.insert(k.clone(), s.to_string());
                    false
                }
                _ => true,
            });
        }
        let entries: Vec<super::Entry> = self
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for e in entries {
            let Ok(mut st) = e.try_lock() else { continue };
            if st.microvm.is_none() || !matches!(st.phase, Phase::Running | Phase::Paused) {
                continue;
            }
            let dead =
                exits.contains_key(&st.key) || !crate::runtime::is_alive(st.pid, st.pid_start);
            if !dead {
                continue;
            }
            let why = exits
                .get(&st.key)
                .map(|s| format!("cube-shim exited: {s}"))
                .unwrap_or_else(|| "cube-shim is gone".into());
            tracing::error!(id = %st.id, pid = st.pid, reason = %why, "microvm sandbox failed");
            st.phase = Phase::Failed;
            if let Some(m) = st.microvm.as_mut() {
                m.failure = Some(why);
            }
            let id = st.id.clone();
            if let Err(e) = self.save(&id, &st) {
                tracing::error!(id, error = %e, "recording failure");
            }
            if let Ok(mut r) = p.responders.lock() {
                r.remove(&id);
            }
            self.metrics
                .operations
                .with_label_values(&["shim_died", "error"])
                .inc();
        }
    }

    /// Tops up warm shims (per template in `pools.started`), taps and disks.
    pub(super) async fn refill_microvm(self: &Arc<Self>) {
        let Ok(p) = self.parts() else { return };
        let taps = self.cfg.microvm.taps as usize;
        if let Err(e) = p.taps.refill(taps) {
            tracing::warn!(error = %e, "tap pool refill");
        }
        let (vcpus, mem) = (
            self.cfg.sandbox.default_vcpus,
            self.cfg.sandbox.default_memory_mib,
        );
        for (t, n) in self.cfg.pools.started.clone() {
            let Ok((m, rootfs)) = self.templates.get(&t, None) else {
                continue;
            };
            // Pre-cloned disks for this template (same pool as the namespace runtime's), unless
            // its snapshot has a disk of its own, which creates clone instead.
            let own_disk = rootfs.parent().is_some_and(|b| {
                microvm::snapshot_dir(b, vcpus, mem)
                    .join(microvm::SNAPSHOT_DISK)
                    .exists()
            });
            while !own_disk
                && self
                    .pools
                    .disks
                    .lock()
                    .map(|d| {
                        d.get(&(t.clone(), m.build.clone()))
                            .map(|v| v.len())
                            .unwrap_or(0)
                    })
                    .unwrap_or(usize::MAX)
                    < self.cfg.pools.disks as usize
            {
                let dst = self
                    .pool_disk_dir
                    .join(format!("{t}-{}-{}.ext4", m.build, new_key()));
                let (s, d2) = (rootfs.clone(), dst.clone());
                match tokio::task::spawn_blocking(move || crate::storage::clone_file(&s, &d2)).await
                {
                    Ok(Ok(_)) => {
                        if let Ok(mut d) = self.pools.disks.lock() {
                            d.entry((t.clone(), m.build.clone())).or_default().push(dst)
                        }
                    }
                    other => {
                        tracing::warn!(?other, "disk pool refill");
                        break;
                    }
                }
            }
            if !p.backoff.ready(&t, Instant::now()) {
                continue;
            }
            let snap = match self.ensure_snapshot(&rootfs, vcpus, mem).await {
                Ok(s) => s,
                Err(e) => {
                    let wait = p.backoff.failed(&t, Instant::now());
                    tracing::warn!(template = %t, error = %e, retry_in_ms = wait.as_millis() as u64, "shim pool: template snapshot");
                    continue;
                }
            };
            let key = PoolKey {
                snapshot: snap.clone(),
                vcpus,
                mem_mib: mem,
            };
            let mut failed = false;
            while p.pool.level(&key) < n as usize {
                if *self.shutdown.borrow() {
                    return;
                }
                match self.spawn_shim(vcpus, mem, Some(snap.clone())).await {
                    Ok(s) => p.pool.put(key.clone(), s),
                    Err(e) => {
                        let wait = p.backoff.failed(&t, Instant::now());
                        tracing::warn!(template = %t, error = %e, retry_in_ms = wait.as_millis() as u64, "shim pool refill");
                        failed = true;
                        break;
                    }
                }
            }
            if !failed {
                p.backoff.succeeded(&t);
            }
        }
    }

    /// Kills pooled shims (all, or those of templates under `under`).
    pub(super) fn drain_microvm_pools(&self, under: Option<&Path>) {
        let Ok(p) = self.parts() else { return };
        for s in p.pool.drain(under) {
            self.discard_shim(s);
        }
        if under.is_none() {
            p.taps.reap_except(&self.live_taps());
        }
    }

    fn live_taps(&self) -> Vec<String> {
        self.registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter_map(|e| {
                e.try_lock()
                    .ok()
                    .and_then(|s| s.microvm.as_ref().and_then(|m| m.tap.clone()))
            })
            .collect()
    }

    pub(super) fn microvm_pool_levels(&self) -> Vec<(String, String, u32, u32)> {
        let Ok(p) = self.parts() else {
            return Vec::new();
        };
        let mut v = vec![(
            "tap".to_string(),
            String::new(),
            p.taps.level() as u32,
            self.cfg.microvm.taps,
        )];
        for (k, n) in p.pool.levels() {
            // templates/<t>/<build>/microvm-…: name the template.
            let t = k
                .snapshot
                .parent()
                .and_then(|b| b.parent())
                .and_then(|t| t.file_name())
                .map(|s| s.to_string_lossy().to_string())
                .unwrap_or_default();
            let target = self.cfg.pools.started.get(&t).copied().unwrap_or(0);
            v.push(("shim".into(), t, n as u32, target));
        }
        v
    }

    /// Shim-side view of a microVM sandbox (stats, for SandboxStats and tests).
    pub async fn microvm_stats(
        &self,
        id: &str,
    ) -> Result<(ShimState, cube_shim::protocol::Stats), NodeError> {
        let st = self.get(id).await?;
        let mv = st.microvm.ok_or_else(|| {
            NodeError::FailedPrecondition(format!("sandbox {id} is not a microVM"))
        })?;
        match blocking(move || microvm::call(&mv.socket, Op::Stats, SHIM_CALL))
            .await
            .map_err(mvm_err("stats"))?
        {
            Reply::Stats { state, stats, .. } => Ok((state, stats)),
            other => Err(NodeError::Internal(format!(
                "unexpected shim reply {other:?}"
            ))),
        }
    }
}
