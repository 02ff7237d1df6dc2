//! The node: the sandbox registry and state files, crash recovery (`recovery.rs`), request
//! defaults (`defaults.rs`) and pools (`pools.rs`), over one [`Runtime`] and the [`Host`]
//! parts it shares with it. Nothing here asks which runtime it has.

mod defaults;
mod history;
mod pools;
mod recovery;

use crate::config::Config;
use crate::network::{Endpoint, GuestIdentity, Network, NetworkHook, Policy};
use crate::runtime::host::{Host, SharedPools};
use crate::runtime::{Runtime, Selection, SnapshotKind};
use crate::storage::CloneKind;
use crate::template::{Source, TemplateStore};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use crate::error::NodeError;
pub use crate::sandbox::{Phase, SandboxState, Shape, STATE_MAGIC, STATE_VERSION};
pub use defaults::{workdir_of, DEFAULT_USER};

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
    /// The master resolved `template` as one of the caller's snapshots (see node.proto).
    pub from_snapshot: bool,
    /// When it ends (unix ms; 0 = no end), see [`Node::set_end_time`].
    pub end_at_ms: u64,
    /// When non-zero, it ends this long after it is ready instead (`end_at_ms` ignored).
    pub timeout_ms: u64,
}

type Entry = Arc<tokio::sync::Mutex<SandboxState>>;

/// The node.
pub struct Node {
    pub host: Arc<Host>,
    pub runtime: Arc<dyn Runtime>,
    /// The runtime chosen at start (`runtime = auto` decides here) and why.
    pub selection: Selection,
    registry: Mutex<HashMap<String, Entry>>,
    refiller: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Each sandbox's samples and log (`history.rs` fills and reads it).
    pub journal: crate::journal::Journal,
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

/// Said once at start, loudly: the namespace runtime's boundary is the host's own kernel.
fn warn_shared_kernel(why: &str) {
    tracing::warn!(
        reason = why,
        "SANDBOXES ON THIS NODE SHARE THE HOST KERNEL: runtime \"namespace\" (namespaces, \
         a user namespace, seccomp allow-list, no_new_privs, dropped capabilities). \
         Untrusted code is safer in the \"gvisor\" runtime (runsc installed) or the \"microvm\" \
         runtime (a host with VMX/SVM)"
    );
}

impl Node {
    /// Prepares directories, detects cgroups and storage, opens netlink, selects and builds
    /// the runtime, recovers state.
    pub async fn start(cfg: Config, hook: Arc<dyn NetworkHook>) -> anyhow::Result<Arc<Node>> {
        use anyhow::Context;
        let gvisor = match cfg.runtime.as_str() {
            "gvisor" | "auto" => crate::runtime::gvisor::can_run(&cfg.gvisor.runsc),
            _ => Err("not asked for".into()),
        };
        let selection = crate::runtime::select(
            &cfg.runtime,
            &crate::runtime::kvm_kind(),
            &cfg.microvm,
            gvisor,
        )
        .map_err(|e| anyhow::anyhow!(e))?;
        tracing::info!(runtime = selection.runtime, kvm = %selection.kvm_kind, reason = %selection.reason, "runtime selected");
        if selection.runtime == crate::sandbox::NAMESPACE {
            warn_shared_kernel(&selection.reason);
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
        crate::template::ensure_staging(&cfg.staging_dir())
            .with_context(|| format!("staging directory {}", cfg.staging_dir().display()))?;
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
        let cg = crate::cgroup::Cgroups::detect(&cfg.cgroup.root, &cfg.cgroup.parent)
            .context("cgroups")?;
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
        let (shutdown, _) = tokio::sync::watch::channel(false);
        let host = Arc::new(Host {
            cfg,
            templates,
            cg,
            net,
            metrics: crate::metrics::Metrics::new(),
            identity,
            storage_mode,
            sandboxes_dir,
            pool_disk_dir,
            pools: SharedPools::default(),
            wake: tokio::sync::Notify::new(),
            refill_hold: std::sync::Mutex::new(None),
            shutdown,
        });
        let runtime = crate::runtime::build(&selection, host.clone())
            .with_context(|| format!("runtime {:?}", selection.runtime))?;
        let journal_dir = host.cfg.data_dir.join("journal");
        let journal = crate::journal::Journal::open(host.cfg.journal.clone(), &journal_dir)
            .with_context(|| format!("opening the journal in {}", journal_dir.display()))?;
        let node = Arc::new(Node {
            host,
            runtime,
            selection,
            registry: Mutex::new(HashMap::new()),
            refiller: Mutex::new(None),
            journal,
        });
        node.recover().await;
        node.readopt_switch().await?;
        Ok(node)
    }

    /// Gives the switch the live sandboxes' endpoints back and records the addresses it
    /// assigned to those whose state has none.
    async fn readopt_switch(&self) -> anyhow::Result<()> {
        let live: Vec<(Endpoint, Option<std::net::Ipv4Addr>, Policy)> = self
            .list()
            .await
            .into_iter()
            .filter_map(|s| s.endpoint.map(|ep| (ep, s.host_addr, s.policy)))
            .collect();
        let addrs = self
            .host
            .net
            .hook()
            .readopt(&live)
            .map_err(|e| anyhow::anyhow!("re-adopting the switch state: {e}"))?;
        for e in self.entries() {
            let mut st = e.lock().await;
            let Some(idx) = st.endpoint.as_ref().map(|ep| ep.host_ifindex) else {
                continue;
            };
            if let Some(&a) = addrs.get(&idx) {
                if st.host_addr != Some(a) {
                    st.host_addr = Some(a);
                    let id = st.id.clone();
                    if let Err(e) = self.host.save(&id, &st) {
                        tracing::error!(id, error = %e, "recording re-adopted host address");
                    }
                }
            }
        }
        Ok(())
    }

    /// Releases everything a sandbox holds. Idempotent; never fails (logs instead).
    async fn destroy(&self, dirname: &str, st: &SandboxState) {
        let reusable = self.runtime.release(st).await;
        self.host.release_rest(dirname, st, reusable).await;
    }

    /// The address the edge reaches a sandbox's agent at.
    pub fn agent_address(&self, st: &SandboxState) -> String {
        let ip = st.host_addr.unwrap_or(self.host.identity.guest_ip);
        format!("{ip}:{}", self.host.cfg.sandbox.agent_port)
    }

    /// Number of sandboxes (not counting pool entries).
    pub fn count(&self) -> usize {
        self.registry.lock().map(|r| r.len()).unwrap_or(0)
    }

    /// CreateSandbox.
    pub async fn create(&self, req: CreateRequest) -> Result<SandboxState, NodeError> {
        let t0 = Instant::now();
        check_id(&req.id)?;
        let h = &self.host;
        let (manifest, rootfs) = h.templates.get(
            &req.template,
            Some(&req.build)
                .filter(|b| !b.is_empty())
                .map(|s| s.as_str()),
        )?;
        // A snapshot is another sandbox's disk (and memory): only a create the master pinned
        // to it as the owner team's may use it, whatever the caller names.
        let is_snapshot = manifest.source == crate::template::SNAPSHOT_SOURCE;
        if is_snapshot != req.from_snapshot {
            return Err(if is_snapshot {
                NodeError::NotFound(format!("template {:?} not found", req.template))
            } else {
                NodeError::InvalidArgument(format!(
                    "template {:?} is not a snapshot (from_snapshot is set)",
                    req.template
                ))
            });
        }
        let shape = defaults::shape(&h.cfg.sandbox, req.shape, manifest.rootfs.bytes)?;
        let nameservers: Vec<String> = h
            .cfg
            .network
            .dns_resolver
            .iter()
            .map(|a| a.to_string())
            .collect();
        let spec = defaults::spec(
            &h.cfg.sandbox,
            &req,
            &rootfs,
            manifest.rootfs.bytes,
            &nameservers,
        );
        let max = h.cfg.sandbox.max_sandboxes as usize;
        let entry = Arc::new(tokio::sync::Mutex::new(SandboxState {
            id: req.id.clone(),
            key: crate::runtime::host::new_key(),
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
            envd_version: manifest.agent_version.clone(),
            end_at_ms: req.end_at_ms,
            stopped: false,
            init: None,
            host_addr: None,
            runtime: self.runtime.new_state(),
        }));
        let mut guard = entry.clone().lock_owned().await;
        let existing = {
            let mut reg = self.registry.lock().unwrap_or_else(|p| p.into_inner());
            match reg.get(&req.id) {
                Some(e) => Some(e.clone()),
                None if max > 0 && reg.len() >= max => {
                    return Err(NodeError::ResourceExhausted(format!(
                        "node is full: {} of {max} sandboxes",
                        reg.len()
                    )));
                }
                None => {
                    reg.insert(req.id.clone(), entry.clone());
                    None
                }
            }
        };
        if let Some(e) = existing {
            return self.created_already(e, &req, &manifest.name).await;
        }
        let res = match self.runtime.create(&spec, &mut guard).await {
            Ok(c) => {
                let st = &mut *guard;
                st.phase = Phase::Running;
                st.from_pool = c.from_pool;
                // A pooled sandbox's state may have replaced this one's fields.
                st.envd_version = manifest.agent_version.clone();
                st.create_latency_us = t0.elapsed().as_micros() as u64;
                if req.timeout_ms > 0 {
                    st.end_at_ms = crate::template::now_ms().saturating_add(req.timeout_ms);
                }
                h.save(&req.id, st).map(|_| c)
            }
            Err(e) => Err(e),
        };
        h.metrics
            .operations
            .with_label_values(&["create", if res.is_ok() { "ok" } else { "error" }])
            .inc();
        let st = guard.clone();
        drop(guard);
        match res {
            Ok(c) => {
                h.metrics
                    .create_seconds
                    .with_label_values(&[if c.from_pool { "true" } else { "false" }])
                    .observe(t0.elapsed().as_secs_f64());
                tracing::info!(id = %st.id, template = %st.template, runtime = st.runtime.name(), from_pool = c.from_pool, latency_us = st.create_latency_us, "sandbox ready");
                self.journal.begin(
                    &st.id,
                    st.created_at_ms,
                    Some(req.access_token.clone()).filter(|t| !t.is_empty()),
                );
                self.journal.event(
                    &st.id,
                    "info",
                    "Sandbox created",
                    &[
                        ("template", &st.template),
                        ("build", &st.build),
                        ("runtime", st.runtime.name()),
                        ("createUs", &st.create_latency_us.to_string()),
                    ],
                );
                self.update_gauges();
                h.wake.notify_one();
                Ok(st)
            }
            Err(e) => {
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

    /// A create for an id this node already has. The master resends a create whose reply it
    /// lost (a dropped connection, or this cubelet restarted and re-adopted the sandbox), so the
    /// same running sandbox of the same template is that create's answer; anything else under
    /// the id is refused. Ids are the master's, so no other create names an existing one.
    async fn created_already(
        &self,
        existing: Entry,
        req: &CreateRequest,
        template: &str,
    ) -> Result<SandboxState, NodeError> {
        // Waits for a first create still in flight to finish.
        let st = existing.lock().await.clone();
        let alive = self
            .registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&req.id)
            .is_some_and(|e| Arc::ptr_eq(e, &existing));
        if !(alive
            && st.phase == Phase::Running
            && st.template == template
            && (req.build.is_empty() || st.build == req.build))
        {
            return Err(NodeError::AlreadyExists(format!(
                "sandbox {} already exists",
                req.id
            )));
        }
        tracing::info!(id = %st.id, "create resent for a sandbox made already; answering with it");
        self.journal.begin(
            &st.id,
            st.created_at_ms,
            Some(req.access_token.clone()).filter(|t| !t.is_empty()),
        );
        Ok(st)
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
        if st.phase == Phase::Running {
            // What the agent logged last, before it goes (briefly: a kill must stay quick).
            self.pull_agent_log(&st, history::LAST_PULL_TIMEOUT).await;
        }
        let t0 = Instant::now();
        self.destroy(id, &st).await;
        self.journal.event(id, "info", "Sandbox killed", &[]);
        self.journal.end(id, crate::template::now_ms());
        tracing::debug!(id, us = t0.elapsed().as_micros() as u64, "killed");
        self.registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        drop(st);
        self.host
            .metrics
            .operations
            .with_label_values(&["kill", "ok"])
            .inc();
        self.update_gauges();
        Ok(true)
    }

    /// SetEndTime: when the master says the sandbox ends; the node's backstop kills it a grace
    /// period after, should the master not.
    pub async fn set_end_time(&self, id: &str, end_at_ms: u64) -> Result<SandboxState, NodeError> {
        let e = self.entry(id)?;
        let mut st = e.lock().await;
        if st.end_at_ms != end_at_ms {
            st.end_at_ms = end_at_ms;
            self.host.save(id, &st)?;
        }
        Ok(st.clone())
    }

    /// Kills running sandboxes whose end time is `sandbox.end_grace_s` past: the master that
    /// should have ended them is gone or cut off. Returns how many.
    pub async fn end_overdue(&self) -> usize {
        let grace = self.host.cfg.sandbox.end_grace_s;
        if grace == 0 {
            return 0;
        }
        let now = crate::template::now_ms();
        let overdue: Vec<(String, u64)> = self
            .entries()
            .into_iter()
            .filter_map(|e| {
                let st = e.try_lock().ok()?;
                let due = st.end_at_ms > 0
                    && st.phase == Phase::Running
                    && now > st.end_at_ms.saturating_add(grace * 1000);
                due.then(|| (st.id.clone(), st.end_at_ms))
            })
            .collect();
        let mut n = 0;
        for (id, end) in overdue {
            tracing::warn!(
                id,
                end_at_ms = end,
                grace_s = grace,
                "ending a sandbox its master did not end"
            );
            self.journal.event(
                &id,
                "warn",
                "Sandbox ended by its node: its end time passed without word from the master",
                &[],
            );
            match self.kill(&id).await {
                Ok(true) => {
                    n += 1;
                    self.host
                        .metrics
                        .operations
                        .with_label_values(&["end_overdue", "ok"])
                        .inc();
                }
                Ok(false) => {}
                Err(e) => tracing::error!(id, error = %e, "ending an overdue sandbox"),
            }
        }
        n
    }

    /// PauseSandbox.
    /// PauseSandbox: with `memory`, where its processes are; without, filesystem only.
    pub async fn pause(&self, id: &str, memory: bool) -> Result<SandboxState, NodeError> {
        self.set_paused(id, true, !memory).await
    }

    /// ResumeSandbox.
    /// ResumeSandbox: where it was, or with `reboot` started afresh from its disk.
    pub async fn resume(&self, id: &str, reboot: bool) -> Result<SandboxState, NodeError> {
        self.set_paused(id, false, reboot).await
    }

    /// Running ⇄ Paused through the runtime; anything else is a failed precondition. `afresh`:
    /// a pause without memory, or a resume that starts the sandbox afresh.
    async fn set_paused(
        &self,
        id: &str,
        pause: bool,
        afresh: bool,
    ) -> Result<SandboxState, NodeError> {
        let e = self.entry(id)?;
        let mut st = e.lock().await;
        let (from, to) = if pause {
            (Phase::Running, Phase::Paused)
        } else {
            (Phase::Paused, Phase::Running)
        };
        if st.phase != from {
            let why = match (pause, st.phase) {
                (true, Phase::Paused) => "is already paused".to_string(),
                (false, Phase::Running) => "is not paused".to_string(),
                (_, p) => format!("is {p:?}"),
            };
            return Err(NodeError::FailedPrecondition(format!("sandbox {id} {why}")));
        }
        let afresh = afresh || (!pause && st.stopped);
        let r = if pause {
            self.runtime.pause(&mut st, !afresh).await
        } else {
            self.runtime.resume(&mut st, afresh).await
        };
        if r.is_ok() {
            st.phase = to;
        }
        let what = match (pause, afresh) {
            (true, false) => "paused",
            (true, true) => "paused (filesystem only)",
            (false, false) => "resumed",
            (false, true) => "resumed, started afresh from its disk",
        };
        match &r {
            Ok(()) => self
                .journal
                .event(id, "info", &format!("Sandbox {what}"), &[]),
            Err(e) => self.journal.event(
                id,
                "error",
                &format!("Sandbox could not be {what}"),
                &[("error", &e.to_string())],
            ),
        }
        // What the runtime recorded counts even when it failed part-way.
        let saved = self.host.save(id, &st);
        let out = st.clone();
        drop(st);
        self.update_gauges();
        r?;
        saved?;
        Ok(out)
    }

    /// SetEgress: the sandbox's new internet switch and allow/deny entries (its ports stay).
    /// Applied at once to a running sandbox's switch port; recorded for one that has none
    /// now (it is bound with the record when it resumes).
    pub async fn set_egress(
        &self,
        id: &str,
        egress: crate::network::Egress,
    ) -> Result<SandboxState, NodeError> {
        let e = self.entry(id)?;
        let mut st = e.lock().await;
        if !matches!(st.phase, Phase::Running | Phase::Paused) {
            return Err(NodeError::FailedPrecondition(format!(
                "sandbox {id} is {:?}",
                st.phase
            )));
        }
        let policy = st.policy.with_egress(egress);
        let hook = self.host.net.hook();
        if let Some(ep) = &st.endpoint {
            hook.update_policy(ep, &policy)
                .map_err(|e| NodeError::FailedPrecondition(format!("sandbox {id}: {e}")))?;
        } else if policy.has_egress_rules() && !hook.isolates() {
            return Err(NodeError::FailedPrecondition(format!(
                "sandbox {id}: this node has no switch, so egress rules cannot be enforced"
            )));
        }
        self.journal.event(
            id,
            "info",
            "Network policy updated",
            &[
                ("internet", &policy.internet.to_string()),
                ("allowOut", &policy.allow_cidrs.join(",")),
                ("denyOut", &policy.deny_cidrs.join(",")),
                ("allowNames", &policy.allow_names.join(",")),
            ],
        );
        st.policy = policy;
        self.host.save(id, &st)?;
        Ok(st.clone())
    }

    /// GuestHealth: whether a running sandbox's agent answers `/health` now.
    pub async fn guest_health(&self, id: &str) -> Result<(bool, String), NodeError> {
        let st = self.get(id).await?;
        if st.phase != Phase::Running {
            return Err(NodeError::FailedPrecondition(format!(
                "sandbox {id} is {:?}",
                st.phase
            )));
        }
        let Some(ep) = &st.endpoint else {
            return Ok((false, "the sandbox has no network endpoint".into()));
        };
        Ok(match self.host.agent(ep, st.host_addr).health().await {
            Ok(()) => (true, String::new()),
            Err(e) => (false, e.to_string()),
        })
    }

    /// GetSandbox.
    pub async fn get(&self, id: &str) -> Result<SandboxState, NodeError> {
        let e = self.entry(id)?;
        let st = e.lock().await;
        Ok(st.clone())
    }

    /// ListSandboxes.
    pub async fn list(&self) -> Vec<SandboxState> {
        let mut out = Vec::new();
        for e in self.entries() {
            out.push(e.lock().await.clone());
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// The sandboxes not in the middle of an operation, without waiting for any: a create
    /// holds its sandbox for up to the ready timeout, and NodeStatus (the master's liveness
    /// probe) must not queue behind it and make a busy node look dead.
    pub fn list_settled(&self) -> Vec<SandboxState> {
        self.entries()
            .iter()
            .filter_map(|e| e.try_lock().ok().map(|g| g.clone()))
            .collect()
    }

    /// SnapshotSandbox: what it keeps is the runtime's [`SnapshotKind`].
    pub async fn snapshot(
        &self,
        id: &str,
        template: &str,
    ) -> Result<(crate::template::Manifest, bool), NodeError> {
        crate::template::check_name(template)?;
        let e = self.entry(id)?;
        let st = e.lock().await;
        if !matches!(st.phase, Phase::Running | Phase::Paused) {
            return Err(NodeError::FailedPrecondition(format!(
                "sandbox {id} is {:?}",
                st.phase
            )));
        }
        // A copy restored with memory still holds this sandbox's agent token; its own /init
        // must show it (the agent lets only the token's holder re-initialise it).
        let token = self.journal.token(id);
        self.runtime.snapshot(&st, template, token.as_deref()).await
    }

    /// What this node's snapshots keep.
    pub fn snapshot_kind(&self) -> SnapshotKind {
        self.runtime.snapshot_kind()
    }

    /// One sample of a sandbox's resource use.
    pub async fn sample(
        &self,
        id: &str,
    ) -> Result<cube_proto::nodev1::SandboxStatsResponse, NodeError> {
        let st = self.get(id).await?;
        self.runtime.sample(&st).await
    }

    /// How many sandboxes use a template build.
    pub fn template_users(&self, name: &str, build: &str) -> usize {
        self.entries()
            .iter()
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
        let live = self.list_settled();
        self.runtime.drain_pools(Some(name), &live).await;
        self.host.drain_pools(Some(name)).await;
        Ok(self
            .host
            .templates
            .delete(name, build, &|n, b| self.template_users(n, b))?)
    }

    /// Stops the refiller and releases pooled parts. Sandboxes keep running (they are re-adopted
    /// by the next cubelet); `kill_sandboxes` also kills them.
    pub async fn shutdown(&self, kill_sandboxes: bool) {
        let _ = self.host.shutdown.send(true);
        // Let an in-flight refill finish, so nothing lands in a pool after it was drained.
        let h = self
            .refiller
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(h) = h {
            let _ = h.await;
        }
        let live = self.list().await;
        self.runtime.drain_pools(None, &live).await;
        self.host.drain_pools(None).await;
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
        let store = self.host.templates.clone();
        let n = name.to_string();
        let r =
            tokio::task::spawn_blocking(move || store.build(&n, &source, extra_mib, &*progress))
                .await
                .map_err(crate::error::task)?;
        Ok(r?)
    }

    pub fn sandboxes_dir(&self) -> &Path {
        &self.host.sandboxes_dir
    }

    /// The metrics text, with per-sandbox switch counters refreshed.
    pub fn render_metrics(&self) -> String {
        let m = &self.host.metrics;
        // Reset so that killed sandboxes disappear from the exposition.
        m.net_packets.reset();
        m.net_bytes.reset();
        m.net_drops.reset();
        for e in self.entries() {
            let Ok(st) = e.try_lock() else { continue };
            let Some(ep) = &st.endpoint else { continue };
            let Some(c) = self.host.net.hook().counters(ep) else {
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
        self.host.cg.memory_bytes(key)
    }
}
