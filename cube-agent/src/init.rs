//! PID-1 duties: mounts, hostname, network, and what an init from the node sets system-wide
//! (clock, entropy, resolver). Zombie reaping lives in `reaper`.

use crate::config::Config;
use crate::mountinfo;
use std::ffi::CString;
use std::path::Path;
use std::time::{Duration, SystemTime};

/// Clock drift beyond which an init sets the clock.
const MAX_CLOCK_DRIFT: Duration = Duration::from_secs(1);
/// Largest entropy seed taken (the kernel caps a single add anyway).
pub const MAX_ENTROPY_BYTES: usize = 4096;

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

pub const RESOLV_CONF: &str = "/etc/resolv.conf";

/// Replaces `path` with one `nameserver` line per address (atomically: a temporary file renamed
/// over it, so a symlink the template had there is replaced, not followed).
pub fn write_resolv_conf(path: &Path, nameservers: &[String]) -> Result<(), String> {
    let mut text = String::from("# written by cube-agent at init\n");
    for n in nameservers {
        let ip: std::net::IpAddr = n
            .parse()
            .map_err(|_| format!("nameserver {n:?} is not an IP address"))?;
        text.push_str(&format!("nameserver {ip}\n"));
    }
    let tmp = path.with_extension("cube-tmp");
    std::fs::write(&tmp, text)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| format!("writing {}: {e}", path.display()))
}

/// Sets the realtime clock when it drifted. Only as init: the same agent runs on developer hosts
/// and in the namespace runtime, where the clock is the host's and must not be touched.
pub fn set_clock_if_drifted(is_init: bool, t: SystemTime) {
    let now = SystemTime::now();
    let drift = now
        .duration_since(t)
        .or_else(|_| t.duration_since(now))
        .unwrap_or_default();
    if drift <= MAX_CLOCK_DRIFT {
        return;
    }
    if !is_init {
        tracing::info!(
            ?drift,
            "clock drifted, but not init: leaving the clock alone"
        );
        return;
    }
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let ts = libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as _,
    };
    // SAFETY: valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        tracing::warn!(
            "setting the clock failed: {}",
            std::io::Error::last_os_error()
        );
    } else {
        tracing::info!(?drift, "clock set from an init");
    }
}

/// Adds bytes to the kernel entropy pool and credits them (`RNDADDENTROPY`).
pub fn add_entropy(bytes: &[u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/random")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut buf = Vec::with_capacity(8 + bytes.len());
    buf.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    buf.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    buf.extend_from_slice(bytes);
    // Pad so the trailing u32 array is whole.
    while buf.len() % 4 != 0 {
        buf.push(0);
    }
    // SAFETY: the buffer holds a complete rand_pool_info.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, buf.as_ptr()) } != 0 {
        let e = std::io::Error::last_os_error();
        // Without CAP_SYS_ADMIN, still mix the bytes in (uncredited) by writing them.
        use std::io::Write;
        let mut f = f;
        f.write_all(bytes)?;
        return Err(e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_is_replaced_and_bad_addresses_refused() {
        let d = std::env::temp_dir().join(format!("cube-agent-resolv-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let target = d.join("elsewhere");
        std::fs::write(&target, "nameserver 127.0.0.53\n").unwrap();
        let p = d.join("resolv.conf");
        let _ = std::fs::remove_file(&p);
        std::os::unix::fs::symlink(&target, &p).unwrap();
        write_resolv_conf(&p, &["203.0.113.53".into(), "2001:db8::53".into()]).unwrap();
        let got = std::fs::read_to_string(&p).unwrap();
        assert!(
            got.contains("nameserver 203.0.113.53\nnameserver 2001:db8::53\n"),
            "{got}"
        );
        // The link was replaced, not followed.
        assert!(!std::fs::symlink_metadata(&p)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            std::fs::read_to_string(&target).unwrap(),
            "nameserver 127.0.0.53\n"
        );
        let e = write_resolv_conf(&p, &["8.8.8.8\nsearch evil".into()]).unwrap_err();
        assert!(e.contains("not an IP address"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
