//! Typed errors of the hypervisor library. Every failure a caller can act on has its own variant;
//! bad input (corrupt files, wrong shapes) is reported here, never by a panic.

use std::path::PathBuf;

/// Errors returned by the hypervisor library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("KVM is not usable: {0}")]
    KvmUnavailable(String),
    #[error("KVM ioctl {op} failed: {source}")]
    Kvm {
        op: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("invalid VM configuration: {0}")]
    InvalidConfig(String),
    #[error("guest memory: {0}")]
    Memory(String),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("system call {op} failed: {source}")]
    Sys {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("guest image does not fit: {0}")]
    Load(String),
    #[error("kernel loader: {0}")]
    Kernel(String),
    #[error("vCPU {vcpu}: {msg}")]
    Vcpu { vcpu: usize, msg: String },
    #[error("timed out waiting for {0}")]
    Timeout(String),
    #[error("the VM is in the wrong state for this operation: {0}")]
    WrongState(String),
    #[error("device bus: {0}")]
    Bus(String),
    #[error("snapshot {path}: {kind}")]
    Snapshot { path: PathBuf, kind: SnapshotError },
}

/// Why a snapshot (or a pause-to-disk image) was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SnapshotError {
    #[error("missing file {0}")]
    Missing(String),
    #[error("bad magic (not a cube vmstate file)")]
    BadMagic,
    #[error("unsupported format version {found} (this VMM reads {supported})")]
    UnsupportedVersion { found: u32, supported: u32 },
    #[error("checksum mismatch in {file}: stored {stored:#x}, computed {computed:#x}")]
    Checksum {
        file: String,
        stored: u64,
        computed: u64,
    },
    #[error("truncated or malformed {0}")]
    Malformed(String),
    #[error("manifest mismatch: {field}: snapshot has {snapshot}, expected {expected}")]
    Mismatch {
        field: &'static str,
        snapshot: String,
        expected: String,
    },
    #[error("memory file size {found} does not match the guest size {expected}")]
    MemorySize { found: u64, expected: u64 },
    #[error("KVM refused restored state: {0}")]
    StateRejected(String),
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn kvm(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
    move |source| Error::Kvm { op, source }
}

pub(crate) fn io(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { op, path, source }
}

pub(crate) fn sys(op: &'static str) -> Error {
    Error::Sys {
        op,
        source: std::io::Error::last_os_error(),
    }
}

pub(crate) fn snap(path: impl Into<PathBuf>, kind: SnapshotError) -> Error {
    Error::Snapshot {
        path: path.into(),
        kind,
    }
}
