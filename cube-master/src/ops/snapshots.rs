//! Snapshots and fork. A snapshot is a template build on the node that took it, named by the
//! snapshot id (so `CreateSandbox(template = snapshot id)` restores it); the master keeps one
//! row per snapshot to know its team, its optional name and, above all, its node: a create
//! from a snapshot is pinned to that node instead of going through the template filter.

use super::{Controller, CreateParams};
use crate::error::MasterError;
use crate::fleet::scheduler::{self, NoFit};
use crate::fleet::Node;
use crate::state::SandboxState;
use crate::store::snapshots::SnapshotRow;
use crate::store::SandboxRow;
use cube_proto::master::v1 as pb;
use cube_proto::nodev1 as node;
use std::time::Duration;

/// How long a node may take to snapshot a sandbox (flush + reflink + manifest).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(120);
/// Fork timeout when the request gives none (E2B's default sandbox timeout).
const DEFAULT_FORK_TIMEOUT_S: u64 = 300;
/// Most sandboxes one fork may create (E2B's limit).
pub const MAX_FORK_COUNT: u32 = 20;

/// Snapshot ids look like E2B template ids (20 lowercase alphanumerics); the leading `s`
/// keeps them apart from sandbox ids (`i…`) and makes them valid node template names.
pub fn new_snapshot_id() -> String {
    crate::ids::random_id("s", 19)
}

/// User-given snapshot names: what a template name may be, so the name can be used wherever
/// a template id can.
pub fn check_name(name: &str) -> Result<(), MasterError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(MasterError::InvalidArgument(format!(
            "invalid snapshot name {name:?}: use 1-63 lowercase letters, digits, '-' or '_'"
        )))
    }
}

/// Operations on snapshots, over the controller's database, nodes and sandbox locks.
impl Controller {
    /// Called by create: when the template is one of the team's snapshots, rewrites it to the
    /// snapshot id and returns the only candidate node (or why it cannot take the sandbox).
    /// `None` = an ordinary template, scheduled by the normal filters.
    pub(crate) async fn pin_for_create(
        &self,
        p: &mut CreateParams,
    ) -> Result<Option<Result<Vec<Node>, NoFit>>, MasterError> {
        let Some(s) = self.db.resolve_snapshot(&p.team_id, &p.template).await? else {
            // Another team's snapshot id is not a template name this team may use: the node would
            // otherwise restore that team's memory and disk for it.
            if self.db.get_snapshot(&p.template).await?.is_some() {
                return Err(MasterError::NotFound(format!(
                    "template '{}' not found",
                    p.template
                )));
            }
            return Ok(None);
        };
        p.template = s.id.clone();
        let Some(n) = self.nodes.find(&s.node_id) else {
            return Err(MasterError::Unavailable(format!(
                "node {} holding snapshot {} is not known to this master",
                s.node_id, s.id
            )));
        };
        // The scheduler's own filters (ready, cordon, capacity, memory), on that one node; its
        // polled template list may not show the snapshot yet, and need not.
        let held = [s.id.clone()];
        let mut v = n.view();
        v.templates = &held;
        let r = scheduler::rank(
            &[v],
            &scheduler::Request {
                template: &s.id,
                memory_mib: self.cfg.default_memory_mib,
            },
        );
        Ok(Some(r.map(|_| vec![n.clone()])))
    }

    /// Snapshots a running or paused sandbox on its node.
    pub async fn snapshot(
        &self,
        team: &str,
        sandbox_id: &str,
        name: &str,
    ) -> Result<SnapshotRow, MasterError> {
        if !name.is_empty() {
            check_name(name)?;
        }
        // Serialised with pause/kill of the same sandbox: the node freezes it meanwhile.
        let lock = self.lock_for(sandbox_id);
        let _g = lock.lock().await;
        let row = self.visible(team, sandbox_id).await?;
        match row.state {
            SandboxState::Running | SandboxState::Paused => {}
            SandboxState::Killing => {
                return Err(MasterError::NotFound(format!(
                    "Sandbox \"{sandbox_id}\" doesn't exist or you don't have access to it"
                )))
            }
            s => {
                return Err(MasterError::FailedPrecondition(format!(
                    "Sandbox \"{sandbox_id}\" cannot be snapshotted while {s}"
                )))
            }
        }
        let n = self.node_of(&row)?;
        let id = new_snapshot_id();
        let mut c = n.client.clone();
        let r = tokio::time::timeout(
            SNAPSHOT_TIMEOUT,
            c.snapshot_sandbox(node::SnapshotSandboxRequest {
                sandbox_id: sandbox_id.to_string(),
                template: id.clone(),
            }),
        )
        .await;
        let resp = match r {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(status)) => {
                return Err(MasterError::Node {
                    node: n.address,
                    status: Box::new(status),
                })
            }
            Err(_) => {
                return Err(MasterError::Unavailable(format!(
                    "snapshot of {sandbox_id} timed out on node {}",
                    n.address
                )))
            }
        };
        let s = SnapshotRow {
            id,
            name: name.to_string(),
            team_id: row.team_id.clone(),
            sandbox_id: sandbox_id.to_string(),
            node_id: row.node_id.clone(),
            template: row.template.clone(),
            build: resp.template.map(|t| t.build).unwrap_or_default(),
            filesystem_only: i64::from(resp.filesystem_only),
            created_at_ms: crate::now_ms(),
        };
        self.db.insert_snapshot(&s).await?;
        tracing::info!(snapshot = %s.id, sandbox = %sandbox_id, node = %s.node_id, "snapshot taken");
        Ok(s)
    }

    /// One page of the team's snapshots, newest first. The token is the last row's
    /// `<created_at_ms>.<id>`.
    pub async fn list_snapshots(
        &self,
        r: &pb::ListSnapshotsRequest,
    ) -> Result<(Vec<SnapshotRow>, String), MasterError> {
        let size = super::page::size(r.limit);
        let cursor = super::page::after(&r.next_token)?;
        let rows: Vec<SnapshotRow> = self
            .db
            .list_snapshot_rows()
            .await?
            .into_iter()
            .filter(|s| r.team_id.is_empty() || s.team_id == r.team_id)
            .filter(|s| r.sandbox_id.is_empty() || s.sandbox_id == r.sandbox_id)
            .filter(|s| r.name.is_empty() || s.name == r.name || s.id == r.name)
            .filter(|s| match &cursor {
                Some(k) => (s.created_at_ms, s.id.clone()) < *k,
                None => true,
            })
            .collect();
        Ok(super::page::cut(rows, size, |s| {
            (s.created_at_ms, s.id.as_str())
        }))
    }

    /// Deletes a snapshot (by id or name) and its build on the node. Refused while live
    /// sandboxes were created from it; `Ok(false)` when there is no such snapshot.
    pub async fn delete_snapshot(&self, team: &str, key: &str) -> Result<bool, MasterError> {
        let Some(s) = self.db.resolve_snapshot(team, key).await? else {
            return Ok(false);
        };
        // Under the snapshot's own lock so that two deletes do not race on the node.
        let lock = self.lock_for(&s.id);
        let _g = lock.lock().await;
        let users = self
            .db
            .list_in_states(&[
                SandboxState::Creating,
                SandboxState::Running,
                SandboxState::Pausing,
                SandboxState::Paused,
                SandboxState::Resuming,
            ])
            .await?
            .into_iter()
            .filter(|r| r.template == s.id)
            .count();
        if users > 0 {
            return Err(MasterError::FailedPrecondition(format!(
                "snapshot {} is in use by {users} sandbox(es); kill them first",
                s.id
            )));
        }
        if let Some(n) = self.nodes.find(&s.node_id) {
            let mut c = n.client.clone();
            let r = tokio::time::timeout(
                Duration::from_secs(60),
                c.delete_template(node::DeleteTemplateRequest {
                    name: s.id.clone(),
                    build: String::new(),
                }),
            )
            .await;
            match r {
                Ok(Ok(_)) => {}
                // Already gone on the node (e.g. its data directory was wiped): forget it.
                Ok(Err(st)) if st.code() == tonic::Code::NotFound => {}
                Ok(Err(st)) => {
                    return Err(MasterError::Node {
                        node: n.address,
                        status: Box::new(st),
                    })
                }
                Err(_) => {
                    return Err(MasterError::Unavailable(format!(
                        "deleting snapshot {} timed out on node {}",
                        s.id, n.address
                    )))
                }
            }
        } else {
            tracing::warn!(snapshot = %s.id, node = %s.node_id, "snapshot's node is unknown; forgetting the snapshot");
        }
        let existed = self.db.delete_snapshot_row(&s.id).await?;
        tracing::info!(snapshot = %s.id, "snapshot deleted");
        Ok(existed)
    }

    /// Snapshot once, then `count` sandboxes from it, each succeeding or failing on its own.
    pub async fn fork(
        &self,
        team: &str,
        sandbox_id: &str,
        count: u32,
        timeout_s: u64,
    ) -> Result<(SnapshotRow, Vec<Result<SandboxRow, MasterError>>), MasterError> {
        let count = if count == 0 { 1 } else { count };
        if count > MAX_FORK_COUNT {
            return Err(MasterError::InvalidArgument(format!(
                "count must be between 1 and {MAX_FORK_COUNT}"
            )));
        }
        let timeout_s = if timeout_s == 0 {
            DEFAULT_FORK_TIMEOUT_S
        } else {
            timeout_s
        };
        // Checked before the snapshot so that a bad timeout leaves nothing behind.
        if timeout_s > self.cfg.max_timeout_s {
            return Err(MasterError::InvalidArgument(format!(
                "Timeout cannot be greater than {} hours",
                self.cfg.max_timeout_s / 3600
            )));
        }
        let src = self.get(team, sandbox_id).await?;
        let snap = self.snapshot(team, sandbox_id, "").await?;
        let creates = (0..count).map(|_| {
            self.create(CreateParams {
                team_id: src.team_id.clone(),
                template: snap.id.clone(),
                timeout_s,
                metadata: src.metadata_map(),
                env_vars: Default::default(),
                // A fork keeps its source's network and lifecycle.
                allow_internet: src.internet(),
                auto_pause: src.auto_pause == 1,
                auto_resume: src.auto_resume == 1,
                auto_pause_filesystem: src.auto_pause_filesystem == 1,
                idempotency_key: String::new(),
                private_ports: src.private_ports == 1,
                mask_request_host: src.mask_request_host.clone(),
                egress: src.egress(),
            })
        });
        let results = futures_util::future::join_all(creates).await;
        Ok((snap, results))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names() {
        let id = new_snapshot_id();
        assert_eq!(id.len(), 20);
        assert!(id.starts_with('s'));
        assert!(check_name(&id).is_ok());
        assert!(check_name("my-snap_1").is_ok());
        for bad in ["", "-x", "Has Caps", "a/b", "x:1", &"a".repeat(64)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
