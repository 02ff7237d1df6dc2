//! Doing file work with a user's rights.
//!
//! The agent runs as root, but file operations requested for a user must be checked against that
//! user's permissions, including every directory and symlink on the way. Linux keeps filesystem
//! credentials (fsuid, fsgid, supplementary groups) per *thread* at the syscall level, so a
//! blocking worker thread switches them for the duration of one operation and switches back.
//! Switching fsuid away from 0 also drops the capabilities that bypass permission checks
//! (CAP_DAC_OVERRIDE, CAP_FOWNER, ...), and switching back restores them.
//! The raw `setgroups` syscall is used on purpose: glibc's wrapper applies it to every thread.
//! Where `setfsuid` has no effect (gVisor's kernel keeps it as a no-op), the thread switches
//! its effective ids instead, with the raw per-thread `setresuid`/`setresgid` (real and saved
//! ids stay 0, so it can switch back; the effective capabilities go and return the same way).

use crate::users::User;

/// How a thread took on a user's rights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Switched {
    No,
    FsIds,
    EffectiveIds,
}

/// Restores root's filesystem credentials when dropped.
pub struct FsCredsGuard {
    how: Switched,
}

/// `(uid_t)-1`: leave that id as it is.
const KEEP: libc::c_long = -1;

impl Drop for FsCredsGuard {
    fn drop(&mut self) {
        // SAFETY: plain syscalls on the current thread.
        unsafe {
            match self.how {
                Switched::No => return,
                Switched::FsIds => {
                    libc::setfsuid(0);
                    libc::setfsgid(0);
                }
                Switched::EffectiveIds => {
                    libc::syscall(libc::SYS_setresuid, KEEP, 0 as libc::c_long, KEEP);
                    libc::syscall(libc::SYS_setresgid, KEEP, 0 as libc::c_long, KEEP);
                }
            }
            libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>());
        }
    }
}

/// Switches the current thread's filesystem credentials to `user`. Must only be called on a
/// thread dedicated to this operation (a blocking-pool thread), never on the async runtime.
pub fn become_user(user: &User) -> std::io::Result<FsCredsGuard> {
    // SAFETY: geteuid cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 || user.uid == 0 {
        // Not root: we can only act as ourselves; root acts as root.
        return Ok(FsCredsGuard { how: Switched::No });
    }
    let groups: Vec<libc::gid_t> = user.groups.clone();
    // SAFETY: raw per-thread syscalls with valid pointers.
    let rc = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut guard = FsCredsGuard {
        how: Switched::FsIds,
    };
    // SAFETY: setfsgid/setfsuid only affect this thread.
    unsafe {
        libc::setfsgid(user.gid);
        libc::setfsuid(user.uid);
        // setfsuid returns the previous value; confirm the switch took effect.
        if libc::setfsuid(user.uid) as u32 == user.uid {
            return Ok(guard);
        }
    }
    guard.how = Switched::EffectiveIds;
    // SAFETY: raw per-thread syscalls (glibc's wrappers would switch every thread).
    let (g, u) = unsafe {
        (
            libc::syscall(
                libc::SYS_setresgid,
                KEEP,
                libc::c_long::from(user.gid),
                KEEP,
            ),
            libc::syscall(
                libc::SYS_setresuid,
                KEEP,
                libc::c_long::from(user.uid),
                KEEP,
            ),
        )
    };
    // SAFETY: geteuid cannot fail.
    if g != 0 || u != 0 || unsafe { libc::geteuid() } != user.uid {
        return Err(std::io::Error::other(
            "neither setfsuid nor setresuid took effect",
        ));
    }
    Ok(guard)
}

/// Runs `f` on a blocking thread with `user`'s filesystem rights.
pub async fn as_user<T, E, F>(user: &User, f: F) -> Result<T, E>
where
    T: Send + 'static,
    E: From<std::io::Error> + Send + 'static,
    F: FnOnce() -> Result<T, E> + Send + 'static,
{
    let user = user.clone();
    match tokio::task::spawn_blocking(move || {
        let _g = become_user(&user)?;
        f()
    })
    .await
    {
        Ok(r) => r,
        Err(e) => Err(std::io::Error::other(format!("worker failed: {e}")).into()),
    }
}
