//! Starting and stopping a namespace sandbox's PID 1: `cubelet sandbox-init` (see `init.rs`)
//! builds its namespaces, mounts and filters and execs cube-agent.

use super::init::{InitResult, InitSpec, SPEC_ENV};
use crate::cgroup::Cgroups;
use crate::runtime::process::proc_start_time;
use crate::sandbox::SandboxPaths;
use std::path::{Path, PathBuf};

/// Errors starting or stopping sandbox processes.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("sandbox launcher: {0}")]
    Launch(String),
    #[error(transparent)]
    Cgroup(#[from] crate::cgroup::CgroupError),
    #[error("{0}")]
    Other(String),
}

/// Static settings for launching sandboxes.
#[derive(Debug, Clone)]
pub struct LaunchSettings {
    pub self_exe: PathBuf,
    pub agent_path: String,
    /// The node's agent binary, bind-mounted at `agent_path` (see `InitSpec::agent_host`).
    pub agent_host: Option<PathBuf>,
    pub agent_args: Vec<String>,
    pub hostname: String,
    pub seccomp: bool,
    /// The sandbox's ids in host terms (its user namespace), if it has one.
    pub ids: Option<super::init::IdMap>,
    pub run_size_mib: u64,
    pub tmp_size_mib: u64,
}

/// Launches PID 1 of a sandbox whose cgroup (with its limits), network namespace and disk
/// exist.
pub fn launch_prepared(
    settings: &LaunchSettings,
    cg: &Cgroups,
    key: &str,
    paths: &SandboxPaths,
    netns: &Path,
) -> Result<(i32, u64), RuntimeError> {
    std::fs::create_dir_all(paths.root())
        .map_err(|e| RuntimeError::Other(format!("mkdir root: {e}")))?;
    let spec = InitSpec {
        disk: paths.disk(),
        root: paths.root(),
        netns: netns.to_path_buf(),
        cgroup_procs: cg.procs_files(key),
        devices_procs: cg.restrict_devices(key)?,
        hostname: settings.hostname.clone(),
        agent_path: settings.agent_path.clone(),
        agent_host: settings.agent_host.clone(),
        agent_args: settings.agent_args.clone(),
        log: paths.log(),
        keep_caps: super::init::AGENT_CAPS.to_vec(),
        seccomp: settings.seccomp,
        ids: settings.ids,
        run_size_mib: settings.run_size_mib,
        tmp_size_mib: settings.tmp_size_mib,
    };
    let json = serde_json::to_string(&spec).map_err(|e| RuntimeError::Other(e.to_string()))?;
    let out = std::process::Command::new(&settings.self_exe)
        .arg("sandbox-init")
        .env_clear()
        .env(SPEC_ENV, json)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| RuntimeError::Launch(format!("spawn {}: {e}", settings.self_exe.display())))?;
    if !out.status.success() {
        return Err(RuntimeError::Launch(
            String::from_utf8_lossy(&out.stderr)
                .trim()
                .trim_start_matches("sandbox-init: ")
                .to_string(),
        ));
    }
    let r: InitResult = serde_json::from_slice(&out.stdout).map_err(|e| {
        RuntimeError::Launch(format!(
            "bad launcher output {:?}: {e}",
            String::from_utf8_lossy(&out.stdout)
        ))
    })?;
    let start = proc_start_time(r.pid)
        .ok_or_else(|| RuntimeError::Launch(format!("sandbox pid {} vanished at start", r.pid)))?;
    Ok((r.pid, start))
}

/// Flushes the sandbox's filesystem to its disk image (through the loop device).
pub fn sync_fs(pid: i32) -> Result<(), RuntimeError> {
    let f = std::fs::File::open(format!("/proc/{pid}/root"))
        .map_err(|e| RuntimeError::Other(format!("open sandbox root: {e}")))?;
    use std::os::fd::AsRawFd;
    // SAFETY: syncfs on an fd we own.
    if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
        return Err(RuntimeError::Other(format!(
            "syncfs: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// Loop devices whose backing file lies under `dir` (leak checks and waiting for autoclear).
pub fn loops_backed_under(dir: &Path) -> Vec<String> {
    let want = dir.to_string_lossy().to_string();
    let mut v = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/sys/block") {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if !n.starts_with("loop") {
                continue;
            }
            if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
                if b.trim().starts_with(&want) {
                    v.push(n);
                }
            }
        }
    }
    v
}
