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

pub mod isolation;
pub mod logging;
pub mod systemd;
pub mod tls;
