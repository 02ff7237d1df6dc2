//! Directory watching with inotify, for `WatchDir` and the polling watcher RPCs.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::io::unix::AsyncFd;

/// Most events a polling watcher keeps between two `GetWatcherEvents` calls.
pub const MAX_BUFFERED_EVENTS: usize = 10_000;

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MOVED_TO
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_DELETE_SELF
    | libc::IN_MOVED_FROM
    | libc::IN_MOVE_SELF
    | libc::IN_ATTRIB;

/// One filesystem event, with the name relative to the watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsEvent {
    pub name: String,
    pub kind: &'static str,
    pub path: PathBuf,
}

/// Maps an inotify mask to envd's (fsnotify's) event type.
pub fn event_kind(mask: u32) -> Option<&'static str> {
    if mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
        Some("EVENT_TYPE_CREATE")
    } else if mask & libc::IN_MODIFY != 0 {
        Some("EVENT_TYPE_WRITE")
    } else if mask & (libc::IN_DELETE | libc::IN_DELETE_SELF) != 0 {
        Some("EVENT_TYPE_REMOVE")
    } else if mask & (libc::IN_MOVED_FROM | libc::IN_MOVE_SELF) != 0 {
        Some("EVENT_TYPE_RENAME")
    } else if mask & libc::IN_ATTRIB != 0 {
        Some("EVENT_TYPE_CHMOD")
    } else {
        None
    }
}

/// An inotify instance before it is attached to the runtime (created on a blocking thread with
/// the user's rights, so the user can only watch what they may read).
pub struct RawWatch {
    fd: OwnedFd,
    wds: HashMap<i32, PathBuf>,
    root: PathBuf,
    recursive: bool,
}

fn add_watch(fd: i32, p: &Path) -> std::io::Result<i32> {
    let c = CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains NUL"))?;
    // SAFETY: valid fd and C string.
    let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), MASK | libc::IN_ONLYDIR) };
    if wd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(wd)
}

fn add_tree(fd: i32, root: &Path, dir: &Path, wds: &mut HashMap<i32, PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            let p = e.path();
            if let Ok(wd) = add_watch(fd, &p) {
                wds.insert(wd, p.strip_prefix(root).unwrap_or(&p).to_path_buf());
                add_tree(fd, root, &p, wds);
            }
        }
    }
}

impl RawWatch {
    pub fn new(root: &Path, recursive: bool) -> std::io::Result<Self> {
        // SAFETY: inotify_init1 returns a new fd or -1.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut wds = HashMap::new();
        let wd = add_watch(fd.as_raw_fd(), root)?;
        wds.insert(wd, PathBuf::new());
        if recursive {
            add_tree(fd.as_raw_fd(), root, root, &mut wds);
        }
        Ok(RawWatch {
            fd,
            wds,
            root: root.to_path_buf(),
            recursive,
        })
    }

    /// Attaches to the runtime. Must be called inside it.
    pub fn attach(self) -> std::io::Result<Watch> {
        // SAFETY: the OwnedFd is moved into the AsyncFd and stays open for its lifetime.
        let fd = unsafe { AsyncFd::register(self.fd) }.map_err(std::io::Error::from)?;
        Ok(Watch {
            fd,
            wds: self.wds,
            root: self.root,
            recursive: self.recursive,
        })
    }
}

/// A live watch.
pub struct Watch {
    fd: AsyncFd<OwnedFd>,
    wds: HashMap<i32, PathBuf>,
    root: PathBuf,
    recursive: bool,
}

impl Watch {
    /// Waits for and returns the next batch of events. `Ok(empty)` never happens; an error or
    /// the watched directory going away ends the watch (`Ok(None)`).
    pub async fn next_batch(&mut self) -> std::io::Result<Option<Vec<FsEvent>>> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if self.wds.is_empty() {
                return Ok(None);
            }
            let mut guard = self.fd.readable().await?;
            let n = match guard.try_io(|inner| {
                // SAFETY: reading into a valid buffer.
                let n =
                    unsafe { libc::read(inner.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            }) {
                Ok(r) => r?,
                Err(_would_block) => continue,
            };
            let events = self.parse(&buf[..n]);
            if !events.is_empty() {
                return Ok(Some(events));
            }
        }
    }

    fn parse(&mut self, data: &[u8]) -> Vec<FsEvent> {
        let hdr = std::mem::size_of::<libc::inotify_event>();
        let mut out = Vec::new();
        let mut off = 0;
        while off + hdr <= data.len() {
            // SAFETY: bounds checked above; read_unaligned copes with alignment.
            let ev: libc::inotify_event =
                unsafe { std::ptr::read_unaligned(data[off..].as_ptr().cast()) };
            let name_end = (off + hdr + ev.len as usize).min(data.len());
            let raw_name = &data[off + hdr..name_end];
            let name = raw_name.split(|b| *b == 0).next().unwrap_or(&[]);
            let name = String::from_utf8_lossy(name).into_owned();
            off = name_end;
            if ev.mask & libc::IN_IGNORED != 0 {
                self.wds.remove(&ev.wd);
                continue;
            }
            let Some(rel_dir) = self.wds.get(&ev.wd).cloned() else {
                continue;
            };
            let rel = if name.is_empty() {
                rel_dir.clone()
            } else {
                rel_dir.join(&name)
            };
            let full = self.root.join(&rel);
            if self.recursive
                && ev.mask & libc::IN_ISDIR != 0
                && ev.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0
            {
                if let Ok(wd) = add_watch(self.fd.get_ref().as_raw_fd(), &full) {
                    self.wds.insert(wd, rel.clone());
                    let mut more = HashMap::new();
                    add_tree(self.fd.get_ref().as_raw_fd(), &self.root, &full, &mut more);
                    self.wds.extend(more);
                }
            }
            // Events on the watched directory itself are reported with an empty name, as
            // subdirectory self-events duplicate their parent's and are skipped.
            if name.is_empty() && !rel_dir.as_os_str().is_empty() {
                continue;
            }
            if let Some(kind) = event_kind(ev.mask) {
                out.push(FsEvent {
                    name: rel.display().to_string(),
                    kind,
                    path: full,
                });
            }
        }
        out
    }
}

/// A watcher created by `CreateWatcher`, polled by `GetWatcherEvents`.
pub struct PolledWatcher {
    pub events: Mutex<Vec<serde_json::Value>>,
    pub task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// All polling watchers by id.
#[derive(Default)]
pub struct WatcherRegistry {
    map: Mutex<HashMap<String, Arc<PolledWatcher>>>,
}

impl WatcherRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&self, id: String, w: Arc<PolledWatcher>) {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, w);
    }

    pub fn get(&self, id: &str) -> Option<Arc<PolledWatcher>> {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    pub fn remove(&self, id: &str) -> Option<Arc<PolledWatcher>> {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id)
    }
}

/// Filesystem magic numbers of network filesystems (statfs `f_type`).
const NETWORK_FS: &[i64] = &[
    0x6969,               // NFS
    0x517B,               // SMB
    0xFF534D42u32 as i64, // CIFS
    0xFE534D42u32 as i64, // SMB2
    0x5346_414F,          // AFS
    0x00C3_6400,          // CEPH
];

/// Whether `p` lives on a network filesystem.
pub fn is_network_mount(p: &Path) -> std::io::Result<bool> {
    let c = CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains NUL"))?;
    // SAFETY: statfs fills a zeroed struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(NETWORK_FS.contains(&(st.f_type as i64)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds() {
        assert_eq!(event_kind(libc::IN_CREATE), Some("EVENT_TYPE_CREATE"));
        assert_eq!(event_kind(libc::IN_MODIFY), Some("EVENT_TYPE_WRITE"));
        assert_eq!(event_kind(libc::IN_DELETE), Some("EVENT_TYPE_REMOVE"));
        assert_eq!(event_kind(libc::IN_MOVED_FROM), Some("EVENT_TYPE_RENAME"));
        assert_eq!(event_kind(libc::IN_ATTRIB), Some("EVENT_TYPE_CHMOD"));
        assert_eq!(event_kind(libc::IN_OPEN), None);
    }

    #[test]
    fn tmp_is_not_network() {
        assert!(!is_network_mount(Path::new("/tmp")).unwrap());
    }
}
