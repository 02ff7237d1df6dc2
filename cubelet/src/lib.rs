//! Node daemon: templates, storage, network, pools and sandbox runtimes.
//!
//! `node/` orchestrates sandboxes over one `runtime::Runtime`: `namespace` (Linux namespaces,
//! a user namespace, cgroups, seccomp: a shared kernel) and, with the `microvm` cargo feature
//! (on by default), `microvm` (one cube-shim process per sandbox hosting a KVM microVM
//! restored from a snapshot); `runtime = "auto"` picks the strongest the host can run
//! (`runtime::select`). `--no-default-features` builds a namespace-only cubelet.

pub mod agent;
pub mod cgroup;
pub mod config;
pub mod egress_proxy;
pub mod error;
pub mod fstree;
pub mod grpc;
pub mod journal;
pub mod metrics;
pub mod network;
pub mod node;
pub mod oci;
pub mod registration;
pub mod runtime;
pub mod sandbox;
pub mod server;
pub mod state;
pub mod stats;
pub mod storage;
pub mod template;
pub mod vswitch;
