//! The seam between the node and the ways it can run a sandbox. A [`Runtime`] takes a sandbox
//! from prepared parts to running and back; the node (`node/`) owns the registry, state files,
//! recovery and request defaults and never asks which runtime it has.
//!
//! * `container/`: a sandbox that is a process tree on the host (disk, cgroup, network
//!   namespace, pre-started pool), its PID 1 started by a launcher:
//!   * `namespace/`: Linux namespaces, a user namespace, seccomp: a shared kernel;
//!   * `gvisor/`: a `runsc` sandbox: gVisor's user-space kernel.
//! * `microvm/` (cargo feature `microvm`): one cube-shim per sandbox hosting a KVM microVM
//!   restored from the template's memory snapshot.
//!
//! [`select`] decides which one a node runs; [`build`] is the only place that names them.

pub mod container;
pub mod gvisor;
pub mod host;
#[cfg(feature = "microvm")]
pub mod microvm;
pub mod namespace;
pub mod process;
pub mod select;

use crate::error::NodeError;
use crate::sandbox::{RuntimeState, SandboxState};
use cube_init::Settings;
use host::{Host, PoolLevel};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use process::is_alive;
pub use select::{kvm_kind, select, Selection};

/// A create, its defaults applied once by the node before a runtime sees it.
#[derive(Debug, Clone)]
pub struct CreateSpec {
    /// The template build's image.
    pub rootfs: PathBuf,
    /// Its size in MiB (the disk size pre-started sandboxes have).
    pub image_mib: u64,
    /// What the agent is initialised with (user and workdir always set).
    pub init: Settings,
    /// How long the sandbox may take to be ready.
    pub ready_timeout: Duration,
}

/// A create's outcome beyond the state the runtime filled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Created {
    /// Whether a pre-started sandbox (or a warm VMM) was taken.
    pub from_pool: bool,
}

/// What a snapshot keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotKind {
    /// The filesystem only: a sandbox created from it starts its processes afresh.
    Filesystem,
    /// Memory, devices and disk: a sandbox created from it continues where it was.
    Full,
}

/// One way of running sandboxes.
///
/// Every method that changes a sandbox records in `st` what it holds as soon as it holds it,
/// so that a failure part-way is released by [`Runtime::release`]. Phase changes and saving
/// the state file are the node's.
#[async_trait::async_trait]
pub trait Runtime: Send + Sync {
    /// The runtime's name (config and API).
    fn name(&self) -> &'static str;

    /// What [`Runtime::snapshot`] keeps.
    fn snapshot_kind(&self) -> SnapshotKind;

    /// The runtime part of a new sandbox's state.
    fn new_state(&self) -> RuntimeState;

    /// Brings a sandbox in phase `Creating` (id, template, shape and policy set) to running
    /// with its agent initialised.
    async fn create(&self, spec: &CreateSpec, st: &mut SandboxState) -> Result<Created, NodeError>;

    /// Stops a running sandbox's processes where they are (`memory`), or, without `memory`,
    /// ends them once the filesystem is flushed (`st.stopped`): a resume starts it afresh.
    async fn pause(&self, st: &mut SandboxState, memory: bool) -> Result<(), NodeError>;

    /// Lets a paused sandbox run again: where it stopped, or, with `reboot` (always for one
    /// paused without memory), started afresh from its disk, its memory dropped.
    async fn resume(&self, st: &mut SandboxState, reboot: bool) -> Result<(), NodeError>;

    /// Makes a running or paused sandbox a build of `template`. `agent_token` is the token
    /// its agent holds, if any (a copy restored with memory holds it too).
    async fn snapshot(
        &self,
        st: &SandboxState,
        template: &str,
        agent_token: Option<&str>,
    ) -> Result<(crate::template::Manifest, bool), NodeError>;

    /// Kills the sandbox's processes and releases what the runtime holds for it. Returns
    /// whether its network endpoint may be reused (nothing of the sandbox is left in it).
    async fn release(&self, st: &SandboxState) -> bool;

    /// At restart: whether a sandbox whose host process is alive can be taken back.
    fn readopt(&self, st: &SandboxState) -> bool;

    /// At restart, after re-adoption: removes runtime leftovers no live sandbox refers to.
    fn reap_leftovers(&self, live: &[SandboxState]);

    /// Why a running or paused sandbox has failed, when it has (checked before each refill);
    /// the runtime records its part of the failure in `st`.
    fn failure(&self, st: &mut SandboxState) -> Option<String>;

    /// Tops up the runtime's pools.
    async fn refill(&self);

    /// The runtime's pools.
    fn pool_levels(&self) -> Vec<PoolLevel>;

    /// Releases pooled entries: of one template, or all (at shutdown).
    async fn drain_pools(&self, template: Option<&str>, live: &[SandboxState]);

    /// One sample of a sandbox's resource use.
    async fn sample(
        &self,
        st: &SandboxState,
    ) -> Result<cube_proto::nodev1::SandboxStatsResponse, NodeError>;
}

/// The runtime `selection` names, over the node's `host`.
pub fn build(selection: &Selection, host: Arc<Host>) -> anyhow::Result<Arc<dyn Runtime>> {
    match selection.runtime {
        #[cfg(feature = "microvm")]
        crate::sandbox::MICROVM => Ok(Arc::new(microvm::Microvm::new(host)?)),
        crate::sandbox::GVISOR => {
            let l = gvisor::Gvisor::new(&host.cfg, &host.identity)?;
            Ok(Arc::new(container::Container::new(host, l)))
        }
        crate::sandbox::NAMESPACE => {
            let l = namespace::Namespace::new(&host.cfg)?;
            Ok(Arc::new(container::Container::new(host, l)))
        }
        other => anyhow::bail!("runtime {other:?} is not built into this cubelet"),
    }
}
