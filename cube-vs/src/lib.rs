//! CubeVS: the eBPF virtual switch that isolates and addresses every sandbox on a node.
//!
//! # Model
//!
//! Every guest has the same network identity ([`GuestNetwork`]: `169.254.77.2/30`, gateway
//! `169.254.77.1`, fixed MACs), so one template memory image restores any number of times
//! without a guest-side fix-up. Each sandbox has its own host-side interface (the tap of a
//! microVM, or the host end of a veth for the namespace runtime) and a unique node-local host
//! address from a pool ([`AddrPool`], default `10.233.0.0/16`). The node routes the host address
//! to the interface; two tc programs on the interface (`bpf/cubevs.c`) then:
//!
//! * translate host address ⇄ fixed guest address in both directions (IP and L4 checksums
//!   fixed up), so the node sees the sandbox at its host address and the guest sees the peer's
//!   real address;
//! * answer ARP for the gateway (towards the guest) and for the host address (towards the node);
//! * enforce the egress policy ([`EgressPolicy`]): internet on/off, allow/deny CIDRs with
//!   longest-prefix match, always-denied private/link-local/host ranges, node-local
//!   destinations, DNS only to the configured resolver, sandbox-to-sandbox always dropped,
//!   anti-spoofing (source IP and source MAC must be the fixed guest identity), IPv6 dropped;
//! * let only the node itself (the edge/proxy) open TCP connections (or send UDP) to the
//!   sandbox's exposed ports; replies to guest-opened connections pass.
//!
//! Traffic leaving the node is masqueraded by nftables (table `cube_vs`). One program object is
//! loaded per node; per-sandbox state lives in maps keyed by interface index. Maps, programs and
//! (in TCX mode) links are pinned under [`SwitchConfig::pin_root`], so a killed cubelet leaves
//! enforcement in place (never fail-open), and the next [`Switch::open`] re-adopts it and swaps
//! its programs in atomically.
//!
//! # How cubelet uses it
//!
//! ```text
//! startup:   sw = Switch::open(cfg.network)?                        // load or re-adopt, ~0.1 s
//!            pool = AddrPool::new(cfg.network.host_pool)?
//!            for p in sw.adopt_existing() {                            // after a restart
//!                if let Some(a) = p.host_addr { pool.mark_in_use(a)? }  // keep live sandboxes
//!                // ports with no sandbox on record: sw.detach(&p.port) or return them to the pool
//!            }
//! pool fill: create the tap (or veth), bring it up, then
//!            port = sw.attach(&tap_name)?                              // ~0.2 ms, drops all until bound
//! create:    addr = pool.allocate()?
//!            sw.bind(&port, &SandboxNet { host_addr: addr, policy, exposed_ports })?   // µs
//!            persist (sandbox id, port, addr) in the sandbox record
//! runtime:   sw.set_policy(&port, &policy)?; sw.set_exposed_ports(&port, &ports)?
//!            sw.counters(port.ifindex)?                                  // for /metrics
//! edge:      connect to addr:port (from the node itself, e.g. sandbox ingress :9092)
//! destroy:   if let Some(a) = sw.unbind(&port)? { pool.release(a) }
//!            sw.detach(&port)?, then delete the tap (or re-bind the port to a new sandbox)
//! shutdown:  just exit; never call Switch::teardown on a normal stop
//! ```
//!
//! The switch must be used from one network namespace (the node's): interface indexes, routes
//! and the nftables table are per namespace. `net.ipv4.ip_forward` must be 1 for sandboxes to
//! reach beyond the node (the switch warns, it does not change host sysctls).
//!
//! # Attach mode
//!
//! [`AttachMode::Netlink`] (default): `cls_bpf` filters on a `clsact` qdisc, measured at about
//! 0.15 ms per interface against about 25 ms for TCX here (see `benches/vs-bench`). The filters
//! live on the device, so a killed loader leaves them enforcing; the next loader replaces the
//! program in them atomically (same priority and handle). [`AttachMode::Tcx`] pins its links
//! under `<pin_root>/links/` and swaps programs with `BPF_LINK_UPDATE`. Either way maps and
//! programs are pinned under `<pin_root>/maps/` and `<pin_root>/progs/`.
//!
//! # Limits (known, by design for now)
//!
//! * Stateless inbound filter for TCP: only SYN-without-ACK is checked against exposed ports and
//!   local origin; other TCP segments pass to the guest (which answers unknown ones with RST).
//!   UDP and ICMP echo towards the guest need a flow the guest (or the node) opened.
//! * Flows live in one LRU table per port of [`SwitchConfig::flow_quota`] entries: a sandbox
//!   with more concurrent flows than that loses its own oldest ones (their replies are then
//!   dropped), never another sandbox's. Node-wide conntrack (masquerade) is not partitioned.
//! * ICMP errors reach the guest with their inner header untranslated (host address inside).
//! * IPv4 only: IPv6 and other ethertypes are dropped both ways.
//! * Domain-based egress rules are not implemented (CIDRs only).
//!
//! The guest side (cube-agent, or the namespace runtime) configures `guest_ip/prefix_len` with
//! MAC `guest_mac` on its NIC and a default route via `gateway_ip`.

mod abi;
mod bpffs;
pub mod config;
pub mod error;
pub mod nft;
pub mod policy;
pub mod pool;
mod route;
pub mod switch;

pub use config::{
    AttachMode, GuestNetwork, Ipv4Cidr, MacAddr, SwitchConfig, DEFAULT_FLOW_QUOTA, FLOW_QUOTA_RANGE,
};
pub use error::{Error, Result};
pub use policy::{reserved_range_of, EgressPolicy, ALWAYS_DENIED};
pub use pool::AddrPool;
pub use switch::{
    datapath_built, Counters, DirCounters, Port, PortInfo, SandboxNet, Switch, ANY_PORT,
    DEFAULT_EXPOSED_PORTS, MAX_POLICY_ENTRIES,
};

#[cfg(test)]
mod config_tests {
    use super::*;

    #[test]
    fn defaults_match_the_architecture() {
        let g = GuestNetwork::default();
        assert_eq!(g.guest_ip.to_string(), "169.254.77.2");
        assert_eq!(g.prefix_len, 30);
        assert_eq!(g.gateway_ip.to_string(), "169.254.77.1");
        assert_eq!(g.guest_mac.to_string(), "02:cb:e0:00:00:02");
        assert_eq!(g.gateway_mac.to_string(), "02:cb:e0:00:00:01");
        let c = SwitchConfig::default();
        assert_eq!(c.host_pool.to_string(), "10.233.0.0/16");
        assert_eq!(c.pin_root.to_str(), Some("/sys/fs/bpf/cube"));
        assert_eq!(c.flow_quota, 4096);
        assert!(FLOW_QUOTA_RANGE.contains(&c.flow_quota));
    }

    #[test]
    fn config_toml_roundtrip_and_errors() {
        let c = SwitchConfig::default();
        let s = toml::to_string(&c).unwrap();
        let back: SwitchConfig = toml::from_str(&s).unwrap();
        assert_eq!(back, c);
        let partial: SwitchConfig = toml::from_str(
            "host_pool = \"10.1.2.3/24\"\n[guest]\nguest_mac = \"02:00:00:00:00:09\"\n",
        )
        .unwrap();
        assert_eq!(partial.host_pool.to_string(), "10.1.2.0/24");
        assert_eq!(partial.guest.guest_mac.0[5], 9);
        assert_eq!(partial.guest.gateway_ip, GuestNetwork::default().gateway_ip);
        let q: SwitchConfig = toml::from_str("flow_quota = 256").unwrap();
        assert_eq!(q.flow_quota, 256);
        assert!(toml::from_str::<SwitchConfig>("flow_quota = -1").is_err());
        assert!(toml::from_str::<SwitchConfig>("host_pool = \"10.0.0.0/40\"").is_err());
        assert!(toml::from_str::<SwitchConfig>("[guest]\nguest_mac = \"02:00\"").is_err());
        assert!(
            toml::from_str::<SwitchConfig>("[guest]\nguest_mac = \"zz:00:00:00:00:00\"").is_err()
        );
        assert!("1.2.3.4/8"
            .parse::<Ipv4Cidr>()
            .unwrap()
            .contains("1.9.9.9".parse().unwrap()));
    }
}
