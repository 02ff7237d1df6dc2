//! `cubelet gvisor-init`: the launcher of a gVisor sandbox. cubelet re-executes itself (a
//! fresh single-threaded process, so it may fork) with a JSON [`GvisorSpec`]; the launcher
//! joins the sandbox's cgroups and network namespace, starts the capped log writer that the
//! namespace runtime uses, runs `runsc run --detach` with the container's output on it, and
//! prints the runsc sandbox process's pid. The sandbox does not depend on cubelet staying up.

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
    let log = crate::runtime::namespace::init::spawn_log_writer(&spec.log)?;
    let out = std::fs::File::from(log);
    let err = out.try_clone().map_err(|e| format!("log pipe: {e}"))?;
    let status = Command::new(&spec.runsc)
        .args(&spec.flags)
        .arg("run")
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
            "runsc run: {status}: {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ));
    }
    let st = state(&spec.runsc, &spec.flags, &spec.id)?;
    if st.pid <= 0 {
        return Err(format!("runsc state: no sandbox process ({})", st.status));
    }
    Ok(st.pid)
}
