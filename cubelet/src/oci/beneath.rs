//! Filesystem operations confined beneath a directory. Image content is hostile: a lower layer
//! may plant `x -> /` and an upper one then names `x/...`. Every path here is walked from the
//! root's directory fd with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`, so no symlink in
//! a parent component is ever followed, and the final step is an `*at` call on the parent fd
//! that does not follow the last component either.

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// A path beneath the root made only of normal components (no `..`, no `/`, no `.`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RelPath {
    parts: Vec<OsString>,
}

/// Why a path from an archive is not acceptable.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PathError {
    /// Contains a `..` component.
    ParentDir,
    /// Absolute (starts with `/`).
    Absolute,
}

impl RelPath {
    /// Parses an archive path. `.` components and repeated slashes are dropped; a leading `/`
    /// is kept as an error only when `allow_absolute` is false (layer entry names are
    /// normalised beneath the root like docker does; hard-link targets are not).
    pub(crate) fn parse(p: &Path, allow_absolute: bool) -> Result<RelPath, PathError> {
        let mut parts = Vec::new();
        for c in p.components() {
            match c {
                Component::Normal(x) => parts.push(x.to_os_string()),
                Component::CurDir => {}
                Component::RootDir if allow_absolute => {}
                Component::RootDir | Component::Prefix(_) => return Err(PathError::Absolute),
                Component::ParentDir => return Err(PathError::ParentDir),
            }
        }
        Ok(RelPath { parts })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The last component, if any.
    pub(crate) fn name(&self) -> Option<&OsStr> {
        self.parts.last().map(|s| s.as_os_str())
    }

    /// Everything but the last component.
    pub(crate) fn parent(&self) -> RelPath {
        let n = self.parts.len().saturating_sub(1);
        RelPath {
            parts: self.parts[..n].to_vec(),
        }
    }

    pub(crate) fn to_path(&self) -> PathBuf {
        self.parts.iter().collect()
    }
}

impl std::fmt::Display for RelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.to_path().display())
    }
}

/// Turns an errno from a confined walk into an error that says what was wrong with the path.
pub(crate) fn walk_error(e: Errno, what: &str) -> io::Error {
    let msg = match e {
        Errno::LOOP => format!("{what}: path goes through a symlink"),
        Errno::NOTDIR => format!("{what}: path goes through a non-directory"),
        Errno::XDEV => format!("{what}: path escapes the root"),
        e => format!("{what}: {}", io::Error::from(e)),
    };
    io::Error::new(io::Error::from(e).kind(), msg)
}

/// Set once `openat2` turned out to be missing (kernel < 5.6 or a seccomp filter); the walk
/// then opens one normal component at a time with `O_NOFOLLOW`, which confines it equally
/// because a [`RelPath`] has no `..` and no `/` in a component.
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

fn openat2_beneath(dir: BorrowedFd<'_>, path: &Path, flags: OFlags) -> Result<OwnedFd, Errno> {
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    loop {
        match rustix::fs::openat2(dir, path, flags, Mode::empty(), resolve) {
            // The kernel asks for a retry when a concurrent rename raced the walk.
            Err(Errno::AGAIN) => continue,
            r => return r,
        }
    }
}

/// Opens the directory `name` (one normal component) in `dir` without following a symlink.
fn step(dir: BorrowedFd<'_>, name: &OsStr) -> Result<OwnedFd, Errno> {
    if !NO_OPENAT2.load(Ordering::Relaxed) {
        match openat2_beneath(dir, Path::new(name), DIR_FLAGS) {
            Err(Errno::NOSYS) => NO_OPENAT2.store(true, Ordering::Relaxed),
            r => return r,
        }
    }
    rustix::fs::openat(dir, name, DIR_FLAGS, Mode::empty())
}

/// The unpack root, as a directory fd.
pub(crate) struct Root {
    fd: OwnedFd,
}

impl Root {
    /// Opens `path`, a directory cubelet created itself (the root is trusted; what is put
    /// beneath it is not).
    pub(crate) fn open(path: &Path) -> io::Result<Root> {
        let fd = rustix::fs::open(path, DIR_FLAGS, Mode::empty()).map_err(|e| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!("opening {}: {}", path.display(), io::Error::from(e)),
            )
        })?;
        Ok(Root { fd })
    }

    /// Opens directory `rel` beneath the root, following no symlink on the way.
    pub(crate) fn open_dir(&self, rel: &RelPath) -> Result<OwnedFd, Errno> {
        if !NO_OPENAT2.load(Ordering::Relaxed) {
            let p = if rel.is_empty() {
                PathBuf::from(".")
            } else {
                rel.to_path()
            };
            match openat2_beneath(self.fd.as_fd(), &p, DIR_FLAGS) {
                Err(Errno::NOSYS) => NO_OPENAT2.store(true, Ordering::Relaxed),
                r => return r,
            }
        }
        let mut cur = step(self.fd.as_fd(), OsStr::new("."))?;
        for part in &rel.parts {
            cur = step(cur.as_fd(), part)?;
        }
        Ok(cur)
    }

    /// Says why walking to `rel` failed with `e`: which component is a symlink or not a
    /// directory (the kernel reports either as ELOOP or ENOTDIR depending on the flags).
    pub(crate) fn explain(&self, rel: &RelPath, e: Errno) -> String {
        if matches!(e, Errno::LOOP | Errno::NOTDIR) {
            let mut cur = match step(self.fd.as_fd(), OsStr::new(".")) {
                Ok(fd) => fd,
                Err(e) => return io::Error::from(e).to_string(),
            };
            let mut seen = PathBuf::new();
            for part in &rel.parts {
                seen.push(part);
                match lstat_type(cur.as_fd(), part) {
                    Ok(Some(FileType::Symlink)) => {
                        return format!("{} is a symlink; not following it", seen.display())
                    }
                    Ok(Some(FileType::Directory)) => {}
                    Ok(Some(_)) => return format!("{} is not a directory", seen.display()),
                    _ => break,
                }
                match step(cur.as_fd(), part) {
                    Ok(fd) => cur = fd,
                    Err(_) => break,
                }
            }
        }
        walk_error(e, "walking").to_string()
    }

    /// Like [`Root::open_dir`], creating missing directories (mode 0755, owned by root, as
    /// docker does for parents an archive does not list).
    pub(crate) fn create_dirs(&self, rel: &RelPath) -> Result<OwnedFd, Errno> {
        match self.open_dir(rel) {
            Err(Errno::NOENT) => {}
            r => return r,
        }
        let mut cur = step(self.fd.as_fd(), OsStr::new("."))?;
        for part in &rel.parts {
            cur = match step(cur.as_fd(), part) {
                Err(Errno::NOENT) => {
                    match rustix::fs::mkdirat(
                        cur.as_fd(),
                        part.as_os_str(),
                        Mode::from_bits_truncate(0o755),
                    ) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(e),
                    }
                    step(cur.as_fd(), part)?
                }
                r => r?,
            };
        }
        Ok(cur)
    }
}

/// The type of `name` in `dir` (not following a symlink), or None when absent.
pub(crate) fn lstat_type(dir: BorrowedFd<'_>, name: &OsStr) -> Result<Option<FileType>, Errno> {
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(FileType::from_raw_mode(st.st_mode))),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Removes `name` from `dir`, a directory recursively; symlinks are removed, never followed.
/// Absent is fine.
pub(crate) fn remove_all_at(dir: BorrowedFd<'_>, name: &OsStr) -> Result<(), Errno> {
    match lstat_type(dir, name)? {
        None => Ok(()),
        Some(FileType::Directory) => {
            let sub = step(dir, name)?;
            clear_dir(sub.as_fd())?;
            rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR)
        }
        Some(_) => match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
            Err(Errno::NOENT) => Ok(()),
            r => r,
        },
    }
}

/// Removes everything inside `dir`, keeping `dir` itself.
pub(crate) fn clear_dir(dir: BorrowedFd<'_>) -> Result<(), Errno> {
    // Names are collected first so the directory stream is closed before recursing: one fd
    // per level of depth, not two.
    let mut names = Vec::new();
    for ent in Dir::read_from(dir)? {
        let ent = ent?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(OsStr::from_bytes(n).to_os_string());
        }
    }
    for n in names {
        remove_all_at(dir, &n)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relpath_parsing() {
        let p = RelPath::parse(Path::new("./a//b/./c"), false).unwrap();
        assert_eq!(p.to_path(), Path::new("a/b/c"));
        assert_eq!(p.name(), Some(OsStr::new("c")));
        assert_eq!(p.parent().to_path(), Path::new("a/b"));
        assert_eq!(
            RelPath::parse(Path::new("a/../b"), true),
            Err(PathError::ParentDir)
        );
        assert_eq!(
            RelPath::parse(Path::new("/etc/passwd"), false),
            Err(PathError::Absolute)
        );
        assert_eq!(
            RelPath::parse(Path::new("/etc/passwd"), true)
                .unwrap()
                .to_path(),
            Path::new("etc/passwd")
        );
        assert!(RelPath::parse(Path::new("./"), false).unwrap().is_empty());
    }

    #[test]
    fn walk_refuses_symlinks_and_fallback_agrees() {
        let d = tempfile::tempdir().unwrap();
        let root_p = d.path().join("root");
        let canary = d.path().join("canary");
        std::fs::create_dir_all(root_p.join("real/sub")).unwrap();
        std::fs::create_dir_all(&canary).unwrap();
        std::os::unix::fs::symlink(&canary, root_p.join("x")).unwrap();
        std::os::unix::fs::symlink("real", root_p.join("inner")).unwrap();
        let root = Root::open(&root_p).unwrap();
        let rel = |s: &str| RelPath::parse(Path::new(s), false).unwrap();
        assert!(root.open_dir(&rel("real/sub")).is_ok());
        // Even a symlink that stays inside the root is not followed.
        assert_eq!(root.open_dir(&rel("inner/sub")).err(), Some(Errno::LOOP));
        // A symlink as the last component reads as ENOTDIR (O_DIRECTORY) or ELOOP.
        let refused = |r: Result<OwnedFd, Errno>| matches!(r, Err(Errno::LOOP | Errno::NOTDIR));
        assert!(refused(root.open_dir(&rel("x"))));
        assert!(refused(root.create_dirs(&rel("x/new"))));
        assert!(!canary.join("new").exists());
        // The per-component walk gives the same answers.
        let fd = step(root.fd.as_fd(), OsStr::new("real")).unwrap();
        assert!(step(fd.as_fd(), OsStr::new("sub")).is_ok());
        let e = rustix::fs::openat(root.fd.as_fd(), "x", DIR_FLAGS, Mode::empty()).err();
        assert!(matches!(e, Some(Errno::LOOP | Errno::NOTDIR)), "{e:?}");
        assert_eq!(
            root.explain(&rel("inner/sub"), Errno::NOTDIR),
            "inner is a symlink; not following it"
        );
    }
}
