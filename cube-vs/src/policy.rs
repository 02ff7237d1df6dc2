//! Per-sandbox egress policy and its compilation into longest-prefix-match entries.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use crate::config::Ipv4Cidr;

/// Ranges a sandbox can never reach unless the policy allows them explicitly: private and
/// shared address space, link-local (cloud metadata `169.254.169.254` included), loopback and
/// non-unicast. The node's own addresses (any destination the node would deliver locally) are
/// also denied by the datapath itself unless an explicit `/32` allow names them.
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
/// 2. DNS (TCP/UDP port 53): allowed only to `dns_resolver`, and only while `internet` is on
///    (so internet-off cannot be tunnelled through a recursive resolver);
/// 3. otherwise the longest matching prefix among `allow`, `deny`, [`ALWAYS_DENIED`] and the
///    default route (`internet` on = allow, off = deny) decides; for the same prefix, `deny`
///    beats `allow`, and an explicit entry beats a built-in one;
/// 4. a destination the node itself would receive is dropped unless the winning entry is an
///    explicit `/32` allow.
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
}

impl Default for EgressPolicy {
    fn default() -> Self {
        EgressPolicy {
            internet: true,
            allow: Vec::new(),
            deny: Vec::new(),
            dns_resolver: None,
        }
    }
}

/// Verdict of one trie entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rule {
    pub allow: bool,
    pub explicit: bool,
}

impl EgressPolicy {
    /// Compiles the policy into one entry per distinct prefix.
    pub(crate) fn compile(&self) -> BTreeMap<Ipv4Cidr, Rule> {
        let mut out = BTreeMap::new();
        let default = Ipv4Cidr::new(Ipv4Addr::UNSPECIFIED, 0).expect("valid");
        out.insert(
            default,
            Rule {
                allow: self.internet,
                explicit: false,
            },
        );
        for &(a, l) in ALWAYS_DENIED {
            out.insert(
                Ipv4Cidr::new(a, l).expect("valid"),
                Rule {
                    allow: false,
                    explicit: false,
                },
            );
        }
        for c in &self.allow {
            out.insert(
                *c,
                Rule {
                    allow: true,
                    explicit: true,
                },
            );
        }
        for c in &self.deny {
            out.insert(
                *c,
                Rule {
                    allow: false,
                    explicit: true,
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
            deny: vec!["8.0.0.0/8".parse().unwrap(), "8.8.0.0/16".parse().unwrap()],
            dns_resolver: None,
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
