//! The master's operations on sandboxes: create (schedule + fail over), kill, pause,
//! connect/resume, timeouts, list, the reaper's pass over sandboxes past their end, and the
//! failing of creates nobody will finish (their master is gone, or their end went unrecorded).

use super::{node_end, Controller, CreateParams, ListParams};
use crate::error::MasterError;
use crate::fleet::scheduler::NoFit;
use crate::fleet::{Health, Node};
use crate::state::SandboxState;
use crate::store::{encode_map, PageQuery, SandboxRow};
use cube_proto::nodev1 as node;
use std::time::Duration;
use tracing::Instrument;

/// The reason a create cut short by its master's end is failed with.
pub const INTERRUPTED_CREATE: &str = "create interrupted: the master restarted before it finished";
/// Why the reaper fails a create whose end went unrecorded.
pub const UNRECORDED_CREATE: &str =
    "create failed: its outcome could not be recorded (the database was unavailable)";

fn random_id() -> String {
    crate::ids::random_id("i", 20)
}

/// Template names as cubelet accepts them.
fn valid_template(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 64
        && t.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// A sandbox a node created, and the end it set itself (None: a node that does not count
/// `timeout_ms`, or none asked).
struct Created {
    sb: node::Sandbox,
    node_end_ms: Option<i64>,
}

impl Controller {
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

    /// A sandbox being killed is already gone for callers (E2B answers 404 from the kill on).
    pub async fn get(&self, team: &str, id: &str) -> Result<SandboxRow, MasterError> {
        let r = self.visible(team, id).await?;
        if r.state == SandboxState::Killing {
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

    pub async fn create(&self, p: CreateParams) -> Result<SandboxRow, MasterError> {
        if !valid_template(&p.template) {
            return Err(MasterError::InvalidArgument(format!(
                "invalid template id {:?}",
                p.template
            )));
        }
        self.check_timeout(p.timeout_s)?;
        if p.auto_resume && !p.auto_pause {
            return Err(MasterError::InvalidArgument(
                "autoResume needs autoPause: only a sandbox paused at its timeout can be resumed by traffic".into(),
            ));
        }
        if p.auto_resume && p.auto_pause_filesystem {
            return Err(MasterError::InvalidArgument(
                "autoResume cannot be combined with a filesystem-only auto-pause (autoPauseMemory false): such a sandbox restarts on resume, which traffic must not do".into(),
            ));
        }
        let id = random_id();
        if !p.idempotency_key.is_empty() {
            if let Some(row) = self.idempotent_replay(&p, &id).await? {
                return Ok(row);
            }
        }
        let (team, key) = (p.team_id.clone(), p.idempotency_key.clone());
        let r = self.create_as(&id, p).await;
        if r.is_err() && !key.is_empty() {
            // A failed create leaves nothing to return: the key may be used again.
            if let Err(e) = self.db.release_idempotency_key(&team, &key, &id).await {
                tracing::warn!(sandbox = %id, error = %e, "could not release an idempotency key");
            }
        }
        r
    }

    /// Claims the create's idempotency key for `id`; if an earlier create holds it, waits
    /// for that create to end and answers with its sandbox.
    async fn idempotent_replay(
        &self,
        p: &CreateParams,
        id: &str,
    ) -> Result<Option<SandboxRow>, MasterError> {
        let key = &p.idempotency_key;
        if key.len() > 255 || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(MasterError::InvalidArgument(
                "Idempotency-Key must be 1-255 printable ASCII characters".into(),
            ));
        }
        let fp = p.fingerprint();
        let other_request = || {
            MasterError::FailedPrecondition(format!(
                "Idempotency-Key {key:?} was used for a different create request"
            ))
        };
        let Some((held, held_fp)) = self
            .db
            .claim_idempotency_key(&p.team_id, key, id, &fp)
            .await?
        else {
            return Ok(None);
        };
        if held_fp != fp {
            return Err(other_request());
        }
        self.metrics.idempotent_replays.inc();
        // The first create may still be running: it answers within its create timeout.
        let deadline = tokio::time::Instant::now()
            + Duration::from_millis(self.cfg.create_timeout_ms.saturating_mul(2));
        let mut held = held;
        loop {
            let row = self.db.get_sandbox(&held).await?;
            let state = row.as_ref().map(|r| r.state);
            // The first create failed (its master died mid-create, or the release after its
            // failure did not happen): nothing to answer with, so the key is let go.
            let failed = state == Some(SandboxState::Failed);
            if failed {
                self.db
                    .release_idempotency_key(&p.team_id, key, &held)
                    .await?;
            }
            if row.is_none() || failed {
                // Claimed but not inserted yet, or its create failed and let the key go:
                // claim it again (then this create goes ahead under it).
                match self
                    .db
                    .claim_idempotency_key(&p.team_id, key, id, &fp)
                    .await?
                {
                    None => return Ok(None),
                    Some((h, f)) if f == fp => held = h,
                    Some(_) => return Err(other_request()),
                }
                if failed {
                    continue;
                }
            }
            match state {
                // Not inserted yet, or still being created.
                None | Some(SandboxState::Creating) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                None | Some(SandboxState::Creating) => {
                    return Err(MasterError::Unavailable(format!(
                        "the create with Idempotency-Key {key:?} has not finished; retry"
                    )))
                }
                Some(s) if s.is_terminal() || s == SandboxState::Killing => {
                    return Err(MasterError::FailedPrecondition(format!(
                        "the sandbox created with Idempotency-Key {key:?} is {s}"
                    )))
                }
                Some(_) => return Ok(row),
            }
        }
    }

    async fn create_as(&self, id: &str, mut p: CreateParams) -> Result<SandboxRow, MasterError> {
        // A snapshot (by id or name) lives on one node: placement is pinned there.
        let pinned = self.pin_for_create(&mut p).await?;
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
            id: id.to_string(),
            team_id: p.team_id.clone(),
            template: p.template.clone(),
            build: String::new(),
            state: SandboxState::Creating,
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
            auto_pause: i64::from(p.auto_pause),
            auto_resume: i64::from(p.auto_resume),
            timeout_s: p.timeout_s as i64,
            internet: i64::from(p.allow_internet.unwrap_or(true)),
            private_ports: i64::from(p.private_ports),
            mask_request_host: p.mask_request_host.clone(),
            allow_out: crate::egress::Rules::encode(&p.egress.allow_out),
            deny_out: crate::egress::Rules::encode(&p.egress.deny_out),
            dns_servers: p.egress.encode_dns(),
            pause_mode: String::new(),
            auto_pause_filesystem: i64::from(p.auto_pause_filesystem),
        };
        row.access_token = crate::token::stored(&self.tokens.token(&row.id));
        let lock = self.lock_for(&row.id);
        let _g = lock.lock().await;
        self.db.insert_sandbox(&row).await?;
        let span = tracing::info_span!("create", sandbox = %row.id, template = %p.template);
        // Instrumented, not `span.enter()`: a guard held across an await corrupts the
        // subscriber's per-thread span stack once the task moves threads (under load the
        // registry panicked, "tried to clone a span that already closed", failing the create).
        async {
            let mut last_err = None;
            for n in cands {
                match self.create_on(&n, &row, &p, pinned_snapshot).await {
                    Ok(made) => {
                        self.nodes.placed(&n.address);
                        return match self.record_created(&n, &mut row, &p, &made).await {
                            Ok(()) => {
                                tracing::info!(node = %row.node_id, agent = %row.agent_address, "sandbox running");
                                Ok(row)
                            }
                            Err(e) => {
                                // The node runs it but the row cannot say so (the database
                                // is away): it goes, so that no sandbox runs unrecorded.
                                tracing::warn!(node = %n.address, error = %e, "recording a created sandbox failed; killing it");
                                self.kill_on(&n, &row.id).await;
                                self.fail_create(&row.id, &e).await;
                                Err(e)
                            }
                        };
                    }
                    Err(e) => {
                        tracing::warn!(node = %n.address, error = %e, "create failed on node");
                        // Whatever the node managed to set up goes (kill is idempotent).
                        self.kill_on(&n, &row.id).await;
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
            self.fail_create(&row.id, &err).await;
            Err(err)
        }
        .instrument(span)
        .await
    }

    /// Records a sandbox the node created: placement, end time, `running`.
    async fn record_created(
        &self,
        n: &Node,
        row: &mut SandboxRow,
        p: &CreateParams,
        made: &Created,
    ) -> Result<(), MasterError> {
        let sb = &made.sb;
        row.node_id = n.id();
        row.agent_address = sb.agent_address.clone();
        row.host_interface = sb.host_interface.clone();
        row.build = sb.build.clone();
        row.runtime = sb.runtime.clone();
        row.disk_mib = sb.shape.as_ref().map(|s| s.disk_mib as i64).unwrap_or(0);
        // What the node recorded for the template's agent; a build from before it was
        // recorded gets the configured default.
        row.envd_version = if sb.envd_version.is_empty() {
            self.cfg.default_envd_version.clone()
        } else {
            sb.envd_version.clone()
        };
        // The timeout counts from when the sandbox is usable; the node counted it already
        // (`timeout_ms`), and its end is the one recorded. Placement, times and state in one
        // write.
        let timeout_ms = (p.timeout_s as i64) * 1000;
        row.end_at_ms = made
            .node_end_ms
            .unwrap_or_else(|| crate::now_ms() + timeout_ms);
        row.started_at_ms = row.end_at_ms - timeout_ms;
        if !self.db.record_created(row, "created").await? {
            return Err(MasterError::Internal(format!(
                "sandbox {} left creating meanwhile",
                row.id
            )));
        }
        row.state = SandboxState::Running;
        let end = node_end(row, row.end_at_ms);
        if made.node_end_ms.is_none() && end != 0 {
            self.tell_end(n, &row.id, end).await;
        }
        Ok(())
    }

    /// Kills what a create made on `n` (kill is idempotent; a failure is left to reconcile).
    async fn kill_on(&self, n: &Node, id: &str) {
        let mut c = n.client.clone();
        let _ = tokio::time::timeout(
            Duration::from_secs(30),
            c.kill_sandbox(node::SandboxRef {
                sandbox_id: id.to_string(),
            }),
        )
        .await;
    }

    /// Marks a create `failed` with its error. If the database refuses even that, the row
    /// stays `creating` with no create holding it, and the reaper fails it later
    /// ([`Controller::fail_unowned_creates`]).
    async fn fail_create(&self, id: &str, err: &MasterError) {
        let r = self
            .db
            .transition(
                id,
                SandboxState::Creating,
                SandboxState::Failed,
                &err.to_string(),
            )
            .await;
        if let Err(e) = r {
            tracing::warn!(sandbox = %id, error = %e, "could not mark a failed create; the reaper will");
        }
    }

    /// Creates the sandbox on `n`.
    async fn create_on(
        &self,
        n: &Node,
        row: &SandboxRow,
        p: &CreateParams,
        from_snapshot: bool,
    ) -> Result<Created, MasterError> {
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
            network: Some({
                let e = crate::egress::node_policy(p.allow_internet.unwrap_or(true), &p.egress);
                node::NetworkPolicy {
                    internet: e.internet,
                    allow_cidrs: e.allow_cidrs,
                    deny_cidrs: e.deny_cidrs,
                    allow_names: e.allow_names,
                    dns: e.dns,
                    // Any port the sandbox listens on is reachable through the edge (E2B's public
                    // ports); the edge decides who may use them (allowPublicTraffic).
                    all_ports: true,
                    ..Default::default()
                }
            }),
            access_token: self.access_token(row),
            default_user: String::new(),
            default_workdir: String::new(),
            ready_timeout_ms: 0,
            from_snapshot,
            // The latest it can end (its timeout counts from when it runs, SetEndTime after);
            // none for a sandbox paused at its end (the node cannot pause it for the master).
            end_at_ms: u64::try_from(node_end(
                row,
                crate::now_ms()
                    + i64::try_from(self.cfg.create_timeout_ms).unwrap_or(0)
                    + p.timeout_s as i64 * 1000,
            ))
            .unwrap_or(0),
            // The node counts the timeout from when the sandbox is ready: no SetEndTime after.
            timeout_ms: u64::try_from(node_end(row, p.timeout_s as i64 * 1000)).unwrap_or(0),
        };
        let (backstop, counts) = (req.end_at_ms, req.timeout_ms > 0);
        let mut c = n.client.clone();
        let t = Duration::from_millis(self.cfg.create_timeout_ms);
        match tokio::time::timeout(t, c.create_sandbox(req)).await {
            Ok(Ok(r)) => {
                let sb = r.into_inner();
                // A node from before `timeout_ms` keeps the backstop: it is told the end.
                let node_end_ms = (counts && sb.end_at_ms != 0 && sb.end_at_ms != backstop)
                    .then(|| i64::try_from(sb.end_at_ms).ok())
                    .flatten();
                Ok(Created { sb, node_end_ms })
            }
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

    /// Records when a sandbox ends, and tells its node (the node kills a running sandbox
    /// itself once that is long past: a backstop should this master be gone). A node that
    /// does not answer is told by the next reconcile.
    pub(crate) async fn set_end(
        &self,
        row: &SandboxRow,
        end_at_ms: i64,
    ) -> Result<(), MasterError> {
        self.db.set_end(&row.id, end_at_ms).await?;
        if let Ok(n) = self.node_of(row) {
            self.tell_end(&n, &row.id, node_end(row, end_at_ms)).await;
        }
        Ok(())
    }

    /// SetEndTime on `n`, bounded; a failure is logged (the reconcile repeats it).
    pub(crate) async fn tell_end(&self, n: &Node, id: &str, end_at_ms: i64) -> bool {
        let mut c = n.client.clone();
        let req = node::SetEndTimeRequest {
            sandbox_id: id.to_string(),
            end_at_ms: u64::try_from(end_at_ms).unwrap_or(0),
        };
        match tokio::time::timeout(Duration::from_secs(2), c.set_end_time(req)).await {
            Ok(Ok(_)) => true,
            Ok(Err(e)) => {
                tracing::warn!(sandbox = id, node = %n.address, error = %e, "SetEndTime failed");
                false
            }
            Err(_) => {
                tracing::warn!(sandbox = id, node = %n.address, "SetEndTime timed out");
                false
            }
        }
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
        let st = row.state;
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
            .is_some_and(|n| n.health == Health::NotReady);
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

    /// New end = now + `t`; with `extend_only` (E2B's refresh) a later end is kept and
    /// `t` may be 0.
    pub async fn set_timeout(
        &self,
        team: &str,
        id: &str,
        t: u64,
        extend_only: bool,
    ) -> Result<SandboxRow, MasterError> {
        if !(extend_only && t == 0) {
            self.check_timeout(t)?;
        }
        let lock = self.lock_for(id);
        let _g = lock.lock().await;
        let mut row = self.visible(team, id).await?;
        let end = crate::now_ms() + (t as i64) * 1000;
        if extend_only && end <= row.end_at_ms {
            return Ok(row);
        }
        row.end_at_ms = end;
        self.set_end(&row, row.end_at_ms).await?;
        Ok(row)
    }

    /// Replaces a running or paused sandbox's egress configuration (E2B's update network):
    /// the node's switch first, then the record, so the record never claims rules the node
    /// did not take.
    pub async fn update_network(
        &self,
        team: &str,
        id: &str,
        internet: bool,
        rules: crate::egress::Rules,
    ) -> Result<SandboxRow, MasterError> {
        let lock = self.lock_for(id);
        let _g = lock.lock().await;
        let row = self.visible(team, id).await?;
        match row.state {
            SandboxState::Running | SandboxState::Paused => {}
            s => {
                return Err(MasterError::FailedPrecondition(format!(
                    "Sandbox \"{id}\" cannot change its network while {s}"
                )))
            }
        }
        let e = crate::egress::node_policy(internet, &rules);
        let n = self.node_of(&row)?;
        let mut c = n.client.clone();
        c.set_egress(node::SetEgressRequest {
            sandbox_id: id.to_string(),
            internet: e.internet,
            allow_cidrs: e.allow_cidrs,
            deny_cidrs: e.deny_cidrs,
            allow_names: e.allow_names,
            dns: e.dns,
        })
        .await
        .map_err(|s| MasterError::Node {
            node: n.address.clone(),
            status: Box::new(s),
        })?;
        self.db.set_egress(id, internet, &rules).await?;
        self.visible(team, id).await
    }

    /// When a sandbox paused now is killed (`paused_retention_s` from now).
    fn paused_until(&self) -> i64 {
        match self.cfg.paused_retention_s {
            // "Until killed": far enough that no reaper pass sees it, small enough for any SQL.
            0 => i64::MAX / 4,
            s => crate::now_ms()
                .saturating_add(i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX / 4)),
        }
    }

    /// A pause that keeps memory; see [`Controller::pause_with`].
    pub async fn pause(
        &self,
        team: &str,
        id: &str,
        require_healthy_guest: bool,
    ) -> Result<SandboxRow, MasterError> {
        self.pause_with(team, id, require_healthy_guest, false)
            .await
    }

    /// A pause; `require_healthy_guest` (implied by `filesystem_only`: the sandbox's writes
    /// are flushed through it) first asks the node whether the sandbox's agent answers and
    /// refuses (Unavailable, the sandbox keeps running) when it does not. `filesystem_only`:
    /// its processes end, and a resume starts it afresh from its disk.
    pub async fn pause_with(
        &self,
        team: &str,
        id: &str,
        require_healthy_guest: bool,
        filesystem_only: bool,
    ) -> Result<SandboxRow, MasterError> {
        let lock = self.lock_for(id);
        let _g = lock.lock().await;
        let row = self.visible(team, id).await?;
        if (require_healthy_guest || filesystem_only) && row.state == SandboxState::Running {
            let n = self.node_of(&row)?;
            let mut c = n.client.clone();
            let h = c
                .guest_health(node::SandboxRef {
                    sandbox_id: id.to_string(),
                })
                .await
                .map_err(|s| MasterError::Node {
                    node: n.address.clone(),
                    status: Box::new(s),
                })?
                .into_inner();
            if !h.healthy {
                return Err(MasterError::Unavailable(format!(
                    "Sandbox \"{id}\" was not paused: its guest agent does not answer ({}); it keeps running, retry later",
                    h.detail
                )));
            }
        }
        self.pause_locked(team, row, "paused", filesystem_only)
            .await
    }

    /// The pause of `row`, whose lock the caller holds; `reason` is recorded with the state.
    async fn pause_locked(
        &self,
        team: &str,
        row: SandboxRow,
        reason: &str,
        filesystem_only: bool,
    ) -> Result<SandboxRow, MasterError> {
        let id = row.id.as_str();
        match row.state {
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
        // A paused sandbox's timeout no longer runs: it is kept for the retention. Set with
        // `pausing` (listed as paused), as a pause to disk can take a while, as is the mode.
        self.set_end(&row, self.paused_until()).await?;
        let mode = if filesystem_only {
            "filesystem"
        } else {
            "full"
        };
        self.db.set_pause_mode(id, mode).await?;
        let n = self.node_of(&row)?;
        let mut c = n.client.clone();
        let r = c
            .pause_sandbox(node::PauseSandboxRequest {
                sandbox_id: id.to_string(),
                filesystem_only,
            })
            .await;
        match r {
            Ok(_) => {
                self.db
                    .transition(id, SandboxState::Pausing, SandboxState::Paused, reason)
                    .await?;
                self.visible(team, id).await
            }
            Err(s) => {
                self.set_end(&row, row.end_at_ms).await?;
                self.db.set_pause_mode(id, "").await?;
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
        self.connect_with(team, id, t, false).await
    }

    /// [`Controller::connect`]; with `reboot` a paused sandbox is started afresh from its disk
    /// (its memory dropped), as one paused without memory always is. A resume by traffic
    /// (`t` 0) does not restart a sandbox paused without memory: it is refused.
    pub async fn connect_with(
        &self,
        team: &str,
        id: &str,
        t: u64,
        reboot: bool,
    ) -> Result<(SandboxRow, bool), MasterError> {
        let lock = self.lock_for(id);
        let _g = lock.lock().await;
        let mut row = self.visible(team, id).await?;
        if t == 0 && row.pause_mode == "filesystem" && row.state == SandboxState::Paused {
            return Err(MasterError::FailedPrecondition(format!(
                "Sandbox \"{id}\" was paused without its memory: traffic does not restart it; resume it with connect"
            )));
        }
        // 0: a resume by traffic gives the sandbox its own create timeout again.
        let t = if t == 0 {
            u64::try_from(row.timeout_s).unwrap_or(0).max(1)
        } else {
            t
        };
        self.check_timeout(t)?;
        let new_end = crate::now_ms() + (t as i64) * 1000;
        match row.state {
            SandboxState::Running => {
                // Connecting never shortens a running sandbox's life.
                if new_end > row.end_at_ms {
                    row.end_at_ms = new_end;
                    self.set_end(&row, new_end).await?;
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
                    .resume_sandbox(node::ResumeSandboxRequest {
                        sandbox_id: id.to_string(),
                        reboot,
                    })
                    .await
                {
                    Ok(_) => {
                        self.db.set_pause_mode(id, "").await?;
                        self.set_end(&row, new_end).await?;
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
        let limit = super::page::size(p.limit);
        let cursor = super::page::after(&p.next_token)?;
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
                    started_after_ms: p.started_after_ms,
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
        Ok(super::page::cut(rows, limit, |r| {
            (r.started_at_ms, r.id.as_str())
        }))
    }

    /// A sandbox past its end: paused if it asked for that at its timeout (and is running),
    /// else killed. True when it was paused or killed now.
    async fn expire(&self, id: &str) -> Result<bool, MasterError> {
        let auto_pause = {
            let lock = self.lock_for(id);
            let _g = lock.lock().await;
            let Some(row) = self.db.get_sandbox(id).await? else {
                return Ok(false);
            };
            let st = row.state;
            // A connect or timeout change since the look-up wins.
            if st != SandboxState::Killing && row.end_at_ms > crate::now_ms() {
                return Ok(false);
            }
            if st == SandboxState::Running && row.auto_pause == 1 {
                let fs = row.auto_pause_filesystem == 1;
                match self.pause_locked("", row, "timeout (auto-pause)", fs).await {
                    Ok(_) => {
                        self.metrics.auto_paused.inc();
                        tracing::info!(sandbox = %id, "sandbox paused at its timeout");
                        return Ok(true);
                    }
                    Err(e) => Some(e),
                }
            } else {
                None
            }
        };
        let reason = match auto_pause {
            // Kept running past its timeout it would hold the node forever: it goes, and the
            // reason says why its state was not kept.
            Some(e) => {
                tracing::warn!(sandbox = %id, error = %e, "auto-pause at the timeout failed; killing");
                format!("timeout; auto-pause failed: {e}")
            }
            None => "timeout".to_string(),
        };
        self.kill("", id, &reason).await
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
            match self.expire(&id).await {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "reaper pass on a sandbox failed")
                }
            }
        }
        let unrecorded = self.fail_unowned_creates(UNRECORDED_CREATE).await?;
        if unrecorded > 0 {
            tracing::warn!(unrecorded, "failed creates whose outcome went unrecorded");
        }
        // Keys whose create could record neither its row nor the key's release; any create
        // in flight claimed its key within its create timeout.
        let stale = crate::now_ms()
            .saturating_sub(i64::try_from(self.cfg.create_timeout_ms).unwrap_or(i64::MAX));
        self.db.release_unrecorded_idempotency_keys(stale).await?;
        if self.cfg.idempotency_retention_s > 0 {
            let now = crate::now_ms();
            let before = now.saturating_sub(
                i64::try_from(self.cfg.idempotency_retention_s * 1000).unwrap_or(i64::MAX),
            );
            let retry_before = now.saturating_sub(cube_proto::RETRY_IDEMPOTENCY_RETENTION_MS);
            self.db.purge_idempotency_keys(before, retry_before).await?;
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

    /// At start, before serving: a row still `creating` was begun by a master that is gone
    /// (this one has begun none yet) and can never finish, so it becomes `failed` with the
    /// reason. Its node's half goes with the next reconcile (the sandbox of a terminal row is
    /// killed), and a retry under its idempotency key goes ahead as a new create rather than
    /// waiting for one that will not end. One leading master per database is assumed.
    pub async fn fail_interrupted_creates(&self) -> Result<usize, MasterError> {
        // A key claimed by a create that died before recording its sandbox has no row to
        // answer with: a retry under it would wait for that create forever.
        let keys = self
            .db
            .release_unrecorded_idempotency_keys(crate::now_ms() + 1)
            .await?;
        if keys > 0 {
            tracing::warn!(
                keys,
                "released idempotency keys of creates that never recorded a sandbox"
            );
        }
        self.fail_unowned_creates(INTERRUPTED_CREATE).await
    }

    /// Fails each `creating` row that no create of this master is working on (a create holds
    /// the sandbox's lock from before it inserts the row until it has recorded its end): its
    /// create died with an earlier master, or could not record its outcome because the
    /// database was away. Run at start and by the reaper.
    pub async fn fail_unowned_creates(&self, reason: &str) -> Result<usize, MasterError> {
        let mut n = 0;
        for r in self.db.list_in_states(&[SandboxState::Creating]).await? {
            let lock = self.lock_for(&r.id);
            let Ok(_g) = lock.try_lock() else {
                continue;
            };
            if self
                .db
                .transition(&r.id, SandboxState::Creating, SandboxState::Failed, reason)
                .await?
            {
                tracing::warn!(sandbox = %r.id, node = %r.node_id, "{reason}");
                n += 1;
            }
        }
        Ok(n)
    }
}
