//! The `microvm` runtime: one cube-shim process per sandbox hosting a KVM microVM restored
//! from the template's memory snapshot (`shim.rs`): create from a warm shim (`shim_pool.rs`)
//! with a pooled tap (`tap_pool.rs`), pause to disk / resume, snapshot into a template (memory
//! included: creating from it forks the sandbox), death detection, re-adoption.

pub mod shim;
pub mod shim_pool;
pub mod tap_pool;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cube_shim::protocol::{Reply, SandboxState as ShimState};
use cube_shim::Op;

use super::host::{clone_disk, new_key, Host, PoolLevel};
use super::{CreateSpec, Created, Runtime, SnapshotKind};
use crate::error::NodeError;
use crate::sandbox::{MicroVmState, Phase, RuntimeState, SandboxState, MICROVM};
use shim::{Guest, InitResponder, MicroVmError, ShimSpawner, SpawnedShim};
use shim_pool::{Backoff, PoolKey, ShimPool};
use tap_pool::TapPool;

/// The shim module under the name the code below uses.
use shim as microvm;

/// How long one shim control call may take (pause-to-disk of a large guest is the slowest).
const SHIM_CALL: Duration = Duration::from_secs(60);
/// How long a fresh shim may take to answer.
const SHIM_START: Duration = Duration::from_secs(10);

/// Why a microVM cannot pause without memory or be rebooted on resume.
const NO_REBOOT: &str = "microvm sandboxes pause with their memory: a filesystem-only pause and \
     a reboot on resume (memory: false) are not implemented for microVMs";

pub struct Microvm {
    host: Arc<Host>,
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

impl Microvm {
    pub fn new(host: Arc<Host>) -> anyhow::Result<Microvm> {
        use anyhow::Context;
        let cfg = &host.cfg;
        let shims_dir = cfg.run_dir.join("shims");
        let roots_dir = cfg.run_dir.join("shim-roots");
        let work_dir = cfg.data_dir.join("shim-work");
        for d in [&shims_dir, &roots_dir, &cfg.data_dir, &work_dir] {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        let abs = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        let spawner = ShimSpawner {
            binary: cfg.microvm.shim_binary.clone(),
            shims_dir: abs(&shims_dir),
            roots_dir: abs(&roots_dir),
            work_dir: abs(&work_dir),
            jail: cfg.microvm.jail,
            cgroup_root: cfg.cgroup.root.clone(),
            cgroup_parent: cfg.cgroup.parent.clone(),
            mem_overhead_mib: cfg.microvm.mem_overhead_mib,
        };
        let guest = Guest::from_config(&cfg.microvm.guest);
        let taps = TapPool::new(&cfg.run_dir.join("taps")).context("tap markers")?;
        Ok(Microvm {
            spawner,
            guest,
            pool: ShimPool::default(),
            taps,
            children: Mutex::new(HashMap::new()),
            responders: Mutex::new(HashMap::new()),
            build_lock: tokio::sync::Mutex::new(()),
            backoff: Backoff::default(),
            host,
        })
    }
}

fn mvm_err(ctx: &str) -> impl FnOnce(MicroVmError) -> NodeError + '_ {
    move |e| match e {
        MicroVmError::Shim(ref c) if c.kind() == Some(cube_shim::ErrorKind::WrongState) => {
            NodeError::FailedPrecondition(format!("{ctx}: {e}"))
        }
        MicroVmError::Init(_) => NodeError::DeadlineExceeded(format!("{ctx}: {e}")),
        MicroVmError::Settings(_) => NodeError::InvalidArgument(format!("{ctx}: {e}")),
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

impl Microvm {
    /// The template snapshot for a build and shape, built on first use.
    async fn ensure_snapshot(
        &self,
        rootfs: &Path,
        vcpus: u32,
        mem_mib: u64,
    ) -> Result<PathBuf, NodeError> {
        let p = self;
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
        let key = format!("build-{}", new_key());
        let (spawner, guest, out, disk, mac, cg) = (
            p.spawner.clone(),
            p.guest.clone(),
            dir.clone(),
            rootfs.to_path_buf(),
            self.host.identity.guest_mac,
            self.host.cg.clone(),
        );
        let limits = self.shim_limits(vcpus, mem_mib);
        let t0 = Instant::now();
        blocking(move || {
            cg.create(&key)
                .and_then(|_| cg.set_limits(&key, limits))
                .map_err(|e| MicroVmError::Build(format!("cgroup: {e}")))?;
            let r = spawner.build_snapshot(&key, &guest, &out, vcpus, mem_mib, Some(&disk), mac);
            if let Err(e) = cg.destroy(&key) {
                tracing::warn!(%key, error = %e, "template build cgroup");
            }
            r
        })
        .await
        .map_err(mvm_err("template snapshot"))?;
        tracing::info!(dir = %dir.display(), ms = t0.elapsed().as_millis() as u64, "template snapshot built");
        Ok(dir)
    }

    /// The cgroup limits of a shim of this shape: its vCPUs, guest RAM and the VMM's overhead.
    fn shim_limits(&self, vcpus: u32, mem_mib: u64) -> crate::cgroup::Limits {
        self.host.limits(
            crate::sandbox::Shape {
                vcpus,
                memory_mib: mem_mib,
                disk_mib: 0,
            },
            self.host.cfg.microvm.mem_overhead_mib,
        )
    }

    /// Spawns a shim (cgroup with the shape's limits first) off the async threads.
    async fn spawn_shim(
        &self,
        vcpus: u32,
        mem_mib: u64,
        template: Option<PathBuf>,
    ) -> Result<SpawnedShim, NodeError> {
        let p = self;
        let key = new_key();
        let (cg, limits, k) = (
            self.host.cg.clone(),
            self.shim_limits(vcpus, mem_mib),
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
        if let Err(e) = self.host.cg.destroy(&s.key) {
            tracing::warn!(key = %s.key, error = %e, "shim cgroup");
        }
        {
            let p = self;
            p.spawner.cleanup(&s.key);
        }
    }

    async fn create_microvm(
        &self,
        spec: &CreateSpec,
        st: &mut SandboxState,
    ) -> Result<Created, NodeError> {
        let p = self;
        let t0 = Instant::now();
        let id = st.id.clone();
        let rootfs = spec.rootfs.as_path();
        let paths = self.host.paths_for(&id);
        std::fs::create_dir(&paths.dir)
            .map_err(|e| NodeError::Internal(format!("creating {}: {e}", paths.dir.display())))?;
        self.host.save(&id, st)?;
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
                    self.host.defer_refill();
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
                clone_disk(&snap_disk, &paths.disk()).await
            } else {
                self.host
                    .prepare_disk(
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
                Ok(tap) if linux => match self.host.net.tap_endpoint(&tap).await {
                    Ok(ep) => match self.host.net.hook().apply_policy(&ep, &policy) {
                        Ok(addr) => Ok((tap, Some((ep, addr)))),
                        Err(e) => {
                            self.host.net.destroy(&ep).await;
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
        self.host.phase("shim", shim_t);
        self.host.phase("disk", disk_t);
        self.host.phase("tap", tap_t);
        // The shim's sockets live in its work directory (the only place its jail can create
        // one); the sandbox directory keeps a link to the control socket.
        let vsock = shim_r
            .as_ref()
            .map(|s| s.work.join(VSOCK))
            .unwrap_or_else(|_| paths.dir.join(VSOCK));
        let body = spec.init.clone();
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
        st.runtime = RuntimeState::Microvm(Box::new(mv));
        if let Ok((_, Some((ep, addr)))) = &tap_r {
            st.endpoint = Some(ep.clone());
            st.host_addr = *addr;
        }
        let shim = match shim_r {
            Ok(s) => s,
            Err(e) => {
                let _ = self.host.save(&id, st);
                return Err(e);
            }
        };
        if let Ok(mut c) = p.children.lock() {
            c.insert(shim.key.clone(), shim.child);
        }
        self.host.save(&id, st)?;
        disk_r?;
        let (tap, _) = tap_r.map_err(|e| NodeError::Internal(format!("tap: {e}")))?;
        let _ = std::os::unix::fs::symlink(&shim.socket, paths.dir.join("shim.sock"));
        let disk_path = give_disk(&paths.disk(), &shim.work, shim.uid)?;
        if let Some(uid) = shim.uid {
            tap_pool::set_owner(&tap, uid)
                .map_err(|e| NodeError::Internal(format!("hand the tap to the shim: {e}")))?;
        }
        // The create's own ready timeout (a request may set it) bounds the guest's init too.
        let responder = InitResponder::start(&vsock, body, shim.uid, spec.ready_timeout)
            .map_err(mvm_err("init channel"))?;
        let tr = Instant::now();
        let socket = shim.socket.clone();
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
        self.host.phase("restore", tr.elapsed());
        tracing::debug!(id, ?restored, "restored");
        let timeout = spec.ready_timeout;
        let ti = Instant::now();
        let (responder, ack) = tokio::task::spawn_blocking(move || {
            let r = responder.wait_ack(timeout);
            (responder, r)
        })
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))?;
        ack.map_err(mvm_err(&format!("sandbox {id}")))?;
        self.host.phase("init", ti.elapsed());
        if let Ok(mut r) = p.responders.lock() {
            r.insert(id.clone(), responder);
        }
        if let Some(m) = st.runtime.microvm_mut() {
            m.inits += 1;
        }
        self.host.phase("total", t0.elapsed());
        Ok(Created { from_pool })
    }

    /// Pause = pause to disk (guest memory released, the shim stays as an empty process);
    /// resume = restore from that directory in the same shim, then a fresh init.
    async fn pause_resume_microvm(
        &self,
        st: &mut SandboxState,
        pause: bool,
    ) -> Result<(), NodeError> {
        let p = self;
        let id = st.id.clone();
        let mv = microvm_state(st)?.clone();
        let sandbox_dir = self.host.paths_for(&id).dir;
        // Where the shim may write: its work directory (the one holding its vsock socket);
        // for a shim started before work directories existed, the sandbox directory.
        let dir = work_of(&mv, &sandbox_dir);
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
            if let Some(m) = st.runtime.microvm_mut() {
                m.paused_dir = Some(pdir);
            }
            return Ok(());
        }
        let pdir = mv
            .paused_dir
            .clone()
            .ok_or_else(|| NodeError::Internal(format!("sandbox {id} has no pause directory")))?;
        // The guest asks for a fresh init (clock, entropy) as soon as it runs again.
        let responder = match p.responders.lock().ok().and_then(|mut r| r.remove(&id)) {
            Some(r) => r,
            None => InitResponder::start(
                &mv.vsock,
                mv.init.clone(),
                p.spawner.uid_of(st.pid),
                p.init_patience(),
            )
            .map_err(mvm_err("init channel"))?,
        };
        responder.drain();
        let (socket, d2, disk, tap, vsock) = (
            mv.socket.clone(),
            pdir.clone(),
            if dir == sandbox_dir {
                self.host.paths_for(&id).disk()
            } else {
                dir.join(SANDBOX_DISK)
            },
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
        let timeout = self.init_patience();
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
        if let Some(m) = st.runtime.microvm_mut() {
            m.paused_dir = None;
            m.inits += 1;
        }
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
    async fn snapshot_microvm(
        &self,
        st: &SandboxState,
        template: &str,
    ) -> Result<(crate::template::Manifest, bool), NodeError> {
        let mv = microvm_state(st)?.clone();
        if st.phase != Phase::Running {
            return Err(NodeError::FailedPrecondition(format!(
                "sandbox {} is {:?}: resume it before taking a snapshot",
                st.id, st.phase
            )));
        }
        let staging = self.host.templates.dir().join(".staging");
        std::fs::create_dir_all(&staging).map_err(|e| NodeError::Internal(e.to_string()))?;
        let tag = new_key();
        let disk_tmp = staging.join(format!("snap-{}-{tag}.ext4", st.id));
        // Written by the shim, so in its work directory; moved into the template store below.
        let mem_tmp =
            work_of(&mv, &self.host.paths_for(&st.id).dir).join(format!("snap-{tag}.mem"));
        let (socket, disk, d2, m2) = (
            mv.socket.clone(),
            self.host.paths_for(&st.id).disk(),
            disk_tmp.clone(),
            mem_tmp.clone(),
        );
        let standin = self.guest == Guest::Standin;
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
        let store = self.host.templates.clone();
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
        let (_, rootfs) = self.host.templates.get(&m.name, Some(&m.build))?;
        let build_dir = rootfs
            .parent()
            .ok_or_else(|| NodeError::Internal("template rootfs has no directory".into()))?;
        let out = microvm::snapshot_dir(build_dir, st.shape.vcpus, st.shape.memory_mib);
        // Replace (a reused build has the same disk but a different memory image).
        crate::storage::replace_dir(&mem_tmp, &out, &tag)
            .map_err(|e| NodeError::Internal(format!("install snapshot: {e}")))?;
        // Out of the shim's reach now: the template belongs to root, not to the shim's uid.
        if self.spawner.jail {
            microvm::chown_tree_to_root(&out)
                .map_err(|e| NodeError::Internal(format!("snapshot ownership: {e}")))?;
        }
        // Warm shims prepared for a replaced snapshot would restore stale memory.
        for s in self.pool.drain(Some(&out)) {
            self.discard_shim(s);
        }
        tracing::info!(sandbox = %st.id, template = %m.name, build = %m.build, "microvm snapshot is a template");
        Ok((m, reused))
    }

    /// Releases a microVM sandbox's parts beyond its cgroup (killed by `destroy`) and directory.
    fn release_microvm(&self, st: &SandboxState) {
        let p = self;
        if let Ok(mut r) = p.responders.lock() {
            r.remove(&st.id);
        }
        // `destroy` already killed and reaped the shim (by pid, with its start time checked):
        // dropping the handle neither signals nor waits, so a reused pid is never touched.
        drop(p.children.lock().ok().and_then(|mut c| c.remove(&st.key)));
        if let Some(t) = st.runtime.microvm().and_then(|m| m.tap.as_ref()) {
            p.taps.delete(t);
        }
        if !st.key.is_empty() {
            p.spawner.cleanup(&st.key);
        }
    }

    /// How long a guest may take over its init: the node's ready timeout.
    fn init_patience(&self) -> Duration {
        Duration::from_millis(u64::from(self.host.cfg.sandbox.ready_timeout_ms))
    }

    /// At restart: whether a live microVM sandbox's shim still answers (then its init channel
    /// is served again).
    fn readopt_microvm(&self, st: &SandboxState) -> bool {
        let p = self;
        let Some(mv) = st.runtime.microvm() else {
            return false;
        };
        match microvm::call(&mv.socket, Op::Ping, Duration::from_secs(5)) {
            Ok(Reply::Pong { pid, .. }) if pid as i32 == st.pid => {}
            other => {
                tracing::warn!(id = %st.id, ?other, "shim of a microvm sandbox does not answer; reaping it");
                return false;
            }
        }
        match InitResponder::start(
            &mv.vsock,
            mv.init.clone(),
            p.spawner.uid_of(st.pid),
            p.init_patience(),
        ) {
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

    /// At restart: taps, sockets and jail roots no live sandbox refers to.
    fn reap_microvm_leftovers(&self, live: &[SandboxState]) {
        let keep_taps: Vec<String> = live_taps(live);
        self.taps.reap_except(&keep_taps);
        if let Ok(rd) = std::fs::read_dir(&self.spawner.work_dir) {
            for e in rd.flatten() {
                let key = e.file_name().to_string_lossy().to_string();
                if !live.iter().any(|s| s.key == key) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        for d in [&self.spawner.shims_dir, &self.spawner.roots_dir] {
            let Ok(rd) = std::fs::read_dir(d) else {
                continue;
            };
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().to_string();
                let key = n.split('.').next().unwrap_or("");
                if !live.iter().any(|s| s.key == key) {
                    let _ = std::fs::remove_file(e.path());
                    let _ = std::fs::remove_dir(e.path());
                }
            }
        }
    }

    /// Whether a sandbox's shim has died (a child of ours that exited, or a re-adopted one
    /// that is gone), and why.
    fn shim_died(&self, st: &mut SandboxState) -> Option<String> {
        let exited = self.children.lock().ok().and_then(|mut c| {
            let s = c.get_mut(&st.key)?.try_wait().ok()??;
            c.remove(&st.key);
            Some(s)
        });
        let why = match exited {
            Some(s) => format!("cube-shim exited: {s}"),
            None if !crate::runtime::is_alive(st.pid, st.pid_start) => "cube-shim is gone".into(),
            None => return None,
        };
        if let Some(m) = st.runtime.microvm_mut() {
            m.failure = Some(why.clone());
        }
        if let Ok(mut r) = self.responders.lock() {
            r.remove(&st.id);
        }
        Some(why)
    }

    /// Tops up warm shims (per template in `pools.started`), taps and disks.
    async fn refill_microvm(&self) {
        let p = self;
        let taps = self.host.cfg.microvm.taps as usize;
        if let Err(e) = p.taps.refill(taps) {
            tracing::warn!(error = %e, "tap pool refill");
        }
        let (vcpus, mem) = (
            self.host.cfg.sandbox.default_vcpus,
            self.host.cfg.sandbox.default_memory_mib,
        );
        for (t, n) in self.host.cfg.pools.started.clone() {
            let Ok((_, rootfs)) = self.host.templates.get(&t, None) else {
                continue;
            };
            // Pre-cloned disks for this template (same pool as the namespace runtime's), unless
            // its snapshot has a disk of its own, which creates clone instead.
            let own_disk = rootfs.parent().is_some_and(|b| {
                microvm::snapshot_dir(b, vcpus, mem)
                    .join(microvm::SNAPSHOT_DISK)
                    .exists()
            });
            if !own_disk {
                self.host.refill_disks(&t).await;
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
                if self.host.shutting_down() {
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

    /// Kills pooled shims (all, or those of templates under `under`), and at shutdown the
    /// taps no live sandbox uses.
    fn drain_microvm_pools(&self, under: Option<&Path>, live: &[SandboxState]) {
        for s in self.pool.drain(under) {
            self.discard_shim(s);
        }
        if under.is_none() {
            self.taps.reap_except(&live_taps(live));
        }
    }

    fn microvm_pool_levels(&self) -> Vec<PoolLevel> {
        let mut v = vec![PoolLevel {
            pool: "tap".into(),
            template: String::new(),
            ready: self.taps.level() as u32,
            target: self.host.cfg.microvm.taps,
        }];
        for (k, n) in self.pool.levels() {
            // templates/<t>/<build>/microvm-…: name the template.
            let t = k
                .snapshot
                .parent()
                .and_then(|b| b.parent())
                .and_then(|t| t.file_name())
                .map(|s| s.to_string_lossy().to_string())
                .unwrap_or_default();
            let target = self.host.cfg.pools.started.get(&t).copied().unwrap_or(0);
            v.push(PoolLevel {
                pool: "shim".into(),
                template: t,
                ready: n as u32,
                target,
            });
        }
        v
    }

    /// Shim-side view of a microVM sandbox.
    async fn shim_stats(
        &self,
        st: &SandboxState,
    ) -> Result<(ShimState, cube_shim::protocol::Stats), NodeError> {
        let socket = microvm_state(st)?.socket.clone();
        match blocking(move || microvm::call(&socket, Op::Stats, SHIM_CALL))
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

/// The sandbox's vsock socket in its shim's work directory.
const VSOCK: &str = "v.sock";
/// The sandbox's disk as its shim sees it: a hard link in the work directory.
const SANDBOX_DISK: &str = "disk.ext4";

/// The directory a sandbox's shim writes to (the one its vsock socket is in).
fn work_of(mv: &MicroVmState, sandbox_dir: &Path) -> PathBuf {
    mv.vsock
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| sandbox_dir.to_path_buf())
}

/// Puts the sandbox's disk where its shim can open it: a hard link in the shim's work
/// directory (same filesystem: both under the data directory), the inode handed to the shim's
/// uid when jailed. Returns the path to send in `restore`.
fn give_disk(disk: &Path, work: &Path, uid: Option<u32>) -> Result<PathBuf, NodeError> {
    let link = work.join(SANDBOX_DISK);
    let _ = std::fs::remove_file(&link);
    std::fs::hard_link(disk, &link).map_err(|e| {
        NodeError::Internal(format!(
            "link {} into the shim's directory: {e}",
            disk.display()
        ))
    })?;
    if let Some(uid) = uid {
        microvm::hand_to(&link, uid)
            .map_err(|e| NodeError::Internal(format!("hand the disk to the shim: {e}")))?;
    }
    Ok(link)
}

fn microvm_state(st: &SandboxState) -> Result<&MicroVmState, NodeError> {
    st.runtime
        .microvm()
        .ok_or_else(|| NodeError::Internal(format!("sandbox {} is not a microVM", st.id)))
}

fn live_taps(live: &[SandboxState]) -> Vec<String> {
    live.iter()
        .filter_map(|s| s.runtime.microvm().and_then(|m| m.tap.clone()))
        .collect()
}

#[async_trait::async_trait]
impl Runtime for Microvm {
    fn name(&self) -> &'static str {
        MICROVM
    }

    fn snapshot_kind(&self) -> SnapshotKind {
        SnapshotKind::Full
    }

    fn new_state(&self) -> RuntimeState {
        RuntimeState::Microvm(Box::default())
    }

    async fn create(&self, spec: &CreateSpec, st: &mut SandboxState) -> Result<Created, NodeError> {
        self.create_microvm(spec, st).await
    }

    /// Pause to disk: guest memory released, the shim stays as an empty process.
    async fn pause(&self, st: &mut SandboxState, memory: bool) -> Result<(), NodeError> {
        if !memory {
            return Err(NodeError::FailedPrecondition(NO_REBOOT.into()));
        }
        self.pause_resume_microvm(st, true).await
    }

    /// Restore from the pause directory in the same shim, then a fresh init.
    async fn resume(&self, st: &mut SandboxState, reboot: bool) -> Result<(), NodeError> {
        if reboot {
            return Err(NodeError::FailedPrecondition(NO_REBOOT.into()));
        }
        self.pause_resume_microvm(st, false).await
    }

    /// Each copy is initialised over the vsock channel, which needs no agent token.
    async fn snapshot(
        &self,
        st: &SandboxState,
        template: &str,
        _agent_token: Option<&str>,
    ) -> Result<(crate::template::Manifest, bool), NodeError> {
        self.snapshot_microvm(st, template).await
    }

    async fn release(&self, st: &SandboxState) -> bool {
        crate::runtime::process::kill_sandbox(&self.host.cg, st).await;
        self.release_microvm(st);
        // A tap endpoint goes with its tap.
        false
    }

    fn readopt(&self, st: &SandboxState) -> bool {
        self.readopt_microvm(st)
    }

    fn reap_leftovers(&self, live: &[SandboxState]) {
        self.reap_microvm_leftovers(live)
    }

    fn failure(&self, st: &mut SandboxState) -> Option<String> {
        self.shim_died(st)
    }

    async fn refill(&self) {
        self.refill_microvm().await
    }

    fn pool_levels(&self) -> Vec<PoolLevel> {
        self.microvm_pool_levels()
    }

    async fn drain_pools(&self, template: Option<&str>, live: &[SandboxState]) {
        let under = template.map(|t| self.host.templates.dir().join(t));
        self.drain_microvm_pools(under.as_deref(), live)
    }

    /// CPU and memory from its shim (the VMM process and the guest RAM it has touched), disk
    /// from its image file (the guest's filesystem is not visible from the host).
    async fn sample(
        &self,
        st: &SandboxState,
    ) -> Result<cube_proto::nodev1::SandboxStatsResponse, NodeError> {
        let (_, s) = self.shim_stats(st).await?;
        let (cpu_count, cpu_used_pct, now) =
            crate::stats::cpu_pct(st, s.cpu_user_us + s.cpu_system_us);
        let (disk_used, disk_total) =
            crate::stats::image_usage(&self.host.paths_for(&st.id).disk()).unwrap_or((0, 0));
        Ok(cube_proto::nodev1::SandboxStatsResponse {
            cpu_count,
            cpu_used_pct,
            mem_used_bytes: s.guest_rss_kib * 1024,
            mem_total_bytes: st.shape.memory_mib << 20,
            mem_cache_bytes: 0,
            disk_used_bytes: disk_used,
            disk_total_bytes: disk_total,
            timestamp_ms: now,
        })
    }
}
