//! The `namespace` runtime's launcher (the rest is `super::container`): PID 1 is cube-agent
//! in new mount/pid/uts/ipc/net/cgroup namespaces over the sandbox's loop-mounted disk, with
//! Docker's capabilities less CAP_MKNOD, `no_new_privs`, an allow-list seccomp filter
//! (`seccomp.rs`), OCI's masked and read-only `/proc` paths, `nosuid,nodev` mounts and a
//! device allow-list (`init.rs`, `crate::cgroup`). Isolation is a shared kernel, like a
//! container: weaker than `microvm`, and reported as such. Each sandbox has a user namespace
//! (`[sandbox] user_namespace`, ids from `id_base`, reserved in /etc/subuid by `subids.rs`):
//! its root is an unprivileged host id, and its disk is an idmapped mount, so the image's
//! root-owned files are its root's.

pub mod init;
pub mod launch;
pub mod seccomp;
pub mod subids;

use super::container::Launcher;
use crate::cgroup::Cgroups;
use crate::config::Config;
use crate::sandbox::{RuntimeState, SandboxPaths, SandboxState, NAMESPACE};
use launch::LaunchSettings;
use std::path::Path;

pub use launch::loops_backed_under;

/// Starts PID 1 with `cubelet sandbox-init` (`init.rs`).
pub struct Namespace {
    launch: LaunchSettings,
}

impl Namespace {
    pub fn new(cfg: &Config) -> anyhow::Result<Namespace> {
        use anyhow::Context;
        // Sandbox inits are double-forked: become their reaper so they do not linger as zombies.
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        let (agent_host, agent_args) = super::container::agent_command(cfg)?;
        let ids = subids::sandbox_ids(&cfg.sandbox).map_err(|e| anyhow::anyhow!(e))?;
        let launch = LaunchSettings {
            self_exe: std::env::current_exe().context("locating own executable")?,
            agent_path: super::container::AGENT_PATH.into(),
            agent_host: Some(agent_host),
            agent_args,
            hostname: cfg.sandbox.hostname.clone(),
            seccomp: cfg.sandbox.seccomp,
            ids,
            run_size_mib: cfg.sandbox.run_size_mib,
            tmp_size_mib: cfg.sandbox.tmp_size_mib,
        };
        Ok(Namespace { launch })
    }
}

impl Launcher for Namespace {
    fn name(&self) -> &'static str {
        NAMESPACE
    }

    fn new_state(&self) -> RuntimeState {
        RuntimeState::Namespace
    }

    fn launch(
        &self,
        cg: &Cgroups,
        key: &str,
        paths: &SandboxPaths,
        netns: &Path,
    ) -> Result<(i32, u64), String> {
        launch::launch_prepared(&self.launch, cg, key, paths, netns).map_err(|e| e.to_string())
    }

    fn sync_fs(&self, st: &SandboxState, _paths: &SandboxPaths) -> Result<(), String> {
        launch::sync_fs(st.pid).map_err(|e| e.to_string())
    }
}
