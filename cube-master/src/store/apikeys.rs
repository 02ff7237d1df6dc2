//! The `api_keys` table (portable SQL, see [`crate::store`]).

use super::Db;
use crate::error::MasterError;
use sqlx::FromRow;

/// One API key row.
#[derive(Debug, Clone, FromRow)]
pub struct ApiKeyRow {
    pub id: String,
    pub name: String,
    pub team_id: String,
    pub key_sha256: String,
    pub prefix: String,
    pub created_at_ms: i64,
    pub revoked: i64,
}

impl Db {
    pub async fn insert_api_key(&self, k: &ApiKeyRow) -> Result<(), MasterError> {
        sqlx::query(
            "INSERT INTO api_keys (id, name, team_id, key_sha256, prefix, created_at_ms, revoked) \
             VALUES ($1, $2, $3, $4, $5, $6, 0)",
        )
        .bind(&k.id)
        .bind(&k.name)
        .bind(&k.team_id)
        .bind(&k.key_sha256)
        .bind(&k.prefix)
        .bind(k.created_at_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn api_key_by_hash(&self, hash: &str) -> Result<Option<ApiKeyRow>, MasterError> {
        Ok(sqlx::query_as::<_, ApiKeyRow>(
            "SELECT * FROM api_keys WHERE key_sha256 = $1 AND revoked = 0",
        )
        .bind(hash)
        .fetch_optional(&self.pool)
        .await?)
    }

    pub async fn list_api_keys(&self) -> Result<Vec<ApiKeyRow>, MasterError> {
        Ok(
            sqlx::query_as::<_, ApiKeyRow>("SELECT * FROM api_keys ORDER BY created_at_ms, id")
                .fetch_all(&self.pool)
                .await?,
        )
    }

    pub async fn revoke_api_key(&self, id: &str) -> Result<bool, MasterError> {
        let r = sqlx::query("UPDATE api_keys SET revoked = 1 WHERE id = $1 AND revoked = 0")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected() == 1)
    }
}
