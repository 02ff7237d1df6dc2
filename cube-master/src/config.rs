//! `cube-master.toml`. Every field has a default.

use serde::Deserialize;
use std::path::Path;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MasterConfig {
    /// gRPC listen address for cube-api and cubectl.
    pub grpc_addr: String,
    /// sqlx database URL (`sqlite://PATH?mode=rwc`).
    pub database_url: String,
    /// cubelet gRPC addresses (`http://host:port`). Static for now; registration comes later.
    pub nodes: Vec<String>,
    /// How often each node's NodeStatus is polled.
    pub node_poll_interval_ms: u64,
    /// Consecutive failed polls after which a node is NotReady.
    pub node_max_misses: u32,
    /// How often the TTL reaper looks for expired sandboxes.
    pub reaper_interval_ms: u64,
    /// Longest allowed sandbox timeout, in seconds.
    pub max_timeout_s: u64,
    /// How long rows of killed sandboxes are kept (for `cubectl sandbox get` and audits)
    /// before the reaper deletes them; 0 keeps them forever.
    pub killed_retention_s: u64,
    /// How often every Ready node's sandboxes are reconciled with the rows (orphans killed,
    /// rows of sandboxes the node no longer runs ended); 0 = only when a node comes back.
    pub reconcile_interval_ms: u64,
    /// How old a sandbox on a node must be before it is killed as an orphan (no row, or a
    /// finished one): longer than any create, so an in-flight create is never taken for one.
    pub orphan_grace_ms: u64,
    /// How long a paused sandbox is kept (from its pause) before the reaper kills it; a
    /// connect resumes it and its timeout counts again. 0 keeps paused sandboxes until killed.
    pub paused_retention_s: u64,
    /// How long a create's `Idempotency-Key` is remembered.
    pub idempotency_retention_s: u64,
    /// Shape of new sandboxes.
    pub default_vcpus: u32,
    pub default_memory_mib: u64,
    /// How long a node may take to create a sandbox (agent healthy), in milliseconds.
    pub create_timeout_ms: u64,
    /// Reported when the node does not know the sandbox agent's envd version (a template built
    /// before builds recorded it).
    pub default_envd_version: String,
    /// RegisterNode needs a one-time join token (CreateJoinToken). False = any node that can
    /// reach the master may register (single-host convenience).
    pub require_join_token: bool,
    /// How often registered nodes heartbeat; NotReady after `node_max_misses` intervals
    /// without one.
    pub heartbeat_interval_ms: u64,
    /// How often a standby master (another leads on the same PostgreSQL database) tries to take
    /// the lead, in ms.
    pub standby_poll_ms: u64,
    /// Prometheus `/metrics` listen address; empty = no metrics endpoint.
    pub metrics_addr: String,
    /// `"text"` or `"json"` (one object per line).
    pub log_format: cube_proto::logging::LogFormat,
    /// Mutual TLS for the gRPC server and the links to nodes; absent = plaintext.
    pub tls: Option<cube_proto::tls::TlsConfig>,
    /// The key envd access tokens are derived from (created when absent; every master of a
    /// fleet must share it). Empty = `<database file>.token-key` for SQLite; PostgreSQL needs
    /// it set.
    pub token_key_file: String,
    /// The key secret values are sealed with (32 raw bytes, created mode 0600 when absent;
    /// every master of a fleet must share it). Empty = beside the token key:
    /// `<database file>.secrets-key` for SQLite, `<token_key_file>.secrets-key` otherwise.
    pub secrets_key_file: String,
}

impl Default for MasterConfig {
    fn default() -> Self {
        MasterConfig {
            grpc_addr: "127.0.0.1:9090".into(),
            database_url: "sqlite:///var/lib/cube/master.db?mode=rwc".into(),
            nodes: vec!["http://127.0.0.1:9091".into()],
            node_poll_interval_ms: 2000,
            node_max_misses: 3,
            reaper_interval_ms: 1000,
            max_timeout_s: 24 * 3600,
            killed_retention_s: 3600,
            reconcile_interval_ms: 30_000,
            orphan_grace_ms: 120_000,
            paused_retention_s: 30 * 24 * 3600,
            idempotency_retention_s: 24 * 3600,
            default_vcpus: 2,
            default_memory_mib: 512,
            create_timeout_ms: 60_000,
            default_envd_version: "0.6.4".into(),
            require_join_token: false,
            heartbeat_interval_ms: 2000,
            standby_poll_ms: 500,
            metrics_addr: "127.0.0.1:9092".into(),
            log_format: Default::default(),
            tls: None,
            token_key_file: String::new(),
            secrets_key_file: String::new(),
        }
    }
}

impl MasterConfig {
    /// Where the token key lives (see `token_key_file`).
    pub fn token_key_path(&self) -> anyhow::Result<std::path::PathBuf> {
        if !self.token_key_file.is_empty() {
            return Ok(self.token_key_file.clone().into());
        }
        let db = self
            .database_url
            .strip_prefix("sqlite://")
            .map(|r| r.split('?').next().unwrap_or(r))
            .filter(|p| p.starts_with('/'))
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "token_key_file is required unless database_url is an absolute sqlite:// path"
                )
            })?;
        Ok(format!("{db}.token-key").into())
    }

    /// Where the secrets key lives (see `secrets_key_file`).
    pub fn secrets_key_path(&self) -> anyhow::Result<std::path::PathBuf> {
        if !self.secrets_key_file.is_empty() {
            return Ok(self.secrets_key_file.clone().into());
        }
        let t = self.token_key_path().map_err(|_| {
            anyhow::anyhow!(
                "secrets_key_file is required unless token_key_file is set or database_url is \
                 an absolute sqlite:// path"
            )
        })?;
        let t = t.to_string_lossy();
        let base = t.strip_suffix(".token-key").unwrap_or(&t);
        Ok(format!("{base}.secrets-key").into())
    }

    /// Reads a config file; a missing file means all defaults.
    pub fn load(path: &Path) -> anyhow::Result<MasterConfig> {
        match std::fs::read_to_string(path) {
            Ok(s) => Ok(toml::from_str(&s)
                .map_err(|e| anyhow::anyhow!("parsing {}: {e}", path.display()))?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(MasterConfig::default()),
            Err(e) => Err(anyhow::anyhow!("reading {}: {e}", path.display())),
        }
    }
}
