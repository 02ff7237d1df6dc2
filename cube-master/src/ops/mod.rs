//! The master's operations, as `impl Controller` blocks, one module per subject: sandboxes
//! (create, kill, pause, connect, timeouts), node lifecycle, snapshots and fork, secrets,
//! templates, a sandbox's history and stats, the reaper. This module holds the controller
//! itself and what they share: the per-sandbox locks (every operation on one sandbox holds
//! that sandbox's lock, so concurrent calls serialise and see each other's result) and the
//! look-ups of sandboxes and their nodes.

use crate::config::MasterConfig;
use crate::error::MasterError;
use crate::fleet::{Node, Nodes};
use crate::state::SandboxState;
use crate::store::{Db, SandboxRow};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

pub mod history;
pub mod lifecycle;
pub mod page;
pub mod reaper;
pub mod sandboxes;
pub mod secrets;
pub mod snapshots;
pub mod stats;
pub mod templates;

/// Parameters of a create.
#[derive(Debug, Clone, Default)]
pub struct CreateParams {
    pub team_id: String,
    pub template: String,
    pub timeout_s: u64,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub allow_internet: Option<bool>,
    /// Pause (memory kept) instead of kill at the timeout.
    pub auto_pause: bool,
    /// Traffic through the edge resumes it when paused; needs `auto_pause`.
    pub auto_resume: bool,
    /// The pause at the timeout keeps only the filesystem; not with `auto_resume`.
    pub auto_pause_filesystem: bool,
    /// Empty = none. A create repeated with the same key (per team) answers with the first
    /// one's sandbox.
    pub idempotency_key: String,
    /// The edge requires the traffic access token for the sandbox's ports.
    pub private_ports: bool,
    /// The Host header the edge sends the sandbox (`${PORT}` replaced); empty = the client's.
    pub mask_request_host: String,
    /// E2B's allowOut / denyOut / dnsServers, checked.
    pub egress: crate::egress::Rules,
}

impl CreateParams {
    /// A hash of what the create asks for, so that one idempotency key cannot stand for two
    /// different requests.
    fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let mut field = |b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        field(self.template.as_bytes());
        field(&self.timeout_s.to_le_bytes());
        for m in [&self.metadata, &self.env_vars] {
            field(&(m.len() as u64).to_le_bytes());
            for (k, v) in m {
                field(k.as_bytes());
                field(v.as_bytes());
            }
        }
        field(&[
            match self.allow_internet {
                None => 2,
                Some(b) => u8::from(b),
            },
            u8::from(self.auto_pause),
            u8::from(self.auto_resume),
            u8::from(self.private_ports),
        ]);
        field(self.mask_request_host.as_bytes());
        for l in [&self.egress.allow_out, &self.egress.deny_out] {
            field(&(l.len() as u64).to_le_bytes());
            for e in l {
                field(e.as_bytes());
            }
        }
        // Only when given, so that the fingerprints of keys claimed before dnsServers existed
        // stay the same.
        if let Some(d) = &self.egress.dns_servers {
            field(b"dns_servers");
            field(&(d.len() as u64).to_le_bytes());
            for e in d {
                field(e.as_bytes());
            }
        }
        if self.auto_pause_filesystem {
            field(b"auto_pause_filesystem");
        }
        hex::encode(h.finalize())
    }
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
    /// Only sandboxes started at or after this (unix ms); 0 = any.
    pub started_after_ms: i64,
}

pub struct Controller {
    pub cfg: MasterConfig,
    pub db: Db,
    pub nodes: Nodes,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Derives envd access tokens (the database keeps only their hashes).
    pub tokens: crate::token::TokenKey,
    /// Seals secret values (the database keeps only sealed ones).
    pub secrets: crate::secrets::SecretsKey,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
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
            secrets: crate::secrets::SecretsKey::random(),
            locks: Mutex::new(HashMap::new()),
        }
    }

    /// The token key shared by the fleet's masters (the default is one for this process only).
    pub fn with_token_key(mut self, k: crate::token::TokenKey) -> Controller {
        self.tokens = k;
        self
    }

    /// The secrets key shared by the fleet's masters (the default is one for this process).
    pub fn with_secrets_key(mut self, k: crate::secrets::SecretsKey) -> Controller {
        self.secrets = k;
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

    fn not_found(id: &str) -> MasterError {
        MasterError::NotFound(format!(
            "Sandbox \"{id}\" doesn't exist or you don't have access to it"
        ))
    }

    /// A live sandbox visible to `team` (empty = any team).
    pub(crate) async fn visible(&self, team: &str, id: &str) -> Result<SandboxRow, MasterError> {
        match self.db.get_sandbox(id).await? {
            Some(r) if (team.is_empty() || r.team_id == team) && !r.state.is_terminal() => Ok(r),
            _ => Err(Self::not_found(id)),
        }
    }

    /// A sandbox of this team in any state, ended ones included (their history is read).
    pub(crate) async fn any_state(&self, team: &str, id: &str) -> Result<SandboxRow, MasterError> {
        match self.db.get_sandbox(id).await? {
            Some(r) if team.is_empty() || r.team_id == team => Ok(r),
            _ => Err(Self::not_found(id)),
        }
    }

    pub(crate) fn node_of(&self, row: &SandboxRow) -> Result<Node, MasterError> {
        self.nodes.find(&row.node_id).ok_or_else(|| {
            MasterError::Unavailable(format!(
                "node {} of sandbox {} is unknown",
                row.node_id, row.id
            ))
        })
    }

    /// The text of `/metrics`: gauges refreshed from the database and the node registry first.
    pub async fn metrics_text(&self) -> String {
        let m = &self.metrics;
        match self.db.count_by_state().await {
            Ok(counts) => {
                for s in SandboxState::ALL {
                    let n = counts.iter().find(|(st, _)| *st == s).map(|x| x.1);
                    m.sandboxes
                        .with_label_values(&[s.as_str()])
                        .set(n.unwrap_or(0));
                }
            }
            Err(e) => tracing::warn!(error = %e, "metrics: counting sandboxes failed"),
        }
        m.observe_nodes(&self.nodes);
        m.render()
    }
}

/// The end a node's backstop gets for a sandbox ending at `end_at_ms`: none for one that is
/// paused at its end (autoPause), which only the master can do.
pub(crate) fn node_end(row: &SandboxRow, end_at_ms: i64) -> i64 {
    if row.auto_pause != 0 {
        0
    } else {
        end_at_ms
    }
}
