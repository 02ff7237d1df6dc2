//! The `gvisor` runtime: each sandbox is a `runsc` sandbox, so its system calls meet gVisor's
//! user-space kernel (the Sentry), not the host's. Everything but PID 1 is the container
//! runtime's (`super::container`): the reflinked disk (mounted on the host here, read-write,
//! `nosuid,nodev`, and given to runsc as the root), the cgroup with the shape's limits (runsc
//! and its processes run in it; `--ignore-cgroups`), the sandbox's network namespace on cube-vs
//! (gVisor's own network stack takes its interface: the sandbox's TCP/IP is the Sentry's too;
//! `init.rs` says how it starts on Debian's runsc despite gVisor issue #10704), the
//! pre-started pool. runsc runs as root of the sandbox's user namespace (`[sandbox]
//! user_namespace`, the namespace runtime's ids), made by the launcher (`init.rs`): the Sentry
//! and the gofer are an unprivileged host id, and the disk is an idmapped mount.
//!
//! Pause freezes the cgroup (memory stays in RAM). With `[gvisor] pause_to_disk = true` it
//! saves processes and memory to disk (`runsc checkpoint`) and stops the sandbox, which then
//! holds no host memory, and resume restores it in its own namespace, addressed again; off by
//! default: restored into the same namespace, about one in ten comes back with its agent
//! wedged on Debian's runsc (gVisor issues #13920, #14147), while snapshots restored into a
//! fresh namespace did not (20 of 20).
//! Snapshots keep memory: `runsc checkpoint` of the stopped sandbox with its disk cloned at the
//! same instant, and a sandbox created from one is `runsc restore`d over a clone of that disk in
//! its own namespace (every sandbox has the same address inside, so the restored stack fits).
//! gVisor cannot save connected TCP sockets: `--net-disconnect-ok` resets them at a checkpoint
//! or pause, in the sandbox that goes on as well as in the copy; processes and listening sockets
//! continue.

pub mod bundle;
pub mod init;

use super::container::{Launcher, AGENT_PATH};
use super::SnapshotKind;
use crate::cgroup::Cgroups;
use crate::config::Config;
use crate::network::GuestIdentity;
use crate::runtime::namespace::init::IdMap;
use crate::sandbox::{RuntimeState, SandboxPaths, SandboxState, GVISOR};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Starts PID 1 with `cubelet gvisor-init` (`init.rs`) and `runsc run`.
pub struct Gvisor {
    runsc: PathBuf,
    /// Global runsc flags.
    flags: Vec<String>,
    /// Where each sandbox's bundle and root mount live: `<dir>/<key>/{config.json,root}`.
    dir: PathBuf,
    self_exe: PathBuf,
    agent_host: PathBuf,
    agent_args: Vec<String>,
    hostname: String,
    tmp_size_mib: u64,
    run_size_mib: u64,
    pause_to_disk: bool,
    /// The sandboxes' user namespace (`init.rs`), when `[sandbox] user_namespace`.
    ids: Option<IdMap>,
    guest: GuestIdentity,
}

/// How long one runsc command may take.
const RUNSC_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Whether `runsc` can run here, and if not, why.
pub fn can_run(runsc: &Path) -> Result<(), String> {
    let out = Command::new(runsc)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", runsc.display()))?;
    let v = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !v.starts_with("runsc version") {
        return Err(format!("{} --version failed", runsc.display()));
    }
    Ok(())
}

impl Gvisor {
    pub fn new(cfg: &Config, guest: &GuestIdentity) -> anyhow::Result<Gvisor> {
        use anyhow::Context;
        can_run(&cfg.gvisor.runsc).map_err(|e| anyhow::anyhow!(e))?;
        let ids = crate::runtime::namespace::subids::sandbox_ids(&cfg.sandbox)
            .map_err(|e| anyhow::anyhow!(e))?;
        let dir = cfg.run_dir.join("gvisor");
        let state = dir.join("state");
        std::fs::create_dir_all(&state).with_context(|| format!("creating {}", dir.display()))?;
        // runsc runs as the sandboxes' root and keeps its records there; others stay out.
        if let Some(ids) = ids {
            let root = ids.host(0);
            std::os::unix::fs::chown(&state, Some(root), Some(root))
                .with_context(|| format!("chown {}", state.display()))?;
            std::fs::set_permissions(&state, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .with_context(|| format!("chmod {}", state.display()))?;
        }
        let mut flags = vec![
            format!("--root={}", state.display()),
            format!("--platform={}", cfg.gvisor.platform),
            "--network=sandbox".into(),
            // Open connections are reset at a checkpoint rather than failing it.
            "--net-disconnect-ok".into(),
            "--ignore-cgroups".into(),
            // Writes go to the sandbox's disk, not to an overlay in memory or in the image.
            "--overlay2=none".into(),
        ];
        flags.extend(cfg.gvisor.extra_args.iter().cloned());
        let (agent_host, agent_args) = super::container::agent_command(cfg)?;
        Ok(Gvisor {
            runsc: cfg.gvisor.runsc.clone(),
            flags,
            dir,
            self_exe: std::env::current_exe().context("locating own executable")?,
            agent_host,
            agent_args,
            hostname: cfg.sandbox.hostname.clone(),
            tmp_size_mib: cfg.sandbox.tmp_size_mib,
            run_size_mib: cfg.sandbox.run_size_mib,
            pause_to_disk: cfg.gvisor.pause_to_disk,
            ids,
            guest: guest.clone(),
        })
    }

    fn bundle_dir(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }

    /// `runsc <flags> <args>`, killed after [`RUNSC_TIMEOUT`] (a frozen sandbox does not
    /// answer, and a blocking thread must not wait on it forever).
    fn runsc(&self, args: &[&str]) -> Result<String, String> {
        use std::io::Read;
        let what = || format!("runsc {}", args.join(" "));
        let mut child = Command::new(&self.runsc)
            .args(&self.flags)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: {e}", what()))?;
        let deadline = std::time::Instant::now() + RUNSC_TIMEOUT;
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(2))
                }
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("{}: no answer in {RUNSC_TIMEOUT:?}", what()));
                }
                Err(e) => return Err(format!("{}: {e}", what())),
            }
        };
        let (mut out, mut err) = (String::new(), String::new());
        if let Some(mut o) = child.stdout.take() {
            let _ = o.read_to_string(&mut out);
        }
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        if !status.success() {
            return Err(format!("{}: {}", what(), err.trim()));
        }
        Ok(out)
    }

    /// Mounts the sandbox's disk at its bundle's root.
    fn mount_root(&self, disk: &Path, root: &Path) -> Result<(), String> {
        std::fs::create_dir_all(root).map_err(|e| format!("mkdir {}: {e}", root.display()))?;
        let out = Command::new("mount")
            .args(["-o", "loop,nosuid,nodev,noatime"])
            .arg(disk)
            .arg(root)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount {}: {}",
                disk.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(())
    }

    /// Deletes runsc's record of a container and the bundle with its root mount.
    /// `runsc pause` (the Sentry stops every task) and `checkpoint --leave-running` into
    /// `image`, leaving the sandbox paused. A failed save (a full disk) resumes it: it runs on.
    fn save_paused(&self, key: &str, image: &Path) -> Result<(), String> {
        self.runsc(&["pause", key])?;
        let path = image.to_string_lossy();
        let saved = self.runsc(&["checkpoint", "--leave-running", "--image-path", &path, key]);
        if let Err(e) = saved {
            return match self.runsc(&["resume", key]) {
                Ok(_) => Err(e),
                Err(r) => Err(format!("{e}; resuming it after: {r}")),
            };
        }
        Ok(())
    }

    /// Gives the endpoint's namespace its eth0 back from the namespace pinned in the bundle,
    /// before that one goes (and the veth with it): the sandbox starts on the endpoint again.
    fn return_guest_link(&self, st: &SandboxState) {
        if let Some(ep) = &st.endpoint {
            if let Err(e) = init::return_guest_link(&self.bundle_dir(&st.key), &ep.netns_path) {
                tracing::warn!(id = %st.id, error = %e, "returning eth0 to its endpoint");
            }
        }
    }

    fn remove(&self, key: &str) {
        if let Err(e) = self.runsc(&["delete", "--force", key]) {
            if !e.contains("does not exist") && !e.contains("not found") {
                tracing::warn!(key, error = %e, "runsc delete");
            }
        }
        let b = self.bundle_dir(key);
        let root = b.join(init::ROOT);
        // The root (the loop device goes with its last reference), the pinned namespace and
        // the bound checkpoint.
        for m in [&root, &b.join(init::NETNS), &b.join(init::IMAGE)] {
            if let Ok(c) = std::ffi::CString::new(m.as_os_str().as_encoded_bytes()) {
                // SAFETY: umount2 on a path we own.
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            }
        }
        let _ = std::fs::remove_dir(&root);
        let _ = std::fs::remove_dir_all(&b);
    }
}

impl Launcher for Gvisor {
    fn name(&self) -> &'static str {
        GVISOR
    }

    fn new_state(&self) -> RuntimeState {
        RuntimeState::Gvisor(Default::default())
    }

    fn launch(
        &self,
        cg: &Cgroups,
        key: &str,
        paths: &SandboxPaths,
        netns: &Path,
    ) -> Result<(i32, u64), String> {
        self.start(cg, key, paths, netns, None)
    }

    fn restore(
        &self,
        cg: &Cgroups,
        key: &str,
        paths: &SandboxPaths,
        netns: &Path,
        image: &Path,
    ) -> Result<(i32, u64), String> {
        self.start(cg, key, paths, netns, Some(image))
    }

    fn needs_wired_network(&self) -> bool {
        true
    }

    /// runsc moved the namespace's addresses and routes into the Sentry: the interface is bare.
    fn endpoint_reusable(&self) -> bool {
        false
    }

    fn snapshot_kind(&self) -> SnapshotKind {
        SnapshotKind::Full
    }

    /// [`Gvisor::save_paused`], `stopped`, `runsc resume`.
    fn checkpoint(
        &self,
        st: &SandboxState,
        image: &Path,
        stopped: &mut dyn FnMut() -> Result<(), String>,
    ) -> Result<(), String> {
        self.save_paused(&st.key, image)?;
        let r = stopped();
        let resumed = self.runsc(&["resume", &st.key]);
        r.and(resumed.map(|_| ()))
    }
    fn pauses_to_disk(&self) -> bool {
        self.pause_to_disk
    }

    /// [`Gvisor::save_paused`], then the paused sandbox is deleted with its
    /// runsc record and root mount (a restore makes both again). Not a plain `checkpoint`,
    /// which ends the sandbox even when the save fails (a full disk): here a failed save is
    /// followed by `runsc resume`, and the sandbox runs on as before. Paused first, so nothing
    /// it does after the save reaches its disk.
    fn checkpoint_and_stop(&self, st: &SandboxState, image: &Path) -> Result<(), String> {
        self.save_paused(&st.key, image)?;
        self.return_guest_link(st);
        self.remove(&st.key);
        crate::runtime::process::reap(st.pid, std::time::Duration::from_secs(10));
        Ok(())
    }

    /// gVisor keeps file data in its own page cache: `sync` inside writes it to the disk.
    fn flush(&self, st: &SandboxState) -> Result<(), String> {
        self.runsc(&["exec", &st.key, "sync"]).map(|_| ())
    }

    fn sync_fs(&self, st: &SandboxState, _paths: &SandboxPaths) -> Result<(), String> {
        let root = self.bundle_dir(&st.key).join(init::ROOT);
        let f = std::fs::File::open(&root).map_err(|e| format!("{}: {e}", root.display()))?;
        use std::os::fd::AsRawFd;
        // SAFETY: syncfs on an fd we own.
        if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
            return Err(format!("syncfs: {}", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    fn cleanup(&self, st: &SandboxState, _paths: &SandboxPaths, keep_endpoint: bool) {
        if st.key.is_empty() {
            return;
        }
        if keep_endpoint {
            self.return_guest_link(st);
        }
        self.remove(&st.key);
    }

    /// Its bundle's root is still mounted (the node checked the sandbox process), or it is
    /// paused to disk and its image is there. Not asked of runsc: `runsc state` talks to the
    /// sandbox, and a paused one is frozen.
    fn readopt(&self, st: &SandboxState) -> bool {
        if let Some(image) = st.runtime.paused_image() {
            let ok = image.is_dir();
            if !ok {
                tracing::warn!(id = %st.id, image = %image.display(), "gVisor sandbox paused to disk without its image");
            }
            return ok;
        }
        let root = self.bundle_dir(&st.key).join(init::ROOT);
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let want = root.to_string_lossy();
        let mounted = mounts
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(want.as_ref()));
        if !mounted {
            tracing::warn!(id = %st.id, root = %root.display(), "gVisor sandbox without its root mount");
        }
        mounted
    }

    fn reap_leftovers(&self, live: &[SandboxState]) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in rd.flatten() {
            let key = e.file_name().to_string_lossy().to_string();
            if key != "state" && !live.iter().any(|s| s.key == key) {
                tracing::warn!(key, "reaping a gVisor sandbox nothing refers to");
                self.remove(&key);
            }
        }
    }
}

impl Gvisor {
    /// Mounts the disk as the bundle's root and starts the sandbox: afresh, or from `restore`.
    fn start(
        &self,
        cg: &Cgroups,
        key: &str,
        paths: &SandboxPaths,
        netns: &Path,
        restore: Option<&Path>,
    ) -> Result<(i32, u64), String> {
        let b = self.bundle_dir(key);
        let root = b.join(init::ROOT);
        self.mount_root(&paths.disk(), &root)?;
        // With a user namespace runsc joins the one the launcher pins in the bundle.
        let sandbox_netns = match self.ids {
            Some(_) => b.join(init::NETNS),
            None => netns.to_path_buf(),
        };
        let r = (|| {
            let config = bundle::Bundle {
                root: &root,
                netns: &sandbox_netns,
                hostname: &self.hostname,
                agent_host: &self.agent_host,
                agent_path: AGENT_PATH,
                agent_args: &self.agent_args,
                tmp_size_mib: self.tmp_size_mib,
                run_size_mib: self.run_size_mib,
            }
            .config()?;
            std::fs::write(b.join("config.json"), config.to_string())
                .map_err(|e| format!("writing the bundle: {e}"))?;
            let spec = init::GvisorSpec {
                runsc: self.runsc.clone(),
                flags: self.flags.clone(),
                id: key.to_string(),
                bundle: b.clone(),
                netns: netns.to_path_buf(),
                cgroup_procs: cg.procs_files(key),
                log: paths.log(),
                restore: restore.map(Path::to_path_buf),
                ids: self.ids,
                guest: self.guest.clone(),
            };
            let json = serde_json::to_string(&spec).map_err(|e| e.to_string())?;
            let out = Command::new(&self.self_exe)
                .arg("gvisor-init")
                .env_clear()
                .env(init::SPEC_ENV, json)
                .stdin(Stdio::null())
                .output()
                .map_err(|e| format!("spawn {}: {e}", self.self_exe.display()))?;
            if !out.status.success() {
                return Err(String::from_utf8_lossy(&out.stderr)
                    .trim()
                    .trim_start_matches("gvisor-init: ")
                    .to_string());
            }
            let v: serde_json::Value = serde_json::from_slice(&out.stdout)
                .map_err(|e| format!("bad launcher output: {e}"))?;
            let pid = v["pid"].as_i64().unwrap_or(0) as i32;
            let start = crate::runtime::process::proc_start_time(pid)
                .ok_or_else(|| format!("runsc sandbox {pid} vanished at start"))?;
            Ok((pid, start))
        })();
        if r.is_err() {
            self.remove(key);
        }
        r
    }
}
