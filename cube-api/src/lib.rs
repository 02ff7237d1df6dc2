//! E2B-compatible REST API (:3000) and sandbox edge proxy (:3001), both backed by cube-master.

mod body;
pub mod config;
pub mod edge;
pub mod error;
mod extract;
pub mod handlers;
pub mod master;
pub mod metrics;
mod middleware;
pub mod openapi;
mod paging;
pub mod ratelimit;
mod rfc3339;
pub mod sandbox_cache;
pub mod state;

pub use config::ApiConfig;
