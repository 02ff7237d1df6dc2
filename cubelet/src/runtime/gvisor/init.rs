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
//!
//! With `[sandbox] user_namespace` (the default) runsc runs as root of a user namespace of
//! its own (the namespace runtime's ids: its root is an unprivileged host id), so the Sentry,
//! the gofer and every file they create belong to that id, not to host root. Debian's runsc
//! refuses a user namespace in the bundle, so the launcher makes it and enters it before
//! starting runsc: the root is an idmapped mount (the disk keeps the image's ids), and the
//! network namespace runsc joins is a new one that user namespace owns (a namespace's owner
//! decides who may join it), pinned at `<bundle>/netns`, with the sandbox's `eth0` moved in
//! from the endpoint's namespace and addressed there.

use crate::network::GuestIdentity;
use crate::runtime::namespace::init::IdMap;
use serde::{Deserialize, Serialize};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
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
    /// The sandbox's user namespace (see the module's comment), if it has one.
    #[serde(default)]
    pub ids: Option<IdMap>,
    /// The guest end's addresses, set at every start (netstack takes them when it stops).
    #[serde(default)]
    pub guest: GuestIdentity,
}

/// Where, in a bundle, the sandbox's disk is mounted.
pub const ROOT: &str = "root";
/// Where, in a bundle, the network namespace of a sandbox with a user namespace is pinned.
pub const NETNS: &str = "netns";
/// Where, in a bundle, the checkpoint a sandbox with a user namespace restores from is bound.
pub const IMAGE: &str = "image";

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
    // Opened and forked with the host's privileges: the writer drops to nobody itself.
    let log = crate::runtime::namespace::init::spawn_log_writer(&spec.log)?;
    let image = match spec.ids {
        Some(ids) => enter_own_userns(spec, ids)?,
        None => {
            // The endpoint's own namespace: addressed again, as a previous start's netstack
            // took the addresses with it.
            crate::network::address_guest_link(&spec.guest)
                .map_err(|e| format!("the sandbox's eth0: {e}"))?;
            spec.restore.clone()
        }
    };
    hide_host_net_sysctls()?;
    let out = std::fs::File::from(log);
    let err = out.try_clone().map_err(|e| format!("log pipe: {e}"))?;
    let mut cmd = Command::new(&spec.runsc);
    cmd.args(&spec.flags);
    match &image {
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

/// Makes the sandbox's user namespace and the network namespace it owns, idmaps the root,
/// pins the namespace at `<bundle>/netns`, moves `eth0` there and addresses it, lets the
/// namespace's root read a checkpoint to restore (returned: where runsc finds it), and joins
/// the user namespace as its root. Everything that needs host privileges happens here, before
/// the join.
fn enter_own_userns(spec: &GvisorSpec, ids: IdMap) -> Result<Option<PathBuf>, String> {
    use crate::runtime::namespace::init as ns;
    let (user, net) = ns::make_userns_with(ids, true)?;
    let net = std::fs::File::from(net.ok_or("no network namespace was made")?);
    ns::idmap_mount(&spec.bundle.join(ROOT), &user)?;
    let pin = spec.bundle.join(NETNS);
    let fd = PathBuf::from(format!("/proc/self/fd/{}", net.as_raw_fd()));
    crate::network::pin_netns(&fd, &pin)
        .map_err(|e| format!("pin the network namespace at {}: {e}", pin.display()))?;
    crate::network::move_guest_link(&net).map_err(|e| format!("the sandbox's eth0: {e}"))?;
    // SAFETY: setns with an fd we own; this process is single-threaded.
    if unsafe { libc::setns(net.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!(
            "join the sandbox's network namespace: {}",
            std::io::Error::last_os_error()
        ));
    }
    crate::network::address_guest_link(&spec.guest)
        .map_err(|e| format!("the sandbox's eth0: {e}"))?;
    // The checkpoint is bind-mounted into the bundle, which runsc reaches anyway: the
    // directories above it (a node's data directory) need not be open to the sandbox's ids.
    let image = match &spec.restore {
        Some(image) => {
            share_tree_read(image, ids.host(0))?;
            let at = spec.bundle.join(IMAGE);
            std::fs::create_dir_all(&at).map_err(|e| format!("mkdir {}: {e}", at.display()))?;
            crate::storage::bind_mount(image, &at)
                .map_err(|e| format!("bind the checkpoint at {}: {e}", at.display()))?;
            Some(at)
        }
        None => None,
    };
    ns::enter_userns(&user)?;
    Ok(image)
}

/// Lets group `gid` read `dir` and everything under it (directories 0750, files 0640; links
/// are not followed), owner unchanged: runsc reads a checkpoint as the sandbox's root, which
/// must not be able to change an image other sandboxes restore from, and others stay out.
fn share_tree_read(dir: &Path, gid: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mode = if meta.is_dir() {
        0o750
    } else if meta.is_file() {
        0o640
    } else {
        return Ok(());
    };
    std::os::unix::fs::lchown(dir, None, Some(gid))
        .and_then(|_| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)))
        .map_err(|e| format!("share {}: {e}", dir.display()))?;
    if meta.is_dir() {
        let rd = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for e in rd {
            let e = e.map_err(|e| format!("{}: {e}", dir.display()))?;
            share_tree_read(&e.path(), gid)?;
        }
    }
    Ok(())
}

/// Moves the sandbox's `eth0` from the namespace pinned in `bundle` back into `to` (the
/// endpoint's), before that pinned namespace goes: a veth in a namespace that ends is deleted
/// with its host end. No pinned namespace (no user namespace): nothing to do.
pub fn return_guest_link(bundle: &Path, to: &Path) -> Result<(), String> {
    let pinned = bundle.join(NETNS);
    if !pinned.exists() {
        return Ok(());
    }
    let (from, to) = (pinned, to.to_path_buf());
    // A thread of its own: joining a namespace changes only the calling thread.
    std::thread::spawn(move || -> Result<(), String> {
        let f = std::fs::File::open(&from).map_err(|e| format!("{}: {e}", from.display()))?;
        // SAFETY: setns with an fd we own; this thread exits right after.
        if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(format!(
                "join {}: {}",
                from.display(),
                std::io::Error::last_os_error()
            ));
        }
        let t = std::fs::File::open(&to).map_err(|e| format!("{}: {e}", to.display()))?;
        crate::network::move_guest_link(&t).map_err(|e| e.to_string())
    })
    .join()
    .map_err(|_| "the thread moving eth0 panicked".to_string())?
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
