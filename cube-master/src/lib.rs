//! Scheduler and source of truth: sandbox state machine, nodes, API keys, in SQL.
//!
//! cube-api and cubectl talk to it over gRPC (`cube.master.v1.Master`); it talks to the
//! cubelets (`cube.node.v1.Node`).

pub mod apikey;
pub mod catalog;
pub mod config;
pub mod db;
pub mod egress;
pub mod error;
pub mod ids;
pub mod leader;
pub mod lifecycle;
pub mod metrics;
pub mod node_store;
pub mod nodes;
pub mod reaper;
pub mod sandbox_history;
pub mod sandbox_metrics;
pub mod scheduler;
pub mod secrets;
pub mod server;
pub mod service;
pub mod snapshots;
pub mod state;
pub mod token;

pub use config::MasterConfig;
pub use error::MasterError;

pub use cube_proto::now_ms;
