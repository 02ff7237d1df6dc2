//! gRPC definitions shared by cube-master, cubelet and cube-api.
//!
//! The `.proto` sources live in `proto/`; `build.rs` compiles them with `protoc`.

/// The node service (cubelet), called by cube-master.
pub mod node {
    /// Version 1 of the node API.
    pub mod v1 {
        tonic::include_proto!("cube.node.v1");
    }
}

/// The master service, reserved for cube-master.
pub mod master {
    /// Version 1 of the master API.
    pub mod v1 {
        tonic::include_proto!("cube.master.v1");
    }
}

pub use node::v1 as nodev1;

/// The prefix of the idempotency keys cube-api makes up for creates that come without one, so
/// that its own resend of a create (across a master restart) never makes two sandboxes.
pub const RETRY_IDEMPOTENCY_PREFIX: &str = "cube-retry:";
/// How long the master keeps such a key: it only has to outlive cube-api's resends.
pub const RETRY_IDEMPOTENCY_RETENTION_MS: i64 = 10 * 60 * 1000;

/// Unix time in milliseconds, the unit of every `*_ms` time in these APIs.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

pub mod isolation;
pub mod logging;
pub mod retry;
pub mod systemd;
pub mod tls;
