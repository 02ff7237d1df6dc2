//! Root filesystem trees: copying with ownership, modes, symlinks and device nodes, and a
//! content hash used to address directory templates.

use sha2::{Digest, Sha256};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

fn ioerr(op: &str, p: &Path, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{op} {}: {e}", p.display()))
}

fn lchown(p: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    std::os::unix::fs::lchown(p, Some(uid), Some(gid)).map_err(|e| ioerr("chown", p, e))
}

/// Copies `src` into `dst` (created if missing), preserving what a root filesystem needs.
/// Hard links become separate files.
pub fn copy_tree(src: &Path, dst: &Path) -> std::io::Result<()> {
    let md = std::fs::symlink_metadata(src).map_err(|e| ioerr("stat", src, e))?;
    std::fs::create_dir_all(dst).map_err(|e| ioerr("mkdir", dst, e))?;
    copy_entries(src, dst)?;
    std::fs::set_permissions(dst, std::fs::Permissions::from_mode(md.mode() & 0o7777))
        .map_err(|e| ioerr("chmod", dst, e))?;
    lchown(dst, md.uid(), md.gid())
}

fn copy_entries(src: &Path, dst: &Path) -> std::io::Result<()> {
    for ent in std::fs::read_dir(src).map_err(|e| ioerr("readdir", src, e))? {
        let ent = ent.map_err(|e| ioerr("readdir", src, e))?;
        let s = ent.path();
        let d = dst.join(ent.file_name());
        let md = std::fs::symlink_metadata(&s).map_err(|e| ioerr("stat", &s, e))?;
        let ft = md.file_type();
        if std::fs::symlink_metadata(&d).is_ok() && !ft.is_dir() {
            std::fs::remove_file(&d).map_err(|e| ioerr("replace", &d, e))?;
        }
        if ft.is_dir() {
            if !d.is_dir() {
                std::fs::create_dir(&d).map_err(|e| ioerr("mkdir", &d, e))?;
            }
            copy_entries(&s, &d)?;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(md.mode() & 0o7777))
                .map_err(|e| ioerr("chmod", &d, e))?;
        } else if ft.is_symlink() {
            let t = std::fs::read_link(&s).map_err(|e| ioerr("readlink", &s, e))?;
            std::os::unix::fs::symlink(&t, &d).map_err(|e| ioerr("symlink", &d, e))?;
        } else if ft.is_file() {
            // Reflink where possible (same filesystem), else a hole-keeping copy.
            crate::storage::clone_file(&s, &d).map_err(|e| std::io::Error::other(e.to_string()))?;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(md.mode() & 0o7777))
                .map_err(|e| ioerr("chmod", &d, e))?;
        } else if ft.is_char_device() || ft.is_block_device() || ft.is_fifo() || ft.is_socket() {
            let c = crate::storage::cstr(&d);
            // SAFETY: valid path; mode and rdev from the source.
            if unsafe { libc::mknod(c.as_ptr(), md.mode(), md.rdev()) } != 0 {
                return Err(ioerr("mknod", &d, std::io::Error::last_os_error()));
            }
        }
        lchown(&d, md.uid(), md.gid())?;
    }
    Ok(())
}

/// Hash of a tree: paths, types, modes, owners, link targets and file contents, in sorted
/// order, so the same tree gives the same hash wherever it lives.
pub fn hash_tree(root: &Path) -> std::io::Result<String> {
    let mut h = Sha256::new();
    hash_dir(root, Path::new(""), &mut h)?;
    Ok(crate::state::hex(&h.finalize()))
}

fn hash_dir(root: &Path, rel: &Path, h: &mut Sha256) -> std::io::Result<()> {
    let dir = root.join(rel);
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .map_err(|e| ioerr("readdir", &dir, e))?
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    names.sort();
    for n in names {
        let r = rel.join(&n);
        let p = root.join(&r);
        let md = std::fs::symlink_metadata(&p).map_err(|e| ioerr("stat", &p, e))?;
        h.update(r.to_string_lossy().as_bytes());
        h.update(format!("\0{:o}\0{}\0{}\0", md.mode(), md.uid(), md.gid()).as_bytes());
        let ft = md.file_type();
        if ft.is_dir() {
            hash_dir(root, &r, h)?;
        } else if ft.is_symlink() {
            h.update(std::fs::read_link(&p)?.to_string_lossy().as_bytes());
        } else if ft.is_file() {
            let mut f = std::fs::File::open(&p).map_err(|e| ioerr("open", &p, e))?;
            std::io::copy(&mut f, h).map_err(|e| ioerr("read", &p, e))?;
        } else {
            h.update(md.rdev().to_le_bytes());
        }
    }
    Ok(())
}

/// Total size of regular files in a tree, in bytes.
pub fn tree_bytes(root: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(rd) = std::fs::read_dir(&d) {
            for e in rd.flatten() {
                if let Ok(md) = e.path().symlink_metadata() {
                    if md.is_dir() {
                        stack.push(e.path());
                    } else {
                        total += md.len();
                    }
                }
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_preserves_and_hash_is_stable() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a");
        std::fs::create_dir_all(a.join("etc/sub")).unwrap();
        std::fs::write(a.join("etc/f"), b"x").unwrap();
        std::fs::set_permissions(a.join("etc/f"), std::fs::Permissions::from_mode(0o750)).unwrap();
        std::os::unix::fs::symlink("f", a.join("etc/l")).unwrap();
        let b = d.path().join("b");
        copy_tree(&a, &b).unwrap();
        assert_eq!(std::fs::read_link(b.join("etc/l")).unwrap(), Path::new("f"));
        assert_eq!(
            std::fs::metadata(b.join("etc/f")).unwrap().mode() & 0o777,
            0o750
        );
        assert_eq!(hash_tree(&a).unwrap(), hash_tree(&b).unwrap());
        std::fs::write(b.join("etc/f"), b"y").unwrap();
        assert_ne!(hash_tree(&a).unwrap(), hash_tree(&b).unwrap());
    }
}
