//! Applying one layer tarball onto a root directory, as host root, over the dir-fd API in
//! [`super::beneath`]: nothing is written, changed or deleted outside the root whatever the
//! archive holds (symlinks planted by lower layers, `..` names, absolute hard links).
//!
//! Decisions, matching docker where that is safe:
//! - A name with a `..` component is rejected (the import fails, naming the entry). A leading
//!   `/` is normalised beneath the root, as docker and the tar crate do.
//! - A symlink entry is created as is (its target text is never resolved here). A later entry
//!   whose parent path goes through a symlink fails the import; a whiteout through one is a
//!   no-op (there is no lower directory content there to hide, only the link).
//! - A hard link's target must be a relative path without `..`; it is resolved beneath the root
//!   without following symlinks.
//! - Character and block devices are skipped with a warning: they would give the sandbox a
//!   host device (say `/dev/sda`) in its root, and the sandbox runtime mounts its own `/dev`.
//!   FIFOs are harmless and are created.

use super::beneath::{self, lstat_type, remove_all_at, walk_error, PathError, RelPath, Root};
use rustix::fs::{AtFlags, FileType, Gid, Mode, OFlags, Timespec, Timestamps, Uid};
use rustix::io::Errno;
use std::ffi::OsStr;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Error for entry `entry` of archive `label`.
fn entry_err(label: &str, entry: &dyn std::fmt::Display, msg: impl std::fmt::Display) -> io::Error {
    bad(format!("layer {label}: entry {entry}: {msg}"))
}

fn errno_err(label: &str, entry: &dyn std::fmt::Display, what: &str, e: Errno) -> io::Error {
    let inner = walk_error(e, what);
    io::Error::new(
        inner.kind(),
        format!("layer {label}: entry {entry}: {inner}"),
    )
}

/// Whiteouts, applied before the layer's own content lands: `.wh.<name>` deletes `<name>`,
/// `.wh..wh..opq` empties its directory. Unsafe names are skipped here; the content pass
/// rejects them.
pub(crate) fn apply_whiteouts<R: Read>(root: &Root, archive: R, label: &str) -> io::Result<()> {
    let mut ar = tar::Archive::new(archive);
    for e in ar.entries()? {
        let e = e?;
        let raw = e.path()?.into_owned();
        let Ok(rel) = RelPath::parse(&raw, true) else {
            continue;
        };
        let Some(name) = rel.name().map(|n| n.as_bytes()) else {
            continue;
        };
        let opaque = name == b".wh..wh..opq";
        let target = match name.strip_prefix(b".wh.") {
            _ if opaque => None,
            // `.wh..wh.*` other than the opaque marker is aufs bookkeeping, not a whiteout.
            Some(t) if t.starts_with(b".wh.") => continue,
            // `.wh.`, `.wh..` and `.wh...` would name the directory itself or its parent.
            Some(t) if t.is_empty() || t == b"." || t == b".." => {
                return Err(entry_err(label, &raw.display(), "invalid whiteout name"));
            }
            Some(t) => Some(OsStr::from_bytes(t).to_os_string()),
            None => continue,
        };
        let parent = rel.parent();
        let dir = match root.open_dir(&parent) {
            Ok(fd) => fd,
            // Nothing below to hide.
            Err(Errno::NOENT) => continue,
            Err(e @ (Errno::LOOP | Errno::NOTDIR | Errno::XDEV)) => {
                tracing::warn!(
                    layer = label,
                    entry = %raw.display(),
                    "whiteout ignored: {}",
                    root.explain(&parent, e)
                );
                continue;
            }
            Err(e) => return Err(errno_err(label, &raw.display(), "opening parent", e)),
        };
        let res = match &target {
            None => beneath::clear_dir(dir.as_fd()),
            Some(t) => remove_all_at(dir.as_fd(), t),
        };
        res.map_err(|e| errno_err(label, &raw.display(), "applying whiteout", e))?;
    }
    Ok(())
}

/// Ownership, mode and mtime from a tar header.
struct Meta {
    uid: Uid,
    gid: Gid,
    mode: Mode,
    times: Timestamps,
}

impl Meta {
    fn from_header(h: &tar::Header) -> io::Result<Meta> {
        // -1 means "unchanged" to chown; anything else above u32 does not fit.
        let id = |v: u64, what: &str| -> io::Result<u32> {
            u32::try_from(v)
                .ok()
                .filter(|v| *v != u32::MAX)
                .ok_or_else(|| bad(format!("{what} {v} is out of range")))
        };
        let uid = Uid::from_raw(id(h.uid()?, "uid")?);
        let gid = Gid::from_raw(id(h.gid()?, "gid")?);
        let mode = Mode::from_bits_truncate(h.mode()? & 0o7777);
        // Like the tar crate cubelet used before: mtime 0 becomes 1 (some tools read 0 as
        // "unset"), and atime is set to the same value.
        let mtime = i64::try_from(h.mtime()?).unwrap_or(i64::MAX).max(1);
        let ts = Timespec {
            tv_sec: mtime,
            tv_nsec: 0,
        };
        Ok(Meta {
            uid,
            gid,
            mode,
            times: Timestamps {
                last_access: ts,
                last_modification: ts,
            },
        })
    }
}

/// Removes whatever is at `name` in `dir` unless it is a directory and `keep_dir`.
/// Returns whether a directory is (still) there.
/// The entry's owner, set on `name` itself (never through a link).
fn chown_entry(dir: BorrowedFd<'_>, name: &OsStr, meta: &Meta) -> Result<(), Errno> {
    rustix::fs::chownat(
        dir,
        name,
        Some(meta.uid),
        Some(meta.gid),
        AtFlags::SYMLINK_NOFOLLOW,
    )
}

fn clear_slot(dir: BorrowedFd<'_>, name: &OsStr, keep_dir: bool) -> Result<bool, Errno> {
    match lstat_type(dir, name)? {
        None => Ok(false),
        Some(FileType::Directory) if keep_dir => Ok(true),
        Some(_) => remove_all_at(dir, name).map(|()| false),
    }
}

/// Writes the layer's content (everything but whiteouts) beneath `root`.
pub(crate) fn apply_content<R: Read>(root: &Root, archive: R, label: &str) -> io::Result<()> {
    let mut ar = tar::Archive::new(archive);
    for e in ar.entries()? {
        let mut e = e?;
        let raw = e.path()?.into_owned();
        let shown_owned = raw.display().to_string();
        let shown: &str = &shown_owned;
        let rel = match RelPath::parse(&raw, true) {
            Ok(r) => r,
            Err(PathError::ParentDir) => {
                return Err(entry_err(
                    label,
                    &shown,
                    "path contains `..`; refusing to write outside the root",
                ));
            }
            Err(PathError::Absolute) => {
                return Err(entry_err(label, &shown, "unsupported path prefix"));
            }
        };
        // `./` or `/`: the root itself, which cubelet owns.
        let Some(name) = rel.name().map(|n| n.to_os_string()) else {
            continue;
        };
        if name.as_encoded_bytes().starts_with(b".wh.") {
            continue;
        }
        use tar::EntryType as T;
        let mut kind = e.header().entry_type();
        // Old (pre-ustar) archives mark directories only by a trailing slash, as the tar
        // crate's own unpacking honoured.
        if kind == T::Regular && e.header().as_ustar().is_none() && e.path_bytes().ends_with(b"/") {
            kind = T::Directory;
        }
        if matches!(
            kind,
            T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink
        ) {
            continue;
        }
        if matches!(kind, T::Char | T::Block) {
            tracing::warn!(
                layer = label,
                entry = %shown,
                "skipping device node: the sandbox gets its own /dev"
            );
            continue;
        }
        let meta = Meta::from_header(e.header()).map_err(|err| entry_err(label, &shown, err))?;
        let prel = rel.parent();
        let parent = root.create_dirs(&prel).map_err(|err| {
            io::Error::new(
                io::Error::from(err).kind(),
                format!("layer {label}: entry {shown}: {}", root.explain(&prel, err)),
            )
        })?;
        let pfd = parent.as_fd();
        let at = |what: &'static str| move |err: Errno| errno_err(label, &shown, what, err);
        match kind {
            T::Directory => {
                if !clear_slot(pfd, &name, true).map_err(at("replacing"))? {
                    rustix::fs::mkdirat(pfd, name.as_os_str(), Mode::from_bits_truncate(0o700))
                        .map_err(at("mkdir"))?;
                }
                let fd = rustix::fs::openat(
                    pfd,
                    name.as_os_str(),
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(at("opening directory"))?;
                // Owner first: chown clears set-id bits that chmod then restores.
                rustix::fs::fchown(&fd, Some(meta.uid), Some(meta.gid)).map_err(at("chown"))?;
                rustix::fs::fchmod(&fd, meta.mode).map_err(at("chmod"))?;
            }
            T::Symlink => {
                let target = e
                    .link_name()
                    .map_err(|err| entry_err(label, &shown, err))?
                    .filter(|t| !t.as_os_str().is_empty())
                    .ok_or_else(|| entry_err(label, &shown, "symlink without a target"))?
                    .into_owned();
                clear_slot(pfd, &name, false).map_err(at("replacing"))?;
                rustix::fs::symlinkat(target.as_os_str(), pfd, name.as_os_str())
                    .map_err(at("symlink"))?;
                chown_entry(pfd, &name, &meta).map_err(at("chown"))?;
                rustix::fs::utimensat(
                    pfd,
                    name.as_os_str(),
                    &meta.times,
                    AtFlags::SYMLINK_NOFOLLOW,
                )
                .map_err(at("setting mtime"))?;
            }
            T::Link => {
                let target = e
                    .link_name()
                    .map_err(|err| entry_err(label, &shown, err))?
                    .ok_or_else(|| entry_err(label, &shown, "hard link without a target"))?
                    .into_owned();
                let trel = RelPath::parse(&target, false).map_err(|err| {
                    entry_err(
                        label,
                        &shown,
                        format!(
                            "hard link target {} is {}; it must name a file inside the image",
                            target.display(),
                            match err {
                                PathError::Absolute => "absolute",
                                PathError::ParentDir => "outside the root (`..`)",
                            }
                        ),
                    )
                })?;
                let tname = trel
                    .name()
                    .ok_or_else(|| entry_err(label, &shown, "hard link to the root"))?;
                if trel == rel {
                    continue;
                }
                let tparent = trel.parent();
                let tdir = root.open_dir(&tparent).map_err(|err| {
                    entry_err(
                        label,
                        &shown,
                        format!("hard link target {}: {}", trel, root.explain(&tparent, err)),
                    )
                })?;
                clear_slot(pfd, &name, false).map_err(at("replacing"))?;
                // No AT_SYMLINK_FOLLOW: a link to a symlink links the symlink itself.
                rustix::fs::linkat(&tdir, tname, pfd, name.as_os_str(), AtFlags::empty())
                    .map_err(at("hard link"))?;
            }
            T::Fifo => {
                clear_slot(pfd, &name, false).map_err(at("replacing"))?;
                rustix::fs::mknodat(pfd, name.as_os_str(), FileType::Fifo, meta.mode, 0)
                    .map_err(at("mkfifo"))?;
                chown_entry(pfd, &name, &meta).map_err(at("chown"))?;
                // mknod applies the umask; the entry we just made is not a symlink.
                rustix::fs::chmodat(pfd, name.as_os_str(), meta.mode, AtFlags::empty())
                    .map_err(at("chmod"))?;
            }
            // Regular, contiguous, sparse, and (as POSIX asks) unknown types: a regular file.
            _ => {
                clear_slot(pfd, &name, false).map_err(at("replacing"))?;
                let fd = rustix::fs::openat(
                    pfd,
                    name.as_os_str(),
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .map_err(at("create"))?;
                let mut f = std::fs::File::from(fd);
                io::copy(&mut e, &mut f)
                    .map_err(|err| entry_err(label, &shown, format!("writing: {err}")))?;
                rustix::fs::fchown(&f, Some(meta.uid), Some(meta.gid)).map_err(at("chown"))?;
                rustix::fs::fchmod(&f, meta.mode).map_err(at("chmod"))?;
                rustix::fs::futimens(&f, &meta.times).map_err(at("setting mtime"))?;
            }
        }
    }
    Ok(())
}

/// Applies one layer file onto `root`.
pub fn apply_layer(layer: &Path, root: &Path) -> io::Result<()> {
    let r = Root::open(root)?;
    let label = layer.display().to_string();
    apply_whiteouts(&r, super::open_layer(layer)?, &label)?;
    apply_content(&r, super::open_layer(layer)?, &label)
}

/// Unpacks a plain archive (a `docker save` tarball) beneath `dir`, with the same confinement.
pub(crate) fn extract_archive<R: Read>(archive: R, dir: &Path, label: &str) -> io::Result<()> {
    apply_content(&Root::open(dir)?, archive, label)
}

#[cfg(test)]
mod tests {
    //! Crafted, hostile layers. Every escape target is a "canary" directory in a temp dir next
    //! to the root, never a real host path.
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
    use std::path::PathBuf;

    enum Ent<'a> {
        File(&'a str, &'a [u8]),
        Dir(&'a str),
        Sym(&'a str, &'a str),
        Hard(&'a str, &'a str),
        Dev(&'a str, tar::EntryType),
        Fifo(&'a str),
    }

    /// A tar with the names written straight into the header, so `..` and `/` get through
    /// (the tar crate's builder refuses them).
    fn tarball(ents: &[Ent]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for ent in ents {
            let mut h = tar::Header::new_gnu();
            let (name, link, kind, data): (&str, &str, _, &[u8]) = match ent {
                Ent::File(n, d) => (n, "", tar::EntryType::Regular, d),
                Ent::Dir(n) => (n, "", tar::EntryType::Directory, b""),
                Ent::Sym(n, t) => (n, t, tar::EntryType::Symlink, b""),
                Ent::Hard(n, t) => (n, t, tar::EntryType::Link, b""),
                Ent::Dev(n, k) => (n, "", *k, b""),
                Ent::Fifo(n) => (n, "", tar::EntryType::Fifo, b""),
            };
            let g = h.as_gnu_mut().unwrap();
            g.name[..name.len()].copy_from_slice(name.as_bytes());
            g.linkname[..link.len()].copy_from_slice(link.as_bytes());
            h.set_entry_type(kind);
            if matches!(ent, Ent::Dev(..)) {
                h.set_device_major(8).unwrap();
                h.set_device_minor(0).unwrap();
            }
            h.set_size(data.len() as u64);
            h.set_mode(if matches!(ent, Ent::Dir(_)) {
                0o755
            } else {
                0o644
            });
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1_600_000_000);
            h.set_cksum();
            b.append(&h, data).unwrap();
        }
        b.into_inner().unwrap()
    }

    struct Fx {
        _d: tempfile::TempDir,
        base: PathBuf,
        root: PathBuf,
        canary: PathBuf,
        n: usize,
    }

    impl Fx {
        fn new() -> Fx {
            let d = tempfile::tempdir().unwrap();
            let base = d.path().to_path_buf();
            let root = base.join("root");
            let canary = base.join("canary");
            std::fs::create_dir_all(&root).unwrap();
            std::fs::create_dir_all(canary.join("evil")).unwrap();
            std::fs::write(canary.join("keep"), b"k").unwrap();
            std::fs::write(canary.join("y"), b"y").unwrap();
            std::fs::write(canary.join("evil/inner"), b"i").unwrap();
            std::fs::write(canary.join("outside-file"), b"o").unwrap();
            Fx {
                _d: d,
                base,
                root,
                canary,
                n: 0,
            }
        }

        fn canary(&self) -> String {
            self.canary.display().to_string()
        }

        fn apply(&mut self, ents: &[Ent]) -> io::Result<()> {
            self.n += 1;
            let p = self.base.join(format!("layer{}.tar", self.n));
            std::fs::write(&p, tarball(ents)).unwrap();
            apply_layer(&p, &self.root)
        }

        /// The canary and the temp dir around the root are exactly as set up.
        fn assert_untouched(&self) {
            let c = &self.canary;
            assert_eq!(std::fs::read(c.join("keep")).unwrap(), b"k");
            assert_eq!(std::fs::read(c.join("y")).unwrap(), b"y");
            assert_eq!(std::fs::read(c.join("evil/inner")).unwrap(), b"i");
            assert_eq!(std::fs::read(c.join("outside-file")).unwrap(), b"o");
            assert_eq!(
                std::fs::metadata(c.join("outside-file")).unwrap().nlink(),
                1
            );
            let mut names: Vec<_> = std::fs::read_dir(c)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            names.sort();
            assert_eq!(names, ["evil", "keep", "outside-file", "y"]);
            let mut around: Vec<_> = std::fs::read_dir(&self.base)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| !n.starts_with("layer"))
                .collect();
            around.sort();
            assert_eq!(around, ["canary", "root"]);
        }
    }

    fn escapes(fx: &Fx) -> Vec<String> {
        vec![
            fx.canary(),
            "../canary".into(),
            // `..` past `/` stays at `/`: this is the `x -> ../../..` escape, aimed at the canary.
            format!("../../../../../../../../../../..{}", fx.canary()),
        ]
    }

    #[test]
    fn opaque_whiteout_through_a_symlink_deletes_nothing_outside() {
        for i in 0..3 {
            let mut fx = Fx::new();
            let target = escapes(&fx)[i].clone();
            fx.apply(&[Ent::Sym("x", &target)]).unwrap();
            let _ = fx.apply(&[Ent::File("x/.wh..wh..opq", b"")]);
            fx.assert_untouched();
            assert!(std::fs::symlink_metadata(fx.root.join("x"))
                .unwrap()
                .file_type()
                .is_symlink());
            // A layer that turns `x` into a real directory still works.
            fx.apply(&[
                Ent::Dir("x"),
                Ent::File("x/.wh..wh..opq", b""),
                Ent::File("x/new", b"n"),
            ])
            .unwrap();
            assert_eq!(std::fs::read(fx.root.join("x/new")).unwrap(), b"n");
            assert!(std::fs::symlink_metadata(fx.root.join("x"))
                .unwrap()
                .is_dir());
            fx.assert_untouched();
        }
    }

    #[test]
    fn entry_through_a_symlink_fails_and_writes_nothing_outside() {
        let mut fx = Fx::new();
        let c = fx.canary();
        fx.apply(&[Ent::Sym("x", &c)]).unwrap();
        // canary/evil is a directory: the old code removed it to make room for the file.
        let err = fx.apply(&[Ent::File("x/evil", b"pwned")]).unwrap_err();
        assert!(err.to_string().contains("x/evil"), "{err}");
        assert!(err.to_string().contains("symlink"), "{err}");
        fx.assert_untouched();
        // Same with the link planted earlier in the same layer, and with a relative link.
        let err = fx
            .apply(&[Ent::Sym("z", "../canary"), Ent::File("z/new", b"pwned")])
            .unwrap_err();
        assert!(err.to_string().contains("z/new"), "{err}");
        let err = fx
            .apply(&[Ent::Sym("w", &c), Ent::Dir("w/sub")])
            .unwrap_err();
        assert!(err.to_string().contains("w/sub"), "{err}");
        fx.assert_untouched();
    }

    #[test]
    fn dotdot_names_are_rejected_and_absolute_ones_stay_beneath() {
        let mut fx = Fx::new();
        for name in ["../escape", "a/../../escape", "../canary/.wh.keep"] {
            let err = fx.apply(&[Ent::File(name, b"e")]).unwrap_err();
            assert!(err.to_string().contains(name), "{err}");
            assert!(err.to_string().contains("`..`"), "{err}");
        }
        fx.assert_untouched();
        // An absolute name lands beneath the root (docker's normalisation), not on the host.
        let abs = format!("{}/abs", fx.canary());
        fx.apply(&[Ent::File(&abs, b"a")]).unwrap();
        assert_eq!(
            std::fs::read(fx.root.join(abs.trim_start_matches('/'))).unwrap(),
            b"a"
        );
        fx.assert_untouched();
    }

    #[test]
    fn hard_links_outside_the_root_are_rejected() {
        let mut fx = Fx::new();
        let outside = format!("{}/outside-file", fx.canary());
        fx.apply(&[Ent::Sym("x", &fx.canary()), Ent::File("etc/a", b"a")])
            .unwrap();
        for (name, target) in [
            ("l1", outside.as_str()),
            ("l2", "../canary/outside-file"),
            ("l3", "x/outside-file"),
            ("l4", "etc/../../canary/outside-file"),
        ] {
            let err = fx.apply(&[Ent::Hard(name, target)]).unwrap_err();
            assert!(err.to_string().contains(name), "{err}");
            assert!(!fx.root.join(name).exists());
        }
        // The link's own name going through the symlink fails too (canary/evil is a dir).
        assert!(fx.apply(&[Ent::Hard("x/evil", "etc/a")]).is_err());
        fx.assert_untouched();
        // A normal hard link still works, over an existing lower-layer file too.
        fx.apply(&[Ent::File("etc/b", b"old")]).unwrap();
        fx.apply(&[Ent::Hard("etc/b", "./etc/a")]).unwrap();
        assert_eq!(std::fs::metadata(fx.root.join("etc/b")).unwrap().nlink(), 2);
        assert_eq!(std::fs::read(fx.root.join("etc/b")).unwrap(), b"a");
    }

    #[test]
    fn whiteouts_through_symlinks_or_naming_parents_delete_nothing_outside() {
        let mut fx = Fx::new();
        fx.apply(&[Ent::Sym("x", &fx.canary()), Ent::Dir("sub")])
            .unwrap();
        fx.apply(&[Ent::File("x/.wh.y", b""), Ent::File("x/.wh.evil", b"")])
            .unwrap();
        fx.assert_untouched();
        // `.wh...` names the parent (the old code removed the root, or the dir around it).
        for name in ["sub/.wh...", ".wh...", ".wh..", ".wh."] {
            let err = fx.apply(&[Ent::File(name, b"")]).unwrap_err();
            assert!(err.to_string().contains("invalid whiteout"), "{err}");
        }
        assert!(fx.root.join("sub").is_dir());
        fx.assert_untouched();
        // A plain whiteout of a symlink removes the link, not what it points to.
        fx.apply(&[Ent::File(".wh.x", b"")]).unwrap();
        assert!(std::fs::symlink_metadata(fx.root.join("x")).is_err());
        fx.assert_untouched();
    }

    #[test]
    fn device_nodes_are_skipped_and_fifos_created() {
        let mut fx = Fx::new();
        fx.apply(&[
            Ent::Dir("dev"),
            Ent::Dev("dev/sda", tar::EntryType::Block),
            Ent::Dev("dev/tty0", tar::EntryType::Char),
            Ent::Fifo("run/fifo"),
        ])
        .unwrap();
        assert!(fx.root.join("dev").is_dir());
        assert!(std::fs::symlink_metadata(fx.root.join("dev/sda")).is_err());
        assert!(std::fs::symlink_metadata(fx.root.join("dev/tty0")).is_err());
        let md = std::fs::symlink_metadata(fx.root.join("run/fifo")).unwrap();
        assert!(md.file_type().is_fifo());
        assert_eq!(md.mode() & 0o7777, 0o644);
    }

    #[test]
    fn normal_layers_keep_metadata() {
        let mut fx = Fx::new();
        let mut b = tar::Builder::new(Vec::new());
        let mut add = |path: &str, kind: tar::EntryType, mode: u32, link: &str, data: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_uid(1234);
            h.set_gid(5678);
            h.set_mtime(1_700_000_000);
            h.set_size(data.len() as u64);
            if !link.is_empty() {
                h.set_link_name(link).unwrap();
            }
            b.append_data(&mut h, path, data).unwrap();
        };
        add("usr/", tar::EntryType::Directory, 0o750, "", b"");
        add("usr/bin/su", tar::EntryType::Regular, 0o4755, "", b"#!su");
        add(
            "usr/bin/sudo",
            tar::EntryType::Link,
            0o4755,
            "usr/bin/su",
            b"",
        );
        add("bin", tar::EntryType::Symlink, 0o777, "usr/bin", b"");
        let raw = b.into_inner().unwrap();
        fx.n += 1;
        let p = fx.base.join("layer-meta.tar");
        std::fs::write(&p, raw).unwrap();
        apply_layer(&p, &fx.root).unwrap();
        let r = &fx.root.clone();
        let usr = std::fs::symlink_metadata(r.join("usr")).unwrap();
        assert_eq!(
            (usr.mode() & 0o7777, usr.uid(), usr.gid()),
            (0o750, 1234, 5678)
        );
        let su = std::fs::symlink_metadata(r.join("usr/bin/su")).unwrap();
        assert_eq!(
            (su.mode() & 0o7777, su.uid(), su.gid()),
            (0o4755, 1234, 5678)
        );
        assert_eq!(su.mtime(), 1_700_000_000);
        assert_eq!(su.nlink(), 2);
        assert_eq!(std::fs::read(r.join("usr/bin/sudo")).unwrap(), b"#!su");
        // Parents the archive does not list are made 0755.
        let bin_dir = std::fs::metadata(r.join("usr/bin")).unwrap();
        assert_eq!(bin_dir.permissions().mode() & 0o7777, 0o755);
        let l = std::fs::symlink_metadata(r.join("bin")).unwrap();
        assert!(l.file_type().is_symlink());
        assert_eq!((l.uid(), l.gid(), l.mtime()), (1234, 5678, 1_700_000_000));
        assert_eq!(
            std::fs::read_link(r.join("bin")).unwrap(),
            Path::new("usr/bin")
        );
        // Later layers replace across types: file over dir, dir over file, link over file.
        fx.apply(&[
            Ent::File("usr/bin", b"file now"),
            Ent::Dir("bin"),
            Ent::File("bin/x", b"x"),
        ])
        .unwrap();
        assert_eq!(std::fs::read(r.join("usr/bin")).unwrap(), b"file now");
        assert!(std::fs::symlink_metadata(r.join("bin")).unwrap().is_dir());
        assert_eq!(std::fs::read(r.join("bin/x")).unwrap(), b"x");
        fx.assert_untouched();
    }
}
