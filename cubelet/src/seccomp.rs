//! The seccomp filter for namespace sandboxes: a deny list on top of the dropped capabilities.
//! Each entry is either host-wide state a sandbox must never touch (kexec, modules, clock,
//! swap, reboot, keyrings), a kernel attack surface the agent does not need (bpf,
//! perf_event_open, userfaultfd, io_uring), or a way to change the mount table (everything is
//! mounted before the agent starts).

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, SeccompRule, TargetArch};
use std::collections::BTreeMap;

/// Syscalls denied with EPERM.
pub const DENIED: &[(&str, i64)] = &[
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("fsopen", libc::SYS_fsopen),
    ("fsmount", libc::SYS_fsmount),
    ("fsconfig", libc::SYS_fsconfig),
    ("fspick", libc::SYS_fspick),
    ("move_mount", libc::SYS_move_mount),
    ("open_tree", libc::SYS_open_tree),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("reboot", libc::SYS_reboot),
    ("acct", libc::SYS_acct),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("adjtimex", libc::SYS_adjtimex),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("iopl", libc::SYS_iopl),
    ("ioperm", libc::SYS_ioperm),
    ("quotactl", libc::SYS_quotactl),
    ("syslog", libc::SYS_syslog),
    ("vhangup", libc::SYS_vhangup),
    ("setns", libc::SYS_setns),
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("kcmp", libc::SYS_kcmp),
    ("process_vm_writev", libc::SYS_process_vm_writev),
];

/// Compiles the filter for x86_64.
pub fn compile() -> Result<BpfProgram, String> {
    let rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|(_, n)| (*n, vec![])).collect();
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        TargetArch::x86_64,
    )
    .map_err(|e| format!("seccomp filter: {e}"))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| format!("seccomp compile: {e}"))
}

/// Installs a compiled filter on the calling thread without setting `no_new_privs`, so setuid
/// programs (sudo) still work inside the sandbox. Needs CAP_SYS_ADMIN, which the caller still
/// has in its effective set at this point.
pub fn install(prog: &BpfProgram) -> Result<(), std::io::Error> {
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
    Ok(())
}
