//! The switch: loads (or re-adopts) the datapath once per node and wires sandboxes onto it.

use std::collections::{BTreeMap, BTreeSet, HashMap as StdHashMap};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap, HashOfMaps, Map, MapData};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle};
use aya::programs::{LinkOrder, SchedClassifier, TcAttachType};
use aya::{Ebpf, EbpfLoader};
use serde::{Deserialize, Serialize};

use crate::abi::*;
use crate::config::{AttachMode, Ipv4Cidr, SwitchConfig, FLOW_QUOTA_RANGE};
use crate::error::{map_err, prog_err, Error, Result};
use crate::policy::EgressPolicy;
use crate::{bpffs, nft, route};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/cubevs.o"));

/// Ports every sandbox exposes to the edge: envd and the code interpreter.
pub const DEFAULT_EXPOSED_PORTS: [u16; 2] = [49983, 49999];

/// In [`SandboxNet::exposed_ports`]: every guest port (E2B's public ports, reached through the
/// edge by `Host: <port>-<id>.<domain>`). Still only for connections the node opens.
pub const ANY_PORT: u16 = 0;

/// Fixed tc priority and handle of our filters, so that a restarted loader can find and
/// atomically replace them.
const TC_PRIORITY: u16 = 0xcb;
const TC_HANDLE: TcHandle = TcHandle::new(0, 0xcb);

/// Most policy entries one sandbox may have (built-ins included).
pub const MAX_POLICY_ENTRIES: usize = 1024;

/// Whether this build carries the eBPF object (clang was available at build time).
pub fn datapath_built() -> bool {
    !OBJECT.is_empty()
}

/// An interface attached to the switch (a pool entry); cheap to copy around.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Port {
    /// Interface index in the switch's network namespace.
    pub ifindex: u32,
    /// Interface name at attach time.
    pub ifname: String,
}

/// What a sandbox gets when it is bound to a port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNet {
    /// The sandbox's unique node-local address (from [`crate::AddrPool`]).
    pub host_addr: Ipv4Addr,
    /// Egress policy.
    pub policy: EgressPolicy,
    /// Guest ports the node's edge may open connections to (TCP and UDP). Include
    /// [`DEFAULT_EXPOSED_PORTS`] ([`SandboxNet::new`] does), or [`ANY_PORT`] for all.
    pub exposed_ports: Vec<u16>,
}

impl SandboxNet {
    /// Default policy, default exposed ports.
    pub fn new(host_addr: Ipv4Addr) -> Self {
        SandboxNet {
            host_addr,
            policy: EgressPolicy::default(),
            exposed_ports: DEFAULT_EXPOSED_PORTS.to_vec(),
        }
    }
}

/// Counters of one direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirCounters {
    pub packets: u64,
    pub bytes: u64,
    pub drops: u64,
}

/// Counters of one port, by direction as seen from the sandbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Packets the guest sent.
    pub from_guest: DirCounters,
    /// Packets delivered to the guest.
    pub to_guest: DirCounters,
}

/// A port as found in the pinned state (see [`Switch::adopt_existing`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortInfo {
    pub port: Port,
    pub attach_mode: AttachMode,
    /// `Some` when a sandbox is bound.
    pub host_addr: Option<Ipv4Addr>,
    pub internet: bool,
    pub dns_resolver: Option<Ipv4Addr>,
    pub exposed_ports: Vec<u16>,
}

#[derive(Debug, Default, Clone)]
struct PortState {
    ifname: String,
    val: PortVal,
    /// Every policy key of this port, either generation: (ifindex word, CIDR length, addr in
    /// map order).
    policy_keys: BTreeSet<(u32, u32, u32)>,
    exposed: BTreeSet<u16>,
}

/// The loaded datapath of one node. Not `Sync`: cubelet wraps it in a mutex.
pub struct Switch {
    cfg: SwitchConfig,
    ebpf: Ebpf,
    ports: HashMap<MapData, u32, PortVal>,
    policy: LpmTrie<MapData, PolicyKeyData, PolicyVal>,
    exposed: HashMap<MapData, ExposedKey, u32>,
    /// ifindex -> that port's own flow table (see `bpf/cubevs.c`).
    flows: HashOfMaps<MapData, u32, FlowTable>,
    stats: HashMap<MapData, u32, StatsVal>,
    state: BTreeMap<u32, PortState>,
    by_addr: StdHashMap<Ipv4Addr, u32>,
}

/// One port's flow table.
type FlowTable = HashMap<MapData, FlowKey, u32>;

/// A fresh, empty flow table of `entries` entries (an LRU hash like the object's template; the
/// kernel lets hash inner maps differ from the template in size only).
fn new_flow_table(entries: u32) -> Result<FlowTable> {
    use aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_LRU_HASH;
    let obj = aya_obj::Map::new_from_params(
        BPF_MAP_TYPE_LRU_HASH as u32,
        std::mem::size_of::<FlowKey>() as u32,
        std::mem::size_of::<u32>() as u32,
        entries,
        0,
    );
    let md = MapData::create(obj, "cvs_flows", None).map_err(map_err(MAP_FLOWS))?;
    FlowTable::try_from(Map::LruHashMap(md)).map_err(map_err(MAP_FLOWS))
}

fn ifname_of(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf has IF_NAMESIZE bytes as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: if_indextoname wrote a NUL-terminated string into buf.
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Some(s.to_string_lossy().into_owned())
}

/// The result of an operation on a link that may vanish under us (a sandbox's namespace torn
/// down by the kernel, which deletes its veth asynchronously): once the link is gone there is
/// nothing left to undo on it, so its failure is not one.
fn unless_gone(ifindex: u32, r: Result<()>) -> Result<()> {
    match r {
        Err(_) if ifname_of(ifindex).is_none() => Ok(()),
        r => r,
    }
}

fn ifindex_of(name: &str) -> Result<u32> {
    let c = std::ffi::CString::new(name).map_err(|_| Error::NoSuchInterface(name.into()))?;
    // SAFETY: c is a valid NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        Err(Error::NoSuchInterface(name.into()))
    } else {
        Ok(idx)
    }
}

fn take<V: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<V> {
    let m = ebpf.take_map(name).ok_or(Error::Map {
        name,
        source: aya::maps::MapError::InvalidName {
            name: name.to_string(),
        },
    })?;
    V::try_from(m).map_err(map_err(name))
}

fn policy_key(word: u32, len: u32, addr: u32) -> Key<PolicyKeyData> {
    Key::new(
        32 + len,
        PolicyKeyData {
            ifindex: word,
            addr,
        },
    )
}

fn is_not_found(e: &aya::maps::MapError) -> bool {
    matches!(e, aya::maps::MapError::KeyNotFound)
        || matches!(e, aya::maps::MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::ENOENT))
}

impl Switch {
    /// Loads the datapath, or re-adopts the one a previous (possibly killed) loader left pinned:
    /// maps are reused, the programs are reloaded and atomically swapped into every attached
    /// interface, and ports whose interface disappeared meanwhile are forgotten. Also installs
    /// the masquerade table. Takes 60–120 ms; call it once at daemon start.
    pub fn open(cfg: SwitchConfig) -> Result<Switch> {
        if OBJECT.is_empty() {
            return Err(Error::NoDatapath);
        }
        if cfg.host_pool.prefix_len() > 30 {
            return Err(Error::PoolTooSmall(cfg.host_pool.to_string()));
        }
        if !FLOW_QUOTA_RANGE.contains(&cfg.flow_quota) {
            return Err(Error::InvalidFlowQuota(cfg.flow_quota));
        }
        bpffs::ensure(&cfg.pin_root)?;
        let map_paths: Vec<(&'static str, PathBuf)> = ALL_MAPS
            .iter()
            .map(|&n| (n, cfg.pin_root.join("maps").join(n)))
            .collect();
        let mut loader = EbpfLoader::new();
        for (n, p) in &map_paths {
            loader.map_pin_path(n, p.as_path());
        }
        let mut ebpf = loader.load(OBJECT)?;
        for name in [PROG_FROM_GUEST, PROG_TO_GUEST] {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or(Error::Program {
                    name,
                    source: aya::programs::ProgramError::UnexpectedProgramType,
                })?
                .try_into()
                .map_err(prog_err(name))?;
            prog.load().map_err(prog_err(name))?;
            // Pinned for inspection (bpftool) and so the programs outlive the loader in TCX mode.
            let pin = cfg.pin_root.join("progs").join(name);
            let _ = std::fs::remove_file(&pin);
            prog.pin(&pin).map_err(|source| Error::Pin {
                path: pin.display().to_string(),
                source,
            })?;
        }

        let mut cfg_map: aya::maps::Array<MapData, Cfg> = take(&mut ebpf, MAP_CFG)?;
        let found = cfg_map.get(&0, 0).map_err(map_err(MAP_CFG))?.abi_version;
        if found != 0 && found != ABI_VERSION {
            return Err(Error::IncompatiblePins {
                root: cfg.pin_root.display().to_string(),
                found,
                want: ABI_VERSION,
            });
        }
        let g = &cfg.guest;
        cfg_map
            .set(
                0,
                Cfg {
                    guest_ip: ip_be(g.guest_ip),
                    gw_ip: ip_be(g.gateway_ip),
                    pool_net: ip_be(cfg.host_pool.addr()),
                    pool_mask: cfg.host_pool.mask().to_be(),
                    guest_mac: g.guest_mac.0,
                    gw_mac: g.gateway_mac.0,
                    abi_version: ABI_VERSION,
                },
                0,
            )
            .map_err(map_err(MAP_CFG))?;

        let mut sw = Switch {
            ports: take(&mut ebpf, MAP_PORTS)?,
            policy: take(&mut ebpf, MAP_POLICY)?,
            exposed: take(&mut ebpf, MAP_EXPOSED)?,
            flows: take(&mut ebpf, MAP_FLOWS)?,
            stats: take(&mut ebpf, MAP_STATS)?,
            ebpf,
            cfg,
            state: BTreeMap::new(),
            by_addr: StdHashMap::new(),
        };
        sw.rebuild_state()?;
        sw.readopt_attachments()?;
        if sw.cfg.masquerade || sw.cfg.egress_proxy.is_some() {
            nft::install(
                &sw.cfg.nft_table,
                sw.cfg.host_pool,
                sw.cfg.masquerade,
                sw.cfg.egress_proxy,
            )?;
        }
        if std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").is_ok_and(|s| s.trim() == "0") {
            tracing::warn!(
                "net.ipv4.ip_forward is 0: sandboxes cannot reach anything beyond the node"
            );
        }
        tracing::info!(
            ports = sw.state.len(),
            root = %sw.cfg.pin_root.display(),
            "cube-vs datapath ready"
        );
        Ok(sw)
    }

    /// The configuration the switch runs with.
    pub fn config(&self) -> &SwitchConfig {
        &self.cfg
    }

    fn rebuild_state(&mut self) -> Result<()> {
        let mut state = BTreeMap::new();
        for item in self.ports.iter() {
            let (ifindex, val) = item.map_err(map_err(MAP_PORTS))?;
            state.insert(
                ifindex,
                PortState {
                    ifname: String::new(),
                    val,
                    ..Default::default()
                },
            );
        }
        for item in self.policy.keys() {
            let k = item.map_err(map_err(MAP_POLICY))?;
            let d = k.data();
            // Keys of the generation a port does not use are leftovers of an interrupted
            // update; the port's next policy write removes them.
            if let Some(s) = state.get_mut(&(d.ifindex & !POLICY_GEN_BIT)) {
                s.policy_keys
                    .insert((d.ifindex, k.prefix_len() - 32, d.addr));
            }
        }
        for item in self.exposed.keys() {
            let k = item.map_err(map_err(MAP_EXPOSED))?;
            if let Some(s) = state.get_mut(&k.ifindex) {
                s.exposed.insert(k.port as u16);
            }
        }
        self.by_addr.clear();
        for (&ifindex, s) in &state {
            if s.val.flags & PORT_BOUND != 0 {
                self.by_addr.insert(ip_from_be(s.val.host_ip), ifindex);
            }
        }
        self.state = state;
        Ok(())
    }

    /// Swaps the freshly loaded programs into every port left by a previous loader.
    fn readopt_attachments(&mut self) -> Result<()> {
        let ifindexes: Vec<u32> = self.state.keys().copied().collect();
        for ifindex in ifindexes {
            let Some(name) = ifname_of(ifindex) else {
                tracing::info!(
                    ifindex,
                    "interface vanished while the switch was down; forgetting it"
                );
                self.forget(ifindex)?;
                continue;
            };
            let tcx = self.state[&ifindex].val.flags & PORT_TCX != 0;
            if let Some(s) = self.state.get_mut(&ifindex) {
                s.ifname = name.clone();
            }
            // Attach always creates one; a port without (a crash in between) would drop all
            // IP traffic.
            if let Err(e) = self.flows.get(&ifindex, 0) {
                if !is_not_found(&e) {
                    return Err(map_err(MAP_FLOWS)(e));
                }
                self.reset_flows(ifindex)?;
            }
            let r = if tcx {
                self.replace_tcx(ifindex)
            } else {
                self.replace_netlink(&name)
            };
            if let Err(e) = r {
                // No filter/link of ours on that interface any more (it was deleted and its index
                // reused, or someone removed the filter): nothing enforces there, so forget it.
                tracing::warn!(ifindex, error = %e, "port lost its programs while the switch was down; forgetting it");
                let bound = self.state[&ifindex].val;
                if bound.flags & PORT_BOUND != 0 {
                    let _ = route::del_host_route(ip_from_be(bound.host_ip), ifindex);
                }
                self.forget(ifindex)?;
            }
        }
        Ok(())
    }

    fn prog(&mut self, name: &'static str) -> Result<&mut SchedClassifier> {
        self.ebpf
            .program_mut(name)
            .ok_or(Error::Program {
                name,
                source: aya::programs::ProgramError::UnexpectedProgramType,
            })?
            .try_into()
            .map_err(prog_err(name))
    }

    fn replace_netlink(&mut self, ifname: &str) -> Result<()> {
        for (name, dir) in [
            (PROG_FROM_GUEST, TcAttachType::Ingress),
            (PROG_TO_GUEST, TcAttachType::Egress),
        ] {
            let link = SchedClassifierLink::attached(ifname, dir, TC_PRIORITY, TC_HANDLE, None)?;
            let prog = self.prog(name)?;
            let id = prog.attach_to_link(link).map_err(prog_err(name))?;
            let link = prog.take_link(id).map_err(prog_err(name))?;
            // Dropping a netlink link detaches it; the filter must outlive this process.
            std::mem::forget(link);
        }
        Ok(())
    }

    fn link_pin(&self, ifindex: u32, dir: &str) -> PathBuf {
        self.cfg
            .pin_root
            .join("links")
            .join(format!("{ifindex}-{dir}"))
    }

    fn replace_tcx(&mut self, ifindex: u32) -> Result<()> {
        for (name, dir) in [(PROG_FROM_GUEST, "ingress"), (PROG_TO_GUEST, "egress")] {
            let path = self.link_pin(ifindex, dir);
            let pinned = PinnedLink::from_pin(&path).map_err(|source| Error::Link {
                path: path.display().to_string(),
                source,
            })?;
            let link: SchedClassifierLink =
                FdLink::from(pinned)
                    .try_into()
                    .map_err(|source| Error::Link {
                        path: path.display().to_string(),
                        source,
                    })?;
            let prog = self.prog(name)?;
            let id = prog.attach_to_link(link).map_err(prog_err(name))?;
            // The pin keeps the (now updated) link; our fd can go.
            drop(prog.take_link(id).map_err(prog_err(name))?);
        }
        Ok(())
    }

    /// Attaches the datapath to an interface by name (pool-fill time, never on a create path).
    /// The port drops everything until [`Switch::bind`]. Idempotent.
    pub fn attach(&mut self, ifname: &str) -> Result<Port> {
        let ifindex = ifindex_of(ifname)?;
        if self.state.contains_key(&ifindex) {
            return Ok(Port {
                ifindex,
                ifname: ifname.to_string(),
            });
        }
        let mode = self.cfg.attach_mode;
        let val = PortVal {
            flags: if mode == AttachMode::Tcx { PORT_TCX } else { 0 },
            ..Default::default()
        };
        // State first: from the first packet on, the programs find an unbound port and drop.
        self.reset_flows(ifindex)?;
        self.ports
            .insert(ifindex, val, 0)
            .map_err(map_err(MAP_PORTS))?;
        self.stats
            .insert(ifindex, StatsVal::default(), 0)
            .map_err(map_err(MAP_STATS))?;
        self.state.insert(
            ifindex,
            PortState {
                ifname: ifname.to_string(),
                val,
                ..Default::default()
            },
        );
        let r = match mode {
            AttachMode::Netlink => self.attach_netlink(ifname),
            AttachMode::Tcx => self.attach_tcx(ifname, ifindex),
        };
        if let Err(e) = r {
            let _ = self.forget(ifindex);
            return Err(e);
        }
        Ok(Port {
            ifindex,
            ifname: ifname.to_string(),
        })
    }

    /// Attaches by interface index.
    pub fn attach_ifindex(&mut self, ifindex: u32) -> Result<Port> {
        let name = ifname_of(ifindex).ok_or_else(|| Error::NoSuchInterface(ifindex.to_string()))?;
        self.attach(&name)
    }

    fn attach_netlink(&mut self, ifname: &str) -> Result<()> {
        match tc::qdisc_add_clsact(ifname) {
            Ok(()) => {}
            Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => {
                return Err(Error::Netlink(format!("adding clsact to {ifname}: {e}")));
            }
        }
        for (name, dir) in [
            (PROG_FROM_GUEST, TcAttachType::Ingress),
            (PROG_TO_GUEST, TcAttachType::Egress),
        ] {
            let prog = self.prog(name)?;
            let id = match prog.attach_with_options(
                ifname,
                dir,
                TcAttachOptions::Netlink(NlOptions {
                    priority: TC_PRIORITY,
                    handle: TC_HANDLE,
                    classid: None,
                }),
            ) {
                Ok(id) => id,
                Err(_) => {
                    // A filter of ours is already there (left by a loader that lost its state):
                    // replace it atomically.
                    let link =
                        SchedClassifierLink::attached(ifname, dir, TC_PRIORITY, TC_HANDLE, None)?;
                    prog.attach_to_link(link).map_err(prog_err(name))?
                }
            };
            let link = prog.take_link(id).map_err(prog_err(name))?;
            std::mem::forget(link);
        }
        Ok(())
    }

    fn attach_tcx(&mut self, ifname: &str, ifindex: u32) -> Result<()> {
        for (name, dir, tag) in [
            (PROG_FROM_GUEST, TcAttachType::Ingress, "ingress"),
            (PROG_TO_GUEST, TcAttachType::Egress, "egress"),
        ] {
            let path = self.link_pin(ifindex, tag);
            let _ = std::fs::remove_file(&path);
            let prog = self.prog(name)?;
            let id = prog
                .attach_with_options(ifname, dir, TcAttachOptions::TcxOrder(LinkOrder::default()))
                .map_err(prog_err(name))?;
            let link = prog.take_link(id).map_err(prog_err(name))?;
            let fd: FdLink = link.try_into().map_err(|source| Error::Link {
                path: path.display().to_string(),
                source,
            })?;
            fd.pin(&path).map_err(|source| Error::Pin {
                path: path.display().to_string(),
                source,
            })?;
        }
        Ok(())
    }

    fn port_state(&self, port: &Port) -> Result<&PortState> {
        self.state
            .get(&port.ifindex)
            .ok_or(Error::NotAttached(port.ifindex))
    }

    /// Binds a sandbox to an attached port (the create path: map updates and one route, a
    /// few tens of µs). Rebinding a bound port replaces its sandbox.
    pub fn bind(&mut self, port: &Port, net: &SandboxNet) -> Result<()> {
        let old = self.port_state(port)?.val;
        let addr = net.host_addr;
        let pool = self.cfg.host_pool;
        let first = u32::from(pool.addr()) + 1;
        let last = u32::from(pool.addr()) + (pool.size() as u32 - 2);
        if !(first..=last).contains(&u32::from(addr)) {
            return Err(Error::OutsidePool {
                addr,
                pool: pool.to_string(),
            });
        }
        if let Some(&other) = self.by_addr.get(&addr) {
            if other != port.ifindex {
                return Err(Error::AddressInUse {
                    addr,
                    ifindex: other,
                });
            }
        }
        if old.flags & PORT_BOUND != 0 && old.host_ip != ip_be(addr) {
            self.unbind(port)?;
        }
        let gen = self.stage_policy(port.ifindex, &net.policy)?;
        self.write_exposed(port.ifindex, &net.exposed_ports)?;
        // Flows of a previous sandbox were dropped by its unbind (a fresh table).
        self.stats
            .insert(port.ifindex, StatsVal::default(), 0)
            .map_err(map_err(MAP_STATS))?;
        route::add_host_route(addr, port.ifindex)?;
        route::add_host_neigh(addr, port.ifindex, self.cfg.guest.guest_mac.0)?;
        let val = PortVal {
            host_ip: ip_be(addr),
            resolver: net.policy.dns_resolver.map(ip_be).unwrap_or(0),
            flags: PORT_BOUND | (old.flags & PORT_TCX) | net.policy.port_flags(),
            policy_gen: gen,
        };
        self.ports
            .insert(port.ifindex, val, 0)
            .map_err(map_err(MAP_PORTS))?;
        if let Some(s) = self.state.get_mut(&port.ifindex) {
            s.val = val;
        }
        self.by_addr.insert(addr, port.ifindex);
        self.prune_policy(port.ifindex)
    }

    /// Replaces the egress policy of a bound sandbox at run time, atomically: the new rules
    /// are written beside the old ones and one port update switches to them.
    pub fn set_policy(&mut self, port: &Port, policy: &EgressPolicy) -> Result<()> {
        let old = self.port_state(port)?.val;
        if old.flags & PORT_BOUND == 0 {
            return Err(Error::NotBound(port.ifindex));
        }
        let gen = self.stage_policy(port.ifindex, policy)?;
        let val = PortVal {
            resolver: policy.dns_resolver.map(ip_be).unwrap_or(0),
            flags: (old.flags & !POLICY_FLAGS) | policy.port_flags(),
            policy_gen: gen,
            ..old
        };
        self.ports
            .insert(port.ifindex, val, 0)
            .map_err(map_err(MAP_PORTS))?;
        if let Some(s) = self.state.get_mut(&port.ifindex) {
            s.val = val;
        }
        self.prune_policy(port.ifindex)
    }

    /// Replaces the set of exposed guest ports of a bound sandbox.
    pub fn set_exposed_ports(&mut self, port: &Port, ports: &[u16]) -> Result<()> {
        if self.port_state(port)?.val.flags & PORT_BOUND == 0 {
            return Err(Error::NotBound(port.ifindex));
        }
        self.write_exposed(port.ifindex, ports)
    }

    /// Writes `policy` under the generation the port does not use (packets do not see it yet)
    /// and returns that generation, for the caller to switch the port to.
    fn stage_policy(&mut self, ifindex: u32, policy: &EgressPolicy) -> Result<u32> {
        let rules = policy.compile();
        if rules.len() > MAX_POLICY_ENTRIES {
            return Err(Error::PolicyTooLarge(rules.len(), MAX_POLICY_ENTRIES));
        }
        let gen = self
            .state
            .get(&ifindex)
            .map(|s| s.val.policy_gen ^ 1)
            .unwrap_or(0);
        let word = ifindex | if gen == 1 { POLICY_GEN_BIT } else { 0 };
        let mut staged = BTreeSet::new();
        for (cidr, rule) in &rules {
            let addr = ip_be(cidr.addr());
            let len = u32::from(cidr.prefix_len());
            let val = PolicyVal {
                action: if rule.allow { ACT_ALLOW } else { ACT_DENY },
                explicit: if rule.explicit { RULE_EXPLICIT } else { 0 }
                    | if rule.host_service {
                        RULE_HOST_SERVICE
                    } else {
                        0
                    },
                plen: cidr.prefix_len(),
                pad: 0,
            };
            self.policy
                .insert(&policy_key(word, len, addr), val, 0)
                .map_err(map_err(MAP_POLICY))?;
            staged.insert((word, len, addr));
        }
        // Leftovers of an interrupted update in this generation that the new policy lacks.
        let left: Vec<_> = self
            .state
            .get(&ifindex)
            .map(|s| {
                s.policy_keys
                    .iter()
                    .filter(|k| k.0 == word && !staged.contains(k))
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        self.remove_policy_keys(ifindex, &left)?;
        if let Some(s) = self.state.get_mut(&ifindex) {
            s.policy_keys.extend(staged);
        }
        Ok(gen)
    }

    /// Removes the keys of the generation the port no longer uses (after it switched).
    fn prune_policy(&mut self, ifindex: u32) -> Result<()> {
        let Some(s) = self.state.get(&ifindex) else {
            return Ok(());
        };
        let live = ifindex
            | if s.val.policy_gen == 1 {
                POLICY_GEN_BIT
            } else {
                0
            };
        let old: Vec<_> = s
            .policy_keys
            .iter()
            .filter(|k| k.0 != live)
            .copied()
            .collect();
        self.remove_policy_keys(ifindex, &old)
    }

    fn remove_policy_keys(&mut self, ifindex: u32, keys: &[(u32, u32, u32)]) -> Result<()> {
        for &(word, len, addr) in keys {
            match self.policy.remove(&policy_key(word, len, addr)) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(MAP_POLICY)(e)),
            }
            if let Some(s) = self.state.get_mut(&ifindex) {
                s.policy_keys.remove(&(word, len, addr));
            }
        }
        Ok(())
    }

    /// Entries in the policy map for this port, both generations (for tests and diagnostics).
    pub fn policy_entries(&self, port: &Port) -> Result<usize> {
        self.port_state(port)?;
        let mut n = 0;
        for item in self.policy.keys() {
            let k = item.map_err(map_err(MAP_POLICY))?;
            if k.data().ifindex & !POLICY_GEN_BIT == port.ifindex {
                n += 1;
            }
        }
        Ok(n)
    }

    fn write_exposed(&mut self, ifindex: u32, ports: &[u16]) -> Result<()> {
        let new: BTreeSet<u16> = ports.iter().copied().collect();
        for &p in &new {
            self.exposed
                .insert(
                    ExposedKey {
                        ifindex,
                        port: u32::from(p),
                    },
                    1,
                    0,
                )
                .map_err(map_err(MAP_EXPOSED))?;
        }
        let old = self
            .state
            .get(&ifindex)
            .map(|s| s.exposed.clone())
            .unwrap_or_default();
        for &p in old.difference(&new) {
            match self.exposed.remove(&ExposedKey {
                ifindex,
                port: u32::from(p),
            }) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(MAP_EXPOSED)(e)),
            }
        }
        if let Some(s) = self.state.get_mut(&ifindex) {
            s.exposed = new;
        }
        Ok(())
    }

    /// Gives the port a fresh, empty flow table of the configured quota: one atomic map
    /// update; the old table is freed by the kernel once no program uses it.
    fn reset_flows(&mut self, ifindex: u32) -> Result<()> {
        let table = new_flow_table(self.cfg.flow_quota)?;
        self.flows
            .insert(ifindex, &table, 0)
            .map_err(map_err(MAP_FLOWS))
    }

    /// Number of flow entries the port holds now (at most [`SwitchConfig::flow_quota`]);
    /// walks the port's table, so for diagnostics and tests, not hot paths.
    pub fn flow_count(&self, port: &Port) -> Result<usize> {
        self.port_state(port)?;
        let table = match self.flows.get(&port.ifindex, 0) {
            Ok(t) => t,
            Err(e) if is_not_found(&e) => return Ok(0),
            Err(e) => return Err(map_err(MAP_FLOWS)(e)),
        };
        // A key evicted under the walk makes the kernel restart it from the first key: dedupe,
        // and bound the walk so that a busy table cannot keep it going.
        let mut seen = std::collections::HashSet::new();
        let bound = 2 * *FLOW_QUOTA_RANGE.end() as usize;
        for k in table.keys().take(bound) {
            seen.insert(k.map_err(map_err(MAP_FLOWS))?);
        }
        Ok(seen.len())
    }

    /// Unbinds the sandbox from its port (the port drops everything again and can be reused).
    /// Returns the host address it had, for [`crate::AddrPool::release`].
    pub fn unbind(&mut self, port: &Port) -> Result<Option<Ipv4Addr>> {
        let old = self.port_state(port)?.val;
        if old.flags & PORT_BOUND == 0 {
            return Ok(None);
        }
        let val = PortVal {
            flags: old.flags & PORT_TCX,
            ..Default::default()
        };
        // Disable first: from here on the port drops everything.
        self.ports
            .insert(port.ifindex, val, 0)
            .map_err(map_err(MAP_PORTS))?;
        if let Some(s) = self.state.get_mut(&port.ifindex) {
            s.val = val;
        }
        let addr = ip_from_be(old.host_ip);
        self.by_addr.remove(&addr);
        if ifname_of(port.ifindex).is_some() {
            unless_gone(port.ifindex, route::del_host_route(addr, port.ifindex))?;
            unless_gone(port.ifindex, route::del_host_neigh(addr, port.ifindex))?;
        }
        self.clear_policy(port.ifindex)?;
        self.write_exposed(port.ifindex, &[])?;
        self.reset_flows(port.ifindex)?;
        Ok(Some(addr))
    }

    fn clear_policy(&mut self, ifindex: u32) -> Result<()> {
        let keys: Vec<_> = self
            .state
            .get(&ifindex)
            .map(|s| s.policy_keys.iter().copied().collect())
            .unwrap_or_default();
        self.remove_policy_keys(ifindex, &keys)
    }

    /// Removes the programs from an interface and forgets it (unbinding first). An interface
    /// that no longer exists is simply forgotten.
    pub fn detach(&mut self, port: &Port) -> Result<()> {
        let st = self.port_state(port)?.clone();
        self.unbind(port)?;
        if let Some(name) = ifname_of(port.ifindex) {
            if st.val.flags & PORT_TCX != 0 {
                for dir in ["ingress", "egress"] {
                    let _ = std::fs::remove_file(self.link_pin(port.ifindex, dir));
                }
            } else {
                for (prog, dir) in [
                    (PROG_FROM_GUEST, TcAttachType::Ingress),
                    (PROG_TO_GUEST, TcAttachType::Egress),
                ] {
                    let r = match tc::qdisc_detach_program(&name, dir, prog) {
                        Ok(()) => Ok(()),
                        Err(tc::TcError::IoError(e))
                            if e.kind() == std::io::ErrorKind::NotFound =>
                        {
                            Ok(())
                        }
                        Err(e) => Err(Error::Netlink(format!("detaching from {name}: {e}"))),
                    };
                    unless_gone(port.ifindex, r)?;
                }
            }
        } else {
            for dir in ["ingress", "egress"] {
                let _ = std::fs::remove_file(self.link_pin(port.ifindex, dir));
            }
        }
        self.forget(port.ifindex)
    }

    fn forget(&mut self, ifindex: u32) -> Result<()> {
        let _ = self.clear_policy(ifindex);
        let _ = self.write_exposed(ifindex, &[]);
        if let Some(s) = self.state.remove(&ifindex) {
            if s.val.flags & PORT_BOUND != 0 {
                self.by_addr.remove(&ip_from_be(s.val.host_ip));
            }
        }
        for dir in ["ingress", "egress"] {
            let _ = std::fs::remove_file(self.link_pin(ifindex, dir));
        }
        for r in [
            self.ports.remove(&ifindex),
            self.stats.remove(&ifindex),
            self.flows.remove(&ifindex),
        ] {
            match r {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(MAP_PORTS)(e)),
            }
        }
        Ok(())
    }

    /// Packet, byte and drop counters of a port.
    pub fn counters(&self, ifindex: u32) -> Result<Counters> {
        if !self.state.contains_key(&ifindex) {
            return Err(Error::NotAttached(ifindex));
        }
        let s = match self.stats.get(&ifindex, 0) {
            Ok(s) => s,
            Err(e) if is_not_found(&e) => StatsVal::default(),
            Err(e) => return Err(map_err(MAP_STATS)(e)),
        };
        Ok(Counters {
            from_guest: DirCounters {
                packets: s.from_packets,
                bytes: s.from_bytes,
                drops: s.from_drops,
            },
            to_guest: DirCounters {
                packets: s.to_packets,
                bytes: s.to_bytes,
                drops: s.to_drops,
            },
        })
    }

    /// Every port in the (pinned) state, bound or not: what cubelet re-adopts after a restart
    /// (mark the host addresses in use in its [`crate::AddrPool`], match ports to sandboxes).
    pub fn adopt_existing(&self) -> Vec<PortInfo> {
        self.state
            .iter()
            .map(|(&ifindex, s)| {
                let bound = s.val.flags & PORT_BOUND != 0;
                PortInfo {
                    port: Port {
                        ifindex,
                        ifname: s.ifname.clone(),
                    },
                    attach_mode: if s.val.flags & PORT_TCX != 0 {
                        AttachMode::Tcx
                    } else {
                        AttachMode::Netlink
                    },
                    host_addr: bound.then(|| ip_from_be(s.val.host_ip)),
                    internet: s.val.flags & PORT_INTERNET != 0,
                    dns_resolver: (s.val.resolver != 0).then(|| ip_from_be(s.val.resolver)),
                    exposed_ports: s.exposed.iter().copied().collect(),
                }
            })
            .collect()
    }

    /// The pool network this switch serves.
    pub fn host_pool(&self) -> Ipv4Cidr {
        self.cfg.host_pool
    }

    /// Removes everything the switch put on the node: programs from every port, host routes,
    /// the nftables table, and all pins under the pin root. For decommissioning a node and for
    /// tests; a normal daemon stop must NOT call this (enforcement has to outlive the daemon).
    pub fn teardown(mut self) -> Result<()> {
        let ports: Vec<Port> = self
            .state
            .iter()
            .map(|(&ifindex, s)| Port {
                ifindex,
                ifname: s.ifname.clone(),
            })
            .collect();
        let mut first_err = None;
        for p in ports {
            if let Err(e) = self.detach(&p) {
                first_err.get_or_insert(e);
            }
        }
        if self.cfg.masquerade || self.cfg.egress_proxy.is_some() {
            if let Err(e) = nft::remove(&self.cfg.nft_table) {
                first_err.get_or_insert(e);
            }
        }
        let root = self.cfg.pin_root.clone();
        drop(self);
        remove_pins(&root);
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

fn remove_pins(root: &Path) {
    for sub in ["maps", "progs", "links"] {
        let d = root.join(sub);
        if let Ok(rd) = std::fs::read_dir(&d) {
            for e in rd.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let _ = std::fs::remove_dir(&d);
    }
    let _ = std::fs::remove_dir(root);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_on_a_vanished_link_is_not_one() {
        let err = || Err(Error::Netlink("detaching: No such device".into()));
        // No link has index u32::MAX; loopback is always 1.
        assert!(unless_gone(u32::MAX, err()).is_ok());
        assert!(unless_gone(1, err()).is_err());
        assert!(unless_gone(1, Ok(())).is_ok());
    }
}
