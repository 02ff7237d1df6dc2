//! Scheduler and source of truth: sandbox state machine, nodes, API keys, in SQL.
//!
//! cube-api and cubectl talk to it over gRPC (`cube.master.v1.Master`); it talks to the
//! cubelets (`cube.node.v1.Node`).

/// API keys: their shape, creation and validation.
pub mod apikey;
/// The master's configuration file.
pub mod config;
/// E2B's egress rules (allowOut, denyOut, dnsServers) and what they mean for a node.
pub mod egress;
/// Typed errors, mapped to gRPC status codes.
pub mod error;
/// The node registry (health, polls, heartbeats, clients) and the pure scheduler.
pub mod fleet;
/// The `cube.master.v1.Master` gRPC service and the protocol's conversions.
pub mod grpc;
/// Random ids.
pub mod ids;
/// One leading master per PostgreSQL database.
pub mod leader;
/// Prometheus metrics and the gRPC request counter.
pub mod metrics;
/// The master's operations, as methods of its [`ops::Controller`].
pub mod ops;
/// The secrets key (sealing values) and the checks of secrets.
pub mod secrets;
/// The sandbox state machine.
pub mod state;
/// SQL storage: migrations, and one `impl Db` per table.
pub mod store;
/// Envd access tokens, derived from the master's key.
pub mod token;

pub use config::MasterConfig;
pub use error::MasterError;

pub use cube_proto::now_ms;
