//! The seccomp allow-list (syscalls, `ioctl` requests, thread-only `clone`) and its
//! installation on every thread.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use super::JailError;

/// Syscalls the shim needs after setup. Built from the code paths (control socket, vCPU run
/// loop and kick signal, snapshot and pause-to-disk file I/O, new shells after a
/// pause-to-disk, std thread spawning) and checked by running the test suite with the filter on.
/// `ioctl`, `clone`, `clone3` and `socket` are allowed only with the arguments in
/// [`seccomp_program`].
pub const ALLOWED_SYSCALLS: &[i64] = &[
    // memory
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_mincore,
    libc::SYS_memfd_create,
    // KVM and devices
    libc::SYS_eventfd2,
    // threads, signals, time
    libc::SYS_futex,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_tgkill,
    libc::SYS_tkill,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_gettimeofday,
    libc::SYS_getrusage,
    libc::SYS_prctl,
    libc::SYS_getrandom,
    // identity (reads only; no set*id)
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_capget,
    // files: snapshots, pause-to-disk, /proc/self for stats
    libc::SYS_openat,
    libc::SYS_open,
    libc::SYS_close,
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_lseek,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_fstatfs,
    libc::SYS_statfs,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_getcwd,
    libc::SYS_getdents64,
    libc::SYS_fcntl,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_dup,
    libc::SYS_dup3,
    // control socket
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    // virtio-vsock host side: the shim binds the sandbox's socket on restore and connects to
    // `<path>_<port>` for guest-initiated connections (`socket` itself is limited to
    // AF_UNIX, see [`seccomp_program`]).
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_connect,
];

/// Allowed only with their first argument equal to the given value.
const ALLOWED_WITH_ARG0: &[(i64, u64)] = &[(libc::SYS_socket, libc::AF_UNIX as u64)];

/// `_IOC` request numbers (asm-generic/ioctl.h, as on x86).
const fn ioc(dir: u32, ty: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | (ty << 8) | nr
}
const KVMIO: u32 = 0xAE;
const fn kvm_io(nr: u32) -> u32 {
    ioc(0, KVMIO, nr, 0)
}
const fn kvm_ior<T>(nr: u32) -> u32 {
    ioc(2, KVMIO, nr, std::mem::size_of::<T>())
}
const fn kvm_iow<T>(nr: u32) -> u32 {
    ioc(1, KVMIO, nr, std::mem::size_of::<T>())
}
const fn kvm_iowr<T>(nr: u32) -> u32 {
    ioc(3, KVMIO, nr, std::mem::size_of::<T>())
}

/// The `ioctl` requests the shim makes after setup, all others kill it: the KVM ones
/// `cube-hypervisor` issues through `kvm-ioctls` (system, VM and vCPU fds: creating a VM
/// shell after a pause-to-disk, restoring and saving state, running), the two tun ones of
/// [`crate::devices::open_tap`], and `FIONBIO` (std's `set_nonblocking` on the vsock
/// sockets). Collected with `strace -e raw=ioctl` over the shim's test suite; the unused
/// rest of KVM (e.g. `KVM_SET_GSI_ROUTING`, `KVM_SET_MSR_FILTER`, device creation) and of tun
/// (`TUNSETOWNER`, `TUNSETPERSIST`, `TUNSETIFF`'s relatives that change the interface) stay
/// out, as do terminal ioctls (`TIOCSTI`).
pub const ALLOWED_IOCTLS: &[(&str, u32)] = {
    use kvm_bindings::*;
    &[
        // system fd
        ("KVM_GET_API_VERSION", kvm_io(0x00)),
        ("KVM_CREATE_VM", kvm_io(0x01)),
        ("KVM_GET_MSR_INDEX_LIST", kvm_iowr::<kvm_msr_list>(0x02)),
        ("KVM_CHECK_EXTENSION", kvm_io(0x03)),
        ("KVM_GET_VCPU_MMAP_SIZE", kvm_io(0x04)),
        ("KVM_GET_SUPPORTED_CPUID", kvm_iowr::<kvm_cpuid2>(0x05)),
        // VM fd
        ("KVM_CREATE_VCPU", kvm_io(0x41)),
        (
            "KVM_SET_USER_MEMORY_REGION",
            kvm_iow::<kvm_userspace_memory_region>(0x46),
        ),
        ("KVM_SET_TSS_ADDR", kvm_io(0x47)),
        ("KVM_CREATE_IRQCHIP", kvm_io(0x60)),
        ("KVM_IRQ_LINE", kvm_iow::<kvm_irq_level>(0x61)),
        ("KVM_GET_IRQCHIP", kvm_iowr::<kvm_irqchip>(0x62)),
        ("KVM_SET_IRQCHIP", kvm_ior::<kvm_irqchip>(0x63)),
        ("KVM_IRQFD", kvm_iow::<kvm_irqfd>(0x76)),
        ("KVM_CREATE_PIT2", kvm_iow::<kvm_pit_config>(0x77)),
        ("KVM_SET_CLOCK", kvm_iow::<kvm_clock_data>(0x7b)),
        ("KVM_GET_CLOCK", kvm_ior::<kvm_clock_data>(0x7c)),
        ("KVM_GET_PIT2", kvm_ior::<kvm_pit_state2>(0x9f)),
        ("KVM_SET_PIT2", kvm_iow::<kvm_pit_state2>(0xa0)),
        // vCPU fd
        ("KVM_RUN", kvm_io(0x80)),
        ("KVM_GET_REGS", kvm_ior::<kvm_regs>(0x81)),
        ("KVM_SET_REGS", kvm_iow::<kvm_regs>(0x82)),
        ("KVM_GET_SREGS", kvm_ior::<kvm_sregs>(0x83)),
        ("KVM_SET_SREGS", kvm_iow::<kvm_sregs>(0x84)),
        ("KVM_GET_MSRS", kvm_iowr::<kvm_msrs>(0x88)),
        ("KVM_SET_MSRS", kvm_iow::<kvm_msrs>(0x89)),
        ("KVM_GET_LAPIC", kvm_ior::<kvm_lapic_state>(0x8e)),
        ("KVM_SET_LAPIC", kvm_iow::<kvm_lapic_state>(0x8f)),
        ("KVM_SET_CPUID2", kvm_iow::<kvm_cpuid2>(0x90)),
        ("KVM_GET_CPUID2", kvm_iowr::<kvm_cpuid2>(0x91)),
        ("KVM_GET_MP_STATE", kvm_ior::<kvm_mp_state>(0x98)),
        ("KVM_SET_MP_STATE", kvm_iow::<kvm_mp_state>(0x99)),
        ("KVM_GET_VCPU_EVENTS", kvm_ior::<kvm_vcpu_events>(0x9f)),
        ("KVM_SET_VCPU_EVENTS", kvm_iow::<kvm_vcpu_events>(0xa0)),
        ("KVM_GET_DEBUGREGS", kvm_ior::<kvm_debugregs>(0xa1)),
        ("KVM_SET_DEBUGREGS", kvm_iow::<kvm_debugregs>(0xa2)),
        ("KVM_GET_TSC_KHZ", kvm_io(0xa3)),
        ("KVM_GET_XSAVE", kvm_ior::<kvm_xsave>(0xa4)),
        ("KVM_SET_XSAVE", kvm_iow::<kvm_xsave>(0xa5)),
        ("KVM_GET_XCRS", kvm_ior::<kvm_xcrs>(0xa6)),
        ("KVM_SET_XCRS", kvm_iow::<kvm_xcrs>(0xa7)),
        ("KVM_KVMCLOCK_CTRL", kvm_io(0xad)),
        // tun: attach to the sandbox's tap, check it is the persistent one
        ("TUNSETIFF", libc::TUNSETIFF as u32),
        ("TUNGETIFF", libc::TUNGETIFF as u32),
        // std's set_nonblocking on sockets
        ("FIONBIO", libc::FIONBIO as u32),
    ]
};

/// Namespace flags a thread-creating `clone` must not carry.
const CLONE_NS_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWCGROUP) as u64;

fn cond(
    arg: u8,
    len: SeccompCmpArgLen,
    op: SeccompCmpOp,
    value: u64,
) -> Result<SeccompCondition, JailError> {
    SeccompCondition::new(arg, len, op, value).map_err(|e| JailError::Seccomp(e.to_string()))
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule, JailError> {
    SeccompRule::new(conds).map_err(|e| JailError::Seccomp(e.to_string()))
}

fn compile(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    mismatch: SeccompAction,
    matched: SeccompAction,
) -> Result<BpfProgram, JailError> {
    let filter = SeccompFilter::new(rules, mismatch, matched, TargetArch::x86_64)
        .map_err(|e| JailError::Seccomp(e.to_string()))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| JailError::Seccomp(e.to_string()))
}

/// Compiles the allow-list into a BPF program.
pub fn seccomp_program() -> Result<BpfProgram, JailError> {
    use SeccompCmpArgLen::{Dword, Qword};
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED_SYSCALLS.iter().map(|&n| (n, Vec::new())).collect();
    for &(nr, arg0) in ALLOWED_WITH_ARG0 {
        rules.insert(
            nr,
            vec![rule(vec![cond(0, Dword, SeccompCmpOp::Eq, arg0)?])?],
        );
    }
    // The kernel takes the request as an unsigned int: compare the low 32 bits only.
    let ioctls = ALLOWED_IOCTLS
        .iter()
        .map(|&(_, n)| rule(vec![cond(1, Dword, SeccompCmpOp::Eq, u64::from(n))?]))
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_ioctl, ioctls);
    // Threads only: CLONE_THREAD set (same process, so no fork of guest memory and no
    // process to exec in) and no namespace flag.
    let thread = libc::CLONE_THREAD as u64;
    rules.insert(
        libc::SYS_clone,
        vec![rule(vec![
            cond(0, Qword, SeccompCmpOp::MaskedEq(thread), thread)?,
            cond(0, Qword, SeccompCmpOp::MaskedEq(CLONE_NS_FLAGS), 0)?,
        ])?],
    );
    // Passed by this filter; the one of [`clone3_program`] answers ENOSYS.
    rules.insert(libc::SYS_clone3, Vec::new());
    compile(rules, SeccompAction::KillProcess, SeccompAction::Allow)
}

/// `clone3` fails with `ENOSYS` (its flags are in memory, which a filter cannot read), so
/// that glibc's `pthread_create` falls back to `clone`, which [`seccomp_program`] filters.
/// Installed next to it: the kernel runs both and takes the stricter verdict.
pub fn clone3_program() -> Result<BpfProgram, JailError> {
    let rules: BTreeMap<i64, Vec<SeccompRule>> =
        [(libc::SYS_clone3, Vec::new())].into_iter().collect();
    compile(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
    )
}

/// Installs the allow-list (and the `clone3` filter) on every thread of the process.
pub fn apply_seccomp() -> Result<(), JailError> {
    let clone3 = clone3_program()?;
    let prog = seccomp_program()?;
    seccompiler::apply_filter_all_threads(&clone3)
        .map_err(|e| JailError::Seccomp(e.to_string()))?;
    seccompiler::apply_filter_all_threads(&prog).map_err(|e| JailError::Seccomp(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allow_list_compiles_and_has_no_duplicates() {
        let prog = seccomp_program().unwrap();
        assert!(prog.len() > ALLOWED_SYSCALLS.len() + ALLOWED_IOCTLS.len());
        let mut v = ALLOWED_SYSCALLS.to_vec();
        v.sort();
        v.dedup();
        assert_eq!(v.len(), ALLOWED_SYSCALLS.len());
        let mut io: Vec<u32> = ALLOWED_IOCTLS.iter().map(|&(_, n)| n).collect();
        io.sort();
        io.dedup();
        assert_eq!(io.len(), ALLOWED_IOCTLS.len());
        // Things a compromised VMM would want must stay out (or behind argument checks).
        for bad in [
            libc::SYS_execve,
            libc::SYS_ptrace,
            libc::SYS_socket,
            libc::SYS_mount,
            libc::SYS_umount2,
            libc::SYS_pivot_root,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_setuid,
            libc::SYS_setresuid,
            libc::SYS_capset,
            libc::SYS_kill,
            libc::SYS_ioctl,
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_fork,
            libc::SYS_vfork,
            libc::SYS_mknod,
            libc::SYS_mknodat,
        ] {
            assert!(
                !ALLOWED_SYSCALLS.contains(&bad),
                "syscall {bad} must not be allowed unconditionally"
            );
        }
    }

    #[test]
    fn ioctl_numbers_match_the_kernel_abi() {
        let get = |name: &str| {
            ALLOWED_IOCTLS
                .iter()
                .find(|(n, _)| *n == name)
                .map(|&(_, v)| v)
                .unwrap()
        };
        // As seen with strace on this hypervisor and in <linux/kvm.h>.
        assert_eq!(get("KVM_CREATE_VM"), 0xae01);
        assert_eq!(get("KVM_RUN"), 0xae80);
        assert_eq!(get("KVM_GET_REGS"), 0x8090_ae81);
        assert_eq!(get("KVM_SET_SREGS"), 0x4138_ae84);
        assert_eq!(get("KVM_GET_MSRS"), 0xc008_ae88);
        assert_eq!(get("KVM_SET_USER_MEMORY_REGION"), 0x4020_ae46);
        assert_eq!(get("KVM_SET_IRQCHIP"), 0x8208_ae63);
        assert_eq!(get("KVM_GET_PIT2"), 0x8070_ae9f);
        assert_eq!(get("KVM_GET_XSAVE"), 0x9000_aea4);
        assert_eq!(get("TUNSETIFF"), 0x4004_54ca);
        let ids: Vec<u32> = ALLOWED_IOCTLS.iter().map(|&(_, n)| n).collect();
        for bad in [
            libc::TUNSETOWNER as u32,
            libc::TUNSETPERSIST as u32,
            libc::TIOCSTI as u32,
        ] {
            assert!(!ids.contains(&bad), "ioctl {bad:#x} must not be allowed");
        }
    }

    /// What a forked child that installed the filters did: exited with a code, or was
    /// killed by a signal.
    #[derive(Debug, PartialEq)]
    enum End {
        Exit(i32),
        Signal(i32),
    }

    /// Forks a child that installs both filters and runs `f` (raw syscalls only), exiting
    /// with its result.
    fn under_filter(f: fn() -> i32) -> End {
        let prog = seccomp_program().unwrap();
        let clone3 = clone3_program().unwrap();
        // SAFETY: the child only makes raw syscalls and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            unsafe {
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
                if seccompiler::apply_filter(&clone3).is_err()
                    || seccompiler::apply_filter(&prog).is_err()
                {
                    libc::_exit(100);
                }
                libc::_exit(f());
            }
        }
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        if libc::WIFSIGNALED(status) {
            End::Signal(libc::WTERMSIG(status))
        } else {
            End::Exit(libc::WEXITSTATUS(status))
        }
    }

    #[test]
    fn the_filter_kills_a_process_that_leaves_the_allow_list() {
        // Allowed: AF_UNIX sockets (vsock backend) and FIONBIO on them.
        let ok = under_filter(|| unsafe {
            libc::syscall(libc::SYS_getpid);
            let fd = libc::syscall(libc::SYS_socket, libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if fd < 0 {
                return 4;
            }
            let mut one: libc::c_int = 1;
            if libc::syscall(libc::SYS_ioctl, fd, libc::FIONBIO, &mut one) != 0 {
                return 5;
            }
            0
        });
        assert_eq!(ok, End::Exit(0));
        // Not allowed: a syscall off the list, an AF_INET socket, an ioctl off the list.
        for f in [
            (|| unsafe { libc::syscall(libc::SYS_getppid) as i32 }) as fn() -> i32,
            || unsafe {
                libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_DGRAM, 0) as i32
            },
            || unsafe {
                let c: u8 = b'x';
                libc::syscall(libc::SYS_ioctl, 2, libc::TIOCSTI, &c) as i32
            },
            || unsafe { libc::syscall(libc::SYS_ioctl, -1, libc::TUNSETOWNER, 0) as i32 },
        ] {
            assert_eq!(under_filter(f), End::Signal(libc::SIGSYS));
        }
    }

    #[test]
    fn clone_is_for_threads_only_and_clone3_is_refused() {
        // A new process (fork-like clone) or one in a new user namespace: killed.
        for flags in [
            libc::SIGCHLD as u64,
            (libc::CLONE_NEWUSER | libc::SIGCHLD) as u64,
            (libc::CLONE_VM | libc::CLONE_SIGHAND | libc::CLONE_THREAD | libc::CLONE_NEWNS) as u64,
        ] {
            static FLAGS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            FLAGS.store(flags, std::sync::atomic::Ordering::SeqCst);
            let end = under_filter(|| unsafe {
                let f = FLAGS.load(std::sync::atomic::Ordering::SeqCst);
                // A raw clone that returns in the child too: both exit at once.
                libc::syscall(libc::SYS_clone, f, 0, 0, 0, 0);
                0
            });
            assert_eq!(end, End::Signal(libc::SIGSYS), "clone flags {flags:#x}");
        }
        // clone3 answers ENOSYS (glibc then uses clone), whatever its arguments.
        let end = under_filter(|| unsafe {
            let args = [0u64; 11];
            let r = libc::syscall(
                libc::SYS_clone3,
                args.as_ptr(),
                std::mem::size_of_val(&args),
            );
            if r == -1 && *libc::__errno_location() == libc::ENOSYS {
                0
            } else {
                6
            }
        });
        assert_eq!(end, End::Exit(0));
    }
}
