//! PID-1 duties: mounts, hostname, network. Zombie reaping lives in `reaper`.

use crate::config::Config;
use crate::mountinfo;
use std::ffi::CString;

struct MountSpec {
    target: &'static str,
    fstype: &'static str,
    source: &'static str,
    flags: libc::c_ulong,
    data: &'static str,
    mode: u32,
}

const MOUNTS: &[MountSpec] = &[
    MountSpec {
        target: "/proc",
        fstype: "proc",
        source: "proc",
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        data: "",
        mode: 0o555,
    },
    MountSpec {
        target: "/sys",
        fstype: "sysfs",
        source: "sysfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        data: "",
        mode: 0o555,
    },
    MountSpec {
        target: "/dev",
        fstype: "devtmpfs",
        source: "devtmpfs",
        flags: libc::MS_NOSUID,
        data: "mode=0755",
        mode: 0o755,
    },
    MountSpec {
        target: "/dev/pts",
        fstype: "devpts",
        source: "devpts",
        flags: libc::MS_NOSUID | libc::MS_NOEXEC,
        data: "gid=5,mode=0620,ptmxmode=0666",
        mode: 0o755,
    },
    MountSpec {
        target: "/dev/shm",
        fstype: "tmpfs",
        source: "shm",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=1777",
        mode: 0o1777,
    },
    MountSpec {
        target: "/tmp",
        fstype: "tmpfs",
        source: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=1777",
        mode: 0o1777,
    },
    MountSpec {
        target: "/run",
        fstype: "tmpfs",
        source: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=0755",
        mode: 0o755,
    },
];

fn mount_one(m: &MountSpec) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let _ = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(m.mode)
        .create(m.target);
    let c = |s: &str| CString::new(s).map_err(|_| std::io::Error::other("NUL in mount spec"));
    let (src, tgt, fst, data) = (c(m.source)?, c(m.target)?, c(m.fstype)?, c(m.data)?);
    // SAFETY: valid C strings.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            fst.as_ptr(),
            m.flags,
            if m.data.is_empty() {
                std::ptr::null()
            } else {
                data.as_ptr().cast()
            },
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Mounts the standard filesystems that are not mounted yet.
pub fn mount_all() {
    for m in MOUNTS {
        // Re-read each time: /proc itself is the first mount.
        let table = std::fs::read_to_string("/proc/self/mountinfo")
            .map(|t| mountinfo::parse(&t))
            .unwrap_or_default();
        if mountinfo::is_mounted(&table, m.target) {
            tracing::debug!(target = m.target, "already mounted");
            continue;
        }
        match mount_one(m) {
            Ok(()) => tracing::info!(target = m.target, fstype = m.fstype, "mounted"),
            Err(e) => tracing::warn!(target = m.target, "mount failed: {e}"),
        }
    }
}

pub fn set_hostname(name: &str) {
    if name.is_empty() {
        return;
    }
    // SAFETY: valid buffer and length.
    if unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } != 0 {
        tracing::warn!(
            "sethostname({name}) failed: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Everything PID 1 does before serving. Never fails: problems are logged.
pub fn run(cfg: &Config) {
    mount_all();
    set_hostname(&cfg.hostname);
    crate::net::configure(&cfg.network);
}
