//! Map keys and values shared with `bpf/cubevs.c`; layouts must match the C structs exactly.

use aya::Pod;

/// Layout version of the pinned maps; bump on any change to the structs below or to map
/// definitions, so that a new loader refuses (rather than misreads) an old node's pins.
/// 2: per-port flow tables (`cvs_port_flows`, map-in-map) replaced the shared `cvs_flows`.
pub(crate) const ABI_VERSION: u32 = 2;

pub(crate) const PORT_BOUND: u32 = 1;
pub(crate) const PORT_INTERNET: u32 = 2;
/// Userspace-only flag: the port was attached with TCX links (not read by the programs).
pub(crate) const PORT_TCX: u32 = 4;
/// TCP the rules deny goes to the node's egress proxy ([`crate::EgressPolicy::proxy_names`]).
pub(crate) const PORT_NAMES: u32 = 8;
/// The resolver answers with internet off too ([`crate::EgressPolicy::dns`]).
pub(crate) const PORT_DNS: u32 = 16;
/// The flags a policy sets (the rest belong to the port).
pub(crate) const POLICY_FLAGS: u32 = PORT_INTERNET | PORT_NAMES | PORT_DNS;

/// `skb->mark` of guest packets for the egress proxy (`PROXY_MARK` in the C source).
pub(crate) const PROXY_MARK: u32 = 0x0cbe_0001;

/// Set in a policy key's `ifindex` word for generation 1: a replacement is written under the
/// generation the port does not use, then the port flips, so the switch is never half-updated.
pub(crate) const POLICY_GEN_BIT: u32 = 0x8000_0000;

/// `PolicyVal::explicit` bits.
pub(crate) const RULE_EXPLICIT: u8 = 1;
pub(crate) const RULE_HOST_SERVICE: u8 = 2;

pub(crate) const ACT_ALLOW: u8 = 1;
pub(crate) const ACT_DENY: u8 = 2;

pub(crate) const MAP_CFG: &str = "cvs_cfg";
pub(crate) const MAP_PORTS: &str = "cvs_ports";
pub(crate) const MAP_POLICY: &str = "cvs_policy";
pub(crate) const MAP_EXPOSED: &str = "cvs_exposed";
pub(crate) const MAP_FLOWS: &str = "cvs_port_flows";
pub(crate) const MAP_STATS: &str = "cvs_stats";
pub(crate) const ALL_MAPS: &[&str] = &[
    MAP_CFG,
    MAP_PORTS,
    MAP_POLICY,
    MAP_EXPOSED,
    MAP_FLOWS,
    MAP_STATS,
];

pub(crate) const PROG_FROM_GUEST: &str = "cvs_from_guest";
pub(crate) const PROG_TO_GUEST: &str = "cvs_to_guest";

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Cfg {
    pub guest_ip: u32,
    pub gw_ip: u32,
    pub pool_net: u32,
    pub pool_mask: u32,
    pub guest_mac: [u8; 6],
    pub gw_mac: [u8; 6],
    pub abi_version: u32,
}
// SAFETY: repr(C), plain integers, no padding (4*4 + 12 + 4 = 32 bytes, alignment 4).
unsafe impl Pod for Cfg {}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PortVal {
    pub host_ip: u32,
    pub resolver: u32,
    pub flags: u32,
    /// 0 or 1: the half of the policy map this port's rules live in (see [`POLICY_GEN_BIT`]).
    pub policy_gen: u32,
}
// SAFETY: repr(C), plain integers, no padding.
unsafe impl Pod for PortVal {}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PolicyKeyData {
    pub ifindex: u32,
    pub addr: u32,
}
// SAFETY: repr(C), plain integers, no padding.
unsafe impl Pod for PolicyKeyData {}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PolicyVal {
    pub action: u8,
    /// `RULE_*` bits.
    pub explicit: u8,
    pub plen: u8,
    pub pad: u8,
}
// SAFETY: repr(C), plain bytes.
unsafe impl Pod for PolicyVal {}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct ExposedKey {
    pub ifindex: u32,
    pub port: u32,
}
// SAFETY: repr(C), plain integers, no padding.
unsafe impl Pod for ExposedKey {}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct FlowKey {
    pub remote_ip: u32,
    pub remote_port: u16,
    pub local_port: u16,
    pub proto: u32,
}
// SAFETY: repr(C), plain integers, no padding (4+2+2+4 = 12).
unsafe impl Pod for FlowKey {}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StatsVal {
    pub from_packets: u64,
    pub from_bytes: u64,
    pub from_drops: u64,
    pub to_packets: u64,
    pub to_bytes: u64,
    pub to_drops: u64,
}
// SAFETY: repr(C), plain integers, no padding.
unsafe impl Pod for StatsVal {}

/// IPv4 address as the programs store it (network byte order in memory).
pub(crate) fn ip_be(ip: std::net::Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

pub(crate) fn ip_from_be(v: u32) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::from(v.to_ne_bytes())
}
