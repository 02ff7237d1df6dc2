//! The seccomp filters of namespace sandboxes: an allow-list modelled on Docker's default
//! profile (what a process may call without the capabilities the agent does not keep), and
//! nothing else:
//!
//! * every other system call fails with `EPERM`: kernel modules, kexec, bpf, perf_event_open,
//!   keyrings, userfaultfd, io_uring, mount and the new mount API, setns and unshare, clock
//!   and swap changes, reboot, ...;
//! * `clone` only without namespace flags; `clone3` fails with `ENOSYS`, so that libc falls back
//!   to `clone` (seccomp cannot see clone3's flags, which sit behind a pointer);
//! * `socket` for every family except `AF_VSOCK`; `personality` only with the harmless values;
//! * x32 system call numbers (the x86_64 ABI with bit 30 set, a second table whose numbers
//!   the allow-list would not see) and any other architecture (i386 via `int 0x80`) kill the
//!   process.
//!
//! `no_new_privs` is set before the filters go in, so no setuid or file-capability program
//! can gain what the sandbox's processes do not have.

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use std::collections::BTreeMap;

/// System calls allowed without conditions (x86_64 numbers; ones newer than the `libc` crate
/// are given by number).
pub const ALLOWED: &[(&str, i64)] = &[
    ("accept", libc::SYS_accept),
    ("accept4", libc::SYS_accept4),
    ("access", libc::SYS_access),
    ("alarm", libc::SYS_alarm),
    ("arch_prctl", libc::SYS_arch_prctl),
    ("bind", libc::SYS_bind),
    ("brk", libc::SYS_brk),
    ("cachestat", 451),
    ("capget", libc::SYS_capget),
    ("capset", libc::SYS_capset),
    ("chdir", libc::SYS_chdir),
    ("chmod", libc::SYS_chmod),
    ("chown", libc::SYS_chown),
    ("chroot", libc::SYS_chroot),
    ("clock_getres", libc::SYS_clock_getres),
    ("clock_gettime", libc::SYS_clock_gettime),
    ("clock_nanosleep", libc::SYS_clock_nanosleep),
    ("close", libc::SYS_close),
    ("close_range", libc::SYS_close_range),
    ("connect", libc::SYS_connect),
    ("copy_file_range", libc::SYS_copy_file_range),
    ("creat", libc::SYS_creat),
    ("dup", libc::SYS_dup),
    ("dup2", libc::SYS_dup2),
    ("dup3", libc::SYS_dup3),
    ("epoll_create", libc::SYS_epoll_create),
    ("epoll_create1", libc::SYS_epoll_create1),
    ("epoll_ctl", libc::SYS_epoll_ctl),
    ("epoll_pwait", libc::SYS_epoll_pwait),
    ("epoll_pwait2", libc::SYS_epoll_pwait2),
    ("epoll_wait", libc::SYS_epoll_wait),
    ("eventfd", libc::SYS_eventfd),
    ("eventfd2", libc::SYS_eventfd2),
    ("execve", libc::SYS_execve),
    ("execveat", libc::SYS_execveat),
    ("exit", libc::SYS_exit),
    ("exit_group", libc::SYS_exit_group),
    ("faccessat", libc::SYS_faccessat),
    ("faccessat2", libc::SYS_faccessat2),
    ("fadvise64", libc::SYS_fadvise64),
    ("fallocate", libc::SYS_fallocate),
    ("fanotify_mark", libc::SYS_fanotify_mark),
    ("fchdir", libc::SYS_fchdir),
    ("fchmod", libc::SYS_fchmod),
    ("fchmodat", libc::SYS_fchmodat),
    ("fchmodat2", 452),
    ("fchown", libc::SYS_fchown),
    ("fchownat", libc::SYS_fchownat),
    ("fcntl", libc::SYS_fcntl),
    ("fdatasync", libc::SYS_fdatasync),
    ("fgetxattr", libc::SYS_fgetxattr),
    ("flistxattr", libc::SYS_flistxattr),
    ("flock", libc::SYS_flock),
    ("fork", libc::SYS_fork),
    ("fremovexattr", libc::SYS_fremovexattr),
    ("fsetxattr", libc::SYS_fsetxattr),
    ("fstat", libc::SYS_fstat),
    ("fstatfs", libc::SYS_fstatfs),
    ("fsync", libc::SYS_fsync),
    ("ftruncate", libc::SYS_ftruncate),
    ("futex", libc::SYS_futex),
    ("futex_requeue", 456),
    ("futex_wait", 455),
    ("futex_waitv", 449),
    ("futex_wake", 454),
    ("futimesat", libc::SYS_futimesat),
    ("getcpu", libc::SYS_getcpu),
    ("getcwd", libc::SYS_getcwd),
    ("getdents", libc::SYS_getdents),
    ("getdents64", libc::SYS_getdents64),
    ("getegid", libc::SYS_getegid),
    ("geteuid", libc::SYS_geteuid),
    ("getgid", libc::SYS_getgid),
    ("getgroups", libc::SYS_getgroups),
    ("getitimer", libc::SYS_getitimer),
    ("getpeername", libc::SYS_getpeername),
    ("getpgid", libc::SYS_getpgid),
    ("getpgrp", libc::SYS_getpgrp),
    ("getpid", libc::SYS_getpid),
    ("getppid", libc::SYS_getppid),
    ("getpriority", libc::SYS_getpriority),
    ("getrandom", libc::SYS_getrandom),
    ("getresgid", libc::SYS_getresgid),
    ("getresuid", libc::SYS_getresuid),
    ("getrlimit", libc::SYS_getrlimit),
    ("get_robust_list", libc::SYS_get_robust_list),
    ("getrusage", libc::SYS_getrusage),
    ("getsid", libc::SYS_getsid),
    ("getsockname", libc::SYS_getsockname),
    ("getsockopt", libc::SYS_getsockopt),
    ("get_thread_area", libc::SYS_get_thread_area),
    ("gettid", libc::SYS_gettid),
    ("gettimeofday", libc::SYS_gettimeofday),
    ("getuid", libc::SYS_getuid),
    ("getxattr", libc::SYS_getxattr),
    ("inotify_add_watch", libc::SYS_inotify_add_watch),
    ("inotify_init", libc::SYS_inotify_init),
    ("inotify_init1", libc::SYS_inotify_init1),
    ("inotify_rm_watch", libc::SYS_inotify_rm_watch),
    ("io_cancel", libc::SYS_io_cancel),
    ("ioctl", libc::SYS_ioctl),
    ("io_destroy", libc::SYS_io_destroy),
    ("io_getevents", libc::SYS_io_getevents),
    ("io_pgetevents", 333),
    ("ioprio_get", libc::SYS_ioprio_get),
    ("ioprio_set", libc::SYS_ioprio_set),
    ("io_setup", libc::SYS_io_setup),
    ("io_submit", libc::SYS_io_submit),
    ("kill", libc::SYS_kill),
    ("landlock_add_rule", libc::SYS_landlock_add_rule),
    ("landlock_create_ruleset", libc::SYS_landlock_create_ruleset),
    ("landlock_restrict_self", libc::SYS_landlock_restrict_self),
    ("lchown", libc::SYS_lchown),
    ("lgetxattr", libc::SYS_lgetxattr),
    ("link", libc::SYS_link),
    ("linkat", libc::SYS_linkat),
    ("listen", libc::SYS_listen),
    ("listxattr", libc::SYS_listxattr),
    ("llistxattr", libc::SYS_llistxattr),
    ("lremovexattr", libc::SYS_lremovexattr),
    ("lseek", libc::SYS_lseek),
    ("lsetxattr", libc::SYS_lsetxattr),
    ("lstat", libc::SYS_lstat),
    ("madvise", libc::SYS_madvise),
    ("map_shadow_stack", 453),
    ("membarrier", libc::SYS_membarrier),
    ("memfd_create", libc::SYS_memfd_create),
    ("memfd_secret", libc::SYS_memfd_secret),
    ("mincore", libc::SYS_mincore),
    ("mkdir", libc::SYS_mkdir),
    ("mkdirat", libc::SYS_mkdirat),
    ("mknod", libc::SYS_mknod),
    ("mknodat", libc::SYS_mknodat),
    ("mlock", libc::SYS_mlock),
    ("mlock2", libc::SYS_mlock2),
    ("mlockall", libc::SYS_mlockall),
    ("mmap", libc::SYS_mmap),
    ("mprotect", libc::SYS_mprotect),
    ("mq_getsetattr", libc::SYS_mq_getsetattr),
    ("mq_notify", libc::SYS_mq_notify),
    ("mq_open", libc::SYS_mq_open),
    ("mq_timedreceive", libc::SYS_mq_timedreceive),
    ("mq_timedsend", libc::SYS_mq_timedsend),
    ("mq_unlink", libc::SYS_mq_unlink),
    ("mremap", libc::SYS_mremap),
    ("mseal", 462),
    ("msgctl", libc::SYS_msgctl),
    ("msgget", libc::SYS_msgget),
    ("msgrcv", libc::SYS_msgrcv),
    ("msgsnd", libc::SYS_msgsnd),
    ("msync", libc::SYS_msync),
    ("munlock", libc::SYS_munlock),
    ("munlockall", libc::SYS_munlockall),
    ("munmap", libc::SYS_munmap),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("nanosleep", libc::SYS_nanosleep),
    ("newfstatat", libc::SYS_newfstatat),
    ("open", libc::SYS_open),
    ("openat", libc::SYS_openat),
    ("openat2", libc::SYS_openat2),
    ("pause", libc::SYS_pause),
    ("pidfd_open", libc::SYS_pidfd_open),
    ("pidfd_send_signal", libc::SYS_pidfd_send_signal),
    ("pipe", libc::SYS_pipe),
    ("pipe2", libc::SYS_pipe2),
    ("pkey_alloc", libc::SYS_pkey_alloc),
    ("pkey_free", libc::SYS_pkey_free),
    ("pkey_mprotect", libc::SYS_pkey_mprotect),
    ("poll", libc::SYS_poll),
    ("ppoll", libc::SYS_ppoll),
    ("prctl", libc::SYS_prctl),
    ("pread64", libc::SYS_pread64),
    ("preadv", libc::SYS_preadv),
    ("preadv2", libc::SYS_preadv2),
    ("prlimit64", libc::SYS_prlimit64),
    ("process_mrelease", libc::SYS_process_mrelease),
    ("pselect6", libc::SYS_pselect6),
    ("ptrace", libc::SYS_ptrace),
    ("pwrite64", libc::SYS_pwrite64),
    ("pwritev", libc::SYS_pwritev),
    ("pwritev2", libc::SYS_pwritev2),
    ("read", libc::SYS_read),
    ("readahead", libc::SYS_readahead),
    ("readlink", libc::SYS_readlink),
    ("readlinkat", libc::SYS_readlinkat),
    ("readv", libc::SYS_readv),
    ("recvfrom", libc::SYS_recvfrom),
    ("recvmmsg", libc::SYS_recvmmsg),
    ("recvmsg", libc::SYS_recvmsg),
    ("remap_file_pages", libc::SYS_remap_file_pages),
    ("removexattr", libc::SYS_removexattr),
    ("rename", libc::SYS_rename),
    ("renameat", libc::SYS_renameat),
    ("renameat2", libc::SYS_renameat2),
    ("restart_syscall", libc::SYS_restart_syscall),
    ("rmdir", libc::SYS_rmdir),
    ("rseq", libc::SYS_rseq),
    ("rt_sigaction", libc::SYS_rt_sigaction),
    ("rt_sigpending", libc::SYS_rt_sigpending),
    ("rt_sigprocmask", libc::SYS_rt_sigprocmask),
    ("rt_sigqueueinfo", libc::SYS_rt_sigqueueinfo),
    ("rt_sigreturn", libc::SYS_rt_sigreturn),
    ("rt_sigsuspend", libc::SYS_rt_sigsuspend),
    ("rt_sigtimedwait", libc::SYS_rt_sigtimedwait),
    ("rt_tgsigqueueinfo", libc::SYS_rt_tgsigqueueinfo),
    ("sched_getaffinity", libc::SYS_sched_getaffinity),
    ("sched_getattr", libc::SYS_sched_getattr),
    ("sched_getparam", libc::SYS_sched_getparam),
    ("sched_get_priority_max", libc::SYS_sched_get_priority_max),
    ("sched_get_priority_min", libc::SYS_sched_get_priority_min),
    ("sched_getscheduler", libc::SYS_sched_getscheduler),
    ("sched_rr_get_interval", libc::SYS_sched_rr_get_interval),
    ("sched_setaffinity", libc::SYS_sched_setaffinity),
    ("sched_setattr", libc::SYS_sched_setattr),
    ("sched_setparam", libc::SYS_sched_setparam),
    ("sched_setscheduler", libc::SYS_sched_setscheduler),
    ("sched_yield", libc::SYS_sched_yield),
    ("seccomp", libc::SYS_seccomp),
    ("select", libc::SYS_select),
    ("semctl", libc::SYS_semctl),
    ("semget", libc::SYS_semget),
    ("semop", libc::SYS_semop),
    ("semtimedop", libc::SYS_semtimedop),
    ("sendfile", libc::SYS_sendfile),
    ("sendmmsg", libc::SYS_sendmmsg),
    ("sendmsg", libc::SYS_sendmsg),
    ("sendto", libc::SYS_sendto),
    ("setfsgid", libc::SYS_setfsgid),
    ("setfsuid", libc::SYS_setfsuid),
    ("setgid", libc::SYS_setgid),
    ("setgroups", libc::SYS_setgroups),
    ("setitimer", libc::SYS_setitimer),
    ("setpgid", libc::SYS_setpgid),
    ("setpriority", libc::SYS_setpriority),
    ("setregid", libc::SYS_setregid),
    ("setresgid", libc::SYS_setresgid),
    ("setresuid", libc::SYS_setresuid),
    ("setreuid", libc::SYS_setreuid),
    ("setrlimit", libc::SYS_setrlimit),
    ("set_robust_list", libc::SYS_set_robust_list),
    ("setsid", libc::SYS_setsid),
    ("setsockopt", libc::SYS_setsockopt),
    ("set_thread_area", libc::SYS_set_thread_area),
    ("set_tid_address", libc::SYS_set_tid_address),
    ("setuid", libc::SYS_setuid),
    ("setxattr", libc::SYS_setxattr),
    ("shmat", libc::SYS_shmat),
    ("shmctl", libc::SYS_shmctl),
    ("shmdt", libc::SYS_shmdt),
    ("shmget", libc::SYS_shmget),
    ("shutdown", libc::SYS_shutdown),
    ("sigaltstack", libc::SYS_sigaltstack),
    ("signalfd", libc::SYS_signalfd),
    ("signalfd4", libc::SYS_signalfd4),
    ("socketpair", libc::SYS_socketpair),
    ("splice", libc::SYS_splice),
    ("stat", libc::SYS_stat),
    ("statfs", libc::SYS_statfs),
    ("statx", libc::SYS_statx),
    ("symlink", libc::SYS_symlink),
    ("symlinkat", libc::SYS_symlinkat),
    ("sync", libc::SYS_sync),
    ("sync_file_range", libc::SYS_sync_file_range),
    ("syncfs", libc::SYS_syncfs),
    ("sysinfo", libc::SYS_sysinfo),
    ("tee", libc::SYS_tee),
    ("tgkill", libc::SYS_tgkill),
    ("time", libc::SYS_time),
    ("timer_create", libc::SYS_timer_create),
    ("timer_delete", libc::SYS_timer_delete),
    ("timer_getoverrun", libc::SYS_timer_getoverrun),
    ("timer_gettime", libc::SYS_timer_gettime),
    ("timer_settime", libc::SYS_timer_settime),
    ("timerfd_create", libc::SYS_timerfd_create),
    ("timerfd_gettime", libc::SYS_timerfd_gettime),
    ("timerfd_settime", libc::SYS_timerfd_settime),
    ("times", libc::SYS_times),
    ("tkill", libc::SYS_tkill),
    ("truncate", libc::SYS_truncate),
    ("umask", libc::SYS_umask),
    ("uname", libc::SYS_uname),
    ("unlink", libc::SYS_unlink),
    ("unlinkat", libc::SYS_unlinkat),
    ("utime", libc::SYS_utime),
    ("utimensat", libc::SYS_utimensat),
    ("utimes", libc::SYS_utimes),
    ("vfork", libc::SYS_vfork),
    ("vmsplice", libc::SYS_vmsplice),
    ("wait4", libc::SYS_wait4),
    ("waitid", libc::SYS_waitid),
    ("write", libc::SYS_write),
    ("writev", libc::SYS_writev),
];

/// `clone` flags that create namespaces, refused like `unshare` (CLONE_NEWTIME exists only for
/// clone3 and unshare).
pub const NAMESPACE_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET) as u64;

/// `personality` values allowed (as Docker): Linux, UNAME26 and ADDR_NO_RANDOMIZE variants,
/// and the query.
const PERSONALITIES: [u64; 5] = [0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

const AF_VSOCK: u64 = 40;
/// Bit 30 of the system call number: the x32 ABI.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

fn cond(arg: u8, op: SeccompCmpOp, v: u64) -> Result<SeccompCondition, String> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Qword, op, v).map_err(|e| format!("seccomp: {e}"))
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule, String> {
    SeccompRule::new(conds).map_err(|e| format!("seccomp: {e}"))
}

fn build(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    mismatch: SeccompAction,
    matched: SeccompAction,
) -> Result<BpfProgram, String> {
    SeccompFilter::new(rules, mismatch, matched, TargetArch::x86_64)
        .map_err(|e| format!("seccomp filter: {e}"))?
        .try_into()
        .map_err(|e: seccompiler::BackendError| format!("seccomp compile: {e}"))
}

/// The sandbox's filters, in the order to install them (the last one's `ERRNO` value wins
/// over an earlier one's for the same call, so `clone3` gets `ENOSYS`).
pub fn compile() -> Result<Vec<BpfProgram>, String> {
    let mut allow: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().map(|(_, n)| (*n, vec![])).collect();
    allow.insert(
        libc::SYS_clone,
        vec![rule(vec![cond(
            0,
            SeccompCmpOp::MaskedEq(NAMESPACE_FLAGS),
            0,
        )?])?],
    );
    allow.insert(
        libc::SYS_socket,
        vec![rule(vec![cond(0, SeccompCmpOp::Ne, AF_VSOCK)?])?],
    );
    allow.insert(
        libc::SYS_personality,
        PERSONALITIES
            .iter()
            .map(|&p| rule(vec![cond(0, SeccompCmpOp::Eq, p)?]))
            .collect::<Result<_, _>>()?,
    );
    let allow_list = build(
        allow,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
    )?;
    let clone3 = build(
        BTreeMap::from([(libc::SYS_clone3, vec![])]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
    )?;
    Ok(vec![allow_list, clone3, x32_kill()])
}

/// Kills the process on any x32 system call number.
fn x32_kill() -> BpfProgram {
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JSET_K: u16 = 0x45; // BPF_JMP | BPF_JSET | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    let ins = |code, jt, jf, k| seccompiler::sock_filter { code, jt, jf, k };
    vec![
        ins(LD_W_ABS, 0, 0, 0), // seccomp_data.nr
        ins(JSET_K, 0, 1, X32_SYSCALL_BIT),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        ins(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

/// Sets `no_new_privs` and installs the filters on the calling thread; exec keeps both.
pub fn install(progs: &[BpfProgram]) -> Result<(), std::io::Error> {
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    for prog in progs {
        let fprog = libc::sock_fprog {
            len: prog.len() as u16,
            filter: prog.as_ptr() as *mut libc::sock_filter,
        };
        // SAFETY: fprog points at a valid, live BPF program.
        let r = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                1u64, /* SECCOMP_SET_MODE_FILTER */
                0u64,
                &fprog as *const libc::sock_fprog,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filters_compile_and_leave_out_what_sandboxes_must_not_call() {
        let f = compile().unwrap();
        assert_eq!(f.len(), 3);
        for n in [
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_mount,
            libc::SYS_bpf,
            libc::SYS_perf_event_open,
            libc::SYS_keyctl,
            libc::SYS_io_uring_setup,
            libc::SYS_init_module,
            libc::SYS_kexec_load,
            libc::SYS_userfaultfd,
            libc::SYS_clone3,
            libc::SYS_open_by_handle_at,
        ] {
            assert!(
                ALLOWED.iter().all(|(_, a)| *a != n),
                "syscall {n} must not be allowed"
            );
        }
        let mut nrs: Vec<i64> = ALLOWED.iter().map(|(_, n)| *n).collect();
        nrs.sort();
        nrs.dedup();
        assert_eq!(nrs.len(), ALLOWED.len(), "duplicate entries");
    }

    #[test]
    fn clone_flags_that_make_namespaces_are_masked() {
        for f in [
            libc::CLONE_NEWUSER,
            libc::CLONE_NEWNET,
            libc::CLONE_NEWNS,
            libc::CLONE_NEWPID,
        ] {
            assert_ne!(NAMESPACE_FLAGS & f as u64, 0);
        }
        // What fork/pthread_create pass must stay allowed.
        let thread = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        assert_eq!(NAMESPACE_FLAGS & thread, 0);
        assert_eq!(NAMESPACE_FLAGS & libc::SIGCHLD as u64, 0);
    }
}
