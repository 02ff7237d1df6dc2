//! E2B-compatible REST API (:3000) and sandbox edge proxy (:3001), both backed by cube-master.

mod body;
pub mod config;
pub mod edge;
pub mod error;
pub mod master;
pub mod metrics;
pub mod openapi;
mod paging;
pub mod ratelimit;
pub mod rest;
pub mod sandbox_cache;
pub mod sandbox_logs;
pub mod sandbox_metrics;
pub mod secrets;
pub mod snapshots;

pub use config::ApiConfig;
