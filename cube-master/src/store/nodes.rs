//! The `nodes` and `join_tokens` tables (portable SQL, see [`crate::store`]).

use super::{sandbox_read, Db, SandboxRow};
use crate::error::MasterError;
use crate::state::SandboxState;
use sqlx::FromRow;

/// One persisted node.
#[derive(Debug, Clone, FromRow)]
pub struct NodeRow {
    pub node_id: String,
    pub address: String,
    pub origin: String,
    pub secret_sha256: String,
    pub cordoned: i64,
    pub version: String,
    pub runtime: String,
    pub kvm_kind: String,
    pub vcpus: i64,
    pub memory_mib: i64,
    pub max_sandboxes: i64,
    pub registered_at_ms: i64,
    pub last_seen_ms: i64,
}

/// How a join token was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum TokenRefusal {
    Unknown,
    Used,
    Expired,
}

impl Db {
    /// Inserts or replaces a registered node (keeps its cordon flag).
    pub async fn upsert_registered_node(&self, r: &NodeRow) -> Result<(), MasterError> {
        sqlx::query(
            "INSERT INTO nodes (node_id, address, origin, secret_sha256, cordoned, version, \
             runtime, kvm_kind, vcpus, memory_mib, max_sandboxes, registered_at_ms, last_seen_ms) \
             VALUES ($1, $2, 'registered', $3, 0, $4, $5, $6, $7, $8, $9, $10, $11) \
             ON CONFLICT (node_id) DO UPDATE SET address = excluded.address, \
             origin = excluded.origin, secret_sha256 = excluded.secret_sha256, \
             version = excluded.version, runtime = excluded.runtime, \
             kvm_kind = excluded.kvm_kind, vcpus = excluded.vcpus, \
             memory_mib = excluded.memory_mib, max_sandboxes = excluded.max_sandboxes, \
             registered_at_ms = excluded.registered_at_ms, last_seen_ms = excluded.last_seen_ms",
        )
        .bind(&r.node_id)
        .bind(&r.address)
        .bind(&r.secret_sha256)
        .bind(&r.version)
        .bind(&r.runtime)
        .bind(&r.kvm_kind)
        .bind(r.vcpus)
        .bind(r.memory_mib)
        .bind(r.max_sandboxes)
        .bind(r.registered_at_ms)
        .bind(r.last_seen_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records a static node's id once it answered (so its cordon flag has a row).
    pub async fn upsert_static_node(
        &self,
        node_id: &str,
        address: &str,
    ) -> Result<(), MasterError> {
        let now = crate::now_ms();
        sqlx::query(
            "INSERT INTO nodes (node_id, address, origin, registered_at_ms, last_seen_ms) \
             VALUES ($1, $2, 'static', $3, $3) \
             ON CONFLICT (node_id) DO UPDATE SET address = excluded.address, \
             origin = excluded.origin, last_seen_ms = excluded.last_seen_ms",
        )
        .bind(node_id)
        .bind(address)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn get_node(&self, node_id: &str) -> Result<Option<NodeRow>, MasterError> {
        Ok(
            sqlx::query_as::<_, NodeRow>("SELECT * FROM nodes WHERE node_id = $1")
                .bind(node_id)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    pub async fn list_nodes(&self) -> Result<Vec<NodeRow>, MasterError> {
        Ok(
            sqlx::query_as::<_, NodeRow>("SELECT * FROM nodes ORDER BY node_id")
                .fetch_all(&self.pool)
                .await?,
        )
    }

    /// Sets the cordon flag; false when the node has no row.
    pub async fn set_cordoned(&self, node_id: &str, cordoned: bool) -> Result<bool, MasterError> {
        let r = sqlx::query("UPDATE nodes SET cordoned = $1 WHERE node_id = $2")
            .bind(cordoned as i64)
            .bind(node_id)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected() == 1)
    }

    pub async fn touch_node(&self, node_id: &str, now_ms: i64) -> Result<(), MasterError> {
        sqlx::query("UPDATE nodes SET last_seen_ms = $1 WHERE node_id = $2")
            .bind(now_ms)
            .bind(node_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn insert_join_token(
        &self,
        sha256: &str,
        now_ms: i64,
        expires_at_ms: i64,
    ) -> Result<(), MasterError> {
        sqlx::query(
            "INSERT INTO join_tokens (token_sha256, created_at_ms, expires_at_ms) VALUES ($1, $2, $3)",
        )
        .bind(sha256)
        .bind(now_ms)
        .bind(expires_at_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Marks a join token used by `node_id`, atomically: of two nodes presenting the same
    /// token, exactly one succeeds.
    pub async fn consume_join_token(
        &self,
        sha256: &str,
        node_id: &str,
        now_ms: i64,
    ) -> Result<Result<(), TokenRefusal>, MasterError> {
        let r = sqlx::query(
            "UPDATE join_tokens SET used_at_ms = $1, used_by = $2 \
             WHERE token_sha256 = $3 AND used_at_ms = 0 AND expires_at_ms > $1",
        )
        .bind(now_ms)
        .bind(node_id)
        .bind(sha256)
        .execute(&self.pool)
        .await?;
        if r.rows_affected() == 1 {
            return Ok(Ok(()));
        }
        let row: Option<(i64, i64)> = sqlx::query_as(
            "SELECT used_at_ms, expires_at_ms FROM join_tokens WHERE token_sha256 = $1",
        )
        .bind(sha256)
        .fetch_optional(&self.pool)
        .await?;
        Ok(Err(match row {
            None => TokenRefusal::Unknown,
            Some((used, _)) if used != 0 => TokenRefusal::Used,
            Some(_) => TokenRefusal::Expired,
        }))
    }

    /// Live sandboxes placed on a node (everything not terminal).
    pub async fn sandboxes_on_node(&self, node_id: &str) -> Result<Vec<SandboxRow>, MasterError> {
        let rows = sqlx::query_as::<_, SandboxRow>(
            "SELECT * FROM sandboxes WHERE node_id = $1 AND state NOT IN ('killed', 'failed') \
             ORDER BY started_at_ms, id",
        )
        .bind(node_id)
        .fetch_all(&self.pool)
        .await
        .map_err(sandbox_read)?;
        Ok(rows)
    }

    /// Count of sandboxes per state.
    pub async fn count_by_state(&self) -> Result<Vec<(SandboxState, i64)>, MasterError> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT state, COUNT(*) FROM sandboxes GROUP BY state")
                .fetch_all(&self.pool)
                .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(s, n)| Some((s.parse().ok()?, n)))
            .collect())
    }
}
