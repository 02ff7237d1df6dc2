//! SQL storage of sandboxes and API keys (sqlx; SQLite today, portable SQL for PostgreSQL).

use crate::error::MasterError;
use crate::state::SandboxState;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use sqlx::FromRow;
use std::collections::BTreeMap;
use std::str::FromStr;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// One sandbox row.
#[derive(Debug, Clone, FromRow)]
pub struct SandboxRow {
    pub id: String,
    pub team_id: String,
    pub template: String,
    pub build: String,
    pub state: String,
    pub reason: String,
    pub node_id: String,
    pub agent_address: String,
    pub host_interface: String,
    pub access_token: String,
    pub envd_version: String,
    pub metadata: String,
    pub vcpus: i64,
    pub memory_mib: i64,
    pub disk_mib: i64,
    pub runtime: String,
    pub started_at_ms: i64,
    pub end_at_ms: i64,
    pub updated_at_ms: i64,
}

impl SandboxRow {
    pub fn state(&self) -> Result<SandboxState, MasterError> {
        SandboxState::from_str(&self.state).map_err(MasterError::Internal)
    }

    pub fn metadata_map(&self) -> BTreeMap<String, String> {
        decode_map(&self.metadata)
    }
}

/// Metadata is stored as a JSON-free `k=v` list with percent-escaping, so that no JSON
/// dependency is needed and SQL `LIKE` is never used for matching (filters run in Rust).
pub fn encode_map(m: &BTreeMap<String, String>) -> String {
    m.iter()
        .map(|(k, v)| format!("{}={}", escape(k), escape(v)))
        .collect::<Vec<_>>()
        .join("&")
}

pub fn decode_map(s: &str) -> BTreeMap<String, String> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .filter_map(|p| {
            let (k, v) = p.split_once('=')?;
            Some((unescape(k), unescape(v)))
        })
        .collect()
}

fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            o.push(b as char);
        } else {
            o.push_str(&format!("%{b:02X}"));
        }
    }
    o
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && b[i + 1].is_ascii_hexdigit()
            && b[i + 2].is_ascii_hexdigit()
        {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

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

#[derive(Clone)]
pub struct Db {
    pool: SqlitePool,
}

impl Db {
    /// Opens (creating if needed) the database and applies the migrations.
    pub async fn open(url: &str) -> Result<Db, MasterError> {
        let opts = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .busy_timeout(std::time::Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(opts)
            .await?;
        MIGRATOR.run(&pool).await?;
        Ok(Db { pool })
    }

    pub async fn insert_sandbox(&self, r: &SandboxRow) -> Result<(), MasterError> {
        sqlx::query(
            "INSERT INTO sandboxes (id, team_id, template, build, state, reason, node_id, \
             agent_address, host_interface, access_token, envd_version, metadata, vcpus, \
             memory_mib, disk_mib, runtime, started_at_ms, end_at_ms, updated_at_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&r.id)
        .bind(&r.team_id)
        .bind(&r.template)
        .bind(&r.build)
        .bind(&r.state)
        .bind(&r.reason)
        .bind(&r.node_id)
        .bind(&r.agent_address)
        .bind(&r.host_interface)
        .bind(&r.access_token)
        .bind(&r.envd_version)
        .bind(&r.metadata)
        .bind(r.vcpus)
        .bind(r.memory_mib)
        .bind(r.disk_mib)
        .bind(&r.runtime)
        .bind(r.started_at_ms)
        .bind(r.end_at_ms)
        .bind(r.updated_at_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRow>, MasterError> {
        Ok(
            sqlx::query_as::<_, SandboxRow>("SELECT * FROM sandboxes WHERE id = ?")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    pub async fn by_access_token(&self, token: &str) -> Result<Option<SandboxRow>, MasterError> {
        Ok(sqlx::query_as::<_, SandboxRow>(
            "SELECT * FROM sandboxes WHERE access_token = ? AND state = 'running'",
        )
        .bind(token)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Sandboxes in any of `states`, ordered by (started_at_ms, id).
    pub async fn list_in_states(
        &self,
        states: &[SandboxState],
    ) -> Result<Vec<SandboxRow>, MasterError> {
        let rows =
            sqlx::query_as::<_, SandboxRow>("SELECT * FROM sandboxes ORDER BY started_at_ms, id")
                .fetch_all(&self.pool)
                .await?;
        Ok(rows
            .into_iter()
            .filter(|r| r.state().map(|s| states.contains(&s)).unwrap_or(false))
            .collect())
    }

    /// Moves a sandbox `from → to` only if it is still in `from`. Returns whether it moved.
    pub async fn transition(
        &self,
        id: &str,
        from: SandboxState,
        to: SandboxState,
        reason: &str,
    ) -> Result<bool, MasterError> {
        if !from.can_go(to) {
            return Err(MasterError::FailedPrecondition(format!(
                "sandbox {id}: illegal transition {from} -> {to}"
            )));
        }
        let r = sqlx::query(
            "UPDATE sandboxes SET state = ?, reason = ?, updated_at_ms = ? WHERE id = ? AND state = ?",
        )
        .bind(to.as_str())
        .bind(reason)
        .bind(crate::now_ms())
        .bind(id)
        .bind(from.as_str())
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    /// Records where a created sandbox lives.
    pub async fn set_placement(&self, r: &SandboxRow) -> Result<(), MasterError> {
        sqlx::query(
            "UPDATE sandboxes SET node_id = ?, agent_address = ?, host_interface = ?, build = ?, \
             envd_version = ?, runtime = ?, disk_mib = ?, updated_at_ms = ? WHERE id = ?",
        )
        .bind(&r.node_id)
        .bind(&r.agent_address)
        .bind(&r.host_interface)
        .bind(&r.build)
        .bind(&r.envd_version)
        .bind(&r.runtime)
        .bind(r.disk_mib)
        .bind(crate::now_ms())
        .bind(&r.id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn set_end(&self, id: &str, end_at_ms: i64) -> Result<(), MasterError> {
        sqlx::query("UPDATE sandboxes SET end_at_ms = ?, updated_at_ms = ? WHERE id = ?")
            .bind(end_at_ms)
            .bind(crate::now_ms())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Ids of running or paused sandboxes whose end time has passed.
    pub async fn expired(&self, now_ms: i64) -> Result<Vec<String>, MasterError> {
        let rows: Vec<(String,)> = sqlx::query_as(
            "SELECT id FROM sandboxes WHERE state IN ('running', 'paused') AND end_at_ms <= ?",
        )
        .bind(now_ms)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|r| r.0).collect())
    }

    pub async fn insert_api_key(&self, k: &ApiKeyRow) -> Result<(), MasterError> {
        sqlx::query(
            "INSERT INTO api_keys (id, name, team_id, key_sha256, prefix, created_at_ms, revoked) \
             VALUES (?, ?, ?, ?, ?, ?, 0)",
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
            "SELECT * FROM api_keys WHERE key_sha256 = ? AND revoked = 0",
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
        let r = sqlx::query("UPDATE api_keys SET revoked = 1 WHERE id = ? AND revoked = 0")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected() == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trip() {
        let mut m = BTreeMap::new();
        m.insert("a b".to_string(), "x=y&z%".to_string());
        m.insert("user".to_string(), "émile".to_string());
        assert_eq!(decode_map(&encode_map(&m)), m);
        assert!(decode_map("").is_empty());
    }
}

#[cfg(test)]
mod state_tests {
    use super::*;

    fn row(id: &str) -> SandboxRow {
        SandboxRow {
            id: id.into(),
            team_id: "t".into(),
            template: "base".into(),
            build: String::new(),
            state: "creating".into(),
            reason: String::new(),
            node_id: String::new(),
            agent_address: String::new(),
            host_interface: String::new(),
            access_token: format!("tok-{id}"),
            envd_version: String::new(),
            metadata: String::new(),
            vcpus: 1,
            memory_mib: 1,
            disk_mib: 0,
            runtime: String::new(),
            started_at_ms: 1,
            end_at_ms: 10,
            updated_at_ms: 1,
        }
    }

    #[tokio::test]
    async fn guarded_transitions_and_expiry() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&format!("sqlite://{}/m.db?mode=rwc", dir.path().display()))
            .await
            .unwrap();
        db.insert_sandbox(&row("a")).await.unwrap();
        use SandboxState::*;
        assert!(db.transition("a", Creating, Running, "ok").await.unwrap());
        // A second writer that still believes it is creating does not move it.
        assert!(!db.transition("a", Creating, Failed, "late").await.unwrap());
        // Illegal steps are refused before touching the database.
        assert!(db.transition("a", Running, Paused, "skip").await.is_err());
        let r = db.get_sandbox("a").await.unwrap().unwrap();
        assert_eq!((r.state.as_str(), r.reason.as_str()), ("running", "ok"));
        assert_eq!(db.expired(9).await.unwrap(), Vec::<String>::new());
        assert_eq!(db.expired(10).await.unwrap(), vec!["a".to_string()]);
        assert_eq!(db.by_access_token("tok-a").await.unwrap().unwrap().id, "a");
        // Duplicate ids are rejected by the primary key.
        assert!(db.insert_sandbox(&row("a")).await.is_err());
        // Reopening keeps the data (migrations are not re-applied).
        drop(db);
        let db = Db::open(&format!("sqlite://{}/m.db?mode=rwc", dir.path().display()))
            .await
            .unwrap();
        assert!(db.get_sandbox("a").await.unwrap().is_some());
    }
}
