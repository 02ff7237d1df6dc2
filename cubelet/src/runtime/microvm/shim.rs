//! The cube-shim side of the `microvm` runtime: one cube-shim process per sandbox hosting a KVM
//! microVM restored from the template's memory snapshot.
//!
//! Pieces (the runtime, `mod.rs`, wires them into its operations):
//! * [`ShimSpawner`]: starts shims (jailed: own cgroup with the shape's limits, mount namespace
//!   with `pivot_root`, PID namespace, own uid without capabilities, seccomp, no new
//!   privileges; see `cube_shim::jail`) and waits for their control socket.
//!
//! # What a jailed shim can reach
//! Only its own **work directory**, `<data_dir>/shim-work/<key>/` ([`ShimSpawner::work_for`]),
//! bound read-write and handed to the shim's uid (`cube_shim::jail::shim_id` of its pid: the
//! range `SHIM_ID_BASE..+SHIM_ID_COUNT`, one uid per live shim), and the template snapshot it
//! was started for, read-only. Shims are started before a sandbox is assigned (the pool), so
//! the work directory is what cubelet fills at assignment: it holds the control socket, the
//! sandbox's disk as a **hard link** to `sandboxes/<id>/disk.ext4` (same inode, chowned to the
//! shim's uid: the shim opens the one file it needs by a path inside its jail, and nothing
//! has to be mounted into a running shim's namespace — same XFS, so the link always works),
//! the vsock sockets (cubelet's init listener is chowned to the shim's uid so it may connect),
//! pause-to-disk directories and snapshot output (moved into `templates/` and handed back to
//! root by cubelet). The sandbox directory itself (state file, logs), other sandboxes, other
//! shims' sockets and the node secret stay outside. A pooled tap belongs to root
//! (`TUNSETOWNER 0`, so no shim can attach to one that is not its own) and is handed to the
//! shim's uid when assigned ([`super::tap_pool::set_owner`]).
//! * [`super::shim_pool::ShimPool`]: shims spawned ahead of time, VM shell created and the
//!   template's memory already mapped, so a create only loads state.
//! * [`InitResponder`]: the host end of the guest's init channel. The guest (today the shim's
//!   `agent_standin` test guest; cube-agent on hosts with hardware KVM) connects over vsock to
//!   host port [`cube_shim::template::STANDIN_INIT_PORT`] after every restore or resume and gets
//!   a fresh [`VsockInit`]: clock, 32 bytes of entropy from the host, env vars and token, so
//!   no two copies of one snapshot share RNG state.
//! * template snapshots: [`ShimSpawner::build_snapshot`] boots the guest once in a jailed
//!   `cube-shim --build-template` and snapshots it at its ready point into
//!   `templates/<t>/<build>/microvm-<v>c<m>m/`.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cube_shim::protocol::Reply;
use cube_shim::{Client, Op};

pub use crate::runtime::select::{Guest, STANDIN_GUEST};
pub use cube_init::{Settings, VsockInit};

/// Kernel arguments of a Linux template (the shim appends devices, the init channel and, on
/// PVM hosts, its workarounds). cube-agent is the template's init.
pub const LINUX_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 pci=off quiet root=/dev/vda rw init=/sbin/cube-agent";
/// Name of the disk a Linux template snapshot was taken with, inside its snapshot directory:
/// sandboxes are cloned from it (it matches the memory image), not from the template's image.
pub const SNAPSHOT_DISK: &str = "disk.img";
/// How long a Linux template build may take to boot to cube-agent's first init request (on PVM
/// hosts guest kernel mode is emulated: about 25 s).
const LINUX_BUILD_TIMEOUT_MS: u64 = 300_000;
#[derive(Debug, thiserror::Error)]
pub enum MicroVmError {
    #[error("{0}")]
    Unavailable(String),
    #[error("spawn cube-shim: {0}")]
    Spawn(String),
    #[error("cube-shim: {0}")]
    Shim(#[from] cube_shim::ClientError),
    #[error("template snapshot: {0}")]
    Build(String),
    #[error("init: {0}")]
    Init(String),
    /// Settings the guest cannot take (too large for one init frame).
    #[error("init: {0}")]
    Settings(#[from] cube_init::InitError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A started shim.
#[derive(Debug)]
pub struct SpawnedShim {
    pub key: String,
    pub pid: i32,
    pub pid_start: u64,
    pub socket: PathBuf,
    pub jail_root: Option<PathBuf>,
    /// Its work directory ([`ShimSpawner::work_for`]).
    pub work: PathBuf,
    /// The uid (and gid) it runs as when jailed; `None` for an unjailed (root) shim.
    pub uid: Option<u32>,
    pub child: Child,
}

/// Starts shims for one node.
#[derive(Debug, Clone)]
pub struct ShimSpawner {
    pub binary: PathBuf,
    /// Logs (and the control sockets of shims started before work directories existed).
    pub shims_dir: PathBuf,
    /// Jail roots (one empty directory per shim).
    pub roots_dir: PathBuf,
    /// Work directories, one per shim (on the data directory's filesystem: disks are hard
    /// linked in, snapshots renamed out).
    pub work_dir: PathBuf,
    pub jail: bool,
    pub cgroup_root: PathBuf,
    pub cgroup_parent: String,
    pub mem_overhead_mib: u64,
}

impl ShimSpawner {
    /// The shim's own directory, the only writable place in its jail.
    pub fn work_for(&self, key: &str) -> PathBuf {
        self.work_dir.join(key)
    }

    pub fn socket_for(&self, key: &str) -> PathBuf {
        self.work_for(key).join("ctl.sock")
    }

    /// The uid a shim with host pid `pid` runs as, when shims are jailed.
    pub fn uid_of(&self, pid: i32) -> Option<u32> {
        (self.jail && pid > 0).then(|| cube_shim::jail::shim_id(pid as u32))
    }

    /// A cube-shim command for `key`'s shape, cgroup `<parent>/<key>` and, when shims are
    /// jailed, its jail (work directory `work`, the paths `ro` read-only); with the jail root.
    fn command<'a>(
        &self,
        key: &str,
        work: &Path,
        vcpus: u32,
        mem_mib: u64,
        ro: impl IntoIterator<Item = &'a Path>,
    ) -> (Command, Option<PathBuf>) {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--vcpus")
            .arg(vcpus.to_string())
            .arg("--mem-mib")
            .arg(mem_mib.to_string())
            .arg("--cgroup")
            .arg(format!("{}/{key}", self.cgroup_parent))
            .arg("--cgroup-root")
            .arg(&self.cgroup_root)
            .arg("--mem-overhead-mib")
            .arg(self.mem_overhead_mib.to_string())
            .env_clear()
            .env("RUST_LOG", "warn");
        let jail_root = self.jail.then(|| self.roots_dir.join(key));
        if let Some(r) = &jail_root {
            cmd.arg("--jail-root").arg(r).arg("--jail-own").arg(work);
            for p in ro {
                cmd.arg("--jail-bind-ro").arg(p);
            }
        }
        (cmd, jail_root)
    }

    /// Spawns a shim for `shape` (optionally prepared for `template`) in cgroup
    /// `<parent>/<key>` (which the caller created with its limits) and waits until it answers.
    pub fn spawn(
        &self,
        key: &str,
        vcpus: u32,
        mem_mib: u64,
        template: Option<&Path>,
        timeout: Duration,
    ) -> Result<SpawnedShim, MicroVmError> {
        let socket = self.socket_for(key);
        let work = self.work_for(key);
        // Fresh and empty: the shim hands it to its own uid.
        std::fs::create_dir(&work)?;
        let log = std::fs::File::create(self.shims_dir.join(format!("{key}.log")))?;
        let (mut cmd, jail_root) = self.command(key, &work, vcpus, mem_mib, template);
        cmd.arg("--socket").arg(&socket);
        if let Some(t) = template {
            cmd.arg("--template").arg(t);
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        // Its own session: signals to cubelet's process group must not reach sandboxes, which
        // outlive a cubelet restart.
        // SAFETY: setsid is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| MicroVmError::Spawn(format!("{}: {e}", self.binary.display())))?;
        let pid = child.id() as i32;
        let t0 = Instant::now();
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                let log = std::fs::read_to_string(self.shims_dir.join(format!("{key}.log")))
                    .unwrap_or_default();
                return Err(MicroVmError::Spawn(format!(
                    "shim exited at start ({st}): {}",
                    log.trim()
                )));
            }
            if socket.exists() {
                if let Ok(mut c) = Client::connect(&socket) {
                    let _ = c.set_timeout(Some(Duration::from_secs(5)));
                    if let Ok(Reply::Pong { .. }) = c.call(Op::Ping) {
                        break;
                    }
                }
            }
            if t0.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                return Err(MicroVmError::Spawn(format!(
                    "shim did not answer within {timeout:?}"
                )));
            }
            std::thread::sleep(Duration::from_micros(500));
        }
        let pid_start = crate::runtime::process::proc_start_time(pid)
            .ok_or_else(|| MicroVmError::Spawn(format!("shim pid {pid} vanished")))?;
        Ok(SpawnedShim {
            key: key.to_string(),
            pid,
            pid_start,
            socket,
            jail_root,
            work,
            uid: self.uid_of(pid),
            child,
        })
    }

    /// Removes what a shim left in the node's directories (work directory with its socket,
    /// disk link and pause directories; log; jail root).
    pub fn cleanup(&self, key: &str) {
        if !key.is_empty() {
            let _ = std::fs::remove_dir_all(self.work_for(key));
        }
        let _ = std::fs::remove_file(self.shims_dir.join(format!("{key}.sock")));
        let _ = std::fs::remove_file(self.shims_dir.join(format!("{key}.log")));
        let _ = std::fs::remove_dir(self.roots_dir.join(key));
    }
}

/// Hands `path` (not following a symlink) to the jailed shim's uid.
pub fn hand_to(path: &Path, uid: u32) -> Result<(), MicroVmError> {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid))?;
    Ok(())
}

/// Gives a snapshot directory a shim wrote (now a template, moved out of the shim's reach)
/// back to root, so that a later shim that happens to get the same uid owns none of it. One
/// level only, never following links: a snapshot is flat, and a shim that still holds a
/// descriptor into it must not steer this elsewhere.
pub fn chown_tree_to_root(dir: &Path) -> Result<(), MicroVmError> {
    std::os::unix::fs::lchown(dir, Some(0), Some(0))?;
    for e in std::fs::read_dir(dir)? {
        std::os::unix::fs::lchown(e?.path(), Some(0), Some(0))?;
    }
    Ok(())
}

/// One call to a shim with a deadline (blocking; run it off the async threads).
pub fn call(socket: &Path, op: Op, timeout: Duration) -> Result<Reply, MicroVmError> {
    let mut c = Client::connect(socket)?;
    c.set_timeout(Some(timeout))?;
    Ok(c.call(op)?)
}

/// Waits until the stand-in guest finished its init round and parked (last checkpoint
/// [`cube_shim::template::STANDIN_INIT_DONE`]). A pause or snapshot taken in the middle of a
/// round would cut its vsock connection and it would never ask for an init again (cube-agent
/// needs no such wait: the host sends it `/init` after a resume).
pub fn wait_standin_idle(socket: &Path, timeout: Duration) -> Result<(), MicroVmError> {
    let t0 = Instant::now();
    loop {
        if let Reply::Stats { checkpoints, .. } = call(socket, Op::Stats, timeout)? {
            if checkpoints.last() == Some(&cube_shim::template::STANDIN_INIT_DONE) {
                return Ok(());
            }
        }
        if t0.elapsed() > timeout {
            return Err(MicroVmError::Init(format!(
                "the guest did not settle after its init within {timeout:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Directory of a template build's microVM snapshot for a shape.
pub fn snapshot_dir(build_dir: &Path, vcpus: u32, mem_mib: u64) -> PathBuf {
    build_dir.join(format!("microvm-{vcpus}c{mem_mib}m"))
}

impl ShimSpawner {
    /// Boots the configured guest once and snapshots it at its ready point into `out`
    /// (`cube-shim --build-template`, so the guest never runs inside cubelet). The build shim
    /// is confined like a serving one (`key` names its cgroup under the parent, which the
    /// caller created with the shape's limits, and its work and jail directories): the guest
    /// boots the template's own image, so it is as hostile as any sandbox. Its work directory
    /// holds everything it writes: the snapshot, the console log, the vsock sockets and, for a
    /// Linux guest, the clone of the image it boots. Only the kernel and a stand-in's disk are
    /// bound in besides, read-only.
    #[allow(clippy::too_many_arguments)]
    pub fn build_snapshot(
        &self,
        key: &str,
        guest: &Guest,
        out: &Path,
        vcpus: u32,
        mem_mib: u64,
        disk: Option<&Path>,
        guest_mac: [u8; 6],
    ) -> Result<(), MicroVmError> {
        use std::os::unix::fs::MetadataExt;
        /// Removes the build's work and jail directories however the build ends.
        struct Cleanup<'a>(&'a ShimSpawner, &'a str);
        impl Drop for Cleanup<'_> {
            fn drop(&mut self) {
                self.0.cleanup(self.1);
            }
        }
        let work = self.work_for(key);
        std::fs::create_dir(&work)?;
        let _cleanup = Cleanup(self, key);
        let build_err =
            |what: &str, e: &dyn std::fmt::Display| MicroVmError::Build(format!("{what}: {e}"));
        // Canonical paths: the jail binds each at its own path, and a bind follows no link.
        let work = work
            .canonicalize()
            .map_err(|e| build_err(&work.display().to_string(), &e))?;
        let snapshot = work.join("snapshot");
        let console = work.join("console.log");
        // A Linux guest boots (and writes) a clone of the template's image; that clone, as it
        // was at the snapshot, is what its sandboxes are cloned from.
        // A stand-in only reads the template's disk: it is bound in read-only.
        let (linux_disk, standin_disk) = match (guest, disk) {
            (Guest::Linux(_), Some(d)) => {
                let c = work.join(SNAPSHOT_DISK);
                crate::storage::clone_file(d, &c)
                    .map_err(|e| build_err(&format!("clone {}", d.display()), &e))?;
                let m = std::fs::metadata(&c)?;
                (Some((c, m.dev(), m.ino())), None)
            }
            (_, Some(d)) => {
                let d = d
                    .canonicalize()
                    .map_err(|e| build_err(&d.display().to_string(), &e))?;
                (None, Some(d))
            }
            (_, None) => (None, None),
        };
        let mac = guest_mac
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":");
        let kernel = match guest {
            Guest::Linux(k) => Some(
                k.canonicalize()
                    .map_err(|e| build_err(&format!("kernel {}", k.display()), &e))?,
            ),
            _ => None,
        };
        // Bound read-only into its jail: the kernel, a stand-in's disk.
        let ro: Vec<&Path> = kernel
            .iter()
            .chain(standin_disk.iter())
            .map(|p| p.as_path())
            .collect();
        let (mut cmd, _) = self.command(key, &work, vcpus, mem_mib, ro);
        cmd.arg("--build-template")
            .arg(&snapshot)
            .arg("--build-scratch")
            .arg(&work)
            .arg("--net-mac")
            .arg(&mac);
        if let Some(d) = linux_disk
            .as_ref()
            .map(|(d, _, _)| d)
            .or(standin_disk.as_ref())
        {
            cmd.arg("--disk").arg(d);
        }
        if let Some(k) = &kernel {
            cmd.arg("--kernel")
                .arg(k)
                .arg("--cmdline")
                .arg(LINUX_CMDLINE)
                .arg("--console")
                .arg(&console)
                .arg("--build-timeout-ms")
                .arg(LINUX_BUILD_TIMEOUT_MS.to_string());
        }
        let o = cmd
            .output()
            .map_err(|e| build_err(&format!("run {}", self.binary.display()), &e))?;
        // The console log is the build's record either way; it leaves the work directory only
        // as a plain file (the shim owned the directory and could have put anything there).
        let console_out = out.with_extension("console.log");
        let _ = std::fs::remove_file(&console_out);
        if kernel.is_some()
            && plain_file(&console)
            && std::fs::rename(&console, &console_out).is_ok()
        {
            let _ = std::os::unix::fs::lchown(&console_out, Some(0), Some(0));
        }
        if !o.status.success() {
            let mut msg = String::from_utf8_lossy(&o.stderr).trim().to_string();
            if kernel.is_some() {
                msg.push_str(&format!(" (guest console: {})", console_out.display()));
            }
            return Err(MicroVmError::Build(msg));
        }
        check_snapshot_dir(&snapshot)?;
        chown_tree_to_root(&snapshot)?;
        if let Some((d, dev, ino)) = &linux_disk {
            // The clone cubelet made, not a file the shim put in its place.
            let m = std::fs::symlink_metadata(d)?;
            if !m.file_type().is_file() || m.dev() != *dev || m.ino() != *ino || m.nlink() != 1 {
                return Err(MicroVmError::Build(format!(
                    "the build shim replaced its disk {}",
                    d.display()
                )));
            }
            std::fs::rename(d, snapshot.join(SNAPSHOT_DISK))?;
        }
        // Replacing an older snapshot: sandboxes restored from it keep the old files (mapped).
        let staging = out.with_extension(format!("tmp{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::rename(&snapshot, &staging)?;
        if out.exists() {
            let old = out.with_extension(format!("old{}", std::process::id()));
            std::fs::rename(out, &old)?;
            std::fs::rename(&staging, out)?;
            let _ = std::fs::remove_dir_all(&old);
        } else {
            std::fs::rename(&staging, out)?;
        }
        Ok(())
    }
}

/// A regular file (not a link, not hard-linked elsewhere).
fn plain_file(p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_file() && m.nlink() == 1)
}

/// A snapshot a build shim wrote is flat: plain files only. Anything else (a link a
/// compromised shim planted towards a host file, a directory) refuses the snapshot before it
/// becomes a template that cubelet and other shims read.
fn check_snapshot_dir(dir: &Path) -> Result<(), MicroVmError> {
    let m = std::fs::symlink_metadata(dir)?;
    if !m.file_type().is_dir() {
        return Err(MicroVmError::Build(format!(
            "the build left no snapshot directory at {}",
            dir.display()
        )));
    }
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if !plain_file(&p) {
            return Err(MicroVmError::Build(format!(
                "the build shim left {} in its snapshot, which is not a plain file",
                p.display()
            )));
        }
    }
    Ok(())
}

/// A vsock init frame for `settings` with the current time and fresh entropy.
pub fn fresh_init(settings: Settings) -> VsockInit {
    let mut entropy = [0u8; cube_init::ENTROPY_BYTES];
    // SAFETY: getrandom into a local buffer of the length given.
    unsafe { libc::getrandom(entropy.as_mut_ptr().cast(), entropy.len(), 0) };
    VsockInit::new(settings, std::time::SystemTime::now(), entropy)
}

/// The host end of a sandbox's init channel: listens on `<vsock>_<port>`, answers every
/// guest "redy" with a fresh payload, and reports each acknowledged one (guest shut the
/// connection down after reading it).
pub struct InitResponder {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    listener: std::sync::Arc<std::os::unix::net::UnixListener>,
    path: PathBuf,
    acks: std::sync::mpsc::Receiver<Result<VsockInit, String>>,
}

impl InitResponder {
    pub fn listen_path(vsock: &Path) -> PathBuf {
        PathBuf::from(format!(
            "{}_{}",
            vsock.display(),
            cube_shim::template::STANDIN_INIT_PORT
        ))
    }

    /// Binds (replacing a stale socket) and serves in a thread (blocked in `accept`, so an
    /// idle sandbox costs no CPU) until dropped. `owner`: the jailed shim's uid, which needs
    /// write permission on the socket to connect. `patience`: how long one guest may take to
    /// say it is ready and to apply its payload (the node's ready timeout: a slow host, such as
    /// nested virtualisation, must not fail a create that is within it).
    pub fn start(
        vsock: &Path,
        settings: Settings,
        owner: Option<u32>,
        patience: Duration,
    ) -> Result<InitResponder, MicroVmError> {
        let path = Self::listen_path(vsock);
        let _ = std::fs::remove_file(&path);
        // Validate once up front so that an oversized body fails the create, not the guest.
        fresh_init(settings.clone()).encode()?;
        let listener = std::sync::Arc::new(std::os::unix::net::UnixListener::bind(&path)?);
        if let Some(uid) = owner {
            std::os::unix::fs::chown(&path, Some(uid), Some(uid))?;
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, acks) = std::sync::mpsc::channel();
        let (s2, l2) = (stop.clone(), listener.clone());
        std::thread::Builder::new()
            .name("init".into())
            .stack_size(256 << 10)
            .spawn(move || {
                // The last acknowledged connection stays open: cube-agent waits on it and asks
                // again only once it ends (a restore or resume resets it).
                let mut _held = None;
                loop {
                    let r = l2.accept();
                    if s2.load(std::sync::atomic::Ordering::SeqCst) {
                        return;
                    }
                    let sent = match r {
                        Ok((conn, _)) => {
                            tx.send(serve_init(conn, &settings, patience).map(|(p, c)| {
                                _held = Some(c);
                                p
                            }))
                        }
                        Err(e) => {
                            std::thread::sleep(Duration::from_millis(10));
                            tx.send(Err(format!("accept: {e}")))
                        }
                    };
                    if sent.is_err() {
                        return;
                    }
                }
            })?;
        Ok(InitResponder {
            stop,
            listener,
            path,
            acks,
        })
    }

    /// Waits for the next acknowledged init.
    pub fn wait_ack(&self, timeout: Duration) -> Result<VsockInit, MicroVmError> {
        match self.acks.recv_timeout(timeout) {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(e)) => Err(MicroVmError::Init(e)),
            Err(_) => Err(MicroVmError::Init(format!(
                "the guest did not take its init payload within {timeout:?}"
            ))),
        }
    }

    /// Acknowledged inits since the last call, without waiting.
    pub fn drain(&self) -> Vec<Result<VsockInit, String>> {
        self.acks.try_iter().collect()
    }
}

impl Drop for InitResponder {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // Wakes the thread blocked in accept (Linux: accept on a shut-down listener fails).
        // SAFETY: shutdown(2) on a socket fd this struct keeps open.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        // And in case it did not: a connection ends its accept, and it sees `stop`.
        let _ = std::os::unix::net::UnixStream::connect(&self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve_init(
    mut conn: std::os::unix::net::UnixStream,
    settings: &Settings,
    patience: Duration,
) -> Result<(VsockInit, std::os::unix::net::UnixStream), String> {
    conn.set_read_timeout(Some(patience))
        .map_err(|e| e.to_string())?;
    let mut hello = [0u8; 4];
    conn.read_exact(&mut hello)
        .map_err(|e| format!("read guest hello: {e}"))?;
    if &hello != b"redy" {
        return Err(format!("unexpected guest hello {hello:?}"));
    }
    let p = fresh_init(settings.clone());
    let bytes = p.encode().map_err(|e| e.to_string())?;
    conn.write_all(&bytes)
        .map_err(|e| format!("send init: {e}"))?;
    // The guest shuts its side down (the stand-in all of it, cube-agent only for writing)
    // once it has applied the payload.
    let mut rest = Vec::new();
    conn.read_to_end(&mut rest)
        .map_err(|e| format!("wait for the guest's acknowledgement: {e}"))?;
    Ok((p, conn))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_snapshot_is_accepted_only_as_plain_files() {
        let d = tempfile::tempdir().unwrap();
        let snap = d.path().join("snapshot");
        std::fs::create_dir(&snap).unwrap();
        std::fs::write(snap.join("memory.img"), b"m").unwrap();
        std::fs::write(snap.join("manifest.json"), b"{}").unwrap();
        check_snapshot_dir(&snap).unwrap();
        // What a compromised build shim could leave for cubelet or a later shim to follow.
        std::os::unix::fs::symlink("/etc/shadow", snap.join("vmstate.bin")).unwrap();
        let e = check_snapshot_dir(&snap).unwrap_err().to_string();
        assert!(
            e.contains("vmstate.bin") && e.contains("not a plain file"),
            "{e}"
        );
        std::fs::remove_file(snap.join("vmstate.bin")).unwrap();
        std::fs::hard_link(snap.join("memory.img"), d.path().join("elsewhere")).unwrap();
        assert!(check_snapshot_dir(&snap).is_err(), "a hard-linked file");
        std::fs::remove_file(d.path().join("elsewhere")).unwrap();
        std::fs::create_dir(snap.join("sub")).unwrap();
        assert!(check_snapshot_dir(&snap).is_err(), "a directory");
        std::fs::remove_dir(snap.join("sub")).unwrap();
        check_snapshot_dir(&snap).unwrap();
        // No snapshot at all (the shim replaced it with a link).
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&snap, &link).unwrap();
        assert!(check_snapshot_dir(&link).is_err());
    }

    #[test]
    fn every_init_frame_is_fresh() {
        let a = fresh_init(Settings::default());
        let b = fresh_init(Settings::default());
        assert_ne!(a.entropy, b.entropy);
        assert!(a.clock_ns > 0 && b.clock_ns >= a.clock_ns);
    }
}
