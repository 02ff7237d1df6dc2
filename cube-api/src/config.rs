//! `cube-api.toml`. Every field has a default.

use serde::Deserialize;
use std::path::Path;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// REST API listen address.
    pub api_addr: String,
    /// Sandbox edge (envd proxy) listen address.
    pub edge_addr: String,
    /// cube-master gRPC address.
    pub master_url: String,
    /// Every cube-master of a fleet with standbys (the leader and the others, in any order);
    /// when set, used instead of `master_url`.
    pub master_urls: Vec<String>,
    /// Returned as `domain` so that `get_host(port)` gives `<port>-<id>.<domain>`; empty = null.
    pub domain: String,
    /// Timeout when `POST /sandboxes` (v1) omits it, in seconds (E2B: 15).
    pub default_timeout_v1_s: u64,
    /// Timeout when `POST /v2/sandboxes` omits it, in seconds (E2B: 300).
    pub default_timeout_v2_s: u64,
    /// Prometheus `/metrics` listen address; empty = not served.
    pub metrics_addr: String,
    /// Largest accepted request body (413 above).
    pub max_body_bytes: usize,
    /// How long a master call that fails in transport (the master restarting) is resent before
    /// the client gets a 503, in ms (0 = one try).
    pub master_retry_ms: u64,
    /// How long the edge trusts a master answer about a sandbox, in ms (0 = ask every time).
    pub edge_cache_ttl_ms: u64,
    /// Per-API-key token buckets.
    pub rate_limit: crate::ratelimit::RateLimitConfig,
    /// `"text"` or `"json"` (one object per line).
    pub log_format: cube_proto::logging::LogFormat,
    /// Mutual TLS to cube-master; absent = plaintext.
    pub tls: Option<cube_proto::tls::TlsConfig>,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            api_addr: "127.0.0.1:3000".into(),
            edge_addr: "127.0.0.1:3001".into(),
            master_url: "http://127.0.0.1:9090".into(),
            master_urls: Vec::new(),
            domain: String::new(),
            default_timeout_v1_s: 15,
            default_timeout_v2_s: 300,
            metrics_addr: "127.0.0.1:9094".into(),
            max_body_bytes: 1 << 20,
            master_retry_ms: 10_000,
            edge_cache_ttl_ms: 1000,
            rate_limit: Default::default(),
            log_format: Default::default(),
            tls: None,
        }
    }
}

impl ApiConfig {
    /// The masters to talk to: `master_urls`, else `master_url`.
    pub fn masters(&self) -> Vec<String> {
        if self.master_urls.is_empty() {
            vec![self.master_url.clone()]
        } else {
            self.master_urls.clone()
        }
    }

    /// Reads a config file; a missing file means all defaults.
    pub fn load(path: &Path) -> anyhow::Result<ApiConfig> {
        let cfg: ApiConfig = match std::fs::read_to_string(path) {
            Ok(s) => toml::from_str(&s)
                .map_err(|e| anyhow::anyhow!("parsing {}: {e}", path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => ApiConfig::default(),
            Err(e) => return Err(anyhow::anyhow!("reading {}: {e}", path.display())),
        };
        cfg.rate_limit
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        if cfg.max_body_bytes == 0 {
            anyhow::bail!("{}: max_body_bytes must be > 0", path.display());
        }
        Ok(cfg)
    }
}
