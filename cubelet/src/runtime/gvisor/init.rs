//! `cubelet gvisor-init`: the launcher of a gVisor sandbox. cubelet re-executes itself (a
//! fresh single-threaded process, so it may fork) with a JSON [`GvisorSpec`]; the launcher
//! joins the sandbox's cgroups and network namespace, starts the capped log writer that the
//! namespace runtime uses, runs `runsc run --detach` (or `runsc restore --detach` from a
//! checkpoint) with the container's output on it, and prints the runsc sandbox process's
//! pid. The sandbox does not depend on cubelet staying up.
//!
//! gVisor's own network stack (netstack) takes the namespace's interface, addresses and
//! routes at start. Debian's runsc refuses it on kernels since about 6.11 (gVisor issue
//! #10704): it takes any namespace where `/proc/sys/net/core/rmem_default` exists for the
//! host's, and such kernels show that file in every namespace. The launcher runs runsc in a
//! mount namespace of its own with an empty tmpfs over `/proc/sys/net`, so the check sees a
//! non-root namespace, which the sandbox's is. Nothing else of runsc reads the host's net
//! sysctls; the sandbox's own `/proc` is the Sentry's.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::process::{Command, Stdio};

pub const SPEC_ENV: &str = "CUBE_GVISOR_INIT_SPEC";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GvisorSpec {
    pub runsc: PathBuf,
    /// Global runsc flags (root, platform, network, ...).
    pub flags: Vec<String>,
    /// Container id: the sandbox's key.
    pub id: String,
    pub bundle: PathBuf,
    pub netns: PathBuf,
    pub cgroup_procs: Vec<PathBuf>,
    pub log: PathBuf,
    /// A checkpoint image directory to restore from instead of starting the bundle afresh.
    #[serde(default)]
    pub restore: Option<PathBuf>,
}

/// runsc's own view of a container (`runsc state`).
#[derive(Debug, Deserialize)]
pub struct State {
    pub pid: i32,
    pub status: String,
}

/// `runsc <flags> state <id>`.
pub fn state(runsc: &std::path::Path, flags: &[String], id: &str) -> Result<State, String> {
    let out = Command::new(runsc)
        .args(flags)
        .args(["state", id])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("runsc state: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "runsc state {id}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("runsc state {id}: {e}"))
}

/// Entry point of `cubelet gvisor-init`. Returns the process exit code.
pub fn main() -> i32 {
    let spec: GvisorSpec = match std::env::var(SPEC_ENV)
        .map_err(|e| e.to_string())
        .and_then(|s| serde_json::from_str(&s).map_err(|e| e.to_string()))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("gvisor-init: bad spec: {e}");
            return 2;
        }
    };
    match launch(&spec) {
        Ok(pid) => {
            println!("{}", serde_json::json!({ "pid": pid }));
            0
        }
        Err(e) => {
            eprintln!("gvisor-init: {e}");
            1
        }
    }
}

fn launch(spec: &GvisorSpec) -> Result<i32, String> {
    crate::runtime::namespace::init::enter(&spec.cgroup_procs, &spec.netns)?;
    hide_host_net_sysctls()?;
    let log = crate::runtime::namespace::init::spawn_log_writer(&spec.log)?;
    let out = std::fs::File::from(log);
    let err = out.try_clone().map_err(|e| format!("log pipe: {e}"))?;
    let mut cmd = Command::new(&spec.runsc);
    cmd.args(&spec.flags);
    match &spec.restore {
        Some(image) => cmd.arg("restore").arg("--image-path").arg(image),
        None => cmd.arg("run"),
    };
    let what = if spec.restore.is_some() {
        "runsc restore"
    } else {
        "runsc run"
    };
    let status = cmd
        .arg("--detach")
        .arg("--bundle")
        .arg(&spec.bundle)
        .arg(&spec.id)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .status()
        .map_err(|e| format!("spawn {}: {e}", spec.runsc.display()))?;
    if !status.success() {
        // runsc's own message went where the container's output goes.
        std::thread::sleep(std::time::Duration::from_millis(50));
        let tail = std::fs::read_to_string(&spec.log).unwrap_or_default();
        let tail: Vec<&str> = tail.lines().rev().take(3).collect();
        return Err(format!(
            "{what}: {status}: {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ));
    }
    let st = state(&spec.runsc, &spec.flags, &spec.id)?;
    if st.pid <= 0 {
        return Err(format!("runsc state: no sandbox process ({})", st.status));
    }
    Ok(st.pid)
}

/// A private mount namespace with an empty tmpfs over `/proc/sys/net` (see the module's
/// comment: gVisor issue #10704). Single-threaded process, so `unshare` is allowed.
fn hide_host_net_sysctls() -> Result<(), String> {
    let c = |s: &str| std::ffi::CString::new(s).map_err(|e| e.to_string());
    let (root, target, tmpfs) = (c("/")?, c("/proc/sys/net")?, c("tmpfs")?);
    // SAFETY: unshare and mount with valid C strings; this process is single-threaded.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return Err(format!(
                "unshare(mount): {}",
                std::io::Error::last_os_error()
            ));
        }
        // Nothing mounted here may reach the host's namespace.
        if libc::mount(
            std::ptr::null(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return Err(format!(
                "make / private: {}",
                std::io::Error::last_os_error()
            ));
        }
        if libc::mount(
            tmpfs.as_ptr(),
            target.as_ptr(),
            tmpfs.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | libc::MS_RDONLY,
            std::ptr::null(),
        ) != 0
        {
            return Err(format!(
                "tmpfs over /proc/sys/net: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}
