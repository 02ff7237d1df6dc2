//! The mount jail: a private mount namespace rooted (`pivot_root`) at an empty tmpfs holding
//! only the shim's devices and the paths cubelet names, and the jail's own `/proc`.

use std::path::{Path, PathBuf};

use super::{cstr, sys, JailError};

fn mount(
    src: Option<&Path>,
    dst: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), JailError> {
    let src_c = src.map(cstr).transpose()?;
    let dst_c = cstr(dst)?;
    let fs_c = fstype.map(|f| std::ffi::CString::new(f).unwrap_or_default());
    let data_c = data.map(|d| std::ffi::CString::new(d).unwrap_or_default());
    let p = |c: &Option<std::ffi::CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is a valid NUL-terminated string or null.
    let r = unsafe {
        libc::mount(
            p(&src_c),
            dst_c.as_ptr(),
            p(&fs_c),
            flags,
            p(&data_c) as *const libc::c_void,
        )
    };
    sys(r, || {
        format!(
            "mount {} on {}",
            src.map(|s| s.display().to_string())
                .or(fstype.map(String::from))
                .unwrap_or_default(),
            dst.display()
        )
    })
}

/// Device nodes every shim needs inside its jail, and whether the shim's own uid must be able
/// to open them after the privilege drop (`/dev/kvm` is opened before it; a tap is attached by
/// opening `/dev/net/tun` on every restore and resume).
pub const JAIL_DEVICES: &[(&str, bool)] = &[("/dev/kvm", false), ("/dev/net/tun", true)];
/// Host facts the hypervisor reads, bound read-only when the host has them.
pub const JAIL_IF_PRESENT: &[&str] = &["/sys/module/kvm_pvm"];

/// What goes into a shim's jail.
#[derive(Debug, Clone, Copy)]
pub struct JailSpec<'a> {
    /// An empty directory (created if missing) that becomes the root.
    pub root: &'a Path,
    /// Bound read-write (tests and debugging; cubelet binds nothing this way).
    pub binds: &'a [PathBuf],
    /// Bound read-only: the template snapshot the shim restores from.
    pub binds_ro: &'a [PathBuf],
    /// Bound read-write and handed to the shim's uid (mode 0700): the shim's own work
    /// directory (control socket, vsock sockets, pause and snapshot output, the sandbox disk).
    pub own: &'a [PathBuf],
    /// The shim's uid and gid ([`shim_id`](super::shim_id)).
    pub id: u32,
}

fn check_absolute(paths: &[PathBuf]) -> Result<(), JailError> {
    for b in paths {
        if !b.is_absolute() {
            return Err(JailError::Mount {
                what: format!("bind path {} is not absolute", b.display()),
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            });
        }
    }
    Ok(())
}

fn io_err(what: String) -> impl FnOnce(std::io::Error) -> JailError {
    move |e| JailError::Mount { what, source: e }
}

/// Creates the mount point for `src` at `dst` (a directory or an empty file).
fn mount_point(src: &Path, dst: &Path) -> Result<(), JailError> {
    let meta = std::fs::metadata(src).map_err(io_err(format!("bind source {}", src.display())))?;
    if meta.is_dir() {
        std::fs::create_dir_all(dst).map_err(io_err(format!("mkdir {}", dst.display())))?;
    } else {
        if let Some(p) = dst.parent() {
            std::fs::create_dir_all(p).map_err(io_err(format!("mkdir {}", p.display())))?;
        }
        std::fs::File::create(dst).map_err(io_err(format!("create {}", dst.display())))?;
    }
    Ok(())
}

/// Binds `src` on `dst`, then sets the bind's own flags (a bind ignores them at creation).
fn bind(src: &Path, dst: &Path, flags: libc::c_ulong) -> Result<(), JailError> {
    mount_point(src, dst)?;
    mount(Some(src), dst, None, libc::MS_BIND | libc::MS_REC, None)?;
    mount(
        None,
        dst,
        None,
        libc::MS_BIND | libc::MS_REMOUNT | flags,
        None,
    )
}

/// Makes device node `src` for the jail at `dst`: a node of its own (same device number) so
/// that its owner and mode can differ from the host's without touching the host's node;
/// where this host forbids `mknod` (a device cgroup), the host's node is bound instead.
fn device_node(src: &Path, dst: &Path, owner: Option<u32>) -> Result<(), JailError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(src).map_err(io_err(format!("stat {}", src.display())))?;
    if let Some(p) = dst.parent() {
        std::fs::create_dir_all(p).map_err(io_err(format!("mkdir {}", p.display())))?;
    }
    let dst_c = cstr(dst)?;
    // SAFETY: mknod with a valid path and the host node's device number.
    let r = unsafe { libc::mknod(dst_c.as_ptr(), libc::S_IFCHR | 0o600, meta.rdev()) };
    if r != 0 {
        tracing::warn!(dev = %src.display(), error = %std::io::Error::last_os_error(), "mknod in the jail failed; binding the host's node");
        return bind(src, dst, libc::MS_NOSUID | libc::MS_NOEXEC);
    }
    if let Some(id) = owner {
        // SAFETY: chown of the node just made.
        sys(unsafe { libc::chown(dst_c.as_ptr(), id, id) }, || {
            format!("chown {}", dst.display())
        })?;
    }
    Ok(())
}

/// Enters a private mount namespace rooted at an empty tmpfs on `spec.root` that holds only
/// [`JAIL_DEVICES`], an empty `/proc` (for [`mount_proc`]) and the spec's paths, and makes it
/// the root with `pivot_root` (the old root is detached). Must run while the process has a
/// single thread (the threads created afterwards share the namespace and root).
pub fn enter_mount_jail(spec: &JailSpec<'_>) -> Result<(), JailError> {
    check_absolute(spec.binds)?;
    check_absolute(spec.binds_ro)?;
    check_absolute(spec.own)?;
    let root = spec.root;
    std::fs::create_dir_all(root).map_err(io_err(format!("mkdir {}", root.display())))?;
    // SAFETY: unshare with a flag constant.
    sys(unsafe { libc::unshare(libc::CLONE_NEWNS) }, || {
        "unshare(CLONE_NEWNS)".into()
    })?;
    // Nothing mounted here may leak back to the host's namespace (and pivot_root needs the
    // old root not shared).
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;
    mount(
        None,
        root,
        Some("tmpfs"),
        libc::MS_NOSUID,
        Some("mode=0755,size=1m"),
    )?;
    let inside = |p: &Path| root.join(p.strip_prefix("/").unwrap_or(p));
    for (dev, for_shim) in JAIL_DEVICES {
        let dev = Path::new(dev);
        device_node(dev, &inside(dev), for_shim.then_some(spec.id))?;
    }
    // The hypervisor tells PVM hosts by this directory (it shapes the vCPU state and the CPU
    // model hash snapshots are checked against).
    for p in JAIL_IF_PRESENT.iter().map(Path::new).filter(|p| p.exists()) {
        bind(
            p,
            &inside(p),
            libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        )?;
    }
    for p in spec.binds {
        bind(p, &inside(p), libc::MS_NOSUID | libc::MS_NODEV)?;
    }
    for p in spec.binds_ro {
        bind(
            p,
            &inside(p),
            libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        )?;
    }
    for p in spec.own {
        bind(
            p,
            &inside(p),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        )?;
        let c = cstr(p)?;
        // SAFETY: chown/chmod of a directory path (the source, seen through its bind).
        sys(unsafe { libc::chown(c.as_ptr(), spec.id, spec.id) }, || {
            format!("chown {}", p.display())
        })?;
        sys(unsafe { libc::chmod(c.as_ptr(), 0o700) }, || {
            format!("chmod {}", p.display())
        })?;
    }
    let proc_dir = root.join("proc");
    std::fs::create_dir_all(&proc_dir).map_err(io_err(format!("mkdir {}", proc_dir.display())))?;
    let root_c = cstr(root)?;
    // SAFETY: chdir/pivot_root/umount2 with valid NUL-terminated paths. pivot_root(".", ".")
    // stacks the old root on top of the new one at "/"; detaching it leaves only the tmpfs.
    sys(unsafe { libc::chdir(root_c.as_ptr()) }, || {
        format!("chdir {}", root.display())
    })?;
    sys(
        unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) } as i32,
        || "pivot_root".into(),
    )?;
    sys(
        unsafe { libc::umount2(c".".as_ptr(), libc::MNT_DETACH) },
        || "detach the old root".into(),
    )?;
    sys(unsafe { libc::chdir(c"/".as_ptr()) }, || "chdir /".into())?;
    // Nothing may be created at the top of the jail afterwards.
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID,
        None,
    )?;
    Ok(())
}

/// Mounts a fresh `/proc` for the calling process's PID namespace (after [`enter_pid_ns`](super::enter_pid_ns),
/// inside the jail): `/proc/1` is the shim itself, no host process is visible.
pub fn mount_proc() -> Result<(), JailError> {
    mount(
        None,
        Path::new("/proc"),
        Some("proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )
}

/// Replaces `/proc` by one with only the per-process entries (`subset=pid`: no `/proc/sys`,
/// `/proc/kcore`, `/proc/keys`…), keeping `/proc/self` for stats and pagemap scans. Kernels
/// without `subset=pid` (before 5.8) keep the full one.
pub fn restrict_proc() -> Result<(), JailError> {
    // SAFETY: umount2 of a fixed path.
    sys(
        unsafe { libc::umount2(c"/proc".as_ptr(), libc::MNT_DETACH) },
        || "umount /proc".into(),
    )?;
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount(
        None,
        Path::new("/proc"),
        Some("proc"),
        flags,
        Some("subset=pid"),
    )
    .or_else(|_| mount_proc())
}
