//! The master's operations on sandboxes: create (schedule + fail over), kill, pause,
//! connect/resume, timeouts. Every operation on one sandbox holds that sandbox's lock, so
//! concurrent calls serialise and see each other's result (idempotent kill, 409 on pause).

use crate::config::MasterConfig;
use crate::db::{encode_map, Db, PageQuery, SandboxRow};
use crate::error::MasterError;
use crate::nodes::{Node, Nodes};
use crate::scheduler::NoFit;
use crate::state::SandboxState;
use cube_proto::nodev1 as node;
use rand::Rng;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Parameters of a create.
#[derive(Debug, Clone, Default)]
pub struct CreateParams {
    pub team_id: String,
    pub template: String,
    pub timeout_s: u64,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub allow_internet: Option<bool>,
}

/// List filter.
#[derive(Debug, Clone, Default)]
pub struct ListParams {
    pub team_id: String,
    pub states: Vec<SandboxState>,
    pub metadata: BTreeMap<String, String>,
    pub limit: u32,
    pub next_token: String,
    pub ascending: bool,
    pub template: String,
}

pub struct Controller {
    pub cfg: MasterConfig,
    pub db: Db,
    pub nodes: Nodes,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Derives envd access tokens (the database keeps only their hashes).
    pub tokens: crate::token::TokenKey,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

fn random_id() -> String {
    const A: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut r = rand::thread_rng();
    let tail: String = (0..20)
        .map(|_| A[r.gen_range(0..A.len())] as char)
        .collect();
    format!("i{tail}")
}

/// Template names as cubelet accepts them.
fn valid_template(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 64
        && t.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// Why one envd version probe got no version.
enum Probe {
    /// Nothing listens there (or the address is not one): no agent to wait for.
    Refused,
    /// No answer yet (timed out, unreachable, cut off): worth another try.
    NoAnswer(String),
}

impl Controller {
    pub fn new(cfg: MasterConfig, db: Db, nodes: Nodes) -> Controller {
        let nodes = nodes.with_heartbeat_interval(cfg.heartbeat_interval_ms);
        Controller {
            cfg,
            db,
            nodes,
            metrics: Arc::new(crate::metrics::Metrics::new()),
            tokens: crate::token::TokenKey::random(),
            locks: Mutex::new(HashMap::new()),
        }
    }

    /// The token key shared by the fleet's masters (the default is one for this process only).
    pub fn with_token_key(mut self, k: crate::token::TokenKey) -> Controller {
        self.tokens = k;
        self
    }

    /// A row's envd access token, as the SDK and the node see it.
    pub fn access_token(&self, r: &SandboxRow) -> String {
        self.tokens.reveal(&r.id, &r.access_token)
    }

    pub(crate) fn lock_for(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = match self.locks.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        // Drop locks nobody holds, so the map does not grow with every sandbox ever made.
        if m.len() > 1024 {
            m.retain(|_, l| Arc::strong_count(l) > 1);
        }
        m.entry(id.to_string()).or_default().clone()
    }

    fn check_timeout(&self, t: u64) -> Result<(), MasterError> {
        if t == 0 {
            return Err(MasterError::InvalidArgument(
                "Timeout must be greater than 0".into(),
            ));
        }
        if t > self.cfg.max_timeout_s {
            return Err(MasterError::InvalidArgument(format!(
                "Timeout cannot be greater than {} hours",
                self.cfg.max_timeout_s / 3600
            )));
        }
        Ok(())
    }

    fn not_found(id: &str) -> MasterError {
        MasterError::NotFound(format!(
            "Sandbox \"{id}\" doesn't exist or you don't have access to it"
        ))
    }

    /// A live sandbox visible to `team` (empty = any team).
    pub(crate) async fn visible(&self, team: &str, id: &str) -> Result<SandboxRow, MasterError> {
        match self.db.get_sandbox(id).await? {
            Some(r) if (team.is_empty() || r.team_id == team) && !r.state()?.is_terminal() => Ok(r),
            _ => Err(Self::not_found(id)),
        }
    }

    /// A sandbox being killed is already gone for callers (E2B answers 404 from the kill on).
    pub async fn get(&self, team: &str, id: &str) -> Result<SandboxRow, MasterError> {
        let r = self.visible(team, id).await?;
        if r.state()? == SandboxState::Killing {
            return Err(Self::not_found(id));
        }
        Ok(r)
    }

    pub async fn by_access_token(&self, token: &str) -> Result<SandboxRow, MasterError> {
        // A stored hash is not a token (it would match itself as a legacy plain token).
        if token.is_empty() || token.starts_with(crate::token::HASHED) {
            return Err(MasterError::NotFound(
                "no sandbox has this access token".into(),
            ));
        }
        self.db
            .by_access_token(&crate::token::stored(token), token)
            .await?
            .ok_or_else(|| MasterError::NotFound("no sandbox has this access token".into()))
    }

    pub async fn create(&self, mut p: CreateParams) -> Result<SandboxRow, MasterError> {
        if !valid_template(&p.template) {
            return Err(MasterError::InvalidArgument(format!(
                "invalid template id {:?}",
                p.template
            )));
        }
        self.check_timeout(p.timeout_s)?;
        // A snapshot (by id or name) lives on one node: placement is pinned there.
        let pinned = crate::snapshots::pin_for_create(self, &mut p).await?;
        let pinned_snapshot = pinned.is_some();
        let decision_start = std::time::Instant::now();
        let mut _inflight = None;
        let placed = pinned.unwrap_or_else(|| {
            self.nodes
                .place(&p.template, self.cfg.default_memory_mib)
                .map(|(c, g)| {
                    _inflight = g;
                    c
                })
        });
        self.metrics
            .decision_seconds
            .observe(decision_start.elapsed().as_secs_f64());
        let outcome = match &placed {
            Ok(_) => "placed",
            Err(NoFit::NoReadyNode) => "no_ready_node",
            Err(NoFit::NoTemplate) => "no_template",
            Err(NoFit::NoCapacity) => "no_capacity",
        };
        self.metrics.decisions.with_label_values(&[outcome]).inc();
        let cands = match placed {
            Ok(c) => c,
            Err(NoFit::NoTemplate) => {
                return Err(MasterError::NotFound(format!(
                    "template '{}' not found",
                    p.template
                )))
            }
            Err(NoFit::NoReadyNode) => {
                return Err(MasterError::Unavailable("no node is ready".into()))
            }
            Err(NoFit::NoCapacity) => {
                return Err(MasterError::ResourceExhausted(
                    "no node has capacity for another sandbox".into(),
                ))
            }
        };
        let now = crate::now_ms();
        let mut row = SandboxRow {
            id: random_id(),
            team_id: p.team_id.clone(),
            template: p.template.clone(),
            build: String::new(),
            state: SandboxState::Creating.as_str().into(),
            reason: String::new(),
            node_id: String::new(),
            agent_address: String::new(),
            host_interface: String::new(),
            access_token: String::new(),
            envd_version: String::new(),
            metadata: encode_map(&p.metadata),
            vcpus: self.cfg.default_vcpus as i64,
            memory_mib: self.cfg.default_memory_mib as i64,
            disk_mib: 0,
            runtime: String::new(),
            started_at_ms: now,
            end_at_ms: now + (p.timeout_s as i64) * 1000,
            updated_at_ms: now,
        };
        row.access_token = crate::token::stored(&self.tokens.token(&row.id));
        let lock = self.lock_for(&row.id);
        let _g = lock.lock().await;
        self.db.insert_sandbox(&row).await?;
        let span = tracing::info_span!("create", sandbox = %row.id, template = %p.template);
        let _e = span.enter();
        let mut last_err = None;
        for n in cands {
            match self.create_on(&n, &row, &p, pinned_snapshot).await {
                Ok(sb) => {
                    self.nodes.placed(&n.address);
                    row.node_id = n.id();
                    row.agent_address = sb.agent_address.clone();
                    row.host_interface = sb.host_interface.clone();
                    row.build = sb.build.clone();
                    row.runtime = sb.runtime.clone();
                    row.disk_mib = sb.shape.as_ref().map(|s| s.disk_mib as i64).unwrap_or(0);
                    row.envd_version = self
                        .probe_envd_version(&row.agent_address, &row.host_interface)
                        .await
                        .unwrap_or_else(|| self.cfg.default_envd_version.clone());
                    self.db.set_placement(&row).await?;
                    // The timeout counts from when the sandbox is usable.
                    let start = crate::now_ms();
                    row.started_at_ms = start;
                    row.end_at_ms = start + (p.timeout_s as i64) * 1000;
                    self.db.set_end(&row.id, row.end_at_ms).await?;
                    if !self
                        .db
                        .transition(
                            &row.id,
                            SandboxState::Creating,
                            SandboxState::Running,
                            "created",
                        )
                        .await?
                    {
                        return Err(MasterError::Internal(format!(
                            "sandbox {} left creating meanwhile",
                            row.id
                        )));
                    }
                    row.state = SandboxState::Running.as_str().into();
                    tracing::info!(node = %row.node_id, agent = %row.agent_address, "sandbox running");
                    return Ok(row);
                }
                Err(e) => {
                    tracing::warn!(node = %n.address, error = %e, "create failed on node");
                    // Whatever the node managed to set up goes (kill is idempotent).
                    let mut c = n.client.clone();
                    let _ = tokio::time::timeout(
                        Duration::from_secs(30),
                        c.kill_sandbox(node::SandboxRef {
                            sandbox_id: row.id.clone(),
                        }),
                    )
                    .await;
                    let fatal = matches!(&e, MasterError::Node { status, .. }
                        if status.code() == tonic::Code::InvalidArgument);
                    last_err = Some(e);
                    self.metrics.failovers.inc();
                    if fatal {
                        break;
                    }
                }
            }
        }
        let err = last_err.unwrap_or_else(|| MasterError::Unavailable("no node".into()));
        let _ = self
            .db
            .transition(
                &row.id,
                SandboxState::Creating,
                SandboxState::Failed,
                &err.to_string(),
            )
            .await;
        Err(err)
    }

    async fn create_on(
        &self,
        n: &Node,
        row: &SandboxRow,
        p: &CreateParams,
        from_snapshot: bool,
    ) -> Result<node::Sandbox, MasterError> {
        let req = node::CreateSandboxRequest {
            template: p.template.clone(),
            build: String::new(),
            sandbox_id: row.id.clone(),
            shape: Some(node::Shape {
                vcpus: self.cfg.default_vcpus,
                memory_mib: self.cfg.default_memory_mib,
                disk_mib: 0,
            }),
            env_vars: p.env_vars.clone().into_iter().collect(),
            metadata: p.metadata.clone().into_iter().collect(),
            network: Some(node::NetworkPolicy {
                internet: p.allow_internet.unwrap_or(true),
                ..Default::default()
            }),
            access_token: self.access_token(row),
            default_user: String::new(),
            default_workdir: String::new(),
            ready_timeout_ms: 0,
            from_snapshot,
        };
        let mut c = n.client.clone();
        let t = Duration::from_millis(self.cfg.create_timeout_ms);
        match tokio::time::timeout(t, c.create_sandbox(req)).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(status)) => Err(MasterError::Node {
                node: n.address.clone(),
                status: Box::new(status),
            }),
            Err(_) => Err(MasterError::Node {
                node: n.address.clone(),
                status: Box::new(tonic::Status::deadline_exceeded("create timed out")),
            }),
        }
    }

    /// Reads `x-envd-version` from the agent's /health (what the agent really implements).
    async fn probe_envd_version(&self, addr: &str, iface: &str) -> Option<String> {
        // A sandbox restored from a running one's snapshot (a microVM fork) may take a moment
        // before its guest network answers, though the node already reached it over vsock:
        // retry an agent that does not answer for a while. One that refuses the connection is
        // not there at all, and one that answers without the header is an older agent: the
        // fallback, at once.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match Self::probe_envd_once(addr, iface).await {
                Ok(v) => return v,
                Err(Probe::Refused) => return None,
                Err(Probe::NoAnswer(_)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(Probe::NoAnswer(why)) => {
                    tracing::warn!(agent = %addr, %why, "envd version probe: no answer; using the default");
                    return None;
                }
            }
        }
    }

    /// `Ok(version header)` from one `GET /health`.
    async fn probe_envd_once(addr: &str, iface: &str) -> Result<Option<String>, Probe> {
        let sa: std::net::SocketAddr = addr.parse().map_err(|_| Probe::Refused)?;
        let no_answer = |e: std::io::Error| {
            if e.kind() == std::io::ErrorKind::ConnectionRefused {
                Probe::Refused
            } else {
                Probe::NoAnswer(e.to_string())
            }
        };
        let fut = async {
            let sock = if sa.is_ipv4() {
                tokio::net::TcpSocket::new_v4()
            } else {
                tokio::net::TcpSocket::new_v6()
            }
            .map_err(no_answer)?;
            if !iface.is_empty() {
                sock.bind_device(Some(iface.as_bytes()))
                    .map_err(no_answer)?;
            }
            let mut s = sock.connect(sa).await.map_err(no_answer)?;
            s.write_all(b"GET /health HTTP/1.0\r\nHost: agent\r\n\r\n")
                .await
                .map_err(no_answer)?;
            let mut buf = Vec::new();
            s.take(16 * 1024)
                .read_to_end(&mut buf)
                .await
                .map_err(no_answer)?;
            if !buf.starts_with(b"HTTP/") {
                return Err(Probe::NoAnswer("not an HTTP response".into()));
            }
            let text = String::from_utf8_lossy(&buf);
            Ok(text.lines().take_while(|l| !l.is_empty()).find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case("x-envd-version")
                    .then(|| v.trim().to_string())
            }))
        };
        tokio::time::timeout(Duration::from_secs(2), fut)
            .await
            .map_err(|_| Probe::NoAnswer("timed out".into()))?
    }

    pub(crate) fn node_of(&self, row: &SandboxRow) -> Result<Node, MasterError> {
        self.nodes.find(&row.node_id).ok_or_else(|| {
            MasterError::Unavailable(format!(
                "node {} of sandbox {} is unknown",
                row.node_id, row.id
            ))
        })
    }

    /// Kills a sandbox; `Ok(false)` when it does not exist (or is gone already).
    pub async fn kill(&self, team: &str, id: &str, reason: &str) -> Result<bool, MasterError> {
        let lock = self.lock_for(id);
        let _g = lock.lock().await;
        let row = match self.visible(team, id).await {
            Ok(r) => r,
            Err(MasterError::NotFound(_)) => return Ok(false),
            Err(e) => return Err(e),
        };
        let st = row.state()?;
        if st != SandboxState::Killing
            && !self
                .db
                .transition(id, st, SandboxState::Killing, reason)
                .await?
        {
            return Err(MasterError::Internal(format!(
                "sandbox {id} changed state meanwhile"
            )));
        }
        // A node that is gone cannot be asked; the sandbox is recorded killed now and removed
        // from the node if it comes back (see lifecycle::reconcile).
        let node_away = self
            .nodes
            .find(&row.node_id)
            .is_some_and(|n| n.health == crate::nodes::Health::NotReady);
        if !row.node_id.is_empty() && !node_away {
            let n = self.node_of(&row)?;
            let mut c = n.client.clone();
            let r = tokio::time::timeout(
                Duration::from_secs(30),
                c.kill_sandbox(node::SandboxRef {
                    sandbox_id: id.to_string(),
                }),
            )
            .await;
            match r {
                Ok(Ok(_)) => {}
                // Left in `killing`: the reaper retries it.
                Ok(Err(s)) => {
                    return Err(MasterError::Node {
                        node: n.address,
                        status: Box::new(s),
                    })
                }
                Err(_) => return Err(MasterError::Unavailable(format!("kill of {id} timed out"))),
            }
        }
        self.db
            .transition(id, SandboxState::Killing, SandboxState::Killed, reason)
            .await?;
        tracing::info!(sandbox = %id, %reason, "sandbox killed");
        Ok(true)
    }

    pub async fn set_timeout(
        &self,
        team: &str,
        id: &str,
        t: u64,
    ) -> Result<SandboxRow, MasterError> {
        self.check_timeout(t)?;
        let lock = self.lock_for(id);
        let _g = lock.lock().await;
        let mut row = self.visible(team, id).await?;
        row.end_at_ms = crate::now_ms() + (t as i64) * 1000;
        self.db.set_end(id, row.end_at_ms).await?;
        Ok(row)
    }

    pub async fn pause(&self, team: &str, id: &str) -> Result<SandboxRow, MasterError> {
        let lock = self.lock_for(id);
        let _g = lock.lock().await;
        let row = self.visible(team, id).await?;
        match row.state()? {
            SandboxState::Running => {}
            SandboxState::Paused | SandboxState::Pausing => {
                return Err(MasterError::FailedPrecondition(format!(
                    "Sandbox \"{id}\" is already paused"
                )))
            }
            s => {
                return Err(MasterError::FailedPrecondition(format!(
                    "Sandbox \"{id}\" cannot be paused while {s}"
                )))
            }
        }
        self.db
            .transition(
                id,
                SandboxState::Running,
                SandboxState::Pausing,
                "pause requested",
            )
            .await?;
        let n = self.node_of(&row)?;
        let mut c = n.client.clone();
        let r = c
            .pause_sandbox(node::SandboxRef {
                sandbox_id: id.to_string(),
            })
            .await;
        match r {
            Ok(_) => {
                self.db
                    .transition(id, SandboxState::Pausing, SandboxState::Paused, "paused")
                    .await?;
                self.visible(team, id).await
            }
            Err(s) => {
                self.db
                    .transition(
                        id,
                        SandboxState::Pausing,
                        SandboxState::Running,
                        &format!("pause failed: {}", s.message()),
                    )
                    .await?;
                Err(MasterError::Node {
                    node: n.address,
                    status: Box::new(s),
                })
            }
        }
    }

    /// Extends a running sandbox, or resumes a paused one. Returns (row, resumed).
    pub async fn connect(
        &self,
        team: &str,
        id: &str,
        t: u64,
    ) -> Result<(SandboxRow, bool), MasterError> {
        self.check_timeout(t)?;
        let lock = self.lock_for(id);
        let _g = lock.lock().await;
        let mut row = self.visible(team, id).await?;
        let new_end = crate::now_ms() + (t as i64) * 1000;
        match row.state()? {
            SandboxState::Running => {
                // Connecting never shortens a running sandbox's life.
                if new_end > row.end_at_ms {
                    row.end_at_ms = new_end;
                    self.db.set_end(id, new_end).await?;
                }
                Ok((row, false))
            }
            SandboxState::Paused => {
                self.db
                    .transition(
                        id,
                        SandboxState::Paused,
                        SandboxState::Resuming,
                        "resume requested",
                    )
                    .await?;
                let n = self.node_of(&row)?;
                let mut c = n.client.clone();
                match c
                    .resume_sandbox(node::SandboxRef {
                        sandbox_id: id.to_string(),
                    })
                    .await
                {
                    Ok(_) => {
                        self.db.set_end(id, new_end).await?;
                        self.db
                            .transition(
                                id,
                                SandboxState::Resuming,
                                SandboxState::Running,
                                "resumed",
                            )
                            .await?;
                        Ok((self.visible(team, id).await?, true))
                    }
                    Err(s) => {
                        self.db
                            .transition(
                                id,
                                SandboxState::Resuming,
                                SandboxState::Paused,
                                &format!("resume failed: {}", s.message()),
                            )
                            .await?;
                        Err(MasterError::Node {
                            node: n.address,
                            status: Box::new(s),
                        })
                    }
                }
            }
            s => Err(MasterError::FailedPrecondition(format!(
                "Sandbox \"{id}\" is {s}; try again"
            ))),
        }
    }

    /// One page of sandboxes. The token is the last row's `<started_at_ms>.<id>`.
    pub async fn list(&self, p: ListParams) -> Result<(Vec<SandboxRow>, String), MasterError> {
        let states = if p.states.is_empty() {
            vec![SandboxState::Running, SandboxState::Paused]
        } else {
            p.states.clone()
        };
        let limit = if p.limit == 0 { 100 } else { p.limit.min(100) } as usize;
        let cursor = if p.next_token.is_empty() {
            None
        } else {
            let (ms, id) = p
                .next_token
                .split_once('.')
                .and_then(|(a, b)| Some((a.parse::<i64>().ok()?, b.to_string())))
                .ok_or_else(|| MasterError::InvalidArgument("invalid next token".into()))?;
            Some((ms, id))
        };
        // Metadata is filtered here (it is an encoded list, not columns): fetch pages until
        // one more match than the limit shows there is a next page.
        let batch = if p.metadata.is_empty() {
            limit + 1
        } else {
            (limit + 1).max(256)
        };
        let mut rows: Vec<SandboxRow> = Vec::new();
        let mut after = cursor;
        loop {
            let got = self
                .db
                .page_sandboxes(&PageQuery {
                    states: &states,
                    team_id: &p.team_id,
                    template: &p.template,
                    cursor: after.clone(),
                    ascending: p.ascending,
                    limit: batch,
                })
                .await?;
            let full = got.len() == batch;
            if let Some(last) = got.last() {
                after = Some((last.started_at_ms, last.id.clone()));
            }
            rows.extend(got.into_iter().filter(|r| {
                let m = r.metadata_map();
                p.metadata.iter().all(|(k, v)| m.get(k) == Some(v))
            }));
            if rows.len() > limit || !full {
                break;
            }
        }
        let more = rows.len() > limit;
        rows.truncate(limit);
        let token = match (more, rows.last()) {
            (true, Some(r)) => format!("{}.{}", r.started_at_ms, r.id),
            _ => String::new(),
        };
        Ok((rows, token))
    }

    /// Kills expired sandboxes and retries kills left half-done.
    pub async fn reap_once(&self) -> Result<usize, MasterError> {
        let mut ids = self.db.expired(crate::now_ms()).await?;
        ids.extend(
            self.db
                .list_in_states(&[SandboxState::Killing])
                .await?
                .into_iter()
                .map(|r| r.id),
        );
        let mut n = 0;
        for id in ids {
            match self.kill("", &id, "timeout").await {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => tracing::warn!(sandbox = %id, error = %e, "reaper kill failed"),
            }
        }
        if self.cfg.killed_retention_s > 0 {
            let before = crate::now_ms().saturating_sub(
                i64::try_from(self.cfg.killed_retention_s * 1000).unwrap_or(i64::MAX),
            );
            let purged = self.db.purge_killed(before).await?;
            if purged > 0 {
                tracing::debug!(purged, "deleted rows of long-killed sandboxes");
            }
        }
        Ok(n)
    }
}
