//! The Cube a run talks to: the E2B endpoints and key that `cubectl up` prints, and the
//! template its sandboxes come from (shared by the suite and `soak`).

use crate::{api, http};
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(clap::Args, Debug, Clone)]
pub struct TargetArgs {
    #[arg(long, env = "E2B_API_URL", hide_env_values = true)]
    pub api_url: Option<String>,
    #[arg(long, env = "E2B_SANDBOX_URL", hide_env_values = true)]
    pub sandbox_url: Option<String>,
    #[arg(long, env = "E2B_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Template to create sandboxes from.
    #[arg(long, env = "CUBE_BENCH_TEMPLATE", default_value = "base")]
    pub template: String,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 120)]
    pub request_timeout_s: u64,
}

/// The Cube a suite runs against.
pub struct Target {
    pub api_url: String,
    pub sandbox_url: String,
    pub api_key: String,
    /// The master `cubectl nodes` asks (else cubectl's own default).
    pub master_url: Option<String>,
}

fn required(v: &Option<String>, flag: &str, env: &str) -> Result<String> {
    match v {
        Some(s) if !s.trim().is_empty() => Ok(s.trim().to_string()),
        _ => bail!("{env} is not set (or pass {flag}); `cubectl up` / deploy/dev-up.sh print E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY"),
    }
}

impl TargetArgs {
    /// The target named by the flags or the environment.
    pub fn resolve(&self) -> Result<Target> {
        Ok(Target {
            api_url: required(&self.api_url, "--api-url", "E2B_API_URL")?,
            sandbox_url: required(&self.sandbox_url, "--sandbox-url", "E2B_SANDBOX_URL")?,
            api_key: required(&self.api_key, "--api-key", "E2B_API_KEY")?,
            master_url: None,
        })
    }

    /// Client settings for `t`: sandboxes carry a one-hour timeout, so the server reaps any
    /// a run leaves behind.
    pub fn settings(&self, t: &Target) -> Result<api::Settings> {
        Ok(api::Settings {
            api: http::Endpoint::parse(&t.api_url)?,
            edge: http::Endpoint::parse(&t.sandbox_url)?,
            api_key: t.api_key.clone(),
            template: self.template.clone(),
            sandbox_timeout_s: 3600,
            request_timeout: Duration::from_secs(self.request_timeout_s.max(1)),
        })
    }
}

/// `cubectl`: the one given, else next to cube-bench, else on PATH.
pub fn find_cubectl(explicit: Option<&Path>) -> Option<PathBuf> {
    explicit.map(Path::to_path_buf).or_else(|| {
        let here = std::env::current_exe().ok()?.parent()?.join("cubectl");
        if here.is_file() {
            return Some(here);
        }
        std::env::split_paths(&std::env::var_os("PATH")?)
            .map(|d| d.join("cubectl"))
            .find(|p| p.is_file())
    })
}
