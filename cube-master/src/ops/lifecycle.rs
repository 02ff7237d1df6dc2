//! Node lifecycle: join tokens, registration, heartbeats, cordon, drain, and what node health
//! means for sandboxes: a node that goes NotReady has its sandboxes marked `lost` (visible with
//! the reason through GetSandbox/ListSandboxes); when it is Ready again they are reconciled with
//! what the node really runs (back to running/paused, or failed when gone), and sandboxes the
//! master already considers dead are removed from it. Ready nodes are reconciled the same way
//! every `reconcile_interval_ms`: a running or paused row whose sandbox the node no longer
//! runs is ended (`killed`, with the reason), and a sandbox no row claims is killed once it is
//! older than `orphan_grace_ms` (so an in-flight create is never taken for one).

use super::{node_end, Controller};
use crate::error::MasterError;
use crate::fleet::{self, Beat, Health, Node, Origin, Registration};
use crate::state::SandboxState;
use crate::store::nodes::{NodeRow, TokenRefusal};
use cube_proto::master::v1 as pb;
use cube_proto::nodev1 as node;
use futures_util::StreamExt;
use rand::RngCore;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

/// Default and longest lifetime of a join token.
const DEFAULT_TOKEN_TTL_S: u64 = 3600;
const MAX_TOKEN_TTL_S: u64 = 30 * 24 * 3600;
/// A registered node's last-seen time is written to the database at most this often.
const PERSIST_SEEN_EVERY_MS: i64 = 15_000;
/// Sandboxes paused or killed at once by a drain.
const DRAIN_PARALLEL: usize = 8;

fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    rand::thread_rng().fill_bytes(&mut b);
    hex::encode(b)
}

/// Node ids as host names allow: 1–63 of `[A-Za-z0-9._-]`.
pub fn valid_node_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

fn short(field: &str, v: &str) -> Result<(), MasterError> {
    if v.len() > 128 {
        return Err(MasterError::InvalidArgument(format!(
            "{field} too long (max 128 bytes)"
        )));
    }
    Ok(())
}

fn node_not_found(key: &str) -> MasterError {
    MasterError::NotFound(format!("node {key:?} not found"))
}

/// What a drain did: the node (cordoned) and the outcome for each of its sandboxes.
#[derive(Debug, Clone)]
pub struct Drained {
    pub node: Node,
    pub sandboxes: Vec<pb::DrainedSandbox>,
}

impl Controller {
    /// Creates a one-time join token; only its hash is stored.
    pub async fn create_join_token(&self, ttl_s: u64) -> Result<(String, i64), MasterError> {
        let ttl = if ttl_s == 0 {
            DEFAULT_TOKEN_TTL_S
        } else {
            ttl_s
        };
        if ttl > MAX_TOKEN_TTL_S {
            return Err(MasterError::InvalidArgument(format!(
                "join token ttl_s must be at most {MAX_TOKEN_TTL_S} (30 days)"
            )));
        }
        let token = format!("cjt_{}", random_hex(24));
        let now = crate::now_ms();
        let expires = now + (ttl as i64) * 1000;
        self.db
            .insert_join_token(&sha256_hex(&token), now, expires)
            .await?;
        tracing::info!(expires_at_ms = expires, "join token created");
        Ok((token, expires))
    }

    /// Registers (or re-registers) a node. See `RegisterNode` in master.proto.
    pub async fn register_node(
        &self,
        r: pb::RegisterNodeRequest,
    ) -> Result<pb::RegisterNodeResponse, MasterError> {
        if !valid_node_id(&r.node_id) {
            return Err(MasterError::InvalidArgument(format!(
                "invalid node id {:?}: use 1-63 letters, digits, '.', '-' or '_'",
                r.node_id
            )));
        }
        fleet::check_address(&r.address)?;
        for (f, v) in [
            ("address", &r.address),
            ("version", &r.version),
            ("runtime", &r.runtime),
            ("kvm_kind", &r.kvm_kind),
            ("join_token", &r.join_token),
            ("node_secret", &r.node_secret),
        ] {
            short(f, v)?;
        }
        if let Some(n) = self.nodes.find(&r.node_id) {
            if n.origin == Origin::Static {
                return Err(MasterError::FailedPrecondition(format!(
                    "node {} is configured statically on this master (nodes = [{:?}]); remove it \
                     there to let it register",
                    r.node_id, n.address
                )));
            }
        }
        let now = crate::now_ms();
        let existing = self.db.get_node(&r.node_id).await?;
        let known_secret = !r.node_secret.is_empty()
            && existing.as_ref().is_some_and(|e| {
                e.origin == Origin::Registered.as_str()
                    && e.secret_sha256 == sha256_hex(&r.node_secret)
            });
        let how = if known_secret {
            "node secret"
        } else if !r.join_token.is_empty() {
            match self
                .db
                .consume_join_token(&sha256_hex(&r.join_token), &r.node_id, now)
                .await?
            {
                Ok(()) => "join token",
                Err(why) if self.cfg.require_join_token => {
                    return Err(MasterError::Unauthenticated(format!(
                        "join token refused: {}",
                        match why {
                            TokenRefusal::Unknown => "unknown token",
                            TokenRefusal::Used => "already used",
                            TokenRefusal::Expired => "expired",
                        }
                    )))
                }
                Err(why) => {
                    tracing::warn!(node = %r.node_id, ?why, "join token refused; open registration allows the node anyway");
                    "open registration"
                }
            }
        } else if self.cfg.require_join_token {
            return Err(MasterError::Unauthenticated(
                "this master requires a join token (create one with CreateJoinToken / `cubectl join-token create`)".into(),
            ));
        } else {
            "open registration"
        };
        let secret = if known_secret {
            r.node_secret.clone()
        } else {
            random_hex(32)
        };
        let row = NodeRow {
            node_id: r.node_id.clone(),
            address: r.address.clone(),
            origin: Origin::Registered.as_str().into(),
            secret_sha256: sha256_hex(&secret),
            cordoned: 0,
            version: r.version.clone(),
            runtime: r.runtime.clone(),
            kvm_kind: r.kvm_kind.clone(),
            vcpus: r.vcpus as i64,
            memory_mib: r.memory_mib.min(i64::MAX as u64) as i64,
            max_sandboxes: r.max_sandboxes as i64,
            registered_at_ms: now,
            last_seen_ms: now,
        };
        self.db.upsert_registered_node(&row).await?;
        let cordoned = existing.map(|e| e.cordoned != 0).unwrap_or(false);
        self.nodes.register(&registration(&row, cordoned), now)?;
        tracing::info!(node = %r.node_id, address = %r.address, version = %r.version, runtime = %r.runtime, via = how, "node registered");
        Ok(pb::RegisterNodeResponse {
            node_id: r.node_id,
            heartbeat_interval_ms: self.nodes.heartbeat_interval_ms().min(u32::MAX as u64) as u32,
            node_secret: secret,
        })
    }

    /// Records a heartbeat. Unknown nodes are told to register again.
    pub async fn node_heartbeat(
        &self,
        r: pb::NodeHeartbeatRequest,
    ) -> Result<pb::NodeHeartbeatResponse, MasterError> {
        if !valid_node_id(&r.node_id) {
            return Err(MasterError::InvalidArgument(format!(
                "invalid node id {:?}",
                r.node_id
            )));
        }
        if r.templates.len() > 10_000 {
            return Err(MasterError::InvalidArgument("too many templates".into()));
        }
        let hash = sha256_hex(&r.node_secret);
        let mut known = self
            .nodes
            .find(&r.node_id)
            .filter(|n| n.origin == Origin::Registered);
        if known.is_none() {
            // Registered through another master sharing the database, or before a restart.
            if let Some(row) = self.db.get_node(&r.node_id).await? {
                if row.origin == Origin::Registered.as_str() {
                    self.nodes
                        .load_registered(&registration(&row, row.cordoned != 0), crate::now_ms())?;
                    known = self.nodes.find(&r.node_id);
                }
            }
        }
        let Some(n) = known else {
            return Ok(pb::NodeHeartbeatResponse {
                reregister: true,
                cordoned: false,
            });
        };
        if n.secret_sha256 != hash {
            return Err(MasterError::Unauthenticated(format!(
                "wrong node secret for node {}",
                r.node_id
            )));
        }
        let now = crate::now_ms();
        let beat = Beat {
            sandboxes: r.sandboxes,
            templates: r.templates,
            disk_free_mib: r.disk_free_mib,
            free_memory_mib: r.memory_mib,
        };
        let Some((cordoned, persisted)) = self.nodes.heartbeat(&r.node_id, &beat, now) else {
            return Ok(pb::NodeHeartbeatResponse {
                reregister: true,
                cordoned: false,
            });
        };
        if now - persisted > PERSIST_SEEN_EVERY_MS {
            self.db.touch_node(&r.node_id, now).await?;
            self.nodes.update(&r.node_id, |n| n.persisted_seen_ms = now);
        }
        Ok(pb::NodeHeartbeatResponse {
            reregister: false,
            cordoned,
        })
    }

    /// Cordons or uncordons a node (by id or address); returns it as it is now.
    pub async fn set_cordon(&self, key: &str, cordoned: bool) -> Result<Node, MasterError> {
        let n = self.nodes.find(key).ok_or_else(|| node_not_found(key))?;
        let id = n.id();
        if n.origin == Origin::Static {
            // A static node that never answered has no id yet: cordon it by address.
            self.db.upsert_static_node(&id, &n.address).await?;
        }
        self.db.set_cordoned(&id, cordoned).await?;
        let n = self
            .nodes
            .update(key, |n| {
                n.cordoned = cordoned;
                n.clone()
            })
            .ok_or_else(|| node_not_found(key))?;
        tracing::info!(node = %id, cordoned, "node cordon changed");
        Ok(n)
    }

    /// Cordons a node, then pauses (or kills) every sandbox on it and reports each.
    pub async fn drain_node(&self, key: &str, kill: bool) -> Result<Drained, MasterError> {
        let cordoned = self.set_cordon(key, true).await?;
        let id = cordoned.id();
        let mut seen: HashSet<String> = HashSet::new();
        let mut out: Vec<pb::DrainedSandbox> = Vec::new();
        // Creates that were already past scheduling land after the first listing: look again
        // until a pass finds nothing new.
        for _ in 0..5 {
            let rows: Vec<_> = self
                .db
                .sandboxes_on_node(&id)
                .await?
                .into_iter()
                .filter(|r| !seen.contains(&r.id))
                .collect();
            if rows.is_empty() {
                break;
            }
            let results: Vec<pb::DrainedSandbox> = futures_util::stream::iter(rows)
                .map(|r| async move {
                    let sid = r.id.clone();
                    let res = if kill {
                        match self.kill("", &sid, "node drained").await {
                            Ok(_) => Ok("killed"),
                            Err(e) => Err(e),
                        }
                    } else if r.state == SandboxState::Paused {
                        Ok("paused")
                    } else {
                        match self.pause("", &sid, false).await {
                            Ok(_) => Ok("paused"),
                            // Paused meanwhile by someone else: the outcome is the same.
                            Err(MasterError::FailedPrecondition(m))
                                if m.contains("already paused") =>
                            {
                                Ok("paused")
                            }
                            Err(e) => Err(e),
                        }
                    };
                    match res {
                        Ok(o) => pb::DrainedSandbox {
                            sandbox_id: sid,
                            outcome: o.into(),
                            error: String::new(),
                        },
                        Err(e) => pb::DrainedSandbox {
                            sandbox_id: sid,
                            outcome: "error".into(),
                            error: e.to_string(),
                        },
                    }
                })
                .buffer_unordered(DRAIN_PARALLEL)
                .collect()
                .await;
            for d in results {
                seen.insert(d.sandbox_id.clone());
                out.push(d);
            }
        }
        out.sort_by(|a, b| a.sandbox_id.cmp(&b.sandbox_id));
        let errors = out.iter().filter(|d| d.outcome == "error").count();
        tracing::info!(node = %id, kill, sandboxes = out.len(), errors, "node drained");
        let node = self.nodes.find(&id).unwrap_or(cordoned);
        Ok(Drained {
            node,
            sandboxes: out,
        })
    }

    /// All nodes, sorted by id.
    pub fn nodes_by_id(&self) -> Vec<Node> {
        let mut v = self.nodes.snapshot();
        v.sort_by_key(|n| n.id());
        v
    }

    /// Loads registered nodes (and static nodes' cordon flags) from the database at start.
    pub async fn load_nodes(&self) -> Result<(), MasterError> {
        let now = crate::now_ms();
        for row in self.db.list_nodes().await? {
            if row.origin == Origin::Registered.as_str() {
                if self
                    .nodes
                    .find(&row.node_id)
                    .is_some_and(|n| n.origin == Origin::Static)
                {
                    continue;
                }
                self.nodes
                    .load_registered(&registration(&row, row.cordoned != 0), now)?;
            } else {
                let (id, cordoned) = (row.node_id.clone(), row.cordoned != 0);
                self.nodes.update(&row.address, |n| {
                    if n.origin == Origin::Static {
                        n.node_id = id;
                        n.cordoned = cordoned;
                        n.db_synced = true;
                    }
                });
            }
        }
        Ok(())
    }

    /// One pass of node health handling: expire silent nodes, mark sandboxes of NotReady
    /// nodes lost, reconcile nodes that are Ready again.
    pub async fn check_nodes(&self) {
        let now = crate::now_ms();
        self.nodes.expire(now);
        let every = self.cfg.reconcile_interval_ms as i64;
        for n in self.nodes.snapshot() {
            if n.origin == Origin::Static && !n.db_synced && n.health == Health::Ready {
                if let Err(e) = self.sync_static(&n).await {
                    tracing::warn!(node = %n.address, error = %e, "recording static node failed");
                }
            }
            if n.health == n.handled {
                if n.health == Health::Ready
                    && every > 0
                    && now - n.reconciled_ms >= every
                    && self.reconcile(&n).await
                {
                    self.nodes.update(&n.address, |e| e.reconciled_ms = now);
                }
                continue;
            }
            let done = match n.health {
                Health::Unknown => true,
                Health::NotReady => self.mark_lost(&n).await,
                Health::Ready => self.reconcile(&n).await,
            };
            if done {
                let h = n.health;
                self.nodes.update(&n.address, |e| {
                    // Only if nothing changed meanwhile; otherwise the next pass handles it.
                    if e.health == h {
                        e.handled = h;
                        if h == Health::Ready {
                            e.reconciled_ms = now;
                        }
                    }
                });
            }
        }
    }

    /// Runs [`Controller::check_nodes`] forever.
    pub async fn run_node_health(self: Arc<Self>, interval: Duration) {
        loop {
            self.check_nodes().await;
            tokio::time::sleep(interval).await;
        }
    }

    async fn sync_static(&self, n: &Node) -> Result<(), MasterError> {
        let id = n.id();
        let cordoned = self
            .db
            .get_node(&id)
            .await?
            .map(|r| r.cordoned != 0)
            .unwrap_or(false);
        self.db.upsert_static_node(&id, &n.address).await?;
        self.nodes.update(&n.address, |e| {
            e.db_synced = true;
            e.cordoned = e.cordoned || cordoned;
        });
        Ok(())
    }

    /// Marks the node's live sandboxes lost. Returns false when some could not be handled
    /// yet (an operation holds its lock), so the next pass tries again.
    async fn mark_lost(&self, n: &Node) -> bool {
        let id = n.id();
        let rows = match self.db.sandboxes_on_node(&id).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(node = %id, error = %e, "listing sandboxes of a lost node failed");
                return false;
            }
        };
        let silent_s = (crate::now_ms() - n.last_seen_ms).max(0) / 1000;
        let reason = match n.origin {
            Origin::Registered => {
                format!("lost: node {id} not ready (no heartbeat for {silent_s} s)")
            }
            Origin::Static => format!(
                "lost: node {id} not ready ({} status polls failed)",
                n.misses
            ),
        };
        let mut complete = true;
        let mut lost = 0;
        for r in rows {
            let lock = self.lock_for(&r.id);
            // An operation stuck on the dead node holds the lock until its own timeout.
            let Ok(_g) = tokio::time::timeout(Duration::from_secs(1), lock.lock()).await else {
                complete = false;
                continue;
            };
            let st = match self.db.get_sandbox(&r.id).await {
                Ok(Some(row)) => row.state,
                Ok(None) => continue,
                Err(_) => {
                    complete = false;
                    continue;
                }
            };
            if !st.can_go(SandboxState::Lost) {
                continue;
            }
            match self
                .db
                .transition(&r.id, st, SandboxState::Lost, &reason)
                .await
            {
                Ok(true) => lost += 1,
                Ok(false) => complete = false,
                Err(e) => {
                    tracing::warn!(sandbox = %r.id, error = %e, "marking sandbox lost failed");
                    complete = false;
                }
            }
        }
        if lost > 0 {
            self.metrics.lost.inc_by(lost);
            tracing::warn!(node = %id, sandboxes = lost, "sandboxes of a not-ready node marked lost");
        }
        complete
    }

    /// Brings the master's view of a node that is Ready (again) in line with what it runs.
    async fn reconcile(&self, n: &Node) -> bool {
        let id = n.id();
        // Rows first, then the node's list: a sandbox the rows show as running was created
        // before the listing, so its absence from the listing is real.
        let rows = match self.db.sandboxes_on_node(&id).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(node = %id, error = %e, "reconcile: listing rows failed");
                return false;
            }
        };
        let mut c = n.client.clone();
        let listed = match tokio::time::timeout(
            Duration::from_secs(10),
            c.list_sandboxes(node::ListSandboxesRequest {}),
        )
        .await
        {
            Ok(Ok(l)) => l.into_inner().sandboxes,
            Ok(Err(e)) => {
                tracing::warn!(node = %id, error = %e, "reconcile: ListSandboxes failed");
                return false;
            }
            Err(_) => {
                tracing::warn!(node = %id, "reconcile: ListSandboxes timed out");
                return false;
            }
        };
        let on_node: HashMap<&str, &node::Sandbox> =
            listed.iter().map(|s| (s.sandbox_id.as_str(), s)).collect();
        let mut complete = true;
        for r in &rows {
            let st = r.state;
            // Each step a transition: a lost sandbox back (or failed), a running or paused one
            // the node no longer runs ended through killing.
            let steps: Vec<(SandboxState, SandboxState, String)> =
                match (st, on_node.get(r.id.as_str())) {
                    (SandboxState::Lost, Some(s)) => {
                        let to = if s.state == node::SandboxState::Paused as i32 {
                            SandboxState::Paused
                        } else {
                            SandboxState::Running
                        };
                        vec![(st, to, format!("node {id} is back"))]
                    }
                    (SandboxState::Lost, None) => vec![(
                        st,
                        SandboxState::Failed,
                        format!("lost: node {id} no longer has this sandbox"),
                    )],
                    (SandboxState::Running | SandboxState::Paused, None) => {
                        let why = format!("gone: node {id} no longer runs this sandbox");
                        vec![
                            (st, SandboxState::Killing, why.clone()),
                            (SandboxState::Killing, SandboxState::Killed, why),
                        ]
                    }
                    _ => continue,
                };
            let lock = self.lock_for(&r.id);
            let Ok(_g) = tokio::time::timeout(Duration::from_secs(1), lock.lock()).await else {
                complete = false;
                continue;
            };
            for (from, to, reason) in steps {
                match self.db.transition(&r.id, from, to, &reason).await {
                    Ok(true) => {
                        tracing::info!(sandbox = %r.id, node = %id, from = %from, to = %to, reason, "reconciled");
                        if to == SandboxState::Killed {
                            self.metrics.gone.inc();
                        }
                    }
                    // It changed meanwhile (an operation finished): the next pass sees it.
                    Ok(false) => break,
                    Err(e) => {
                        tracing::warn!(sandbox = %r.id, error = %e, "reconcile transition failed");
                        complete = false;
                        break;
                    }
                }
            }
        }
        // The node's backstop end times follow the rows (a SetEndTime that failed is repeated),
        // read again under the sandbox's lock so a concurrent extension is not undone.
        for r in &rows {
            let Some(s) = on_node.get(r.id.as_str()) else {
                continue;
            };
            let running = s.state == node::SandboxState::Running as i32;
            let want = node_end(r, r.end_at_ms);
            if !running || i64::try_from(s.end_at_ms).ok() == Some(want) {
                continue;
            }
            let lock = self.lock_for(&r.id);
            let Ok(_g) = tokio::time::timeout(Duration::from_secs(1), lock.lock()).await else {
                complete = false;
                continue;
            };
            if let Ok(Some(fresh)) = self.db.get_sandbox(&r.id).await {
                let end = node_end(&fresh, fresh.end_at_ms);
                if fresh.state == SandboxState::Running && !self.tell_end(n, &fresh.id, end).await {
                    complete = false;
                }
            }
        }
        // Sandboxes the master has given up on (killed while the node was away), and those no
        // row claims once they are older than any create, go now.
        let now = crate::now_ms();
        for s in &listed {
            let dead = match self.db.get_sandbox(&s.sandbox_id).await {
                Ok(Some(row)) => row.state.is_terminal(),
                Ok(None) => {
                    let age_ms = now - i64::try_from(s.created_at_ms).unwrap_or(0);
                    let orphan = age_ms >= self.cfg.orphan_grace_ms as i64;
                    if !orphan {
                        tracing::debug!(node = %id, sandbox = %s.sandbox_id, age_ms, "no row for a young sandbox (a create in flight?); left for now");
                    }
                    orphan
                }
                Err(_) => false,
            };
            if dead {
                let r = tokio::time::timeout(
                    Duration::from_secs(30),
                    c.kill_sandbox(node::SandboxRef {
                        sandbox_id: s.sandbox_id.clone(),
                    }),
                )
                .await;
                match r {
                    Ok(Ok(_)) => {
                        self.metrics.orphans_killed.inc();
                        tracing::warn!(node = %id, sandbox = %s.sandbox_id, "killed a sandbox no live row claims")
                    }
                    _ => complete = false,
                }
            }
        }
        if complete {
            tracing::info!(node = %id, sandboxes = listed.len(), "node reconciled");
        }
        complete
    }
}

fn registration(row: &NodeRow, cordoned: bool) -> Registration {
    Registration {
        node_id: row.node_id.clone(),
        address: row.address.clone(),
        version: row.version.clone(),
        runtime: row.runtime.clone(),
        kvm_kind: row.kvm_kind.clone(),
        vcpus: row.vcpus.clamp(0, u32::MAX as i64) as u32,
        memory_mib: row.memory_mib.max(0) as u64,
        max_sandboxes: row.max_sandboxes.clamp(0, u32::MAX as i64) as u32,
        cordoned,
        secret_sha256: row.secret_sha256.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids() {
        assert!(valid_node_id("node-1.example_a"));
        assert!(!valid_node_id(""));
        assert!(!valid_node_id("a b"));
        assert!(!valid_node_id(&"a".repeat(64)));
        assert!(!valid_node_id("x/y"));
    }
}
