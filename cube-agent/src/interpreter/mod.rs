//! The code-interpreter protocol of `e2b-code-interpreter` (port 49999), served by the agent
//! when the template enables it: `POST /execute` streams NDJSON, `/contexts` manages stateful
//! contexts. Each context is one long-lived `python3` worker (no Jupyter) started as the
//! sandbox user; the default Python context's worker is started with the agent, so the first
//! `run_code` after a sandbox is created or restored finds it warm.

pub mod contexts;
pub mod http;
pub mod protocol;
pub mod worker;

use serde::Deserialize;

/// `[interpreter]` in the agent config.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct InterpreterConfig {
    /// Off by default: sandboxes that do not use it pay nothing.
    pub enabled: bool,
    /// Address to listen on.
    pub address: String,
    pub port: u16,
    /// The Python interpreter (default: `python3` from the standard PATH).
    pub python: Option<String>,
    /// Start the default Python context's worker at agent start.
    pub prestart: bool,
    /// Start workers with `python3 -S` and put the site directories on `sys.path` directly:
    /// skips `.pth` files and `sitecustomize`, which cost hundreds of ms in a fresh sandbox.
    pub fast_start: bool,
    /// Seconds of silence after which a running cell's stream gets a `keepalive` line; 0 = never.
    /// Off by default because the SDK's `timeout` is an HTTP read timeout: any byte (a keepalive
    /// too) restarts it, so a keepalive shorter than the timeout would stop it from firing.
    pub keepalive_s: u64,
    /// Largest accepted request body, bytes.
    pub max_body_bytes: usize,
}

impl Default for InterpreterConfig {
    fn default() -> Self {
        InterpreterConfig {
            enabled: false,
            address: "0.0.0.0".into(),
            port: 49999,
            python: None,
            prestart: true,
            fast_start: true,
            keepalive_s: 0,
            max_body_bytes: 32 << 20,
        }
    }
}

pub use http::{serve, Interpreter};

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn off_by_default_and_enabled_by_the_template_config() {
        let c = Config::parse("", "t").unwrap();
        assert!(!c.interpreter.enabled);
        let c = Config::parse("[interpreter]\nenabled = true\nport = 49999\n", "t").unwrap();
        assert!(c.interpreter.enabled);
        assert_eq!(c.interpreter.port, 49999);
        assert!(c.interpreter.prestart);
        assert!(c.interpreter.fast_start);
        assert_eq!(c.interpreter.keepalive_s, 0);
        assert!(Config::parse("[interpreter]\nenabeld = true\n", "t").is_err());
        assert!(Config::parse("[interpreter]\nport = 70000\n", "t").is_err());
    }
}
