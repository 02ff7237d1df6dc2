//! E2B's egress rules (`network.allowOut` / `denyOut` / `dnsServers`, `allow_internet_access`)
//! and what they mean for a node's switch and egress proxy: the one place their semantics live.
//!
//! E2B: with no rules, all traffic may leave; `denyOut` blocks addresses ("0.0.0.0/0" blocks
//! everything, as `allow_internet_access: false` does); `allowOut` entries always take
//! precedence over `denyOut` ones. The node's switch decides by longest prefix with a deny
//! beating an allow of the same prefix, so [`node_policy`](crate::egress::node_policy) drops
//! every deny entry an allow entry covers, and turns "deny all" into the switch's internet
//! switch. `allowOut` may also name domains ("example.com", "*.example.com"), which the node's
//! egress proxy admits; their DNS goes to `dnsServers` when given (each then an allowed
//! address), else to the node's resolver.

use crate::error::MasterError;
use std::net::{IpAddr, Ipv4Addr};

/// E2B's "all traffic" selector.
pub const ALL_TRAFFIC: &str = "0.0.0.0/0";

/// Most entries per list (the switch holds at most 1024 per sandbox, built-ins included).
pub const MAX_ENTRIES: usize = 500;

/// One IPv4 network, host bits cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Net {
    addr: u32,
    len: u8,
}

impl Net {
    fn mask(len: u8) -> u32 {
        if len == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(len))
        }
    }

    fn covers(&self, other: &Net) -> bool {
        self.len <= other.len && other.addr & Net::mask(self.len) == self.addr
    }
}

impl std::fmt::Display for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", Ipv4Addr::from(self.addr), self.len)
    }
}

/// A parsed entry: IPv4 (what the switch enforces), IPv6 (sandboxes have no IPv6: every
/// IPv6 packet is dropped already, so a deny holds and an allow cannot) or a domain name
/// (lower case, no trailing dot; `*.` = its subdomains), which the node's egress proxy admits.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    V4(Net),
    V6(String),
    Name(String),
}

fn parse_entry(list: &str, s: &str) -> Result<Entry, MasterError> {
    let bad = |why: &str| MasterError::InvalidArgument(format!("{list} entry {s:?}: {why}"));
    let (ip, len) = match s.split_once('/') {
        Some((ip, len)) => (ip, Some(len)),
        None => (s, None),
    };
    let prefix = |max: u8| match len {
        None => Ok(max),
        Some(l) => l
            .parse::<u8>()
            .ok()
            .filter(|l| *l <= max)
            .ok_or_else(|| bad(&format!("the prefix length must be 0-{max}"))),
    };
    match ip.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => {
            let len = prefix(32)?;
            Ok(Entry::V4(Net {
                addr: u32::from(a) & Net::mask(len),
                len,
            }))
        }
        Ok(IpAddr::V6(a)) => Ok(Entry::V6(format!("{a}/{}", prefix(128)?))),
        Err(_) if ip == "*" || ip == "*." => Err(bad(
            "a bare \"*\" is not a domain name (use \"0.0.0.0/0\" for all traffic)",
        )),
        Err(_) => {
            let name = ip.strip_suffix('.').unwrap_or(ip).to_ascii_lowercase();
            if !looks_like_name(&name) || name.rsplit('.').next().is_some_and(all_digits) {
                return Err(bad("not an IP address, a CIDR or a domain name"));
            }
            if len.is_some() {
                return Err(bad("a domain name takes no prefix length"));
            }
            if name
                .strip_prefix("*.")
                .is_some_and(|rest| !rest.contains('.'))
            {
                return Err(bad(
                    "a wildcard must name a domain below a top-level one (\"*.example.com\")",
                ));
            }
            Ok(Entry::Name(name))
        }
    }
}

fn all_digits(label: &str) -> bool {
    label.bytes().all(|b| b.is_ascii_digit())
}

fn looks_like_name(s: &str) -> bool {
    let s = s.strip_prefix("*.").unwrap_or(s);
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Most `dnsServers` (E2B's limit).
pub const MAX_DNS_SERVERS: usize = 10;

/// A sandbox's egress rules as the user gave them, checked (and host bits cleared).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    pub allow_out: Vec<String>,
    pub deny_out: Vec<String>,
    /// E2B's `dnsServers`: plain IPv4 addresses, sorted; `None` = not given (the node's
    /// resolver serves the names of `allow_out`).
    pub dns_servers: Option<Vec<String>>,
}

impl Rules {
    /// Checks the lists; the entries are kept in the form the node and the API report.
    pub fn parse(
        allow_out: &[String],
        deny_out: &[String],
        dns_servers: Option<&[String]>,
    ) -> Result<Rules, MasterError> {
        let list = |name: &str, v: &[String], allow: bool| -> Result<Vec<String>, MasterError> {
            if v.len() > MAX_ENTRIES {
                return Err(MasterError::InvalidArgument(format!(
                    "{name} has {} entries; at most {MAX_ENTRIES}",
                    v.len()
                )));
            }
            let mut out = Vec::with_capacity(v.len());
            for s in v {
                match parse_entry(name, s.trim())? {
                    Entry::V4(n) => out.push(n.to_string()),
                    Entry::V6(_) if allow => {
                        return Err(MasterError::InvalidArgument(format!(
                            "{name} entry {s:?}: sandboxes have no IPv6, so it cannot be allowed"
                        )))
                    }
                    Entry::V6(n) => out.push(n),
                    Entry::Name(n) if allow => out.push(n),
                    Entry::Name(_) => {
                        return Err(MasterError::InvalidArgument(format!(
                            "{name} entry {s:?}: E2B allows domain names in allowOut only \
                             (denyOut takes IP addresses and CIDRs)"
                        )))
                    }
                }
            }
            out.sort();
            out.dedup();
            Ok(out)
        };
        let allow_out = list("allowOut", allow_out, true)?;
        let deny_out = list("denyOut", deny_out, false)?;
        let dns_servers = dns_servers.map(parse_dns_servers).transpose()?;
        let servers = dns_servers.as_ref().map_or(0, Vec::len);
        if allow_out.len() + servers > MAX_ENTRIES {
            // Each server is one more allow entry on the node's switch.
            return Err(MasterError::InvalidArgument(format!(
                "allowOut and dnsServers have {} entries together; at most {MAX_ENTRIES}",
                allow_out.len() + servers
            )));
        }
        Ok(Rules {
            allow_out,
            deny_out,
            dns_servers,
        })
    }

    /// Stored form: entries joined by commas (no entry contains one).
    pub fn encode(v: &[String]) -> String {
        v.join(",")
    }

    pub fn decode(s: &str) -> Vec<String> {
        s.split(',')
            .filter(|e| !e.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Stored form of `dns_servers`: NULL = not given, `""` = none, else comma-joined.
    pub fn encode_dns(&self) -> Option<String> {
        self.dns_servers.as_deref().map(Rules::encode)
    }

    pub fn decode_dns(s: Option<&str>) -> Option<Vec<String>> {
        s.map(Rules::decode)
    }
}

fn parse_dns_servers(v: &[String]) -> Result<Vec<String>, MasterError> {
    if v.len() > MAX_DNS_SERVERS {
        return Err(MasterError::InvalidArgument(format!(
            "dnsServers has {} entries; at most {MAX_DNS_SERVERS}",
            v.len()
        )));
    }
    let mut out = Vec::with_capacity(v.len());
    for s in v {
        let bad =
            |why: &str| MasterError::InvalidArgument(format!("dnsServers entry {s:?}: {why}"));
        let t = s.trim();
        let a = match t.parse::<IpAddr>() {
            Ok(IpAddr::V4(a)) => a,
            Ok(IpAddr::V6(_)) => return Err(bad("sandboxes have no IPv6; use an IPv4 address")),
            Err(_) if t.contains('/') => {
                return Err(bad("must be a single IPv4 address, not a CIDR"))
            }
            Err(_) => return Err(bad("not an IPv4 address")),
        };
        if a.is_unspecified() || a.is_loopback() || a.is_multicast() || a.is_broadcast() {
            return Err(bad(
                "not a usable DNS server address (unspecified, loopback, multicast or broadcast)",
            ));
        }
        out.push(a.to_string());
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// What the node gets for a sandbox's egress.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePolicy {
    /// Internet egress on (the switch's default allow).
    pub internet: bool,
    pub allow_cidrs: Vec<String>,
    pub deny_cidrs: Vec<String>,
    /// allowOut's domain names and wildcards, for the node's egress proxy.
    pub allow_names: Vec<String>,
    /// The node's resolver answers the sandbox even with internet off.
    pub dns: bool,
}

/// What the node's switch (and egress proxy) get. Domain names never change the CIDR
/// precedence; with names, `dnsServers` (E2B) are the only resolvers the sandbox may reach
/// (each one an allowed /32), and without them the node's own resolver stays open. Without
/// names, `dnsServers` change nothing, as in E2B.
pub fn node_policy(internet: bool, r: &Rules) -> NodePolicy {
    let mut allow: Vec<Net> = Vec::new();
    let mut allow_names = Vec::new();
    for s in &r.allow_out {
        match parse_entry("", s) {
            Ok(Entry::V4(n)) => allow.push(n),
            Ok(Entry::Name(n)) => allow_names.push(n),
            _ => {}
        }
    }
    let all = Net { addr: 0, len: 0 };
    if allow.contains(&all) {
        // Allowed beats denied, and this allows everything.
        return NodePolicy {
            internet: true,
            ..NodePolicy::default()
        };
    }
    let mut dns = false;
    if !allow_names.is_empty() {
        match &r.dns_servers {
            None => dns = true,
            Some(servers) => {
                for s in servers {
                    if let Ok(a) = s.parse::<Ipv4Addr>() {
                        let n = Net {
                            addr: u32::from(a),
                            len: 32,
                        };
                        if !allow.contains(&n) {
                            allow.push(n);
                        }
                    }
                }
            }
        }
    }
    let mut internet = internet;
    let mut deny = Vec::new();
    for s in &r.deny_out {
        match parse_entry("", s) {
            Ok(Entry::V4(n)) if n == all => internet = false,
            Ok(Entry::V4(n)) if allow.iter().any(|a| a.covers(&n)) => {}
            Ok(Entry::V4(n)) => deny.push(n.to_string()),
            // IPv6: the switch drops all of it anyway; kept so the node records the rule.
            _ => deny.push(s.clone()),
        }
    }
    NodePolicy {
        internet,
        allow_cidrs: allow.iter().map(|n| n.to_string()).collect(),
        deny_cidrs: deny,
        allow_names,
        dns,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    fn rules(a: &[&str], d: &[&str]) -> Rules {
        Rules::parse(&v(a), &v(d), None).unwrap()
    }

    fn err(a: &[&str], d: &[&str]) -> String {
        Rules::parse(&v(a), &v(d), None).unwrap_err().to_string()
    }

    fn dns_err(servers: &[&str]) -> String {
        Rules::parse(&v(&["example.com"]), &[], Some(&v(servers)))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn entries_are_checked_and_normalised() {
        let r = rules(
            &["1.1.1.1", "8.8.8.9/24", "8.8.8.0/24"],
            &["2001:db8::/32", ALL_TRAFFIC],
        );
        assert_eq!(r.allow_out, v(&["1.1.1.1/32", "8.8.8.0/24"]));
        assert_eq!(r.deny_out, v(&["0.0.0.0/0", "2001:db8::/32"]));
        assert_eq!(r.dns_servers, None);
        assert!(err(&["1.2.3.4/33"], &[]).contains("0-32"));
        assert!(err(&["::1"], &[]).contains("no IPv6"));
        assert!(err(&["not an address!"], &[]).contains("not an IP address"));
        assert!(err(&["1.2.3.256"], &[]).contains("not an IP address"));
        let many: Vec<String> = (0..=MAX_ENTRIES)
            .map(|i| format!("1.1.{}.{}", i / 256, i % 256))
            .collect();
        assert!(Rules::parse(&many, &[], None)
            .unwrap_err()
            .to_string()
            .contains("at most"));
    }

    #[test]
    fn domain_names_are_allowed_out_only() {
        let r = rules(
            &[" Example.COM. ", "*.Foo.org", "example.com", "1.1.1.1"],
            &[],
        );
        assert_eq!(r.allow_out, v(&["*.foo.org", "1.1.1.1/32", "example.com"]));
        let e = err(&[], &["example.com"]);
        assert!(
            e.contains("denyOut entry") && e.contains("allowOut only"),
            "{e}"
        );
        assert!(err(&[], &["*.example.com"]).contains("allowOut only"));
        assert!(err(&["*"], &[]).contains("bare"));
        assert!(err(&["*.com"], &[]).contains("wildcard"));
        assert!(err(&["*.com."], &[]).contains("wildcard"));
        assert!(err(&["example.com/24"], &[]).contains("no prefix length"));
        assert!(err(&["a.*.com"], &[]).contains("not an IP address"));
        assert!(err(&["exa_mple.com"], &[]).contains("not an IP address"));
        assert!(err(&["example..com"], &[]).contains("not an IP address"));
        // The stored form is parsed back to the same names.
        let again = Rules::parse(&r.allow_out, &[], None).unwrap();
        assert_eq!(again, r);
    }

    #[test]
    fn dns_servers_are_plain_ipv4_addresses() {
        let r = Rules::parse(
            &v(&["example.com"]),
            &[],
            Some(&v(&["8.8.8.8", " 1.1.1.1", "8.8.8.8"])),
        )
        .unwrap();
        assert_eq!(r.dns_servers, Some(v(&["1.1.1.1", "8.8.8.8"])));
        let none = Rules::parse(&[], &[], Some(&[])).unwrap();
        assert_eq!(none.dns_servers, Some(vec![]));
        for (bad, why) in [
            ("1.1.1.0/24", "not a CIDR"),
            ("1.1.1.1/32", "not a CIDR"),
            ("2001:4860:4860::8888", "no IPv6"),
            ("dns.google", "not an IPv4 address"),
            ("0.0.0.0", "not a usable"),
            ("127.0.0.53", "not a usable"),
            ("224.0.0.251", "not a usable"),
            ("255.255.255.255", "not a usable"),
        ] {
            let e = dns_err(&[bad]);
            assert!(
                e.contains("dnsServers entry") && e.contains(why),
                "{bad}: {e}"
            );
        }
        let eleven: Vec<String> = (1..=11).map(|i| format!("9.9.9.{i}")).collect();
        let refs: Vec<&str> = eleven.iter().map(String::as_str).collect();
        assert!(dns_err(&refs).contains("at most 10"));
        // Each server is one more allow entry.
        let full: Vec<String> = (0..MAX_ENTRIES)
            .map(|i| format!("1.1.{}.{}", i / 256, i % 256))
            .collect();
        assert!(Rules::parse(&full, &[], Some(&v(&["9.9.9.9"])))
            .unwrap_err()
            .to_string()
            .contains("dnsServers"));
    }

    fn np(internet: bool, allow: &[&str], deny: &[&str]) -> NodePolicy {
        NodePolicy {
            internet,
            allow_cidrs: v(allow),
            deny_cidrs: v(deny),
            ..NodePolicy::default()
        }
    }

    #[test]
    fn allow_beats_deny_and_deny_all_turns_internet_off() {
        let p = |a: &[&str], d: &[&str], internet| node_policy(internet, &rules(a, d));
        // Deny all + allow-list.
        assert_eq!(
            p(&["1.1.1.1"], &[ALL_TRAFFIC], true),
            np(false, &["1.1.1.1/32"], &[])
        );
        // Allow-all + deny-list.
        assert_eq!(p(&[], &["8.8.8.8"], true), np(true, &[], &["8.8.8.8/32"]));
        // An allow covering a deny (or equal to it) wins; a deny around an allow stays.
        assert_eq!(
            p(
                &["8.0.0.0/8", "9.9.9.9"],
                &["8.8.8.8", "9.9.9.9/32", "9.0.0.0/8"],
                true
            ),
            np(true, &["8.0.0.0/8", "9.9.9.9/32"], &["9.0.0.0/8"])
        );
        // allow_internet_access false is deny-all; allowing all traffic overrides every deny.
        assert_eq!(p(&[], &[], false), np(false, &[], &[]));
        assert_eq!(
            p(&[ALL_TRAFFIC], &[ALL_TRAFFIC, "1.2.3.4"], false),
            np(true, &[], &[])
        );
        // IPv6 denies are passed on (the switch drops IPv6 anyway).
        assert_eq!(
            p(&[], &["2001:db8::/32"], true).deny_cidrs,
            v(&["2001:db8::/32"])
        );
    }

    #[test]
    fn names_reach_the_node_with_their_dns() {
        let p = |a: &[&str], d: &[&str], dns: Option<&[&str]>| {
            let dns = dns.map(v);
            node_policy(true, &Rules::parse(&v(a), &v(d), dns.as_deref()).unwrap())
        };
        // No servers given: the node's resolver stays open, even with internet off.
        assert_eq!(
            p(&["example.com", "1.1.1.1"], &[ALL_TRAFFIC], None),
            NodePolicy {
                internet: false,
                allow_cidrs: v(&["1.1.1.1/32"]),
                deny_cidrs: v(&[]),
                allow_names: v(&["example.com"]),
                dns: true,
            }
        );
        // Servers given: only they may be asked, as allowed /32s (beating denies they cover).
        assert_eq!(
            p(
                &["*.example.com", "1.1.1.1"],
                &[ALL_TRAFFIC, "8.8.8.8", "9.9.0.0/16"],
                Some(&["8.8.8.8", "1.1.1.1"])
            ),
            NodePolicy {
                internet: false,
                allow_cidrs: v(&["1.1.1.1/32", "8.8.8.8/32"]),
                deny_cidrs: v(&["9.9.0.0/16"]),
                allow_names: v(&["*.example.com"]),
                dns: false,
            }
        );
        // An empty list: no DNS at all.
        let none = p(&["example.com"], &[ALL_TRAFFIC], Some(&[]));
        assert_eq!((none.dns, none.allow_cidrs), (false, v(&[])));
        // Without names, servers change nothing (E2B).
        assert_eq!(
            p(&["1.1.1.1"], &[ALL_TRAFFIC, "8.8.8.8"], Some(&["8.8.8.8"])),
            np(false, &["1.1.1.1/32"], &["8.8.8.8/32"])
        );
        assert_eq!(p(&[], &[ALL_TRAFFIC], None), np(false, &[], &[]));
        // Allowing all traffic makes names (and their DNS) moot.
        assert_eq!(
            p(&[ALL_TRAFFIC, "example.com"], &[], Some(&["8.8.8.8"])),
            np(true, &[], &[])
        );
    }

    #[test]
    fn stored_form_round_trips() {
        let r = Rules::parse(
            &v(&["1.1.1.1", "10.0.0.0/8", "*.example.com"]),
            &[],
            Some(&v(&["8.8.8.8", "1.1.1.1"])),
        )
        .unwrap();
        let s = Rules::encode(&r.allow_out);
        assert_eq!(Rules::decode(&s), r.allow_out);
        assert!(Rules::decode("").is_empty());
        assert_eq!(r.encode_dns().as_deref(), Some("1.1.1.1,8.8.8.8"));
        assert_eq!(Rules::decode_dns(r.encode_dns().as_deref()), r.dns_servers);
        let empty = Rules {
            dns_servers: Some(vec![]),
            ..Rules::default()
        };
        assert_eq!(empty.encode_dns().as_deref(), Some(""));
        assert_eq!(Rules::decode_dns(Some("")), Some(vec![]));
        assert_eq!(Rules::default().encode_dns(), None);
        assert_eq!(Rules::decode_dns(None), None);
    }
}
