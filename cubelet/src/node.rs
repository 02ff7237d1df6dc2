//! The node: sandboxes (registry, on-disk state, crash recovery), templates, storage,
//! network and pools, behind the operations the gRPC service exposes.

use crate::cgroup::{Cgroups, Limits};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::network::{Endpoint, GuestIdentity, Network, NetworkHook, Policy};
use crate::runtime::{self, LaunchSettings, SandboxPaths};
use crate::storage::CloneKind;
use crate::template::{Source, TemplateError, TemplateStore};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The `microvm` runtime's node operations; the rest of this file is shared by both runtimes.
#[cfg(feature = "microvm")]
mod microvm_ops;

pub const STATE_MAGIC: &str = "cube-sandbox-state";
pub const STATE_VERSION: u32 = 1;

/// Phases reported in the `sandboxes` gauge.
#[cfg(feature = "microvm")]
const GAUGED_PHASES: [&str; 4] = ["creating", "running", "paused", "failed"];
#[cfg(not(feature = "microvm"))]
const GAUGED_PHASES: [&str; 3] = ["creating", "running", "paused"];

/// Errors of node operations; each maps to one gRPC status code.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    Internal(String),
}

impl From<TemplateError> for NodeError {
    fn from(e: TemplateError) -> Self {
        match e {
            TemplateError::BadName(_) | TemplateError::BadBuild(_) | TemplateError::Source(_) => {
                NodeError::InvalidArgument(e.to_string())
            }
            TemplateError::NotFound(_) | TemplateError::NoBuild { .. } => {
                NodeError::NotFound(e.to_string())
            }
            TemplateError::InUse(..) => NodeError::FailedPrecondition(e.to_string()),
            _ => NodeError::Internal(e.to_string()),
        }
    }
}

fn internal(ctx: &str) -> impl FnOnce(String) -> NodeError + '_ {
    move |e| NodeError::Internal(format!("{ctx}: {e}"))
}

/// Life-cycle phase persisted per sandbox.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Resources being assembled; never re-adopted after a crash.
    Creating,
    /// Pre-started, waiting in a pool for a CreateSandbox.
    Pooled,
    Running,
    Paused,
    /// The sandbox's VMM process (cube-shim) died; kept (and reported) until killed.
    #[cfg(feature = "microvm")]
    Failed,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct Shape {
    pub vcpus: u32,
    pub memory_mib: u64,
    pub disk_mib: u64,
}

/// Per-sandbox state, persisted in `sandboxes/<id>/state.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxState {
    pub id: String,
    /// Resource key: names the cgroup (and, for cold creates, the endpoint).
    pub key: String,
    pub phase: Phase,
    pub template: String,
    pub build: String,
    pub shape: Shape,
    pub pid: i32,
    pub pid_start: u64,
    pub endpoint: Option<Endpoint>,
    pub metadata: BTreeMap<String, String>,
    pub policy: Policy,
    pub created_at_ms: u64,
    pub create_latency_us: u64,
    pub from_pool: bool,
    /// The sandbox's node-local host address (cube-vs); absent without a switch and in state
    /// files written before the switch was integrated (the field is optional, so version 1
    /// files stay readable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_addr: Option<std::net::Ipv4Addr>,
    /// Set on the `microvm` runtime (`pid` is then the shim's); absent on `namespace`.
    #[cfg(feature = "microvm")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microvm: Option<crate::microvm::MicroVmState>,
}

impl SandboxState {
    /// Whether the sandbox is a microVM (hosted by a cube-shim) rather than namespaces.
    pub fn is_microvm(&self) -> bool {
        #[cfg(feature = "microvm")]
        return self.microvm.is_some();
        #[cfg(not(feature = "microvm"))]
        return false;
    }

    /// The runtime the sandbox runs on.
    pub fn runtime(&self) -> &'static str {
        #[cfg(feature = "microvm")]
        if self.is_microvm() {
            return crate::microvm::RUNTIME_NAME;
        }
        runtime::RUNTIME_NAME
    }
}

/// A create request, already decoded from gRPC.
#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    pub id: String,
    pub template: String,
    pub build: String,
    pub shape: Shape,
    pub env_vars: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub policy: Policy,
    pub access_token: String,
    pub default_user: String,
    pub default_workdir: String,
    pub ready_timeout_ms: u32,
}

/// Pools of pre-made parts; see `refill`.
#[derive(Default)]
struct Pools {
    net: Mutex<Vec<Endpoint>>,
    /// (template, build) → pre-cloned disk files.
    disks: Mutex<HashMap<(String, String), Vec<PathBuf>>>,
    /// template → pre-started sandboxes (phase Pooled).
    started: Mutex<HashMap<String, Vec<SandboxState>>>,
    /// template → (pre-starts under way, creates waiting for one of them).
    starting: Mutex<HashMap<String, (usize, usize)>>,
    /// Signalled whenever a pre-start ends (pooled or failed).
    started_done: tokio::sync::Notify,
    wake: tokio::sync::Notify,
}

type Entry = Arc<tokio::sync::Mutex<SandboxState>>;

/// The node.
pub struct Node {
    pub cfg: Config,
    pub templates: TemplateStore,
    pub cg: Cgroups,
    pub net: Network,
    pub metrics: Metrics,
    pub identity: GuestIdentity,
    pub storage_mode: CloneKind,
    launch: LaunchSettings,
    sandboxes_dir: PathBuf,
    pool_disk_dir: PathBuf,
    registry: Mutex<HashMap<String, Entry>>,
    pools: Pools,
    shutdown: tokio::sync::watch::Sender<bool>,
    refiller: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The runtime chosen at start (`runtime = auto` decides here) and why.
    #[cfg(feature = "microvm")]
    pub selection: crate::microvm::Selection,
    /// The microvm runtime's parts, when it is the node's runtime.
    #[cfg(feature = "microvm")]
    mvm: Option<microvm_ops::Parts>,
}

/// A reflink clone of a disk image, off the async threads.
async fn clone_disk(src: &Path, dst: &Path) -> Result<(), NodeError> {
    let (s, d) = (src.to_path_buf(), dst.to_path_buf());
    tokio::task::spawn_blocking(move || crate::storage::clone_file(&s, &d))
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))?
        .map(|_| ())
        .map_err(|e| NodeError::Internal(format!("cloning disk: {e}")))
}

fn new_key() -> String {
    let mut b = [0u8; 6];
    // SAFETY: getrandom into a local buffer.
    unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, b.len(), 0) };
    crate::state::hex(&b)
}

/// Sandbox ids: what E2B hosts and the edge router accept.
pub fn check_id(id: &str) -> Result<(), NodeError> {
    if id.is_empty()
        || id.len() > 64
        || !id
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
    {
        return Err(NodeError::InvalidArgument(format!(
            "invalid sandbox id {id:?}: use 1-64 characters of [a-z0-9]"
        )));
    }
    Ok(())
}

/// What kind of KVM this host has: "none", "hardware" (VMX/SVM) or "pvm".
pub fn kvm_kind() -> String {
    if !Path::new("/dev/kvm").exists() {
        return "none".into();
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let hw = cpu
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    if hw {
        "hardware".into()
    } else {
        "pvm".into()
    }
}

/// Said once at start, loudly: the namespace runtime's boundary is the host's own kernel.
fn warn_shared_kernel(why: &str) {
    tracing::warn!(
        reason = why,
        "SANDBOXES ON THIS NODE SHARE THE HOST KERNEL: runtime \"namespace\" (namespaces, \
         a user namespace, seccomp allow-list, no_new_privs, dropped capabilities). \
         Untrusted code is safer in the \"microvm\" runtime (a host with VMX/SVM)"
    );
}

impl Node {
    /// Prepares directories, detects cgroups and storage, opens netlink, recovers state.
    pub async fn start(cfg: Config, hook: Arc<dyn NetworkHook>) -> anyhow::Result<Arc<Node>> {
        use anyhow::Context;
        #[cfg(feature = "microvm")]
        let selection = crate::microvm::select(&cfg.runtime, &kvm_kind(), &cfg.microvm)
            .map_err(|e| anyhow::anyhow!(e))?;
        #[cfg(feature = "microvm")]
        tracing::info!(runtime = selection.runtime, kvm = %selection.kvm_kind, reason = %selection.reason, "runtime selected");
        #[cfg(feature = "microvm")]
        if selection.runtime == runtime::RUNTIME_NAME {
            warn_shared_kernel(&selection.reason);
        }
        // `auto` means microvm where this node can run it; this build has only `namespace`.
        #[cfg(not(feature = "microvm"))]
        if cfg.runtime == "auto" {
            warn_shared_kernel("this cubelet is built without the microvm runtime");
        } else if cfg.runtime == runtime::RUNTIME_NAME {
            warn_shared_kernel("configured");
        } else if cfg.runtime != runtime::RUNTIME_NAME {
            anyhow::bail!(
                "runtime {:?} is not available on this node (only \"namespace\" is implemented)",
                cfg.runtime
            );
        }
        if let Some(img) = &cfg.storage.xfs_loop_image {
            crate::storage::ensure_xfs_loop(
                img,
                cfg.storage.xfs_loop_size_gib << 30,
                &cfg.data_dir,
            )
            .context("XFS loop image for the data directory")?;
        }
        let sandboxes_dir = cfg.data_dir.join("sandboxes");
        let pool_disk_dir = cfg.data_dir.join("pool/disks");
        for d in [&sandboxes_dir, &pool_disk_dir, &cfg.run_dir, &cfg.cache_dir] {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        let storage_mode =
            crate::storage::probe_reflink(&cfg.data_dir).context("probing reflink support")?;
        if storage_mode != CloneKind::Reflink {
            tracing::warn!(data_dir = %cfg.data_dir.display(), "no reflink on the data directory: disks are full (sparse) copies; use XFS with reflink=1 (storage.xfs_loop_image)");
        }
        let templates = TemplateStore::new(
            &cfg.data_dir.join("templates"),
            &cfg.cache_dir,
            &cfg.agent_binary,
        )?;
        let cg = Cgroups::detect(&cfg.cgroup.root, &cfg.cgroup.parent).context("cgroups")?;
        // One guest identity for the whole node: the switch's (`[switch.guest]`).
        let g = &cfg.switch.guest;
        let identity = GuestIdentity {
            guest_ip: g.guest_ip,
            gateway_ip: g.gateway_ip,
            prefix_len: g.prefix_len,
            guest_mac: g.guest_mac.0,
            gateway_mac: g.gateway_mac.0,
        };
        let net =
            Network::new(&cfg.run_dir.join("netns"), identity.clone(), hook).context("netlink")?;
        // Sandbox inits are double-forked: become their reaper so they do not linger as zombies.
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        let mut agent_args = vec![
            "--addr".to_string(),
            format!("0.0.0.0:{}", cfg.sandbox.agent_port),
            "--init".into(),
            "auto".into(),
        ];
        agent_args.extend(cfg.sandbox.agent_args.iter().cloned());
        let launch = LaunchSettings {
            self_exe: std::env::current_exe().context("locating own executable")?,
            // The node's agent, bind-mounted on the sandbox's /run (shared page cache).
            agent_path: "/run/cube-agent".into(),
            agent_host: Some(
                cfg.agent_binary
                    .canonicalize()
                    .with_context(|| format!("agent binary {}", cfg.agent_binary.display()))?,
            ),
            agent_args,
            hostname: cfg.sandbox.hostname.clone(),
            seccomp: cfg.sandbox.seccomp,
            ids: cfg
                .sandbox
                .user_namespace
                .then_some(crate::sandbox_init::IdMap {
                    base: cfg.sandbox.id_base,
                    count: cfg.sandbox.id_count,
                }),
            run_size_mib: cfg.sandbox.run_size_mib,
            tmp_size_mib: cfg.sandbox.tmp_size_mib,
            pids_max: cfg.sandbox.pids_max,
        };
        #[cfg(feature = "microvm")]
        let is_namespace = selection.runtime == runtime::RUNTIME_NAME;
        #[cfg(not(feature = "microvm"))]
        let is_namespace = true;
        if is_namespace {
            tracing::warn!("runtime \"namespace\": sandboxes share the host kernel (container-level isolation, no memory snapshots)");
        }
        #[cfg(feature = "microvm")]
        let mvm = if selection.runtime == crate::microvm::RUNTIME_NAME {
            Some(microvm_ops::Parts::new(&cfg).context("microvm runtime")?)
        } else {
            None
        };
        let (shutdown, _) = tokio::sync::watch::channel(false);
        let node = Arc::new(Node {
            cfg,
            templates,
            cg,
            net,
            metrics: Metrics::new(),
            identity,
            storage_mode,
            launch,
            sandboxes_dir,
            pool_disk_dir,
            registry: Mutex::new(HashMap::new()),
            pools: Pools::default(),
            shutdown,
            refiller: Mutex::new(None),
            #[cfg(feature = "microvm")]
            selection,
            #[cfg(feature = "microvm")]
            mvm,
        });
        node.recover().await;
        let live: Vec<(Endpoint, Option<std::net::Ipv4Addr>, Policy)> = node
            .list()
            .await
            .into_iter()
            .filter_map(|s| s.endpoint.map(|ep| (ep, s.host_addr, s.policy)))
            .collect();
        let addrs = node
            .net
            .hook()
            .readopt(&live)
            .map_err(|e| anyhow::anyhow!("re-adopting the switch state: {e}"))?;
        // Record addresses the switch assigned during re-adoption (state written without one).
        let entries: Vec<Entry> = node
            .registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for e in entries {
            let mut st = e.lock().await;
            let Some(idx) = st.endpoint.as_ref().map(|ep| ep.host_ifindex) else {
                continue;
            };
            if let Some(&a) = addrs.get(&idx) {
                if st.host_addr != Some(a) {
                    st.host_addr = Some(a);
                    let id = st.id.clone();
                    if let Err(e) = node.save(&id, &st) {
                        tracing::error!(id, error = %e, "recording re-adopted host address");
                    }
                }
            }
        }
        Ok(node)
    }

    fn paths_for(&self, dirname: &str) -> SandboxPaths {
        SandboxPaths {
            dir: self.sandboxes_dir.join(dirname),
        }
    }

    fn save(&self, dirname: &str, st: &SandboxState) -> Result<(), NodeError> {
        crate::state::write(
            &self.paths_for(dirname).state(),
            STATE_MAGIC,
            STATE_VERSION,
            st,
        )
        .map_err(|e| NodeError::Internal(e.to_string()))
    }

    /// Re-adopts live sandboxes, reaps half-created ones and every orphaned resource.
    async fn recover(self: &Arc<Self>) {
        let mut keep_keys: Vec<String> = Vec::new();
        let mut keep_eps: Vec<String> = Vec::new();
        let dirs: Vec<PathBuf> = std::fs::read_dir(&self.sandboxes_dir)
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        for dir in dirs {
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default();
            let st = crate::state::read::<SandboxState>(
                &dir.join("state.json"),
                STATE_MAGIC,
                STATE_VERSION,
            );
            match st {
                Ok(st)
                    if matches!(st.phase, Phase::Running | Phase::Paused)
                        && st.id == name
                        && runtime::is_alive(st.pid, st.pid_start)
                        && self.readopt_runtime(&st) =>
                {
                    tracing::info!(id = %st.id, pid = st.pid, phase = ?st.phase, runtime = st.runtime(), "re-adopted sandbox");
                    keep_keys.push(st.key.clone());
                    if let Some(ep) = &st.endpoint {
                        keep_eps.push(ep.key.clone());
                    }
                    self.registry
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(st.id.clone(), Arc::new(tokio::sync::Mutex::new(st)));
                }
                Ok(st) => {
                    tracing::warn!(id = %st.id, phase = ?st.phase, "reaping sandbox that was not running at restart");
                    self.destroy(&name, &st).await;
                }
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "reaping sandbox directory without valid state");
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
        }
        // Orphans: resources no valid state refers to (a crash between creating and recording).
        for key in self.cg.list() {
            if !keep_keys.contains(&key) {
                tracing::warn!(key, "reaping orphan cgroup");
                if let Err(e) = self.cg.destroy(&key) {
                    tracing::error!(key, error = %e, "orphan cgroup");
                }
            }
        }
        // Only endpoints whose namespace file lives in our run directory are ours: other
        // cubelets (tests, a second instance) may own other `cvh*` links on this host.
        for k in self.net.list_netns() {
            if !keep_eps.contains(&k) {
                self.net.destroy_key(&k).await;
            }
        }
        if let Ok(rd) = std::fs::read_dir(&self.pool_disk_dir) {
            for e in rd.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
        #[cfg(feature = "microvm")]
        self.recover_microvm_leftovers(&keep_keys).await;
        self.update_gauges();
    }

    /// At restart: whether the runtime can take a live sandbox back (namespaces: always).
    fn readopt_runtime(&self, st: &SandboxState) -> bool {
        #[cfg(feature = "microvm")]
        if st.is_microvm() {
            return self.readopt_microvm(st);
        }
        let _ = st;
        true
    }

    /// Releases everything a sandbox holds. Idempotent; never fails (logs instead).
    async fn destroy(&self, dirname: &str, st: &SandboxState) {
        let (cg, key, pid, start) = (self.cg.clone(), st.key.clone(), st.pid, st.pid_start);
        let r = tokio::task::spawn_blocking(move || runtime::kill(&cg, &key, pid, start)).await;
        let killed = match r {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::error!(id = %st.id, error = %e, "killing sandbox");
                false
            }
            Err(e) => {
                tracing::error!(id = %st.id, error = %e, "kill task");
                false
            }
        };
        if let Some(ep) = &st.endpoint {
            // A sandbox that ran has a fully wired endpoint, and with every process of it gone
            // nothing holds the namespace: reuse it rather than pay for deleting and creating.
            let reusable =
                killed && st.phase != Phase::Creating && ep.host_ifindex != 0 && !st.is_microvm();
            if !(reusable && self.recycle_endpoint(ep)) {
                self.net.destroy(ep).await;
            }
        }
        #[cfg(feature = "microvm")]
        if st.is_microvm() {
            self.release_microvm(st);
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

    fn update_gauges(&self) {
        let reg = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        let mut counts: HashMap<&'static str, i64> = HashMap::new();
        for e in reg.values() {
            let ph = e.try_lock().map(|s| s.phase).unwrap_or(Phase::Creating);
            let k = match ph {
                Phase::Creating => "creating",
                Phase::Pooled => "pooled",
                Phase::Running => "running",
                Phase::Paused => "paused",
                #[cfg(feature = "microvm")]
                Phase::Failed => "failed",
            };
            *counts.entry(k).or_default() += 1;
        }
        drop(reg);
        for k in GAUGED_PHASES {
            self.metrics
                .sandboxes
                .with_label_values(&[k])
                .set(*counts.get(k).unwrap_or(&0));
        }
        self.metrics
            .pool_ready
            .with_label_values(&["network", ""])
            .set(self.pools.net.lock().map(|v| v.len() as i64).unwrap_or(0));
        self.metrics
            .pool_target
            .with_label_values(&["network", ""])
            .set(i64::from(self.cfg.pools.network));
        if let Ok(d) = self.pools.disks.lock() {
            for ((t, _), v) in d.iter() {
                self.metrics
                    .pool_ready
                    .with_label_values(&["disk", t])
                    .set(v.len() as i64);
                self.metrics
                    .pool_target
                    .with_label_values(&["disk", t])
                    .set(i64::from(self.cfg.pools.disks));
            }
        }
        if let Ok(s) = self.pools.started.lock() {
            for (t, v) in s.iter() {
                self.metrics
                    .pool_ready
                    .with_label_values(&["started", t])
                    .set(v.len() as i64);
            }
        }
        for (t, n) in &self.cfg.pools.started {
            self.metrics
                .pool_target
                .with_label_values(&["started", t])
                .set(i64::from(*n));
        }
        #[cfg(feature = "microvm")]
        for (pool, t, ready, target) in self.microvm_pool_levels() {
            let l = [pool.as_str(), t.as_str()];
            self.metrics
                .pool_ready
                .with_label_values(&l)
                .set(i64::from(ready));
            self.metrics
                .pool_target
                .with_label_values(&l)
                .set(i64::from(target));
        }
    }

    fn resolve_shape(&self, s: Shape, template_bytes: u64) -> Result<Shape, NodeError> {
        let c = &self.cfg.sandbox;
        let vcpus = if s.vcpus == 0 {
            c.default_vcpus
        } else {
            s.vcpus
        };
        let memory_mib = if s.memory_mib == 0 {
            c.default_memory_mib
        } else {
            s.memory_mib
        };
        if vcpus > c.max_vcpus {
            return Err(NodeError::InvalidArgument(format!(
                "shape: {vcpus} vCPUs exceeds this node's maximum of {}",
                c.max_vcpus
            )));
        }
        if !(64..=c.max_memory_mib).contains(&memory_mib) {
            return Err(NodeError::InvalidArgument(format!(
                "shape: memory {memory_mib} MiB is outside 64..={} MiB",
                c.max_memory_mib
            )));
        }
        let min_disk = template_bytes.div_ceil(1 << 20);
        if s.disk_mib != 0 && (s.disk_mib < min_disk || s.disk_mib > c.max_disk_mib) {
            return Err(NodeError::InvalidArgument(format!("shape: disk {} MiB is outside {min_disk}..={} MiB (the template's image is {min_disk} MiB)", s.disk_mib, c.max_disk_mib)));
        }
        Ok(Shape {
            vcpus,
            memory_mib,
            disk_mib: if s.disk_mib == 0 {
                min_disk
            } else {
                s.disk_mib
            },
        })
    }

    fn limits(&self, s: Shape) -> Limits {
        Limits {
            vcpus: s.vcpus,
            memory_mib: s.memory_mib,
            pids: self.launch.pids_max,
        }
    }

    /// The agent of a sandbox: at its host address when the switch gave it one, else (no
    /// switch) at the fixed guest address through its host interface.
    fn agent(
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

    /// The address the edge reaches a sandbox's agent at.
    pub fn agent_address(&self, st: &SandboxState) -> String {
        let ip = st.host_addr.unwrap_or(self.identity.guest_ip);
        format!("{ip}:{}", self.cfg.sandbox.agent_port)
    }

    /// Number of sandboxes (not counting pool entries).
    pub fn count(&self) -> usize {
        self.registry.lock().map(|r| r.len()).unwrap_or(0)
    }

    /// CreateSandbox.
    pub async fn create(self: &Arc<Self>, req: CreateRequest) -> Result<SandboxState, NodeError> {
        let t0 = Instant::now();
        check_id(&req.id)?;
        let (manifest, rootfs) = self.templates.get(
            &req.template,
            Some(&req.build)
                .filter(|b| !b.is_empty())
                .map(|s| s.as_str()),
        )?;
        let shape = self.resolve_shape(req.shape, manifest.rootfs.bytes)?;
        let max = self.cfg.sandbox.max_sandboxes as usize;
        let entry = Arc::new(tokio::sync::Mutex::new(SandboxState {
            id: req.id.clone(),
            key: new_key(),
            phase: Phase::Creating,
            template: manifest.name.clone(),
            build: manifest.build.clone(),
            shape,
            pid: 0,
            pid_start: 0,
            endpoint: None,
            metadata: req.metadata.clone(),
            policy: req.policy.clone(),
            created_at_ms: crate::template::now_ms(),
            create_latency_us: 0,
            from_pool: false,
            host_addr: None,
            #[cfg(feature = "microvm")]
            microvm: None,
        }));
        let mut guard = entry.clone().lock_owned().await;
        {
            let mut reg = self.registry.lock().unwrap_or_else(|p| p.into_inner());
            if reg.contains_key(&req.id) {
                return Err(NodeError::AlreadyExists(format!(
                    "sandbox {} already exists",
                    req.id
                )));
            }
            if max > 0 && reg.len() >= max {
                return Err(NodeError::ResourceExhausted(format!(
                    "node is full: {} of {max} sandboxes",
                    reg.len()
                )));
            }
            reg.insert(req.id.clone(), entry.clone());
        }
        let res = self.create_inner(&req, &mut guard, &rootfs, t0).await;
        let ok = res.is_ok();
        self.metrics
            .operations
            .with_label_values(&["create", if ok { "ok" } else { "error" }])
            .inc();
        match res {
            Ok(()) => {
                let st = guard.clone();
                drop(guard);
                self.update_gauges();
                self.pools.wake.notify_one();
                Ok(st)
            }
            Err(e) => {
                let st = guard.clone();
                drop(guard);
                tracing::warn!(id = %req.id, error = %e, "create failed; releasing its resources");
                self.destroy(&req.id, &st).await;
                self.registry
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&req.id);
                self.update_gauges();
                Err(e)
            }
        }
    }

    async fn create_inner(
        self: &Arc<Self>,
        req: &CreateRequest,
        st: &mut SandboxState,
        rootfs: &Path,
        t0: Instant,
    ) -> Result<(), NodeError> {
        #[cfg(feature = "microvm")]
        if self.mvm.is_some() {
            return self.create_microvm(req, st, rootfs, t0).await;
        }
        let paths = self.paths_for(&req.id);
        let pooled = if st.shape.disk_mib
            == self
                .templates
                .get(&st.template, Some(&st.build))?
                .0
                .rootfs
                .bytes
                .div_ceil(1 << 20)
        {
            self.claim_started(&st.template, &st.build).await
        } else {
            None
        };
        let from_pool = pooled.is_some();
        if let Some(p) = pooled {
            // Claim a pre-started sandbox: rename its directory, apply the shape and policy.
            let from = self.paths_for(&format!("pool-{}", p.key)).dir;
            std::fs::rename(&from, &paths.dir)
                .map_err(|e| NodeError::Internal(format!("claiming pooled sandbox: {e}")))?;
            st.key = p.key.clone();
            st.pid = p.pid;
            st.pid_start = p.pid_start;
            st.endpoint = p.endpoint.clone();
            st.host_addr = p.host_addr;
            st.from_pool = true;
            self.save(&req.id, st)?;
            self.cg
                .set_limits(&st.key, self.limits(st.shape))
                .map_err(|e| NodeError::Internal(e.to_string()))?;
        } else {
            std::fs::create_dir(&paths.dir).map_err(|e| {
                NodeError::Internal(format!("creating {}: {e}", paths.dir.display()))
            })?;
            self.save(&req.id, st)?;
            // Disk clone, network endpoint and cgroup are independent: build them at once.
            let disk = async {
                let t = Instant::now();
                let r = self
                    .prepare_disk(
                        &st.template,
                        &st.build,
                        rootfs,
                        &paths.disk(),
                        st.shape.disk_mib,
                    )
                    .await;
                (r, t.elapsed())
            };
            // A pooled endpoint when there is one; else only the namespace now, and the veth
            // while the sandbox starts in it.
            let endpoint = async {
                let t = Instant::now();
                let pooled = self.pools.net.lock().ok().and_then(|mut v| v.pop());
                let r = match pooled {
                    Some(ep) => {
                        self.pools.wake.notify_one();
                        Ok((ep, None))
                    }
                    None => {
                        let ep = self.net.endpoint_for(&new_key());
                        match self.net.create_netns_only(&ep).await {
                            Ok(h) => Ok((ep, Some(h))),
                            Err(e) => {
                                self.net.destroy(&ep).await;
                                Err(NodeError::Internal(format!("network namespace: {e}")))
                            }
                        }
                    }
                };
                (r, t.elapsed())
            };
            let (cg, key, limits) = (self.cg.clone(), st.key.clone(), self.limits(st.shape));
            let cgroup = async move {
                let t = Instant::now();
                let r = tokio::task::spawn_blocking(move || {
                    cg.create(&key)?;
                    cg.set_limits(&key, limits)
                })
                .await
                .map_err(|e| NodeError::Internal(e.to_string()))
                .and_then(|r| r.map_err(|e| NodeError::Internal(format!("cgroup: {e}"))));
                (r, t.elapsed())
            };
            let tp = Instant::now();
            let ((disk_r, disk_t), (ep_r, ep_t), (cg_r, cg_t)) =
                tokio::join!(disk, endpoint, cgroup);
            self.phase("disk", disk_t);
            self.phase("endpoint", ep_t);
            self.phase("cgroup", cg_t);
            self.phase("prepare", tp.elapsed());
            // Record the endpoint before failing on anything else, so cleanup releases it.
            if let Ok((ep, _)) = ep_r.as_ref() {
                st.endpoint = Some(ep.clone());
            }
            let (ep, nsh) = ep_r?;
            disk_r?;
            cg_r?;
            tracing::debug!(id = %req.id, disk_us = disk_t.as_micros() as u64, endpoint_us = ep_t.as_micros() as u64, cgroup_us = cg_t.as_micros() as u64, us = t0.elapsed().as_micros() as u64, "disk, netns and cgroup ready");
            self.save(&req.id, st)?;
            let (settings, cg, key, netns) = (
                self.launch.clone(),
                self.cg.clone(),
                st.key.clone(),
                ep.netns_path.clone(),
            );
            let p2 = paths.clone();
            let tl = Instant::now();
            let launch = tokio::task::spawn_blocking(move || {
                let r = runtime::launch_prepared(&settings, &cg, &key, &p2, &netns);
                (r, tl.elapsed())
            });
            // The veth and the switch binding need only the namespace: build them while the
            // launcher runs (the agent listens on 0.0.0.0 and is reached only after this).
            let tw = Instant::now();
            let wired = match nsh {
                Some(h) => self
                    .net
                    .wire_netns(ep, h)
                    .await
                    .map_err(|e| NodeError::Internal(format!("network endpoint: {e}"))),
                None => Ok(ep),
            };
            self.phase("veth", tw.elapsed());
            let tpol = Instant::now();
            let policy = wired.and_then(|ep| {
                st.endpoint = Some(ep.clone());
                self.net
                    .hook()
                    .apply_policy(&ep, &st.policy)
                    .map_err(internal("network policy"))
            });
            self.phase("policy", tpol.elapsed());
            let (launched, launch_t) = launch
                .await
                .map_err(|e| NodeError::Internal(e.to_string()))?;
            self.phase("launch", launch_t);
            // Record the pid first: a network error must still kill the started sandbox.
            let (pid, start) =
                launched.map_err(|e| NodeError::Internal(format!("starting sandbox: {e}")))?;
            st.pid = pid;
            st.pid_start = start;
            st.host_addr = match policy {
                Ok(a) => a,
                Err(e) => {
                    let _ = self.save(&req.id, st);
                    return Err(e);
                }
            };
            self.save(&req.id, st)?;
            tracing::debug!(id = %req.id, launch_us = launch_t.as_micros() as u64, us = t0.elapsed().as_micros() as u64, "launched");
        }
        let ep = st
            .endpoint
            .clone()
            .ok_or_else(|| NodeError::Internal("sandbox has no network endpoint".into()))?;
        if from_pool {
            let addr = self
                .net
                .hook()
                .apply_policy(&ep, &st.policy)
                .map_err(internal("network policy"))?;
            if addr != st.host_addr {
                st.host_addr = addr;
                self.save(&req.id, st)?;
            }
        }
        let agent = self.agent(&ep, st.host_addr);
        let timeout = Duration::from_millis(u64::from(if req.ready_timeout_ms == 0 {
            self.cfg.sandbox.ready_timeout_ms
        } else {
            req.ready_timeout_ms
        }));
        let th = Instant::now();
        if !from_pool {
            agent.wait_healthy(timeout).await.map_err(|e| {
                let log = std::fs::read_to_string(paths.log()).unwrap_or_default();
                let tail: String = log
                    .lines()
                    .rev()
                    .take(5)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join(" | ");
                NodeError::DeadlineExceeded(format!("sandbox {}: {e}; agent log: {tail}", req.id))
            })?;
        }
        if !from_pool {
            self.phase("healthy", th.elapsed());
        }
        tracing::debug!(id = %req.id, us = t0.elapsed().as_micros() as u64, "agent healthy");
        let user = if req.default_user.is_empty() {
            "user".to_string()
        } else {
            req.default_user.clone()
        };
        let workdir = if !req.default_workdir.is_empty() {
            req.default_workdir.clone()
        } else if user == "root" {
            "/root".into()
        } else {
            format!("/home/{user}")
        };
        let init = crate::agent::InitRequest {
            env_vars: req.env_vars.clone(),
            access_token: Some(req.access_token.clone()).filter(|t| !t.is_empty()),
            timestamp: crate::agent::rfc3339_now(),
            default_user: user,
            default_workdir: workdir,
        };
        let ti = Instant::now();
        agent
            .init(&init)
            .await
            .map_err(|e| NodeError::Internal(format!("sandbox {}: /init: {e}", req.id)))?;
        st.phase = Phase::Running;
        st.create_latency_us = t0.elapsed().as_micros() as u64;
        self.save(&req.id, st)?;
        if !from_pool {
            self.phase("init", ti.elapsed());
            self.phase("total", t0.elapsed());
        }
        self.metrics
            .create_seconds
            .with_label_values(&[if from_pool { "true" } else { "false" }])
            .observe(t0.elapsed().as_secs_f64());
        tracing::info!(id = %req.id, template = %st.template, from_pool, latency_us = st.create_latency_us, "sandbox ready");
        Ok(())
    }

    /// Records one phase of a create in `cube_create_phase_seconds{phase}`.
    fn phase(&self, name: &str, d: Duration) {
        self.metrics
            .create_phase
            .with_label_values(&[name])
            .observe(d.as_secs_f64());
    }

    /// A disk for a sandbox: a pre-cloned one when the pool has it, else a clone now.
    async fn prepare_disk(
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
            self.pools.wake.notify_one();
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
            .map_err(|e| NodeError::Internal(e.to_string()))?
            .map_err(internal("growing disk"))?;
        }
        Ok(())
    }

    async fn take_endpoint(&self) -> Result<Endpoint, NodeError> {
        let ep = self.pools.net.lock().ok().and_then(|mut v| v.pop());
        if let Some(ep) = ep {
            self.pools.wake.notify_one();
            return Ok(ep);
        }
        self.net
            .create(&new_key())
            .await
            .map_err(|e| NodeError::Internal(format!("network endpoint: {e}")))
    }

    /// A pre-started sandbox: one from the pool, else the next one of the pre-starts under
    /// way (most of its work is done, and starting another from scratch would compete with
    /// them for the CPU), else None when none is coming.
    async fn claim_started(&self, template: &str, build: &str) -> Option<SandboxState> {
        if let Some(p) = self.take_started(template, build) {
            return Some(p);
        }
        // Wait only while there are more pre-starts under way than creates already waiting
        // for them: with more creates than that, a cold start is sooner than the queue.
        let reserved = self
            .pools
            .starting
            .lock()
            .map(|mut m| {
                let (coming, waiting) = m.entry(template.to_string()).or_default();
                if *coming > *waiting {
                    *waiting += 1;
                    true
                } else {
                    false
                }
            })
            .unwrap_or(false);
        if !reserved {
            return None;
        }
        let deadline = Instant::now() + Duration::from_millis(self.cfg.pools.claim_wait_ms);
        let got = loop {
            let done = self.pools.started_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if let Some(p) = self.take_started(template, build) {
                break Some(p);
            }
            let coming = self
                .pools
                .starting
                .lock()
                .map(|m| m.get(template).map(|c| c.0).unwrap_or(0))
                .unwrap_or(0);
            if coming == 0
                || tokio::time::timeout_at(deadline.into(), done)
                    .await
                    .is_err()
            {
                break None;
            }
        };
        if let Ok(mut m) = self.pools.starting.lock() {
            if let Some(c) = m.get_mut(template) {
                c.1 = c.1.saturating_sub(1);
            }
        }
        got
    }

    fn take_started(&self, template: &str, build: &str) -> Option<SandboxState> {
        let mut s = self.pools.started.lock().ok()?;
        let v = s.get_mut(template)?;
        let i = v
            .iter()
            .rposition(|p| p.build == build && runtime::is_alive(p.pid, p.pid_start))?;
        let p = v.remove(i);
        self.pools.wake.notify_one();
        Some(p)
    }

    fn entry(&self, id: &str) -> Result<Entry, NodeError> {
        check_id(id)?;
        self.registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(format!("sandbox {id} not found")))
    }

    /// KillSandbox. Returns whether it existed.
    pub async fn kill(&self, id: &str) -> Result<bool, NodeError> {
        let e = match self.entry(id) {
            Ok(e) => e,
            Err(NodeError::NotFound(_)) => return Ok(false),
            Err(e) => return Err(e),
        };
        let st = e.lock().await;
        let t0 = Instant::now();
        self.destroy(id, &st).await;
        tracing::debug!(id, us = t0.elapsed().as_micros() as u64, "killed");
        self.registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        drop(st);
        self.metrics
            .operations
            .with_label_values(&["kill", "ok"])
            .inc();
        self.update_gauges();
        Ok(true)
    }

    /// PauseSandbox: freeze the cgroup.
    pub async fn pause(&self, id: &str) -> Result<SandboxState, NodeError> {
        self.set_frozen(id, true).await
    }

    /// ResumeSandbox: thaw the cgroup.
    pub async fn resume(&self, id: &str) -> Result<SandboxState, NodeError> {
        self.set_frozen(id, false).await
    }

    /// Freezes (pause) or thaws (resume) a sandbox's cgroup: Running ⇄ Paused, anything else is
    /// a failed precondition.
    async fn set_frozen(&self, id: &str, freeze: bool) -> Result<SandboxState, NodeError> {
        let e = self.entry(id)?;
        let mut st = e.lock().await;
        #[cfg(feature = "microvm")]
        if st.is_microvm() {
            let r = self.pause_resume_microvm(&mut st, freeze).await;
            let out = st.clone();
            drop(st);
            self.update_gauges();
            return r.map(|_| out);
        }
        let (from, to) = if freeze {
            (Phase::Running, Phase::Paused)
        } else {
            (Phase::Paused, Phase::Running)
        };
        if st.phase != from {
            let why = match (freeze, &st.phase) {
                (true, Phase::Paused) => "is already paused".to_string(),
                (true, p) => format!("is {p:?}"),
                (false, _) => "is not paused".to_string(),
            };
            return Err(NodeError::FailedPrecondition(format!("sandbox {id} {why}")));
        }
        let (cg, key) = (self.cg.clone(), st.key.clone());
        tokio::task::spawn_blocking(move || cg.set_frozen(&key, freeze))
            .await
            .map_err(|e| NodeError::Internal(e.to_string()))?
            .map_err(|e| NodeError::Internal(e.to_string()))?;
        st.phase = to;
        self.save(id, &st)?;
        let out = st.clone();
        drop(st);
        self.update_gauges();
        Ok(out)
    }

    /// GetSandbox.
    pub async fn get(&self, id: &str) -> Result<SandboxState, NodeError> {
        let e = self.entry(id)?;
        let st = e.lock().await;
        Ok(st.clone())
    }

    /// ListSandboxes.
    pub async fn list(&self) -> Vec<SandboxState> {
        let entries: Vec<Entry> = self
            .registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        let mut out = Vec::new();
        for e in entries {
            out.push(e.lock().await.clone());
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// The sandboxes not in the middle of an operation, without waiting for any: a create
    /// holds its sandbox for up to the ready timeout, and NodeStatus (the master's liveness
    /// probe) must not queue behind it and make a busy node look dead.
    pub fn list_settled(&self) -> Vec<SandboxState> {
        self.registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter_map(|e| e.try_lock().ok().map(|g| g.clone()))
            .collect()
    }

    /// SnapshotSandbox: filesystem only on this runtime. The sandbox is frozen while its
    /// filesystem is flushed and its disk cloned, then restored to its previous state.
    pub async fn snapshot(
        &self,
        id: &str,
        template: &str,
    ) -> Result<(crate::template::Manifest, bool), NodeError> {
        crate::template::check_name(template)?;
        let e = self.entry(id)?;
        let st = e.lock().await;
        #[cfg(feature = "microvm")]
        if st.is_microvm() {
            return self.snapshot_microvm(&st, template).await;
        }
        if !matches!(st.phase, Phase::Running | Phase::Paused) {
            return Err(NodeError::FailedPrecondition(format!(
                "sandbox {id} is {:?}",
                st.phase
            )));
        }
        let was_running = st.phase == Phase::Running;
        let paths = self.paths_for(id);
        let tmp = self
            .templates
            .dir()
            .join(".staging")
            .join(format!("snap-{id}-{}.ext4", new_key()));
        let (cg, key, pid, disk, tmp2) = (
            self.cg.clone(),
            st.key.clone(),
            st.pid,
            paths.disk(),
            tmp.clone(),
        );
        tokio::task::spawn_blocking(move || -> Result<(), String> {
            if was_running {
                cg.set_frozen(&key, true).map_err(|e| e.to_string())?;
            }
            let r = runtime::sync_fs(pid)
                .map_err(|e| e.to_string())
                .and_then(|_| {
                    crate::storage::clone_file(&disk, &tmp2)
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                });
            if was_running {
                cg.set_frozen(&key, false).map_err(|e| e.to_string())?;
            }
            r
        })
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))?
        .map_err(internal("snapshot"))?;
        drop(st);
        let store = self.templates.clone();
        let (t, sid) = (template.to_string(), id.to_string());
        let tmp3 = tmp.clone();
        let r = tokio::task::spawn_blocking(move || {
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
        .map_err(|e| NodeError::Internal(e.to_string()))?;
        let _ = std::fs::remove_file(&tmp);
        Ok(r?)
    }

    /// How many sandboxes use a template build.
    pub fn template_users(&self, name: &str, build: &str) -> usize {
        let reg = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        reg.values()
            .filter(|e| {
                e.try_lock()
                    .map(|s| s.template == name && s.build == build)
                    .unwrap_or(true)
            })
            .count()
    }

    /// DeleteTemplate: refuses builds in use; drops pooled parts of the template first.
    pub async fn delete_template(&self, name: &str, build: Option<&str>) -> Result<u32, NodeError> {
        crate::template::check_name(name)?;
        let stale: Vec<SandboxState> = self
            .pools
            .started
            .lock()
            .map(|mut s| s.remove(name).unwrap_or_default())
            .unwrap_or_default();
        for p in stale {
            self.destroy(&format!("pool-{}", p.key), &p).await;
        }
        #[cfg(feature = "microvm")]
        self.drain_microvm_pools(Some(&self.templates.dir().join(name)));
        if let Ok(mut d) = self.pools.disks.lock() {
            d.retain(|(t, _), files| {
                if t == name {
                    for f in files.iter() {
                        let _ = std::fs::remove_file(f);
                    }
                    false
                } else {
                    true
                }
            });
        }
        Ok(self
            .templates
            .delete(name, build, &|n, b| self.template_users(n, b))?)
    }

    /// Starts the background pool refiller.
    pub fn spawn_refiller(self: &Arc<Self>) {
        let node = self.clone();
        let mut stop = self.shutdown.subscribe();
        let h = tokio::spawn(async move {
            let interval = Duration::from_millis(node.cfg.pools.refill_interval_ms.max(10));
            loop {
                node.refill_once().await;
                tokio::select! {
                    _ = node.pools.wake.notified() => {}
                    _ = tokio::time::sleep(interval) => {}
                    _ = stop.changed() => break,
                }
                if *stop.borrow() {
                    break;
                }
            }
        });
        *self.refiller.lock().unwrap_or_else(|p| p.into_inner()) = Some(h);
    }

    /// One pass over all pools, filling each up to its target.
    pub async fn refill_once(self: &Arc<Self>) {
        if *self.shutdown.borrow() {
            return;
        }
        #[cfg(feature = "microvm")]
        if self.mvm.is_some() {
            self.check_shims().await;
            self.refill_microvm().await;
            self.update_gauges();
            return;
        }
        // Network endpoints.
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
            if *self.shutdown.borrow() {
                return;
            }
        }
        // Disks for the templates named in the config.
        let mut tmpls: Vec<String> = self.cfg.pools.disk_templates.clone();
        tmpls.extend(self.cfg.pools.started.keys().cloned());
        tmpls.sort();
        tmpls.dedup();
        for t in &tmpls {
            let Ok((m, rootfs)) = self.templates.get(t, None) else {
                continue;
            };
            let k = (t.clone(), m.build.clone());
            if let Ok(mut d) = self.pools.disks.lock() {
                // Disks of an older build are useless now.
                d.retain(|(tt, b), files| {
                    if tt == t && *b != m.build {
                        for f in files.iter() {
                            let _ = std::fs::remove_file(f);
                        }
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
                    .join(format!("{t}-{}-{}.ext4", m.build, new_key()));
                let (s, d2) = (rootfs.clone(), dst.clone());
                match tokio::task::spawn_blocking(move || crate::storage::clone_file(&s, &d2)).await
                {
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
        // Pre-started sandboxes.
        for (t, n) in self.cfg.pools.started.clone() {
            let Ok((m, rootfs)) = self.templates.get(&t, None) else {
                continue;
            };
            let stale: Vec<SandboxState> = self
                .pools
                .started
                .lock()
                .map(|mut s| {
                    let v = s.entry(t.clone()).or_default();
                    let (keep, drop): (Vec<_>, Vec<_>) = v
                        .drain(..)
                        .partition(|p| p.build == m.build && runtime::is_alive(p.pid, p.pid_start));
                    *v = keep;
                    drop
                })
                .unwrap_or_default();
            for p in stale {
                self.destroy(&format!("pool-{}", p.key), &p).await;
            }
            let par = match self.cfg.pools.refill_parallelism {
                0 => std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
                    .min(4),
                n => n as usize,
            };
            loop {
                let have = self
                    .pools
                    .started
                    .lock()
                    .map(|s| s.get(&t).map(|v| v.len()).unwrap_or(0))
                    .unwrap_or(usize::MAX);
                let want = (n as usize).saturating_sub(have).min(par);
                if want == 0 || *self.shutdown.borrow() {
                    break;
                }
                if let Ok(mut m) = self.pools.starting.lock() {
                    m.entry(t.clone()).or_default().0 += want;
                }
                // Each lands in the pool as soon as it is ready: a create may be waiting for it.
                let batch = futures::future::join_all((0..want).map(|_| async {
                    let r = self.prestart(&t, &m.build, &rootfs, m.rootfs.bytes).await;
                    let ok = match r {
                        Ok(p) => {
                            if let Ok(mut s) = self.pools.started.lock() {
                                s.entry(t.clone()).or_default().push(p)
                            }
                            true
                        }
                        Err(e) => {
                            tracing::warn!(template = %t, error = %e, "started pool refill");
                            false
                        }
                    };
                    if let Ok(mut m) = self.pools.starting.lock() {
                        if let Some(c) = m.get_mut(&t) {
                            c.0 = c.0.saturating_sub(1);
                        }
                    }
                    self.pools.started_done.notify_waiters();
                    ok
                }))
                .await;
                let failed = batch.iter().any(|ok| !ok);
                if failed {
                    break;
                }
            }
        }
        self.update_gauges();
    }

    /// Starts a sandbox that waits in the pool for its /init.
    async fn prestart(
        self: &Arc<Self>,
        template: &str,
        build: &str,
        rootfs: &Path,
        bytes: u64,
    ) -> Result<SandboxState, NodeError> {
        let key = new_key();
        let dirname = format!("pool-{key}");
        let paths = self.paths_for(&dirname);
        let shape = Shape {
            vcpus: self.cfg.sandbox.default_vcpus,
            memory_mib: self.cfg.sandbox.default_memory_mib,
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
            metadata: BTreeMap::new(),
            policy: Policy::default(),
            created_at_ms: crate::template::now_ms(),
            create_latency_us: 0,
            from_pool: true,
            host_addr: None,
            #[cfg(feature = "microvm")]
            microvm: None,
        };
        let r: Result<(), NodeError> = async {
            std::fs::create_dir(&paths.dir).map_err(|e| NodeError::Internal(e.to_string()))?;
            self.save(&dirname, &st)?;
            self.prepare_disk(template, build, rootfs, &paths.disk(), 0)
                .await?;
            let ep = self.take_endpoint().await?;
            st.endpoint = Some(ep.clone());
            self.save(&dirname, &st)?;
            let (settings, cg, k, netns, limits) = (
                self.launch.clone(),
                self.cg.clone(),
                key.clone(),
                ep.netns_path.clone(),
                self.limits(shape),
            );
            let p2 = paths.clone();
            let (pid, start) = tokio::task::spawn_blocking(move || {
                runtime::launch(&settings, &cg, &k, &p2, &netns, limits)
            })
            .await
            .map_err(|e| NodeError::Internal(e.to_string()))?
            .map_err(|e| NodeError::Internal(e.to_string()))?;
            st.pid = pid;
            st.pid_start = start;
            st.phase = Phase::Pooled;
            // Bound with the default (no internet) policy until a create claims it, so its
            // agent can be health-checked at its host address.
            st.host_addr = self
                .net
                .hook()
                .apply_policy(&ep, &Policy::default())
                .map_err(internal("network policy"))?;
            self.save(&dirname, &st)?;
            // Pooled only once warm (a code-interpreter template's Python worker is up), so the
            // create that takes it finds nothing left to start.
            self.agent(&ep, st.host_addr)
                .wait_warm(Duration::from_millis(u64::from(
                    self.cfg.sandbox.ready_timeout_ms,
                )))
                .await
                .map_err(|e| NodeError::DeadlineExceeded(e.to_string()))?;
            Ok(())
        }
        .await;
        match r {
            Ok(()) => Ok(st),
            Err(e) => {
                self.destroy(&dirname, &st).await;
                Err(e)
            }
        }
    }

    /// Pool levels: (pool, template, ready, target).
    pub fn pool_levels(&self) -> Vec<(String, String, u32, u32)> {
        let mut v = vec![(
            "network".to_string(),
            String::new(),
            self.pools.net.lock().map(|x| x.len() as u32).unwrap_or(0),
            self.cfg.pools.network,
        )];
        if let Ok(d) = self.pools.disks.lock() {
            for ((t, _), f) in d.iter() {
                v.push((
                    "disk".into(),
                    t.clone(),
                    f.len() as u32,
                    self.cfg.pools.disks,
                ));
            }
        }
        for (t, n) in &self.cfg.pools.started {
            let ready = self
                .pools
                .started
                .lock()
                .map(|s| s.get(t).map(|x| x.len() as u32).unwrap_or(0))
                .unwrap_or(0);
            v.push(("started".into(), t.clone(), ready, *n));
        }
        #[cfg(feature = "microvm")]
        v.extend(self.microvm_pool_levels());
        v
    }

    /// Stops the refiller and releases pooled parts. Sandboxes keep running (they are re-adopted
    /// by the next cubelet); `kill_sandboxes` also kills them.
    pub async fn shutdown(&self, kill_sandboxes: bool) {
        let _ = self.shutdown.send(true);
        // Let an in-flight refill finish, so nothing lands in a pool after it was drained.
        let h = self
            .refiller
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(h) = h {
            let _ = h.await;
        }
        let started: Vec<SandboxState> = self
            .pools
            .started
            .lock()
            .map(|mut s| s.drain().flat_map(|(_, v)| v).collect())
            .unwrap_or_default();
        for p in started {
            self.destroy(&format!("pool-{}", p.key), &p).await;
        }
        let eps: Vec<Endpoint> = self
            .pools
            .net
            .lock()
            .map(|mut v| v.drain(..).collect())
            .unwrap_or_default();
        for ep in eps {
            self.net.destroy(&ep).await;
        }
        if let Ok(mut d) = self.pools.disks.lock() {
            for (_, files) in d.drain() {
                for f in files {
                    let _ = std::fs::remove_file(f);
                }
            }
        }
        #[cfg(feature = "microvm")]
        self.drain_microvm_pools(None);
        if kill_sandboxes {
            let ids: Vec<String> = self
                .registry
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .keys()
                .cloned()
                .collect();
            for id in ids {
                let _ = self.kill(&id).await;
            }
        }
    }

    /// Import (build) a template in the background thread pool.
    pub async fn import_template(
        &self,
        name: &str,
        source: Source,
        extra_mib: u64,
        progress: Arc<dyn Fn(crate::template::BuildEvent) + Send + Sync>,
    ) -> Result<(crate::template::Manifest, bool), NodeError> {
        crate::template::check_name(name)?;
        let store = self.templates.clone();
        let n = name.to_string();
        let r =
            tokio::task::spawn_blocking(move || store.build(&n, &source, extra_mib, &*progress))
                .await
                .map_err(|e| NodeError::Internal(e.to_string()))?;
        Ok(r?)
    }

    pub fn sandboxes_dir(&self) -> &Path {
        &self.sandboxes_dir
    }

    /// The metrics text, with per-sandbox switch counters refreshed.
    pub fn render_metrics(&self) -> String {
        let entries: Vec<Entry> = self
            .registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        let m = &self.metrics;
        // Reset so that killed sandboxes disappear from the exposition.
        m.net_packets.reset();
        m.net_bytes.reset();
        m.net_drops.reset();
        for e in entries {
            let Ok(st) = e.try_lock() else { continue };
            let Some(ep) = &st.endpoint else { continue };
            let Some(c) = self.net.hook().counters(ep) else {
                continue;
            };
            for (dir, d) in [("from_guest", c.from_guest), ("to_guest", c.to_guest)] {
                let l = [st.id.as_str(), dir];
                m.net_packets.with_label_values(&l).set(d.packets as i64);
                m.net_bytes.with_label_values(&l).set(d.bytes as i64);
                m.net_drops.with_label_values(&l).set(d.drops as i64);
            }
        }
        m.render()
    }

    /// Memory charged to a sandbox's cgroup.
    pub fn memory_bytes(&self, key: &str) -> Option<u64> {
        self.cg.memory_bytes(key)
    }
}
