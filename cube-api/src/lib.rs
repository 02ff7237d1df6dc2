//! E2B-compatible REST API (:3000) and sandbox edge proxy (:3001), both backed by cube-master.

pub mod config;
pub mod edge;
pub mod error;
pub mod master;
pub mod rest;

pub use config::ApiConfig;
