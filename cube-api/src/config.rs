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
    /// Returned as `domain` so that `get_host(port)` gives `<port>-<id>.<domain>`; empty = null.
    pub domain: String,
    /// Timeout when `POST /sandboxes` (v1) omits it, in seconds (E2B: 15).
    pub default_timeout_v1_s: u64,
    /// Timeout when `POST /v2/sandboxes` omits it, in seconds (E2B: 300).
    pub default_timeout_v2_s: u64,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            api_addr: "127.0.0.1:3000".into(),
            edge_addr: "127.0.0.1:3001".into(),
            master_url: "http://127.0.0.1:9090".into(),
            domain: String::new(),
            default_timeout_v1_s: 15,
            default_timeout_v2_s: 300,
        }
    }
}

impl ApiConfig {
    /// Reads a config file; a missing file means all defaults.
    pub fn load(path: &Path) -> anyhow::Result<ApiConfig> {
        match std::fs::read_to_string(path) {
            Ok(s) => Ok(toml::from_str(&s)
                .map_err(|e| anyhow::anyhow!("parsing {}: {e}", path.display()))?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(ApiConfig::default()),
            Err(e) => Err(anyhow::anyhow!("reading {}: {e}", path.display())),
        }
    }
}
