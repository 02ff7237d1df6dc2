//! The `namespace` runtime: a sandbox is its reflinked disk (loop-mounted ext4 inside the
//! sandbox's own mount namespace), cube-agent as PID 1 in new mount/pid/uts/ipc/net/cgroup
//! namespaces, cgroup limits, Docker's capabilities less CAP_MKNOD, `no_new_privs`, an
//! allow-list seccomp filter (`seccomp.rs`), OCI's masked and read-only `/proc` paths,
//! `nosuid,nodev` mounts and a device allow-list (`sandbox_init.rs`, `cgroup.rs`). Isolation
//! is a shared kernel, like a container: weaker than `microvm`, and reported as such. Each
//! sandbox has a user namespace (`[sandbox] user_namespace`, ids from `id_base`): its root is
//! an unprivileged host id, and its disk is an idmapped mount, so the image's root-owned files
//! are its root's.

use crate::cgroup::{Cgroups, Limits};
use crate::sandbox_init::{InitResult, InitSpec, SPEC_ENV};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const RUNTIME_NAME: &str = "namespace";

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
    pub ids: Option<crate::sandbox_init::IdMap>,
    pub run_size_mib: u64,
    pub tmp_size_mib: u64,
    pub pids_max: u64,
}

/// Where a sandbox's parts live.
#[derive(Debug, Clone)]
pub struct SandboxPaths {
    pub dir: PathBuf,
}

impl SandboxPaths {
    pub fn disk(&self) -> PathBuf {
        self.dir.join("disk.ext4")
    }
    pub fn root(&self) -> PathBuf {
        self.dir.join("root")
    }
    pub fn log(&self) -> PathBuf {
        self.dir.join("agent.log")
    }
    pub fn state(&self) -> PathBuf {
        self.dir.join("state.json")
    }
}

/// Start time of a process in clock ticks since boot (field 22 of /proc/PID/stat): with the
/// pid it identifies a process across pid reuse.
pub fn proc_start_time(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &s[s.rfind(')')? + 2..];
    after.split(' ').nth(19)?.parse().ok()
}

/// True when `pid` is alive (not a zombie) and is the process that started at `start`.
pub fn is_alive(pid: i32, start: u64) -> bool {
    if pid <= 0 {
        return false;
    }
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some(close) = s.rfind(')') else {
        return false;
    };
    let mut f = s[close + 2..].split(' ');
    let state = f.next().unwrap_or("");
    let started: Option<u64> = f.nth(18).and_then(|x| x.parse().ok());
    state != "Z" && started == Some(start)
}

/// Launches PID 1 of a sandbox whose cgroup, network namespace and disk exist.
pub fn launch(
    settings: &LaunchSettings,
    cg: &Cgroups,
    key: &str,
    paths: &SandboxPaths,
    netns: &Path,
    limits: Limits,
) -> Result<(i32, u64), RuntimeError> {
    cg.create(key)?;
    cg.set_limits(key, limits)?;
    launch_prepared(settings, cg, key, paths, netns)
}

/// Like [`launch`], for a sandbox whose cgroup already exists with its limits set.
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
        keep_caps: crate::sandbox_init::AGENT_CAPS.to_vec(),
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

/// Kills every process of the sandbox, reaps PID 1 when it is our child, and removes the
/// cgroup. Idempotent.
pub fn kill(cg: &Cgroups, key: &str, pid: i32, start: u64) -> Result<(), RuntimeError> {
    if is_alive(pid, start) {
        if cg.is_frozen(key) {
            let _ = cg.set_frozen(key, false);
        }
        // SIGKILL to a pid namespace's init kills the whole namespace.
        // SAFETY: kill(2); pid identity checked just above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    if pid > 0 {
        reap(pid, Duration::from_secs(10));
    }
    cg.destroy(key)?;
    Ok(())
}

/// Waits for `pid` to exit: waitpid when it is our child (re-parented to us as subreaper),
/// else polls /proc until it is gone or a zombie of someone else.
pub fn reap(pid: i32, timeout: Duration) {
    let start = Instant::now();
    loop {
        let mut st = 0;
        // SAFETY: waitpid on a specific pid with WNOHANG.
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        if r == pid {
            return;
        }
        if r < 0 {
            // Not our child: done when it no longer runs.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rfind(')')
                .and_then(|i| stat.get(i + 2..i + 3))
                .unwrap_or("");
            if stat.is_empty() || state == "Z" {
                return;
            }
        }
        if start.elapsed() > timeout {
            tracing::warn!(pid, "sandbox init did not exit in time");
            return;
        }
        std::thread::sleep(Duration::from_micros(500));
    }
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
