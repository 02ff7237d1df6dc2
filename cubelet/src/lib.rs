//! Node daemon: templates, storage, network, pools and sandbox runtimes.
//!
//! Runtimes: `namespace` (Linux namespaces + cgroups + seccomp, shared kernel), and with the
//! `microvm` cargo feature (on by default) also `microvm` (one cube-shim process per sandbox
//! hosting a KVM microVM restored from a snapshot) and `auto`, which picks between them
//! (`microvm::select`). `--no-default-features` builds a namespace-only cubelet. Both share
//! `node.rs`; the microVM operations live in `node/microvm_ops.rs`.

pub mod agent;
pub mod cgroup;
pub mod config;
pub mod fstree;
pub mod grpc;
pub mod metrics;
#[cfg(feature = "microvm")]
pub mod microvm;
pub mod network;
pub mod node;
pub mod oci;
pub mod registration;
pub mod runtime;
pub mod sandbox_init;
pub mod seccomp;
pub mod server;
#[cfg(feature = "microvm")]
pub mod shim_pool;
pub mod state;
pub mod stats;
pub mod storage;
#[cfg(feature = "microvm")]
pub mod tap_pool;
pub mod template;
pub mod vswitch;
