//! Disk images: reflink clones (FICLONE) with a hole-preserving copy fallback, loop devices,
//! and the loop-mounted XFS data directory for a single-host install.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Errors of the storage layer.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{cmd} failed: {msg}")]
    Command { cmd: String, msg: String },
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StorageError {
    let path = path.display().to_string();
    move |source| StorageError::Io { op, path, source }
}

/// How a clone was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloneKind {
    /// Copy-on-write clone sharing all extents (XFS reflink=1, btrfs).
    Reflink,
    /// Full, hole-preserving copy: the filesystem has no reflink (degraded mode).
    SparseCopy,
}

impl CloneKind {
    pub fn as_str(self) -> &'static str {
        match self {
            CloneKind::Reflink => "reflink",
            CloneKind::SparseCopy => "copy",
        }
    }
}

/// Clones `src` to `dst` (which must not exist). Reflink first; on a filesystem that cannot
/// (EOPNOTSUPP, EXDEV, EINVAL) falls back to a copy that keeps holes, because `std::fs::copy`
/// would turn a sparse image into a fully allocated one.
pub fn clone_file(src: &Path, dst: &Path) -> Result<CloneKind, StorageError> {
    match reflink_copy::reflink(src, dst) {
        Ok(()) => Ok(CloneKind::Reflink),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP) | Some(libc::EXDEV) | Some(libc::EINVAL)
            ) =>
        {
            let _ = std::fs::remove_file(dst);
            sparse_copy(src, dst)?;
            Ok(CloneKind::SparseCopy)
        }
        Err(e) => Err(StorageError::Io {
            op: "reflink",
            path: format!("{} -> {}", src.display(), dst.display()),
            source: e,
        }),
    }
}

/// Moves the directory `new` to `out`, replacing what is there (a memory snapshot installed
/// over an older one of a reused build: sandboxes restored from the old one keep the files they
/// opened). `tag` names the old one while it is removed.
pub fn replace_dir(new: &Path, out: &Path, tag: &str) -> Result<(), StorageError> {
    if out.exists() {
        let old = out.with_extension(format!("old-{tag}"));
        std::fs::rename(out, &old).map_err(io("rename", out))?;
        let _ = std::fs::remove_dir_all(&old);
    }
    std::fs::rename(new, out).map_err(io("rename", new))
}

/// Copies only the data segments of `src` (SEEK_DATA/SEEK_HOLE + copy_file_range); holes stay
/// holes in `dst`.
pub fn sparse_copy(src: &Path, dst: &Path) -> Result<(), StorageError> {
    let s = File::open(src).map_err(io("open", src))?;
    let len = s.metadata().map_err(io("stat", src))?.len();
    let d = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(dst)
        .map_err(io("create", dst))?;
    d.set_len(len).map_err(io("truncate", dst))?;
    let (sfd, dfd) = (s.as_raw_fd(), d.as_raw_fd());
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: plain lseek on an fd we own.
        let data = unsafe { libc::lseek(sfd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole remains
            }
            return Err(io("seek data", src)(e));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(sfd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io("seek hole", src)(std::io::Error::last_os_error()));
        }
        let mut off_in = data;
        let mut off_out = data;
        while off_in < hole {
            let n = (hole - off_in) as usize;
            // SAFETY: offsets point at our own locals; fds are open.
            let r = unsafe {
                libc::copy_file_range(sfd, &mut off_in, dfd, &mut off_out, n.min(1 << 30), 0)
            };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EXDEV)
                        | Some(libc::EINVAL)
                        | Some(libc::ENOSYS)
                        | Some(libc::EOPNOTSUPP)
                ) {
                    // Across filesystems copy_file_range refuses: copy the segment by hand.
                    copy_segment(&s, &d, off_in as u64, (hole - off_in) as u64)
                        .map_err(io("copy", dst))?;
                    break;
                }
                return Err(io("copy_file_range", dst)(e));
            }
            if r == 0 {
                break;
            }
        }
        pos = hole;
    }
    Ok(())
}

fn copy_segment(src: &File, dst: &File, mut off: u64, mut len: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    while len > 0 {
        let n = src.read_at(&mut buf[..len.min(1 << 20) as usize], off)?;
        if n == 0 {
            break;
        }
        dst.write_all_at(&buf[..n], off)?;
        off += n as u64;
        len -= n as u64;
    }
    Ok(())
}

/// Probes whether `dir` supports reflink clones (creates and removes two small files).
pub fn probe_reflink(dir: &Path) -> Result<CloneKind, StorageError> {
    let a = dir.join(format!(".reflink-probe-{}", std::process::id()));
    let b = dir.join(format!(".reflink-probe-{}.clone", std::process::id()));
    let _ = std::fs::remove_file(&a);
    let _ = std::fs::remove_file(&b);
    std::fs::write(&a, [1u8; 4096]).map_err(io("write", &a))?;
    let r = clone_file(&a, &b);
    let _ = std::fs::remove_file(&a);
    let _ = std::fs::remove_file(&b);
    r
}

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LO_FLAGS_AUTOCLEAR: u32 = 4;

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// An attached loop device. With autoclear the kernel detaches it when the last user (mount
/// or open fd) goes away, so a crashed process cannot leak it once its mount is gone.
pub struct LoopDevice {
    pub path: PathBuf,
    file: File,
}

impl LoopDevice {
    /// Attaches `image` to a free loop device with autoclear. Retries when another process
    /// grabs the same free device first.
    pub fn attach(image: &Path) -> Result<LoopDevice, StorageError> {
        let backing = OpenOptions::new()
            .read(true)
            .write(true)
            .open(image)
            .map_err(io("open", image))?;
        let ctl_path = Path::new("/dev/loop-control");
        let ctl = File::open(ctl_path).map_err(io("open", ctl_path))?;
        for _ in 0..64 {
            // SAFETY: ioctl on the loop-control fd, no argument.
            let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
            if n < 0 {
                return Err(io("LOOP_CTL_GET_FREE", ctl_path)(
                    std::io::Error::last_os_error(),
                ));
            }
            let path = PathBuf::from(format!("/dev/loop{n}"));
            let file = match OpenOptions::new().read(true).write(true).open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io("open", &path)(e)),
            };
            // SAFETY: zeroed POD config struct.
            let mut cfg: LoopConfig = unsafe { std::mem::zeroed() };
            cfg.fd = backing.as_raw_fd() as u32;
            cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR;
            // SAFETY: cfg is a valid loop_config for the duration of the call.
            let r = unsafe { libc::ioctl(file.as_raw_fd(), LOOP_CONFIGURE as _, &cfg) };
            if r == 0 {
                return Ok(LoopDevice { path, file });
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EBUSY) {
                continue;
            }
            return Err(io("LOOP_CONFIGURE", &path)(e));
        }
        Err(StorageError::Command {
            cmd: "loop attach".into(),
            msg: "no free loop device after 64 attempts".into(),
        })
    }

    /// Detaches explicitly (needed only when the device was never mounted).
    pub fn detach(self) {
        // SAFETY: ioctl on our own fd.
        unsafe { libc::ioctl(self.file.as_raw_fd(), LOOP_CLR_FD as _, 0) };
    }

    /// Drops our fd; autoclear then detaches the device once it is unmounted.
    pub fn release(self) {}
}

fn run(cmd: &mut Command) -> Result<(), StorageError> {
    let name = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| StorageError::Command {
        cmd: name.clone(),
        msg: e.to_string(),
    })?;
    if !out.status.success() {
        return Err(StorageError::Command {
            cmd: name,
            msg: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// Creates (if missing) a sparse XFS image with reflink and mounts it on `mountpoint`, for a
/// single-host install whose data directory is not on XFS. Idempotent: an existing mount of the
/// same image is left alone.
pub fn ensure_xfs_loop(
    image: &Path,
    size_bytes: u64,
    mountpoint: &Path,
) -> Result<(), StorageError> {
    if is_mountpoint(mountpoint) {
        return Ok(());
    }
    if !image.exists() {
        if let Some(parent) = image.parent() {
            std::fs::create_dir_all(parent).map_err(io("mkdir", parent))?;
        }
        let f = File::create(image).map_err(io("create", image))?;
        f.set_len(size_bytes).map_err(io("truncate", image))?;
        drop(f);
        run(Command::new("mkfs.xfs")
            .args(["-q", "-m", "reflink=1"])
            .arg(image))?;
    }
    std::fs::create_dir_all(mountpoint).map_err(io("mkdir", mountpoint))?;
    let dev = LoopDevice::attach(image)?;
    let r = mount_dev(&dev.path, mountpoint, "xfs", 0, "");
    match r {
        Ok(()) => {
            dev.release();
            Ok(())
        }
        Err(e) => {
            dev.detach();
            Err(e)
        }
    }
}

/// Unmounts a mount made by [`ensure_xfs_loop`] (the loop device autoclears).
pub fn unmount(mountpoint: &Path) -> Result<(), StorageError> {
    let c = cstr(mountpoint);
    // SAFETY: valid C string.
    if unsafe { libc::umount2(c.as_ptr(), 0) } != 0 {
        return Err(io("umount", mountpoint)(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Bind-mounts `src` (a file or a directory) at `dst`, which must exist and be of its kind.
pub fn bind_mount(src: &Path, dst: &Path) -> std::io::Result<()> {
    let (s, d) = (cstr(src), cstr(dst));
    // SAFETY: valid C strings for the duration of the call.
    let r = unsafe {
        libc::mount(
            s.as_ptr(),
            d.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

pub(crate) fn cstr(p: &Path) -> std::ffi::CString {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap_or_default()
}

/// Mounts a block device.
pub fn mount_dev(
    dev: &Path,
    target: &Path,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), StorageError> {
    let (d, t) = (cstr(dev), cstr(target));
    let fs = std::ffi::CString::new(fstype).unwrap_or_default();
    let opts = std::ffi::CString::new(data).unwrap_or_default();
    let data_ptr = if data.is_empty() {
        std::ptr::null()
    } else {
        opts.as_ptr() as *const libc::c_void
    };
    // SAFETY: valid C strings; data is null or a valid C string.
    let r = unsafe { libc::mount(d.as_ptr(), t.as_ptr(), fs.as_ptr(), flags, data_ptr) };
    if r != 0 {
        return Err(io("mount", target)(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// True when `p` is a mount point (per /proc/self/mountinfo).
pub fn is_mountpoint(p: &Path) -> bool {
    let Ok(canon) = p.canonicalize() else {
        return false;
    };
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = canon.to_string_lossy().to_string();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| m == want)
}

/// Runs `mkfs.ext4 -d root image` on a sparse image of `size_bytes`.
pub fn mkfs_ext4_from_dir(root: &Path, image: &Path, size_bytes: u64) -> Result<(), StorageError> {
    let f = File::create(image).map_err(io("create", image))?;
    f.set_len(size_bytes).map_err(io("truncate", image))?;
    drop(f);
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "root_owner=0:0", "-L", "cube-root", "-d"])
        .arg(root)
        .arg(image))?;
    // FICLONE flushes a dirty source first (1.9 s for 1 GiB): sync once at build time.
    let f = File::open(image).map_err(io("open", image))?;
    f.sync_all().map_err(io("fsync", image))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn sparse_copy_keeps_holes_and_data() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        let mut f = File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        f.seek(SeekFrom::Start(40 << 20)).unwrap();
        f.write_all(b"tail-data").unwrap();
        drop(f);
        let dst = d.path().join("dst");
        sparse_copy(&src, &dst).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        let m = std::fs::metadata(&dst).unwrap();
        assert_eq!(m.len(), 64 << 20);
        assert!(
            m.blocks() * 512 < 4 << 20,
            "copy is not sparse: {} blocks",
            m.blocks()
        );
    }

    #[test]
    fn clone_falls_back_or_reflinks_with_same_content() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("a");
        std::fs::write(&src, b"hello").unwrap();
        let dst = d.path().join("b");
        let kind = clone_file(&src, &dst).unwrap();
        assert_eq!(std::fs::read(&dst).unwrap(), b"hello");
        assert!(matches!(kind, CloneKind::Reflink | CloneKind::SparseCopy));
        // dst exists now: a second clone onto it must fail, not overwrite silently.
        assert!(clone_file(&src, &dst).is_err());
    }

    #[test]
    fn xfs_loop_image_reflinks() {
        cube_testkit::require_priv!("storage::xfs_loop_image_reflinks");
        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("xfs.img");
        let mnt = d.path().join("mnt");
        ensure_xfs_loop(&img, 320 << 20, &mnt).unwrap();
        let guard = scopeguard(&mnt);
        assert!(is_mountpoint(&mnt));
        // Idempotent.
        ensure_xfs_loop(&img, 320 << 20, &mnt).unwrap();
        assert_eq!(probe_reflink(&mnt).unwrap(), CloneKind::Reflink);
        let a = mnt.join("a");
        std::fs::write(&a, vec![3u8; 1 << 20]).unwrap();
        assert_eq!(clone_file(&a, &mnt.join("b")).unwrap(), CloneKind::Reflink);
        drop(guard);
        assert!(!is_mountpoint(&mnt));
    }

    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = unmount(self.0);
        }
    }
    fn scopeguard(p: &Path) -> Unmount<'_> {
        Unmount(p)
    }
}
