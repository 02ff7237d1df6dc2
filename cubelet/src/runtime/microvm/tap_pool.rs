//! Persistent tap interfaces for microVM sandboxes, created ahead of time.
//!
//! A tap is created persistent (`TUNSETPERSIST`) so that the shim can attach to it by name
//! (fds are not passed over the shim's socket) and so that it outlives the fd that made it.
//! Every tap this node made is recorded as a marker file in its own directory, so that after
//! a crash the node deletes its leftovers and never touches taps of other cubelets on the
//! same host.
//!
//! A pooled tap belongs to root (`TUNSETOWNER 0`): a tap without an owner may be attached by
//! any user, so a jailed shim (its own unprivileged uid) could otherwise take a tap meant for
//! another sandbox. [`set_owner`] hands it to the shim it is assigned to.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("tap {name}: {what}: {source}")]
    Io {
        name: String,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("invalid tap name {0:?}")]
    BadName(String),
}

/// Prefix of the taps cubelet creates (`cbt` + 12 hex digits = 15 bytes, the kernel's limit).
pub const PREFIX: &str = "cbt";

fn ifreq(name: &str, flags: i32) -> Result<libc::ifreq, TapError> {
    if name.is_empty() || name.len() > 15 || !name.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(TapError::BadName(name.into()));
    }
    // SAFETY: ifreq is plain data; zeroed is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (i, b) in name.bytes().enumerate() {
        ifr.ifr_name[i] = b as libc::c_char;
    }
    ifr.ifr_ifru.ifru_flags = flags as libc::c_short;
    Ok(ifr)
}

/// `ioctl` with an integer argument; the error names the request.
fn ioctl_int(
    fd: libc::c_int,
    req: libc::c_ulong,
    what: &'static str,
    arg: libc::c_ulong,
) -> Result<(), (&'static str, std::io::Error)> {
    // SAFETY: a tun request that takes an integer, on a tun fd the caller owns.
    if unsafe { libc::ioctl(fd, req as _, arg) } < 0 {
        return Err((what, std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Attaches to (creating if needed) tap `name` and sets its persistence (and, when
/// persisting, its owner: root until [`set_owner`]).
fn set_persist(name: &str, persist: bool) -> Result<(), TapError> {
    attach_and(name, |fd| {
        if persist {
            ioctl_int(fd, libc::TUNSETOWNER as _, "TUNSETOWNER", 0)?;
        }
        ioctl_int(
            fd,
            libc::TUNSETPERSIST as _,
            "TUNSETPERSIST",
            u64::from(persist),
        )
    })
}

/// Hands persistent tap `name` to `uid` (the jailed shim it is assigned to): only that uid (or
/// root) may attach to it from then on.
pub fn set_owner(name: &str, uid: u32) -> Result<(), TapError> {
    attach_and(name, |fd| {
        ioctl_int(fd, libc::TUNSETOWNER as _, "TUNSETOWNER", u64::from(uid))
    })
}

/// Attaches to tap `name` (creating it if missing) and runs `f` on the attached fd.
fn attach_and(
    name: &str,
    f: impl FnOnce(libc::c_int) -> Result<(), (&'static str, std::io::Error)>,
) -> Result<(), TapError> {
    let io = |what| {
        move |e| TapError::Io {
            name: name.into(),
            what,
            source: e,
        }
    };
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(io("open /dev/net/tun"))?;
    // A single-queue tap takes one attachment at a time, and the kernel may still be tearing
    // down the previous one (ours, closed just before) under load: EBUSY is retried briefly.
    let mut tries = 0;
    loop {
        let mut ifr = ifreq(name, libc::IFF_TAP | libc::IFF_NO_PI)?;
        // SAFETY: TUNSETIFF on a tun fd we own, with a valid ifreq.
        if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF as _, &mut ifr) } >= 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        tries += 1;
        if e.raw_os_error() != Some(libc::EBUSY) || tries >= 40 {
            return Err(io("TUNSETIFF")(e));
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    f(tun.as_raw_fd()).map_err(|(what, e)| io(what)(e))
}

/// Whether interface `name` exists in this network namespace.
pub fn exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// The pool. `take` hands out a pre-created tap or creates one now.
pub struct TapPool {
    marker_dir: PathBuf,
    ready: Mutex<Vec<String>>,
}

impl TapPool {
    pub fn new(marker_dir: &Path) -> std::io::Result<TapPool> {
        std::fs::create_dir_all(marker_dir)?;
        Ok(TapPool {
            marker_dir: marker_dir.to_path_buf(),
            ready: Mutex::new(Vec::new()),
        })
    }

    /// Creates a new persistent tap and records it.
    pub fn create(&self) -> Result<String, TapError> {
        let mut b = [0u8; 6];
        // SAFETY: getrandom into a local buffer.
        unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, b.len(), 0) };
        let name = format!("{PREFIX}{}", crate::state::hex(&b));
        // Marker first: a crash right after creating the tap still finds it.
        std::fs::write(self.marker_dir.join(&name), b"").map_err(|e| TapError::Io {
            name: name.clone(),
            what: "write marker",
            source: e,
        })?;
        if let Err(e) = set_persist(&name, true) {
            let _ = std::fs::remove_file(self.marker_dir.join(&name));
            return Err(e);
        }
        Ok(name)
    }

    /// A tap for a sandbox.
    pub fn take(&self) -> Result<String, TapError> {
        let pooled = self.ready.lock().ok().and_then(|mut v| v.pop());
        match pooled {
            Some(t) => Ok(t),
            None => self.create(),
        }
    }

    pub fn level(&self) -> usize {
        self.ready.lock().map(|v| v.len()).unwrap_or(0)
    }

    /// Tops the pool up to `target`.
    pub fn refill(&self, target: usize) -> Result<(), TapError> {
        while self.level() < target {
            let t = self.create()?;
            if let Ok(mut v) = self.ready.lock() {
                v.push(t);
            }
        }
        Ok(())
    }

    /// Deletes tap `name` (idempotent) and its marker.
    pub fn delete(&self, name: &str) {
        if exists(name) {
            if let Err(e) = set_persist(name, false) {
                tracing::warn!(tap = name, error = %e, "deleting tap");
            }
        }
        let _ = std::fs::remove_file(self.marker_dir.join(name));
    }

    /// Deletes every tap this node recorded except `keep` (after a restart), and empties the pool.
    pub fn reap_except(&self, keep: &[String]) {
        let pooled: Vec<String> = self
            .ready
            .lock()
            .map(|mut v| v.drain(..).collect())
            .unwrap_or_default();
        for t in pooled {
            self.delete(&t);
        }
        let Ok(rd) = std::fs::read_dir(&self.marker_dir) else {
            return;
        };
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if !keep.contains(&n) {
                tracing::info!(tap = %n, "deleting leftover tap");
                self.delete(&n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(ifreq("", 0).is_err());
        assert!(ifreq("a/b", 0).is_err());
        assert!(ifreq("0123456789abcdef", 0).is_err());
        assert!(ifreq("cbt0123456789ab", 0).is_ok());
    }

    #[test]
    fn taps_are_created_persistent_and_deleted() {
        cube_testkit::require_priv!("tap_pool_create_delete");
        let d = tempfile::tempdir().unwrap();
        let p = TapPool::new(d.path()).unwrap();
        p.refill(2).unwrap();
        assert_eq!(p.level(), 2);
        let t = p.take().unwrap();
        assert!(exists(&t), "{t} exists");
        assert!(d.path().join(&t).exists(), "marker for {t}");
        // Pooled taps belong to root; assigned ones to their shim's uid.
        let owner = || std::fs::read_to_string(format!("/sys/class/net/{t}/owner")).unwrap();
        assert_eq!(owner().trim(), "0");
        set_owner(&t, 1_100_000_123).unwrap();
        assert_eq!(owner().trim(), "1100000123");
        // The other pooled tap and `t` are both reaped when nothing keeps them.
        p.reap_except(&[]);
        assert!(!exists(&t));
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
        p.delete(&t); // idempotent
    }
}
