//! The `snapshots` table (portable SQL, see [`crate::store`]): one row per snapshot, for its
//! team, its optional name and its node (see [`crate::ops::snapshots`]).

use super::Db;
use crate::error::MasterError;
use sqlx::FromRow;

/// One snapshot row.
#[derive(Debug, Clone, FromRow, PartialEq, Eq)]
pub struct SnapshotRow {
    pub id: String,
    pub name: String,
    pub team_id: String,
    pub sandbox_id: String,
    pub node_id: String,
    pub template: String,
    pub build: String,
    pub filesystem_only: i64,
    pub created_at_ms: i64,
}

impl Db {
    pub async fn insert_snapshot(&self, s: &SnapshotRow) -> Result<(), MasterError> {
        sqlx::query(
            "INSERT INTO snapshots (id, name, team_id, sandbox_id, node_id, template, build, \
             filesystem_only, created_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&s.id)
        .bind(&s.name)
        .bind(&s.team_id)
        .bind(&s.sandbox_id)
        .bind(&s.node_id)
        .bind(&s.template)
        .bind(&s.build)
        .bind(s.filesystem_only)
        .bind(s.created_at_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn get_snapshot(&self, id: &str) -> Result<Option<SnapshotRow>, MasterError> {
        Ok(
            sqlx::query_as::<_, SnapshotRow>("SELECT * FROM snapshots WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    /// The team's newest snapshot with this name.
    pub async fn snapshot_by_name(
        &self,
        team: &str,
        name: &str,
    ) -> Result<Option<SnapshotRow>, MasterError> {
        Ok(sqlx::query_as::<_, SnapshotRow>(
            "SELECT * FROM snapshots WHERE team_id = $1 AND name = $2 \
             ORDER BY created_at_ms DESC, id DESC LIMIT 1",
        )
        .bind(team)
        .bind(name)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Every snapshot, newest first.
    pub async fn list_snapshot_rows(&self) -> Result<Vec<SnapshotRow>, MasterError> {
        Ok(sqlx::query_as::<_, SnapshotRow>(
            "SELECT * FROM snapshots ORDER BY created_at_ms DESC, id DESC",
        )
        .fetch_all(&self.pool)
        .await?)
    }

    pub async fn delete_snapshot_row(&self, id: &str) -> Result<bool, MasterError> {
        let r = sqlx::query("DELETE FROM snapshots WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected() == 1)
    }

    /// The snapshot `key` (id, or name) names for `team` (empty = any team, id only for names).
    pub async fn resolve_snapshot(
        &self,
        team: &str,
        key: &str,
    ) -> Result<Option<SnapshotRow>, MasterError> {
        if let Some(s) = self.get_snapshot(key).await? {
            if team.is_empty() || s.team_id == team {
                return Ok(Some(s));
            }
            return Ok(None);
        }
        if team.is_empty() {
            return Ok(None);
        }
        self.snapshot_by_name(team, key).await
    }
}
