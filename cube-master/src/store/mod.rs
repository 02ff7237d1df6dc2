//! SQL storage of sandboxes, API keys, nodes, snapshots and secrets through sqlx's `Any`
//! driver: SQLite (`sqlite://PATH`) or PostgreSQL (`postgres://...`), one set of migrations for
//! both. This module holds the sandboxes and idempotency keys; the other tables have a
//! submodule each, all as `impl Db`. Only this module and its submodules reach the pool.
//!
//! Portability rules for every query and migration here (both backends run them in CI):
//! placeholders are `$1, $2, ...` (SQLite accepts `$N` and binds it by number), types are
//! TEXT / BIGINT only (booleans as 0/1, times as unix milliseconds), no `RETURNING`, no
//! backend-specific functions; conditional `UPDATE ... WHERE state = $n` is the concurrency
//! primitive (checked through `rows_affected`).

use crate::error::MasterError;
use crate::state::SandboxState;
use sqlx::any::AnyPoolOptions;
use sqlx::AnyPool;
use sqlx::FromRow;
use std::collections::BTreeMap;

pub mod apikeys;
pub mod nodes;
pub mod secrets;
pub mod snapshots;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// What [`Db::page_sandboxes`] selects. Empty strings filter nothing; `limit` 0 = all.
#[derive(Debug, Default)]
pub struct PageQuery<'a> {
    pub states: &'a [SandboxState],
    pub team_id: &'a str,
    pub template: &'a str,
    /// Rows strictly after this (started_at_ms, id) in the chosen order.
    pub cursor: Option<(i64, String)>,
    /// Only rows started at or after this (unix ms); 0 = any.
    pub started_after_ms: i64,
    pub ascending: bool,
    pub limit: usize,
}

/// One sandbox row.
#[derive(Debug, Clone, FromRow)]
pub struct SandboxRow {
    pub id: String,
    pub team_id: String,
    pub template: String,
    pub build: String,
    /// Decoded when the row is read: a state this master does not know fails the read with
    /// an internal error.
    pub state: SandboxState,
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
    /// 0/1: pause instead of kill at the timeout.
    pub auto_pause: i64,
    /// 0/1: traffic through the edge resumes it when paused.
    pub auto_resume: i64,
    /// The create's timeout, in seconds.
    pub timeout_s: i64,
    /// 0/1, or -1 for rows from before it was recorded.
    pub internet: i64,
    /// 0/1: the edge requires the traffic access token for its ports.
    pub private_ports: i64,
    /// The Host header the edge sends (`${PORT}` replaced); empty = the client's.
    pub mask_request_host: String,
    /// E2B's allowOut / denyOut, checked ([`crate::egress::Rules::encode`]).
    pub allow_out: String,
    pub deny_out: String,
    /// E2B's dnsServers ([`crate::egress::Rules::encode_dns`]): NULL = not given.
    pub dns_servers: Option<String>,
    /// While paused: `full` or `filesystem` (it restarts on resume); empty otherwise.
    pub pause_mode: String,
    /// 0/1: the pause at the timeout keeps only the filesystem (autoPauseMemory false).
    pub auto_pause_filesystem: i64,
}

impl SandboxRow {
    pub fn metadata_map(&self) -> BTreeMap<String, String> {
        decode_map(&self.metadata)
    }

    pub fn internet(&self) -> Option<bool> {
        match self.internet {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }

    pub fn egress(&self) -> crate::egress::Rules {
        crate::egress::Rules {
            allow_out: crate::egress::Rules::decode(&self.allow_out),
            deny_out: crate::egress::Rules::decode(&self.deny_out),
            dns_servers: crate::egress::Rules::decode_dns(self.dns_servers.as_deref()),
        }
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

/// Which database the URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    pub fn of_url(url: &str) -> Result<Backend, MasterError> {
        if url.starts_with("sqlite:") {
            Ok(Backend::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Backend::Postgres)
        } else {
            Err(MasterError::InvalidArgument(format!(
                "database_url must start with sqlite: or postgres:// (got {:?})",
                url.split(':').next().unwrap_or_default()
            )))
        }
    }
}

#[derive(Clone)]
pub struct Db {
    // Private: the submodules of `store` (one per table) use it, nothing outside.
    // NOTE: `$1, $2` placeholders only (see the module comment): PostgreSQL rejects `?`.
    pool: AnyPool,
    backend: Backend,
}

/// A stored sandbox state that is none of [`SandboxState`]'s names.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct UnknownState(String);

/// Sandbox states are stored as their names ([`SandboxState::as_str`]) and decoded when a row
/// is read, so that [`SandboxRow::state`] is the enum.
impl sqlx::Type<sqlx::Any> for SandboxState {
    fn type_info() -> sqlx::any::AnyTypeInfo {
        <String as sqlx::Type<sqlx::Any>>::type_info()
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Any> for SandboxState {
    fn decode(
        value: <sqlx::Any as sqlx::Database>::ValueRef<'r>,
    ) -> Result<Self, sqlx::error::BoxDynError> {
        let s = <String as sqlx::Decode<'r, sqlx::Any>>::decode(value)?;
        s.parse().map_err(|e| UnknownState(e).into())
    }
}

/// The error of a read of sandbox rows: a state this master does not know is an internal
/// error saying so (`unknown sandbox state "..."`), any other a database error.
fn sandbox_read(e: sqlx::Error) -> MasterError {
    match e {
        sqlx::Error::ColumnDecode { source, .. } if source.is::<UnknownState>() => {
            MasterError::Internal(source.to_string())
        }
        e => MasterError::Db(e),
    }
}

impl Db {
    /// Opens (creating an SQLite file if needed) the database and applies the migrations.
    pub async fn open(url: &str) -> Result<Db, MasterError> {
        static DRIVERS: std::sync::Once = std::sync::Once::new();
        DRIVERS.call_once(sqlx::any::install_default_drivers);
        let backend = Backend::of_url(url)?;
        let pool = match backend {
            Backend::Sqlite => {
                // A plain `sqlite://PATH` would refuse a missing file; the master creates it.
                let url = if url.contains("mode=") {
                    url.to_string()
                } else if url.contains('?') {
                    format!("{url}&mode=rwc")
                } else {
                    format!("{url}?mode=rwc")
                };
                let pool = AnyPoolOptions::new()
                    .max_connections(4)
                    .connect(&url)
                    .await?;
                // WAL lets readers run beside the writer; it is a property of the file.
                sqlx::query("PRAGMA journal_mode=WAL")
                    .execute(&pool)
                    .await?;
                pool
            }
            Backend::Postgres => {
                AnyPoolOptions::new()
                    .max_connections(16)
                    .acquire_timeout(std::time::Duration::from_secs(10))
                    .connect(url)
                    .await?
            }
        };
        MIGRATOR.run(&pool).await?;
        Ok(Db { pool, backend })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub async fn insert_sandbox(&self, r: &SandboxRow) -> Result<(), MasterError> {
        sqlx::query(
            "INSERT INTO sandboxes (id, team_id, template, build, state, reason, node_id, \
             agent_address, host_interface, access_token, envd_version, metadata, vcpus, \
             memory_mib, disk_mib, runtime, started_at_ms, end_at_ms, updated_at_ms, auto_pause, \
             auto_resume, timeout_s, internet, private_ports, mask_request_host, allow_out, \
             deny_out, dns_servers, pause_mode, auto_pause_filesystem) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, \
             $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30)",
        )
        .bind(&r.id)
        .bind(&r.team_id)
        .bind(&r.template)
        .bind(&r.build)
        .bind(r.state.as_str())
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
        .bind(r.auto_pause)
        .bind(r.auto_resume)
        .bind(r.timeout_s)
        .bind(r.internet)
        .bind(r.private_ports)
        .bind(&r.mask_request_host)
        .bind(&r.allow_out)
        .bind(&r.deny_out)
        .bind(&r.dns_servers)
        .bind(&r.pause_mode)
        .bind(r.auto_pause_filesystem)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRow>, MasterError> {
        sqlx::query_as::<_, SandboxRow>("SELECT * FROM sandboxes WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(sandbox_read)
    }

    /// The running sandbox whose stored token is `hashed` (or, for rows from before tokens
    /// were hashed, `legacy_plain`).
    pub async fn by_access_token(
        &self,
        hashed: &str,
        legacy_plain: &str,
    ) -> Result<Option<SandboxRow>, MasterError> {
        sqlx::query_as::<_, SandboxRow>(
            "SELECT * FROM sandboxes WHERE access_token IN ($1, $2) AND state = 'running' LIMIT 1",
        )
        .bind(hashed)
        .bind(legacy_plain)
        .fetch_optional(&self.pool)
        .await
        .map_err(sandbox_read)
    }

    /// Sandboxes in any of `states`, ordered by (started_at_ms, id).
    pub async fn list_in_states(
        &self,
        states: &[SandboxState],
    ) -> Result<Vec<SandboxRow>, MasterError> {
        self.page_sandboxes(&PageQuery {
            states,
            ascending: true,
            ..PageQuery::default()
        })
        .await
    }

    /// One page of sandboxes filtered, ordered and cut in SQL (the `sandboxes_state` index),
    /// so a list costs the page, not every sandbox ever created.
    pub async fn page_sandboxes(&self, q: &PageQuery<'_>) -> Result<Vec<SandboxRow>, MasterError> {
        if q.states.is_empty() {
            return Ok(Vec::new());
        }
        let mut n = 0;
        let mut next = || {
            n += 1;
            format!("${n}")
        };
        let marks: Vec<String> = q.states.iter().map(|_| next()).collect();
        let mut sql = format!(
            "SELECT * FROM sandboxes WHERE state IN ({})",
            marks.join(", ")
        );
        if !q.team_id.is_empty() {
            sql += &format!(" AND team_id = {}", next());
        }
        if !q.template.is_empty() {
            sql += &format!(" AND template = {}", next());
        }
        if q.started_after_ms > 0 {
            sql += &format!(" AND started_at_ms >= {}", next());
        }
        let (cmp, order) = if q.ascending {
            (">", "ASC")
        } else {
            ("<", "DESC")
        };
        if q.cursor.is_some() {
            // Spelled out rather than a row-value comparison, which not every SQLite has.
            let (a, b, c) = (next(), next(), next());
            sql += &format!(
                " AND (started_at_ms {cmp} {a} OR (started_at_ms = {b} AND id {cmp} {c}))"
            );
        }
        sql += &format!(" ORDER BY started_at_ms {order}, id {order}");
        if q.limit > 0 {
            sql += &format!(" LIMIT {}", q.limit);
        }
        let mut query = sqlx::query_as::<_, SandboxRow>(&sql);
        for s in q.states {
            query = query.bind(s.as_str());
        }
        if !q.team_id.is_empty() {
            query = query.bind(q.team_id);
        }
        if !q.template.is_empty() {
            query = query.bind(q.template);
        }
        if q.started_after_ms > 0 {
            query = query.bind(q.started_after_ms);
        }
        if let Some((ms, id)) = &q.cursor {
            query = query.bind(*ms).bind(*ms).bind(id.as_str());
        }
        query.fetch_all(&self.pool).await.map_err(sandbox_read)
    }

    /// Deletes rows of sandboxes killed before `before_ms`; returns how many.
    pub async fn purge_killed(&self, before_ms: i64) -> Result<u64, MasterError> {
        let r = sqlx::query("DELETE FROM sandboxes WHERE state = $1 AND updated_at_ms < $2")
            .bind(SandboxState::Killed.as_str())
            .bind(before_ms)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected())
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
            "UPDATE sandboxes SET state = $1, reason = $2, updated_at_ms = $3 WHERE id = $4 AND state = $5",
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

    /// Records a sandbox its node created: where it lives, its start and end, and the
    /// transition `creating` -> `running` (false when it is no longer `creating`).
    pub async fn record_created(&self, r: &SandboxRow, reason: &str) -> Result<bool, MasterError> {
        let res = sqlx::query(
            "UPDATE sandboxes SET node_id = $1, agent_address = $2, host_interface = $3, build = $4, \
             envd_version = $5, runtime = $6, disk_mib = $7, started_at_ms = $8, end_at_ms = $9, \
             state = $10, reason = $11, updated_at_ms = $12 WHERE id = $13 AND state = $14",
        )
        .bind(&r.node_id)
        .bind(&r.agent_address)
        .bind(&r.host_interface)
        .bind(&r.build)
        .bind(&r.envd_version)
        .bind(&r.runtime)
        .bind(r.disk_mib)
        .bind(r.started_at_ms)
        .bind(r.end_at_ms)
        .bind(SandboxState::Running.as_str())
        .bind(reason)
        .bind(crate::now_ms())
        .bind(&r.id)
        .bind(SandboxState::Creating.as_str())
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    /// What the sandbox's pause kept (`full`, `filesystem`; empty once it runs again).
    pub async fn set_pause_mode(&self, id: &str, mode: &str) -> Result<(), MasterError> {
        sqlx::query("UPDATE sandboxes SET pause_mode = $1, updated_at_ms = $2 WHERE id = $3")
            .bind(mode)
            .bind(crate::now_ms())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn set_end(&self, id: &str, end_at_ms: i64) -> Result<(), MasterError> {
        sqlx::query("UPDATE sandboxes SET end_at_ms = $1, updated_at_ms = $2 WHERE id = $3")
            .bind(end_at_ms)
            .bind(crate::now_ms())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// A sandbox's egress configuration (PUT /sandboxes/{id}/network), dnsServers included.
    pub async fn set_egress(
        &self,
        id: &str,
        internet: bool,
        rules: &crate::egress::Rules,
    ) -> Result<(), MasterError> {
        sqlx::query(
            "UPDATE sandboxes SET internet = $1, allow_out = $2, deny_out = $3, dns_servers = $4, \
             updated_at_ms = $5 WHERE id = $6",
        )
        .bind(i64::from(internet))
        .bind(crate::egress::Rules::encode(&rules.allow_out))
        .bind(crate::egress::Rules::encode(&rules.deny_out))
        .bind(rules.encode_dns())
        .bind(crate::now_ms())
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Ids of running, paused or lost sandboxes whose end time has passed.
    pub async fn expired(&self, now_ms: i64) -> Result<Vec<String>, MasterError> {
        let rows: Vec<(String,)> = sqlx::query_as(
            "SELECT id FROM sandboxes WHERE state IN ('running', 'paused', 'lost') AND end_at_ms <= $1",
        )
        .bind(now_ms)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|r| r.0).collect())
    }

    /// Claims `(team, key)` for `sandbox_id`. `Ok(None)`: claimed now; `Ok(Some((sandbox,
    /// fingerprint)))`: an earlier create holds it.
    pub async fn claim_idempotency_key(
        &self,
        team: &str,
        key: &str,
        sandbox_id: &str,
        fingerprint: &str,
    ) -> Result<Option<(String, String)>, MasterError> {
        let r = sqlx::query(
            "INSERT INTO idempotency_keys (team_id, idem_key, sandbox_id, fingerprint, created_at_ms) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
        )
        .bind(team)
        .bind(key)
        .bind(sandbox_id)
        .bind(fingerprint)
        .bind(crate::now_ms())
        .execute(&self.pool)
        .await?;
        if r.rows_affected() == 1 {
            return Ok(None);
        }
        let held: Option<(String, String)> = sqlx::query_as(
            "SELECT sandbox_id, fingerprint FROM idempotency_keys WHERE team_id = $1 AND idem_key = $2",
        )
        .bind(team)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?;
        held.map(Some).ok_or_else(|| {
            // Purged between the two statements: the caller may simply retry.
            MasterError::Unavailable("idempotency key changed meanwhile; retry".into())
        })
    }

    /// Forgets a key whose create (of `sandbox_id`) failed, so that a retry with it creates
    /// again. A key another create has claimed since is left alone.
    pub async fn release_idempotency_key(
        &self,
        team: &str,
        key: &str,
        sandbox_id: &str,
    ) -> Result<(), MasterError> {
        sqlx::query(
            "DELETE FROM idempotency_keys WHERE team_id = $1 AND idem_key = $2 AND sandbox_id = $3",
        )
        .bind(team)
        .bind(key)
        .bind(sandbox_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Deletes keys claimed before `claimed_before_ms` whose create never recorded its sandbox
    /// (its master died between claiming the key and inserting the row, or the database
    /// refused the insert and then the release): no create will ever answer under them. Keys
    /// of creates in flight must be younger than the bound. Returns how many.
    pub async fn release_unrecorded_idempotency_keys(
        &self,
        claimed_before_ms: i64,
    ) -> Result<u64, MasterError> {
        let r = sqlx::query(
            "DELETE FROM idempotency_keys WHERE created_at_ms < $1 \
             AND sandbox_id NOT IN (SELECT id FROM sandboxes)",
        )
        .bind(claimed_before_ms)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected())
    }

    /// Deletes keys claimed before `before_ms`, and keys cube-api made up for its own resends
    /// ([`cube_proto::RETRY_IDEMPOTENCY_PREFIX`]) claimed before `retry_before_ms`; returns how
    /// many.
    pub async fn purge_idempotency_keys(
        &self,
        before_ms: i64,
        retry_before_ms: i64,
    ) -> Result<u64, MasterError> {
        let r = sqlx::query(
            "DELETE FROM idempotency_keys WHERE created_at_ms < $1 \
             OR (idem_key LIKE $2 AND created_at_ms < $3)",
        )
        .bind(before_ms)
        .bind(format!("{}%", cube_proto::RETRY_IDEMPOTENCY_PREFIX))
        .bind(retry_before_ms)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected())
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

    #[tokio::test]
    async fn unknown_state_is_an_internal_error() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&format!("sqlite://{}/m.db", dir.path().display()))
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO sandboxes (id, team_id, template, state, node_id, access_token, \
             started_at_ms, end_at_ms, updated_at_ms) \
             VALUES ('a', 't', 'base', 'hibernating', 'n1', 'x', 1, 2, 1)",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        for e in [
            db.get_sandbox("a").await.unwrap_err(),
            db.sandboxes_on_node("n1").await.unwrap_err(),
        ] {
            let want = "unknown sandbox state \"hibernating\"";
            assert!(matches!(&e, MasterError::Internal(m) if m == want), "{e:?}");
        }
    }
}
