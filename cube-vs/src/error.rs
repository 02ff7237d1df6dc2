//! Typed errors of the switch.

use std::net::Ipv4Addr;

/// Everything the switch can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The crate was built without clang, so there is no eBPF object to load.
    #[error("the eBPF datapath was not built (clang missing at build time); install clang and libbpf-dev and rebuild")]
    NoDatapath,
    #[error("pinned datapath state under {root} has layout version {found}, this build needs {want}; detach the old switch (Switch::teardown of the old version) first")]
    IncompatiblePins { root: String, found: u32, want: u32 },
    #[error("invalid CIDR {0:?}: expected a.b.c.d/len with len <= 32")]
    InvalidCidr(String),
    #[error("invalid MAC address {0:?}: expected six hex bytes separated by ':'")]
    InvalidMac(String),
    #[error("interface {0:?} not found")]
    NoSuchInterface(String),
    #[error("interface index {0} is not attached to the switch")]
    NotAttached(u32),
    #[error("interface index {0} is not bound to a sandbox")]
    NotBound(u32),
    #[error("host address {addr} is outside the host pool {pool}")]
    OutsidePool { addr: Ipv4Addr, pool: String },
    #[error("host address {addr} is already bound to interface index {ifindex}")]
    AddressInUse { addr: Ipv4Addr, ifindex: u32 },
    #[error("host address pool {0} is exhausted")]
    PoolExhausted(String),
    #[error("host address pool {0} has no usable addresses (prefix too long)")]
    PoolTooSmall(String),
    #[error("flow quota {0} is outside {min}..={max}", min = crate::config::FLOW_QUOTA_RANGE.start(), max = crate::config::FLOW_QUOTA_RANGE.end())]
    InvalidFlowQuota(u32),
    #[error("too many policy entries for one sandbox ({0}, limit {1})")]
    PolicyTooLarge(usize, usize),
    #[error("bpffs at {path}: {source}")]
    Bpffs {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("eBPF program {name}: {source}")]
    Program {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("eBPF map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("pinning {path}: {source}")]
    Pin {
        path: String,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("pinned link {path}: {source}")]
    Link {
        path: String,
        #[source]
        source: aya::programs::links::LinkError,
    },
    #[error("netlink: {0}")]
    Netlink(String),
    #[error("nftables: {0}")]
    Nft(String),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn map_err(name: &'static str) -> impl FnOnce(aya::maps::MapError) -> Error {
    move |source| Error::Map { name, source }
}

pub(crate) fn prog_err(name: &'static str) -> impl FnOnce(aya::programs::ProgramError) -> Error {
    move |source| Error::Program { name, source }
}
