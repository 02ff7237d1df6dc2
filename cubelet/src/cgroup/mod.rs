//! Per-sandbox cgroups: cgroup v2 (`cpu.max`, `memory.max`, `pids.max`, `cgroup.freeze`) where the
//! host has it with those controllers, else the v1 hierarchies (`cpu`, `memory`, `pids`,
//! `freezer`) as on hosts booted in hybrid mode. Both give the same operations.

pub mod devices;

pub use devices::DEVICE_ALLOW;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Errors of cgroup management.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("no usable cgroup hierarchy: {0}")]
    Unsupported(String),
    #[error("cgroup {0} did not {1} within {2:?}")]
    Timeout(String, &'static str, Duration),
    #[error("device filter: {0}")]
    Devices(String),
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.display().to_string();
    move |source| CgroupError::Io { op, path, source }
}

/// Which hierarchy layout the host has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupMode {
    /// Unified hierarchy mounted at the path, with cpu, memory and pids enabled for `cube/`.
    V2(PathBuf),
    /// Legacy hierarchies: root containing `cpu`, `memory`, `pids`, `freezer` mounts.
    V1(PathBuf),
}

/// Resource limits of one sandbox.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub vcpus: u32,
    pub memory_mib: u64,
    pub pids: u64,
}

/// The cgroup manager: all sandbox cgroups live under `<hierarchy>/<parent>/<key>`.
#[derive(Debug, Clone)]
pub struct Cgroups {
    mode: CgroupMode,
    parent: String,
}

const V1_CONTROLLERS: [&str; 4] = ["cpu", "memory", "pids", "freezer"];

fn write(path: &Path, v: &str) -> Result<(), CgroupError> {
    std::fs::write(path, v).map_err(io("write", path))
}

impl Cgroups {
    /// Detects the host layout and prepares the parent cgroup(s).
    pub fn detect(root: &Path, parent: &str) -> Result<Cgroups, CgroupError> {
        let ctrl = root.join("cgroup.controllers");
        if let Ok(c) = std::fs::read_to_string(&ctrl) {
            let have: Vec<&str> = c.split_whitespace().collect();
            if ["cpu", "memory", "pids"].iter().all(|x| have.contains(x)) {
                let cg = Cgroups {
                    mode: CgroupMode::V2(root.to_path_buf()),
                    parent: parent.into(),
                };
                let p = root.join(parent);
                std::fs::create_dir_all(&p).map_err(io("mkdir", &p))?;
                write(&root.join("cgroup.subtree_control"), "+cpu +memory +pids")?;
                write(&p.join("cgroup.subtree_control"), "+cpu +memory +pids")?;
                return Ok(cg);
            }
        }
        if V1_CONTROLLERS
            .iter()
            .all(|c| root.join(c).join("cgroup.procs").exists())
        {
            for c in V1_CONTROLLERS {
                let p = root.join(c).join(parent);
                std::fs::create_dir_all(&p).map_err(io("mkdir", &p))?;
            }
            return Ok(Cgroups {
                mode: CgroupMode::V1(root.to_path_buf()),
                parent: parent.into(),
            });
        }
        Err(CgroupError::Unsupported(format!(
            "{} has neither cgroup v2 with cpu+memory+pids nor v1 cpu/memory/pids/freezer",
            root.display()
        )))
    }

    pub fn mode(&self) -> &CgroupMode {
        &self.mode
    }

    pub fn mode_name(&self) -> &'static str {
        match self.mode {
            CgroupMode::V2(_) => "v2",
            CgroupMode::V1(_) => "v1",
        }
    }

    fn dirs(&self, key: &str) -> Vec<PathBuf> {
        match &self.mode {
            CgroupMode::V2(r) => vec![r.join(&self.parent).join(key)],
            CgroupMode::V1(r) => V1_CONTROLLERS
                .iter()
                .map(|c| r.join(c).join(&self.parent).join(key))
                .chain(self.devices_dir(key))
                .chain(self.unified_dir(key))
                .collect(),
        }
    }

    /// The sandbox's v1 `devices` cgroup, where the host has that hierarchy.
    fn devices_dir(&self, key: &str) -> Option<PathBuf> {
        match &self.mode {
            CgroupMode::V1(r) if r.join("devices").join("devices.allow").exists() => {
                Some(r.join("devices").join(&self.parent).join(key))
            }
            _ => None,
        }
    }

    /// The sandbox's cgroup on the unified hierarchy: its only cgroup on v2; on hybrid hosts
    /// one more, next to the v1 ones, to carry the device program.
    fn unified_dir(&self, key: &str) -> Option<PathBuf> {
        match &self.mode {
            CgroupMode::V2(r) => Some(r.join(&self.parent).join(key)),
            CgroupMode::V1(r) if r.join("unified").join("cgroup.controllers").exists() => {
                Some(r.join("unified").join(&self.parent).join(key))
            }
            CgroupMode::V1(_) => None,
        }
    }

    /// The child of [`Cgroups::unified_dir`] with the device program: the init moves into it
    /// once its disk is mounted (inside its cgroup namespace, whose root is the parent);
    /// limits and freezing of the parent cover it.
    fn unified_devices_dir(&self, key: &str) -> Option<PathBuf> {
        self.unified_dir(key).map(|d| d.join("sandbox"))
    }

    /// Limits the sandbox to [`DEVICE_ALLOW`] (v1 `devices` controller and a v2 device
    /// program, each where the host has it) and returns the `cgroup.procs` files its init
    /// joins once it has mounted its disk (the loop device is not on the list).
    pub fn restrict_devices(&self, key: &str) -> Result<Vec<PathBuf>, CgroupError> {
        let mut join = Vec::new();
        let mkdir = |d: &Path| -> Result<(), CgroupError> {
            if let Some(parent) = d.parent() {
                std::fs::create_dir_all(parent).map_err(io("mkdir", parent))?;
            }
            match std::fs::create_dir(d) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
                Err(e) => Err(io("mkdir", d)(e)),
            }
        };
        if let Some(d) = self.devices_dir(key) {
            mkdir(&d)?;
            write(&d.join("devices.deny"), "a")?;
            for rule in DEVICE_ALLOW {
                write(&d.join("devices.allow"), rule)?;
            }
            join.push(d.join("cgroup.procs"));
        }
        if let Some(d) = self.unified_devices_dir(key) {
            mkdir(&d)?;
            devices::allow_list_program()
                .and_then(|p| devices::attach(&d, p))
                .map_err(CgroupError::Devices)?;
            join.push(d.join("cgroup.procs"));
        }
        Ok(join)
    }

    /// The `cgroup.procs` files a process must join (one per hierarchy; the devices cgroup,
    /// see [`Cgroups::restrict_devices`], is joined separately).
    pub fn procs_files(&self, key: &str) -> Vec<PathBuf> {
        let devices = self.devices_dir(key);
        self.dirs(key)
            .into_iter()
            .filter(|d| Some(d) != devices.as_ref())
            .map(|d| d.join("cgroup.procs"))
            .collect()
    }

    /// Creates the cgroup(s) for `key` (not the devices cgroup: see
    /// [`Cgroups::restrict_devices`]).
    pub fn create(&self, key: &str) -> Result<(), CgroupError> {
        let devices = self.devices_dir(key);
        for d in self
            .dirs(key)
            .into_iter()
            .filter(|d| Some(d) != devices.as_ref())
        {
            if let (Some(p), true) = (d.parent(), Some(&d) == self.unified_dir(key).as_ref()) {
                // The parent exists on the v1 hierarchies (detect); maybe not yet on unified.
                std::fs::create_dir_all(p).map_err(io("mkdir", p))?;
            }
            match std::fs::create_dir(&d) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io("mkdir", &d)(e)),
            }
        }
        Ok(())
    }

    /// Applies CPU, memory and pids limits.
    pub fn set_limits(&self, key: &str, l: Limits) -> Result<(), CgroupError> {
        let period: u64 = 100_000;
        let quota = period * u64::from(l.vcpus.max(1));
        let mem = l.memory_mib.max(16) << 20;
        match &self.mode {
            CgroupMode::V2(r) => {
                let d = r.join(&self.parent).join(key);
                write(&d.join("cpu.max"), &format!("{quota} {period}"))?;
                write(&d.join("memory.max"), &mem.to_string())?;
                // No swap for sandboxes: a limit must be a limit.
                let _ = write(&d.join("memory.swap.max"), "0");
                write(&d.join("pids.max"), &l.pids.to_string())?;
            }
            CgroupMode::V1(r) => {
                let cpu = r.join("cpu").join(&self.parent).join(key);
                write(&cpu.join("cpu.cfs_period_us"), &period.to_string())?;
                write(&cpu.join("cpu.cfs_quota_us"), &quota.to_string())?;
                let m = r.join("memory").join(&self.parent).join(key);
                write(&m.join("memory.limit_in_bytes"), &mem.to_string())?;
                let p = r.join("pids").join(&self.parent).join(key);
                write(&p.join("pids.max"), &l.pids.to_string())?;
            }
        }
        Ok(())
    }

    /// Pids in the sandbox's cgroup.
    pub fn pids(&self, key: &str) -> Vec<i32> {
        let files = match &self.mode {
            CgroupMode::V2(r) => {
                let d = r.join(&self.parent).join(key);
                vec![
                    d.join("cgroup.procs"),
                    d.join("sandbox").join("cgroup.procs"),
                ]
            }
            CgroupMode::V1(r) => vec![r
                .join("pids")
                .join(&self.parent)
                .join(key)
                .join("cgroup.procs")],
        };
        files
            .iter()
            .flat_map(|f| {
                std::fs::read_to_string(f)
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect::<Vec<i32>>()
            })
            .collect()
    }

    /// Memory currently charged to the sandbox, in bytes.
    pub fn memory_bytes(&self, key: &str) -> Option<u64> {
        let f = match &self.mode {
            CgroupMode::V2(r) => r.join(&self.parent).join(key).join("memory.current"),
            CgroupMode::V1(r) => r
                .join("memory")
                .join(&self.parent)
                .join(key)
                .join("memory.usage_in_bytes"),
        };
        std::fs::read_to_string(f).ok()?.trim().parse().ok()
    }

    /// Freezes (true) or thaws (false) every process of the sandbox and waits until done.
    pub fn set_frozen(&self, key: &str, frozen: bool) -> Result<(), CgroupError> {
        let timeout = Duration::from_secs(10);
        let start = Instant::now();
        match &self.mode {
            CgroupMode::V2(r) => {
                let d = r.join(&self.parent).join(key);
                write(&d.join("cgroup.freeze"), if frozen { "1" } else { "0" })?;
                let want = if frozen { "frozen 1" } else { "frozen 0" };
                loop {
                    let ev = std::fs::read_to_string(d.join("cgroup.events")).unwrap_or_default();
                    if ev.lines().any(|l| l == want) {
                        return Ok(());
                    }
                    if start.elapsed() > timeout {
                        return Err(CgroupError::Timeout(key.into(), "freeze", timeout));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            CgroupMode::V1(r) => {
                let d = r.join("freezer").join(&self.parent).join(key);
                let f = d.join("freezer.state");
                let want = if frozen { "FROZEN" } else { "THAWED" };
                write(&f, want)?;
                let mut polls = 0u32;
                loop {
                    let s = std::fs::read_to_string(&f).unwrap_or_default();
                    if s.trim() == want {
                        return Ok(());
                    }
                    if start.elapsed() > timeout {
                        return Err(CgroupError::Timeout(key.into(), "freeze", timeout));
                    }
                    // v1 stays FREEZING when a task escaped the first pass (one forked at that
                    // moment, say); writing FROZEN again freezes what is left.
                    polls += 1;
                    if polls.is_multiple_of(20) {
                        write(&f, want)?;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    /// True when the sandbox's cgroup is frozen.
    pub fn is_frozen(&self, key: &str) -> bool {
        match &self.mode {
            CgroupMode::V2(r) => {
                std::fs::read_to_string(r.join(&self.parent).join(key).join("cgroup.events"))
                    .map(|s| s.lines().any(|l| l == "frozen 1"))
                    .unwrap_or(false)
            }
            CgroupMode::V1(r) => std::fs::read_to_string(
                r.join("freezer")
                    .join(&self.parent)
                    .join(key)
                    .join("freezer.state"),
            )
            .map(|s| s.trim() == "FROZEN")
            .unwrap_or(false),
        }
    }

    /// Kills every process in the cgroup (thawing first, since frozen tasks do not die on v1),
    /// waits until it is empty, and removes the cgroup(s). Idempotent.
    pub fn destroy(&self, key: &str) -> Result<(), CgroupError> {
        // The device cgroup first: on v2 it is a child of the sandbox's.
        let dirs: Vec<PathBuf> = self
            .unified_devices_dir(key)
            .into_iter()
            .chain(self.dirs(key))
            .collect();
        if !dirs.iter().any(|d| d.exists()) {
            return Ok(());
        }
        if self.is_frozen(key) {
            let _ = self.set_frozen(key, false);
        }
        let timeout = Duration::from_secs(10);
        let start = Instant::now();
        loop {
            let pids = self.pids(key);
            if pids.is_empty() {
                break;
            }
            if let CgroupMode::V2(r) = &self.mode {
                let _ = write(&r.join(&self.parent).join(key).join("cgroup.kill"), "1");
            }
            for p in pids {
                // SAFETY: kill(2) with a pid read from the cgroup.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            if start.elapsed() > timeout {
                return Err(CgroupError::Timeout(key.into(), "empty", timeout));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        for d in dirs {
            // rmdir fails with EBUSY for a moment after the last task exits; retry briefly.
            let mut tries = 0;
            loop {
                match std::fs::remove_dir(&d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e) if tries < 1000 && e.raw_os_error() == Some(libc::EBUSY) => {
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => return Err(io("rmdir", &d)(e)),
                }
            }
        }
        Ok(())
    }

    /// Keys of all sandbox cgroups that exist (for orphan reaping after a crash).
    pub fn list(&self) -> Vec<String> {
        let d = match &self.mode {
            CgroupMode::V2(r) => r.join(&self.parent),
            CgroupMode::V1(r) => r.join("pids").join(&self.parent),
        };
        let mut v: Vec<String> = std::fs::read_dir(d)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter(|e| e.path().is_dir())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        if let CgroupMode::V1(r) = &self.mode {
            // A crash between the mkdirs can leave a key in some hierarchies only.
            for c in V1_CONTROLLERS.iter().chain(&["devices", "unified"]) {
                if let Ok(rd) = std::fs::read_dir(r.join(c).join(&self.parent)) {
                    for e in rd.flatten() {
                        if let Ok(n) = e.file_name().into_string() {
                            if e.path().is_dir() && !v.contains(&n) {
                                v.push(n);
                            }
                        }
                    }
                }
            }
        }
        v
    }
}
