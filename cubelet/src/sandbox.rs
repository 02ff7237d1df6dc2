//! A sandbox's persisted state (`sandboxes/<id>/state.json`): what every runtime shares, and
//! each runtime's own part as one always-compiled enum, so the file has one type whatever
//! runtimes a cubelet is built with.

use crate::network::{Endpoint, Policy};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const STATE_MAGIC: &str = "cube-sandbox-state";
/// Version 3: gVisor's part is a struct (version 2: the bare name `"gvisor"`). Version 2: the
/// runtime's part is `runtime` (version 1 had an optional `microvm` field).
pub const STATE_VERSION: u32 = 3;

/// Life-cycle phase persisted per sandbox.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Resources being assembled; never re-adopted after a crash.
    Creating,
    /// Pre-started, waiting in a pool for a CreateSandbox.
    Pooled,
    Running,
    Paused,
    /// The sandbox's runtime process died (a microVM's cube-shim); kept (and reported) until
    /// killed.
    Failed,
}

impl Phase {
    /// Every phase, by its gauge label.
    pub const ALL: [(Phase, &'static str); 5] = [
        (Phase::Creating, "creating"),
        (Phase::Pooled, "pooled"),
        (Phase::Running, "running"),
        (Phase::Paused, "paused"),
        (Phase::Failed, "failed"),
    ];

    pub fn label(self) -> &'static str {
        Phase::ALL
            .iter()
            .find(|(p, _)| *p == self)
            .map(|(_, l)| *l)
            .unwrap_or("unknown")
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct Shape {
    pub vcpus: u32,
    pub memory_mib: u64,
    pub disk_mib: u64,
}

/// Per-sandbox state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxState {
    pub id: String,
    /// Resource key: names the cgroup (and, for cold creates, the endpoint).
    pub key: String,
    pub phase: Phase,
    pub template: String,
    pub build: String,
    pub shape: Shape,
    /// The sandbox's host process: PID 1 of its namespaces, or its VMM (cube-shim).
    pub pid: i32,
    pub pid_start: u64,
    pub endpoint: Option<Endpoint>,
    pub metadata: BTreeMap<String, String>,
    pub policy: Policy,
    pub created_at_ms: u64,
    pub create_latency_us: u64,
    pub from_pool: bool,
    /// The envd version of its template's agent (the build's manifest), for the master.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub envd_version: String,
    /// When the master says it ends (unix ms; 0 = no end): the node's backstop kills a running
    /// sandbox `sandbox.end_grace_s` after it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub end_at_ms: u64,
    /// Paused without memory: no process of it is left, and a resume starts it afresh from
    /// its disk.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stopped: bool,
    /// What a container runtime's agent was initialised with, for a start afresh (a microVM
    /// keeps it in its own part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<cube_init::Settings>,
    /// The sandbox's node-local host address (cube-vs); absent without a switch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_addr: Option<std::net::Ipv4Addr>,
    /// What the sandbox's runtime keeps of it.
    pub runtime: RuntimeState,
}

/// The runtime-specific part of a sandbox's state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "snake_case")]
pub enum RuntimeState {
    /// Namespaces: everything needed is in the shared part (pid, key, endpoint).
    #[default]
    Namespace,
    /// A runsc sandbox named by the sandbox's key.
    Gvisor(GvisorState),
    Microvm(Box<MicroVmState>),
}

impl RuntimeState {
    /// The runtime's name, as configured and reported.
    pub fn name(&self) -> &'static str {
        match self {
            RuntimeState::Namespace => NAMESPACE,
            RuntimeState::Gvisor(_) => GVISOR,
            RuntimeState::Microvm(_) => MICROVM,
        }
    }

    pub fn microvm(&self) -> Option<&MicroVmState> {
        match self {
            RuntimeState::Microvm(m) => Some(m),
            _ => None,
        }
    }

    pub fn microvm_mut(&mut self) -> Option<&mut MicroVmState> {
        match self {
            RuntimeState::Microvm(m) => Some(m),
            _ => None,
        }
    }

    /// Where a sandbox paused to disk without a host process keeps its processes and memory.
    pub fn paused_image(&self) -> Option<&Path> {
        match self {
            RuntimeState::Gvisor(g) => g.paused_image.as_deref(),
            _ => None,
        }
    }

    /// Records (or clears) the image of a pause to disk; only a runtime that has one can.
    pub fn set_paused_image(&mut self, image: Option<PathBuf>) -> Result<(), String> {
        match self {
            RuntimeState::Gvisor(g) => {
                g.paused_image = image;
                Ok(())
            }
            other => Err(format!(
                "{} sandboxes do not pause to an image",
                other.name()
            )),
        }
    }
}

/// Per-sandbox gVisor state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct GvisorState {
    /// Set while paused to disk: the `runsc checkpoint` image; no runsc process is left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_image: Option<PathBuf>,
}

/// Runtime names (config `runtime = ...`, API `runtime`).
pub const NAMESPACE: &str = "namespace";
pub const GVISOR: &str = "gvisor";
pub const MICROVM: &str = "microvm";

/// Per-sandbox microVM state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct MicroVmState {
    /// The shim's control socket.
    pub socket: PathBuf,
    /// The shim's jail root (removed with the sandbox).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jail_root: Option<PathBuf>,
    /// The template snapshot it was restored from.
    pub snapshot: PathBuf,
    pub tap: Option<String>,
    /// The host socket of the guest's vsock device (`<vsock>_<port>` for guest connections).
    pub vsock: PathBuf,
    /// Set while paused to disk: the directory holding the state (guest memory released).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_dir: Option<PathBuf>,
    /// Init payloads the guest acknowledged (one per restore / resume).
    #[serde(default)]
    pub inits: u32,
    /// What every init carries (env vars, token, user); clock and entropy are fresh each time.
    #[serde(default)]
    pub init: cube_init::Settings,
    /// Why the sandbox failed (shim gone), when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

/// Where a sandbox's files live.
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

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Writes a sandbox's state file.
pub fn save(path: &Path, st: &SandboxState) -> Result<(), crate::state::StateError> {
    crate::state::write(path, STATE_MAGIC, STATE_VERSION, st)
}

/// Reads a sandbox's state file, migrating versions 1 and 2.
pub fn load(path: &Path) -> Result<SandboxState, crate::state::StateError> {
    let (version, body) = crate::state::read_versions(path, STATE_MAGIC, 1..=STATE_VERSION)?;
    let json = |e| crate::state::StateError::Json {
        path: path.display().to_string(),
        source: e,
    };
    if version == STATE_VERSION {
        return serde_json::from_str(&body).map_err(json);
    }
    let mut v: serde_json::Value = serde_json::from_str(&body).map_err(json)?;
    if let Some(o) = v.as_object_mut() {
        if version == 1 {
            let rt = match o.remove("microvm") {
                Some(m) if !m.is_null() => serde_json::json!({ "microvm": m }),
                _ => serde_json::json!("namespace"),
            };
            o.insert("runtime".into(), rt);
        }
        if o.get("runtime").and_then(|r| r.as_str()) == Some(GVISOR) {
            o.insert("runtime".into(), serde_json::json!({ GVISOR: {} }));
        }
    }
    serde_json::from_value(v).map_err(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(runtime: RuntimeState) -> SandboxState {
        SandboxState {
            id: "a1".into(),
            key: "k".into(),
            phase: Phase::Running,
            template: "base".into(),
            build: "b".into(),
            shape: Shape::default(),
            pid: 7,
            pid_start: 9,
            endpoint: None,
            metadata: BTreeMap::new(),
            policy: Policy::default(),
            created_at_ms: 1,
            create_latency_us: 2,
            from_pool: false,
            envd_version: String::new(),
            end_at_ms: 0,
            stopped: false,
            init: None,
            host_addr: None,
            runtime,
        }
    }

    #[test]
    fn round_trip_and_migrations() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.json");
        let mv = MicroVmState {
            socket: "/s".into(),
            inits: 3,
            ..Default::default()
        };
        for rt in [
            RuntimeState::Namespace,
            RuntimeState::Gvisor(GvisorState::default()),
            RuntimeState::Gvisor(GvisorState {
                paused_image: Some("/p".into()),
            }),
            RuntimeState::Microvm(Box::new(mv.clone())),
        ] {
            save(&p, &state(rt.clone())).unwrap();
            assert_eq!(load(&p).unwrap().runtime, rt);
        }
        // Version 1: the microVM part was an optional `microvm` field.
        let mut v1 = serde_json::to_value(state(RuntimeState::Namespace)).unwrap();
        let o = v1.as_object_mut().unwrap();
        o.remove("runtime");
        crate::state::write(&p, STATE_MAGIC, 1, &v1).unwrap();
        assert_eq!(load(&p).unwrap().runtime, RuntimeState::Namespace);
        v1.as_object_mut()
            .unwrap()
            .insert("microvm".into(), serde_json::to_value(&mv).unwrap());
        crate::state::write(&p, STATE_MAGIC, 1, &v1).unwrap();
        let st = load(&p).unwrap();
        assert_eq!(st.runtime, RuntimeState::Microvm(Box::new(mv)));
        assert_eq!(st.runtime.name(), MICROVM);
        // Version 2: gVisor's part was its bare name.
        let mut v2 = serde_json::to_value(state(RuntimeState::Namespace)).unwrap();
        v2["runtime"] = serde_json::json!("gvisor");
        crate::state::write(&p, STATE_MAGIC, 2, &v2).unwrap();
        let st = load(&p).unwrap();
        assert_eq!(st.runtime, RuntimeState::Gvisor(GvisorState::default()));
        assert_eq!(st.runtime.paused_image(), None);
        crate::state::write(&p, STATE_MAGIC, 4, &v1).unwrap();
        assert!(load(&p).is_err());
    }
}
