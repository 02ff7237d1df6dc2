//! Credentials and capabilities: the shim's own uid/gid, the privilege drop and
//! no-new-privs.

use super::{priv_sys, JailError};

/// First uid (and gid) of the range shims run as. Each shim runs as `SHIM_ID_BASE + pid`,
/// where pid is the host pid of the process cubelet spawned ([`shim_id`]): pids are unique
/// among live processes, so no two live shims ever share an id, and cubelet derives the id
/// from the pid it already records without any extra state. The range is distinct from the
/// namespace runtime's sub-ids (`cube:1000000000:65536`, see cubelet's `subids.rs`) and must
/// be reserved for cube on the node (no other user or sub-id range inside it).
pub const SHIM_ID_BASE: u32 = 1_100_000_000;
/// Size of the range: `PID_MAX_LIMIT` on 64-bit Linux (pids are below 2^22).
pub const SHIM_ID_COUNT: u32 = 1 << 22;

// The range fits in uid_t (below the invalid -1) and lies above the namespace runtime's.
const _: () = assert!(
    (SHIM_ID_BASE as u64 + SHIM_ID_COUNT as u64) < (u32::MAX as u64)
        && SHIM_ID_BASE as u64 >= 1_000_000_000 + 65_536
);

/// The uid and gid of the shim whose host pid is `host_pid`.
pub fn shim_id(host_pid: u32) -> u32 {
    SHIM_ID_BASE + host_pid % SHIM_ID_COUNT
}

/// Errors unless the process has exactly one thread (credentials and capability sets are per
/// thread: changed on one, they would stay on the others).
pub fn ensure_single_threaded() -> Result<(), JailError> {
    let n = std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .map_err(|e| JailError::Privileges {
            what: "count threads in /proc/self/task".into(),
            source: e,
        })?;
    if n != 1 {
        return Err(JailError::Privileges {
            what: format!("{n} threads"),
            source: std::io::Error::from(std::io::ErrorKind::Other),
        });
    }
    Ok(())
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

/// The calling thread's effective, permitted and inheritable capability sets (64-bit masks).
pub fn capabilities() -> std::io::Result<[u64; 3]> {
    let mut h = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut d = [CapData::default(); 2];
    // SAFETY: capget with a v3 header and two data slots, as the ABI requires.
    if unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let join = |lo: u32, hi: u32| u64::from(lo) | (u64::from(hi) << 32);
    Ok([
        join(d[0].effective, d[1].effective),
        join(d[0].permitted, d[1].permitted),
        join(d[0].inheritable, d[1].inheritable),
    ])
}

/// Capabilities in the calling thread's bounding set and ambient set (bit masks).
pub fn bounding_and_ambient() -> (u64, u64) {
    let (mut b, mut a) = (0u64, 0u64);
    for cap in 0..64 {
        // SAFETY: prctl reads with integer arguments.
        if unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap) } == 1 {
            b |= 1 << cap;
        }
        if unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_IS_SET, cap, 0, 0) } == 1
        {
            a |= 1 << cap;
        }
    }
    (b, a)
}

/// Becomes uid/gid `id` with no supplementary groups and every capability set empty (the
/// bounding and ambient sets too, so nothing can bring one back). With `dumpable` the process
/// stays dumpable: a credential change makes it non-dumpable, which hands its `/proc/self`
/// files to root, and the VMM reads its own `smaps` and `pagemap` (only its own uid, unique to
/// this shim, gains anything by it; core dumps are off). Per thread: call it single-threaded.
pub fn drop_privileges(id: u32, dumpable: bool) -> Result<(), JailError> {
    if id == 0 {
        return Err(JailError::Privileges {
            what: "uid 0 is not a shim uid".into(),
            source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        });
    }
    // SAFETY (whole block): prctl/setgroups/setres[ug]id/capset/setrlimit with integer
    // arguments or pointers to locals.
    unsafe {
        priv_sys(libc::prctl(libc::PR_SET_KEEPCAPS, 0).into(), || {
            "PR_SET_KEEPCAPS".into()
        })?;
        for cap in 0..64 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap) != 0
                && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL)
            {
                return Err(JailError::Privileges {
                    what: format!("PR_CAPBSET_DROP {cap}"),
                    source: std::io::Error::last_os_error(),
                });
            }
        }
        priv_sys(
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL,
                0,
                0,
                0,
            )
            .into(),
            || "PR_CAP_AMBIENT_CLEAR_ALL".into(),
        )?;
        priv_sys(libc::setgroups(0, std::ptr::null()).into(), || {
            "setgroups".into()
        })?;
        priv_sys(libc::setresgid(id, id, id).into(), || {
            format!("setresgid {id}")
        })?;
        priv_sys(libc::setresuid(id, id, id).into(), || {
            format!("setresuid {id}")
        })?;
        // Leaving uid 0 emptied the effective and permitted sets; the inheritable one stays.
        let mut h = CapHeader {
            version: CAP_VERSION_3,
            pid: 0,
        };
        let d = [CapData::default(); 2];
        priv_sys(libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()), || {
            "capset".into()
        })?;
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        priv_sys(libc::setrlimit(libc::RLIMIT_CORE, &no_core).into(), || {
            "RLIMIT_CORE".into()
        })?;
        if dumpable {
            priv_sys(libc::prctl(libc::PR_SET_DUMPABLE, 1).into(), || {
                "PR_SET_DUMPABLE".into()
            })?;
        }
    }
    let caps = capabilities().map_err(|e| JailError::Privileges {
        what: "capget".into(),
        source: e,
    })?;
    let (bounding, ambient) = bounding_and_ambient();
    // SAFETY: getuid/getgid take no arguments.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    if caps != [0; 3] || bounding != 0 || ambient != 0 || uid != id || gid != id {
        return Err(JailError::Privileges {
            what: format!(
                "still privileged: caps {caps:x?} bounding {bounding:#x} ambient {ambient:#x} uid {uid} gid {gid}"
            ),
            source: std::io::Error::from(std::io::ErrorKind::Other),
        });
    }
    Ok(())
}

pub fn no_new_privs() -> Result<(), JailError> {
    // SAFETY: plain prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(JailError::NoNewPrivs(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shim_ids_are_unprivileged_and_distinct_per_pid() {
        assert_eq!(shim_id(1), SHIM_ID_BASE + 1);
        assert_ne!(shim_id(100), shim_id(101));
        // Every possible pid maps inside the range, above the namespace runtime's sub-ids.
        assert_eq!(shim_id(SHIM_ID_COUNT - 1), SHIM_ID_BASE + SHIM_ID_COUNT - 1);
    }
}
