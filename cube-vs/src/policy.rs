//! Per-sandbox egress policy and its compilation into longest-prefix-match entries.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use crate::config::Ipv4Cidr;

/// Ranges a sandbox can never reach unless the policy allows them explicitly: private and
/// shared address space, link-local (cloud metadata `169.254.169.254` included), loopback and
/// non-unicast. The node's own addresses (any destination the node would deliver locally) are
/// also denied by the datapath itself unless a [`EgressPolicy::host_services`] entry names them.
pub const ALWAYS_DENIED: &[(Ipv4Addr, u8)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(10, 0, 0, 0), 8),
    (Ipv4Addr::new(100, 64, 0, 0), 10),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(172, 16, 0, 0), 12),
    (Ipv4Addr::new(192, 168, 0, 0), 16),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

/// Egress policy of one sandbox; can be replaced at run time with
/// [`crate::Switch::set_policy`].
///
/// Evaluation of a packet the guest sends to `dst`:
/// 1. sandbox-to-sandbox (the host pool), the gateway itself, loopback and multicast: dropped,
///    whatever the policy says;
/// 2. DNS (TCP/UDP port 53) to `dns_resolver`: allowed while `internet` or `dns` is on (so
///    internet-off cannot be tunnelled through a recursive resolver); to anywhere else only
///    when an explicit `allow` entry is the longest match (then 4 applies);
/// 3. otherwise the longest matching prefix among `allow`, `deny`, [`ALWAYS_DENIED`] and the
///    default route (`internet` on = allow, off = deny) decides; for the same prefix, `deny`
///    beats `allow`, and an explicit entry beats a built-in one; with `proxy_names`, TCP that
///    the default route or a `deny` entry refuses is handed to the node's egress proxy
///    (marked for the DNAT the switch's nftables table holds) instead of dropped;
/// 4. a destination the node itself would receive is dropped unless the winning entry is a
///    [`EgressPolicy::host_services`] `/32`: an `allow` entry never opens the node itself, so
///    user-supplied allow lists cannot reach node-local services.
///
/// A replacement ([`crate::Switch::set_policy`]) is atomic: the datapath sees the old rules or
/// the new ones, never a mix.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EgressPolicy {
    /// Public internet reachable (default on, as with E2B).
    pub internet: bool,
    /// Networks explicitly allowed.
    pub allow: Vec<Ipv4Cidr>,
    /// Networks explicitly denied.
    pub deny: Vec<Ipv4Cidr>,
    /// The only DNS server the guest may query (when internet is on).
    pub dns_resolver: Option<Ipv4Addr>,
    /// Addresses of the node itself the sandbox may reach (an operator's choice; a `deny`
    /// entry still wins).
    pub host_services: Vec<Ipv4Addr>,
    /// TCP the rules deny goes to the node's egress proxy
    /// ([`crate::SwitchConfig::egress_proxy`]), which admits it by name or closes it.
    pub proxy_names: bool,
    /// `dns_resolver` answers with `internet` off too (what allowed names need).
    pub dns: bool,
}

/// The [`ALWAYS_DENIED`] range that contains `c` (or equals it): an explicit allow of `c` would
/// override the built-in deny, so callers that take allow entries from users refuse those.
pub fn reserved_range_of(c: &Ipv4Cidr) -> Option<Ipv4Cidr> {
    ALWAYS_DENIED
        .iter()
        .filter_map(|&(a, l)| Ipv4Cidr::new(a, l).ok())
        .find(|r| r.prefix_len() <= c.prefix_len() && r.contains(c.addr()))
}

impl Default for EgressPolicy {
    fn default() -> Self {
        EgressPolicy {
            internet: true,
            allow: Vec::new(),
            deny: Vec::new(),
            dns_resolver: None,
            host_services: Vec::new(),
            proxy_names: false,
            dns: false,
        }
    }
}

/// Verdict of one trie entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rule {
    pub allow: bool,
    pub explicit: bool,
    /// Opens a node-local destination (a host-service /32).
    pub host_service: bool,
}

impl EgressPolicy {
    /// The port flags this policy sets (the datapath reads them; see `abi.rs`).
    pub(crate) fn port_flags(&self) -> u32 {
        use crate::abi::{PORT_DNS, PORT_INTERNET, PORT_NAMES};
        let on = |b: bool, f: u32| if b { f } else { 0 };
        on(self.internet, PORT_INTERNET) | on(self.proxy_names, PORT_NAMES) | on(self.dns, PORT_DNS)
    }

    /// Compiles the policy into one entry per distinct prefix.
    pub(crate) fn compile(&self) -> BTreeMap<Ipv4Cidr, Rule> {
        let mut out = BTreeMap::new();
        let default = Ipv4Cidr::new(Ipv4Addr::UNSPECIFIED, 0).expect("valid");
        out.insert(
            default,
            Rule {
                allow: self.internet,
                explicit: false,
                host_service: false,
            },
        );
        for &(a, l) in ALWAYS_DENIED {
            out.insert(
                Ipv4Cidr::new(a, l).expect("valid"),
                Rule {
                    allow: false,
                    explicit: false,
                    host_service: false,
                },
            );
        }
        for c in &self.allow {
            out.insert(
                *c,
                Rule {
                    allow: true,
                    explicit: true,
                    host_service: false,
                },
            );
        }
        for c in self
            .host_services
            .iter()
            .filter_map(|a| Ipv4Cidr::new(*a, 32).ok())
        {
            out.insert(
                c,
                Rule {
                    allow: true,
                    explicit: true,
                    host_service: true,
                },
            );
        }
        for c in &self.deny {
            out.insert(
                *c,
                Rule {
                    allow: false,
                    explicit: true,
                    host_service: false,
                },
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(rules: &BTreeMap<Ipv4Cidr, Rule>, ip: Ipv4Addr) -> Rule {
        *rules
            .iter()
            .filter(|(c, _)| c.contains(ip))
            .max_by_key(|(c, _)| c.prefix_len())
            .unwrap()
            .1
    }

    #[test]
    fn longest_prefix_and_deny_precedence() {
        let p = EgressPolicy {
            internet: true,
            allow: vec![
                "10.1.0.0/16".parse().unwrap(),
                "8.8.0.0/16".parse().unwrap(),
            ],
            deny: vec![
                "8.0.0.0/8".parse().unwrap(),
                "8.8.0.0/16".parse().unwrap(),
                "8.8.4.4/32".parse().unwrap(),
            ],
            dns_resolver: None,
            host_services: vec!["198.18.0.1".parse().unwrap(), "8.8.4.4".parse().unwrap()],
            ..Default::default()
        };
        let r = p.compile();
        assert!(lookup(&r, "1.1.1.1".parse().unwrap()).allow);
        assert!(!lookup(&r, "10.2.0.1".parse().unwrap()).allow);
        assert!(lookup(&r, "10.1.2.3".parse().unwrap()).allow);
        assert!(lookup(&r, "10.1.2.3".parse().unwrap()).explicit);
        assert!(!lookup(&r, "8.9.9.9".parse().unwrap()).allow);
        // Same prefix in both lists: deny wins.
        assert!(!lookup(&r, "8.8.8.8".parse().unwrap()).allow);
        assert!(!lookup(&r, "169.254.169.254".parse().unwrap()).allow);
        // Only host-service entries open the node; a deny still beats one.
        assert!(lookup(&r, "198.18.0.1".parse().unwrap()).host_service);
        assert!(!lookup(&r, "10.1.2.3".parse().unwrap()).host_service);
        assert!(!lookup(&r, "8.8.4.4".parse().unwrap()).allow);
    }

    #[test]
    fn reserved_ranges_of_user_entries() {
        let r = |s: &str| reserved_range_of(&s.parse().unwrap()).map(|c| c.to_string());
        assert_eq!(r("10.1.2.3").as_deref(), Some("10.0.0.0/8"));
        assert_eq!(r("10.0.0.0/8").as_deref(), Some("10.0.0.0/8"));
        assert_eq!(r("169.254.169.254").as_deref(), Some("169.254.0.0/16"));
        assert_eq!(r("172.20.0.0/16").as_deref(), Some("172.16.0.0/12"));
        assert_eq!(r("0.0.0.0/8").as_deref(), Some("0.0.0.0/8"));
        // Broader than a reserved range: the built-in (longer) prefix still wins there.
        assert_eq!(r("0.0.0.0/0"), None);
        assert_eq!(r("8.0.0.0/7"), None);
        assert_eq!(r("198.51.100.7"), None);
    }

    #[test]
    fn internet_off_denies_default_route_only() {
        let p = EgressPolicy {
            internet: false,
            allow: vec!["1.2.3.0/24".parse().unwrap()],
            ..Default::default()
        };
        let r = p.compile();
        assert!(!lookup(&r, "9.9.9.9".parse().unwrap()).allow);
        assert!(lookup(&r, "1.2.3.4".parse().unwrap()).allow);
    }

    #[test]
    fn policy_toml_roundtrip_and_bad_input() {
        let p: EgressPolicy =
            toml::from_str("internet = false\nallow = [\"1.2.3.4\"]\ndeny = [\"5.0.0.0/8\"]\n")
                .unwrap();
        assert!(!p.internet);
        assert_eq!(p.allow[0].to_string(), "1.2.3.4/32");
        let back: EgressPolicy = toml::from_str(&toml::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert!(toml::from_str::<EgressPolicy>("allow = [\"1.2.3.4/33\"]").is_err());
        assert!(toml::from_str::<EgressPolicy>("allow = [\"nonsense\"]").is_err());
        assert!(toml::from_str::<EgressPolicy>("surprise = 1").is_err());
    }
}
