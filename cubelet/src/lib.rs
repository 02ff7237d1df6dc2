//! Node daemon: templates, storage, network, pools and sandbox runtimes.
//!
//! Runtime on this build: `namespace` (Linux namespaces + cgroups + seccomp, shared kernel).
//! The `microvm` runtime (cube-shim + cube-hypervisor) plugs into the same node operations.

pub mod agent;
pub mod cgroup;
pub mod config;
pub mod fstree;
pub mod grpc;
pub mod metrics;
pub mod network;
pub mod node;
pub mod oci;
pub mod runtime;
pub mod sandbox_init;
pub mod seccomp;
pub mod server;
pub mod state;
pub mod storage;
pub mod template;
pub mod vswitch;
