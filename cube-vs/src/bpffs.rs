//! Making sure the pin root lives on a bpffs.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::{Error, Result};

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

fn is_bpffs(path: &Path) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: c is a valid NUL-terminated path; st is a properly sized out-parameter.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == BPF_FS_MAGIC
    }
}

fn mount_bpffs(at: &Path) -> Result<()> {
    let err = |source| Error::Bpffs {
        path: at.display().to_string(),
        source,
    };
    std::fs::create_dir_all(at).map_err(err)?;
    let target = CString::new(at.as_os_str().as_bytes())
        .map_err(|_| err(std::io::Error::other("path contains NUL")))?;
    // SAFETY: all pointers are valid NUL-terminated strings; data is null.
    let rc = unsafe {
        libc::mount(
            c"bpf".as_ptr(),
            target.as_ptr(),
            c"bpf".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(err(std::io::Error::last_os_error()));
    }
    tracing::info!(path = %at.display(), "mounted bpffs");
    Ok(())
}

/// Ensures `root` (and its `maps`, `progs`, `links` subdirectories) exist on a bpffs. Mounts
/// one at `/sys/fs/bpf` when `root` is below it, else at `root` itself.
pub(crate) fn ensure(root: &Path) -> Result<()> {
    let sys = Path::new("/sys/fs/bpf");
    let existing = root.ancestors().find(|p| p.exists());
    let on_bpffs = existing.is_some_and(is_bpffs);
    if !on_bpffs {
        if root.starts_with(sys) {
            if !is_bpffs(sys) {
                mount_bpffs(sys)?;
            }
        } else {
            mount_bpffs(root)?;
        }
    }
    for sub in ["maps", "progs", "links"] {
        let d = root.join(sub);
        std::fs::create_dir_all(&d).map_err(|source| Error::Bpffs {
            path: d.display().to_string(),
            source,
        })?;
    }
    if !is_bpffs(root) {
        return Err(Error::Bpffs {
            path: root.display().to_string(),
            source: std::io::Error::other("not on a bpf filesystem after mounting"),
        });
    }
    Ok(())
}
