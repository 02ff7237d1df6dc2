//! Configuration shared by cubelet, cube-agent and the switch: the fixed guest identity, the
//! host address pool and where the switch pins its state.

use std::fmt;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::Error;

/// An Ethernet address, written `02:cb:e0:00:00:02` in configs.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for MacAddr {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for b in &mut out {
            let p = parts.next().ok_or_else(|| Error::InvalidMac(s.into()))?;
            if p.is_empty() || p.len() > 2 {
                return Err(Error::InvalidMac(s.into()));
            }
            *b = u8::from_str_radix(p, 16).map_err(|_| Error::InvalidMac(s.into()))?;
        }
        if parts.next().is_some() {
            return Err(Error::InvalidMac(s.into()));
        }
        Ok(MacAddr(out))
    }
}

impl Serialize for MacAddr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MacAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// An IPv4 network, written `10.233.0.0/16` (a bare address means `/32`). Host bits are
/// cleared on parse, so `10.1.2.3/8` is `10.0.0.0/8`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Cidr {
    addr: Ipv4Addr,
    len: u8,
}

impl Ipv4Cidr {
    /// Builds a network, clearing host bits. Fails when `len > 32`.
    pub fn new(addr: Ipv4Addr, len: u8) -> Result<Self, Error> {
        if len > 32 {
            return Err(Error::InvalidCidr(format!("{addr}/{len}")));
        }
        let a = u32::from(addr) & Self::mask_of(len);
        Ok(Ipv4Cidr {
            addr: a.into(),
            len,
        })
    }

    fn mask_of(len: u8) -> u32 {
        if len == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(len))
        }
    }

    /// The network address.
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix_len(&self) -> u8 {
        self.len
    }

    /// True for `0.0.0.0/0`.
    pub fn is_default(&self) -> bool {
        self.len == 0
    }

    /// The netmask as an integer.
    pub fn mask(&self) -> u32 {
        Self::mask_of(self.len)
    }

    /// Whether `ip` is inside this network.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.addr)
    }

    /// Number of addresses in the network.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.len))
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl fmt::Debug for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Ipv4Cidr {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::InvalidCidr(s.into());
        let (a, l) = match s.split_once('/') {
            Some((a, l)) => (a, l.parse::<u8>().map_err(|_| bad())?),
            None => (s, 32),
        };
        let addr: Ipv4Addr = a.trim().parse().map_err(|_| bad())?;
        Ipv4Cidr::new(addr, l).map_err(|_| bad())
    }
}

impl Serialize for Ipv4Cidr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Ipv4Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The network identity every guest has. One template memory image restores N times without a
/// guest-side fix-up because every sandbox sees exactly these values. cube-agent configures the
/// guest side from it, cubelet and the switch the host side.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GuestNetwork {
    /// The guest's address (`169.254.77.2`).
    pub guest_ip: Ipv4Addr,
    /// Prefix length of the guest's link network (`30`).
    pub prefix_len: u8,
    /// The default gateway the guest routes through (`169.254.77.1`).
    pub gateway_ip: Ipv4Addr,
    /// The guest NIC's MAC (`02:cb:e0:00:00:02`).
    pub guest_mac: MacAddr,
    /// The gateway's MAC, answered by the switch's ARP proxy (`02:cb:e0:00:00:01`).
    pub gateway_mac: MacAddr,
}

impl Default for GuestNetwork {
    fn default() -> Self {
        GuestNetwork {
            guest_ip: Ipv4Addr::new(169, 254, 77, 2),
            prefix_len: 30,
            gateway_ip: Ipv4Addr::new(169, 254, 77, 1),
            guest_mac: MacAddr([0x02, 0xcb, 0xe0, 0, 0, 0x02]),
            gateway_mac: MacAddr([0x02, 0xcb, 0xe0, 0, 0, 0x01]),
        }
    }
}

/// How programs are attached to an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AttachMode {
    /// Legacy netlink `cls_bpf` on a `clsact` qdisc: ~0.15 ms per interface. The filter lives
    /// on the device, so it survives the loader by construction.
    #[default]
    Netlink,
    /// TCX bpf links (kernel >= 6.6), pinned in bpffs: ~25 ms per interface on this kind of
    /// machine (an RCU grace period per hook).
    Tcx,
}

/// Configuration of the switch on one node (`[network]` in cubelet's TOML).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SwitchConfig {
    /// The fixed guest identity.
    pub guest: GuestNetwork,
    /// Node-local pool of per-sandbox host addresses (`10.233.0.0/16`).
    pub host_pool: Ipv4Cidr,
    /// Where maps, programs and links are pinned (`/sys/fs/bpf/cube`). A bpffs is mounted at
    /// `/sys/fs/bpf` (or at this directory when it lies elsewhere) if none is there.
    pub pin_root: PathBuf,
    /// How programs are attached.
    pub attach_mode: AttachMode,
    /// Masquerade sandbox traffic leaving the node (nftables table `nft_table`).
    pub masquerade: bool,
    /// Name of our own nftables table (family `ip`).
    pub nft_table: String,
    /// Most flow-table entries one sandbox may hold (`4096`; 64 to 1048576): each port gets
    /// its own table of this size, so a sandbox opening more flows (e.g. UDP to many peers)
    /// only recycles its own least recently used entries, never another sandbox's. The table
    /// is preallocated at attach, about 90 bytes per entry (~350 KiB per port by default).
    /// A change applies to ports attached or unbound after it.
    pub flow_quota: u32,
    /// Where the node's egress proxy listens: TCP that a sandbox's rules deny while its
    /// policy allows names ([`crate::EgressPolicy::proxy_names`]) is DNATed there. `None`:
    /// no proxy, and such TCP is dropped like any other denied packet.
    pub egress_proxy: Option<std::net::SocketAddrV4>,
}

/// Bounds of [`SwitchConfig::flow_quota`]. Below the minimum the kernel's LRU (which keeps
/// per-CPU free lists) evicts well before the table is full.
pub const FLOW_QUOTA_RANGE: std::ops::RangeInclusive<u32> = 64..=1 << 20;
/// Default of [`SwitchConfig::flow_quota`].
pub const DEFAULT_FLOW_QUOTA: u32 = 4096;

impl Default for SwitchConfig {
    fn default() -> Self {
        SwitchConfig {
            guest: GuestNetwork::default(),
            host_pool: Ipv4Cidr {
                addr: Ipv4Addr::new(10, 233, 0, 0),
                len: 16,
            },
            pin_root: PathBuf::from("/sys/fs/bpf/cube"),
            attach_mode: AttachMode::Netlink,
            masquerade: true,
            nft_table: "cube_vs".into(),
            flow_quota: DEFAULT_FLOW_QUOTA,
            egress_proxy: None,
        }
    }
}
