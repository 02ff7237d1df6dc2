//! The envd protocol version this agent implements: the single place it is defined.
//!
//! `GET /health`, `POST /init` (`X-Envd-Version`) and `--version` all report it.

/// Highest envd version whose feature set this agent implements.
pub const ENVD_VERSION: &str = "0.6.4";
