//! The `secrets` table (portable SQL, see [`crate::store`]): sealed values only, see
//! [`crate::secrets`].

use super::Db;
use crate::error::MasterError;
use sqlx::FromRow;

/// One secret row: its current version's value, sealed ([`crate::secrets::SecretsKey`]).
#[derive(Debug, Clone, FromRow, PartialEq, Eq)]
pub struct SecretRow {
    pub id: String,
    pub team_id: String,
    /// Canonical (lower-cased); unique in the team.
    pub name: String,
    pub version: i64,
    /// [`super::encode_map`] of the metadata.
    pub metadata: String,
    pub sealed: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl Db {
    /// Inserts a secret; `Ok(false)` when the team already has one of that name.
    pub async fn insert_secret(&self, r: &SecretRow) -> Result<bool, MasterError> {
        let res = sqlx::query(
            "INSERT INTO secrets (id, team_id, name, version, metadata, sealed, created_at_ms, \
             updated_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
        )
        .bind(&r.id)
        .bind(&r.team_id)
        .bind(&r.name)
        .bind(r.version)
        .bind(&r.metadata)
        .bind(&r.sealed)
        .bind(r.created_at_ms)
        .bind(r.updated_at_ms)
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    /// The team's secret whose id or name is `key`.
    pub async fn get_secret(
        &self,
        team: &str,
        key: &str,
    ) -> Result<Option<SecretRow>, MasterError> {
        Ok(sqlx::query_as::<_, SecretRow>(
            "SELECT * FROM secrets WHERE team_id = $1 AND (id = $2 OR name = $3)",
        )
        .bind(team)
        .bind(key)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Up to `limit` of the team's secrets strictly after `cursor` (created_at_ms, id), in
    /// that order.
    pub async fn page_secrets(
        &self,
        team: &str,
        cursor: Option<(i64, String)>,
        limit: usize,
    ) -> Result<Vec<SecretRow>, MasterError> {
        let order = format!("ORDER BY created_at_ms, id LIMIT {limit}");
        Ok(match cursor {
            None => {
                sqlx::query_as::<_, SecretRow>(&format!(
                    "SELECT * FROM secrets WHERE team_id = $1 {order}"
                ))
                .bind(team)
                .fetch_all(&self.pool)
                .await?
            }
            Some((ms, id)) => {
                sqlx::query_as::<_, SecretRow>(&format!(
                    "SELECT * FROM secrets WHERE team_id = $1 AND \
                     (created_at_ms > $2 OR (created_at_ms = $3 AND id > $4)) {order}"
                ))
                .bind(team)
                .bind(ms)
                .bind(ms)
                .bind(id)
                .fetch_all(&self.pool)
                .await?
            }
        })
    }

    /// Stores the row's new version, sealed value, metadata and update time, only if the
    /// stored version is still `from`. Returns whether it did.
    pub async fn update_secret(&self, r: &SecretRow, from: i64) -> Result<bool, MasterError> {
        let res = sqlx::query(
            "UPDATE secrets SET version = $1, sealed = $2, metadata = $3, updated_at_ms = $4 \
             WHERE team_id = $5 AND id = $6 AND version = $7",
        )
        .bind(r.version)
        .bind(&r.sealed)
        .bind(&r.metadata)
        .bind(r.updated_at_ms)
        .bind(&r.team_id)
        .bind(&r.id)
        .bind(from)
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    pub async fn delete_secret(&self, team: &str, id: &str) -> Result<bool, MasterError> {
        let res = sqlx::query("DELETE FROM secrets WHERE team_id = $1 AND id = $2")
            .bind(team)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(res.rows_affected() == 1)
    }
}
