//! E2B's egress rules (`network.allowOut` / `denyOut`, `allow_internet_access`) and what they
//! mean for a node's switch: the one place their semantics live.
//!
//! E2B: with no rules, all traffic may leave; `denyOut` blocks addresses ("0.0.0.0/0" blocks
//! everything, as `allow_internet_access: false` does); `allowOut` entries always take
//! precedence over `denyOut` ones. The node's switch decides by longest prefix with a deny
//! beating an allow of the same prefix, so [`node_policy`] drops every deny entry an allow
//! entry covers, and turns "deny all" into the switch's internet switch.

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

/// A parsed entry: IPv4 (what the switch enforces) or IPv6 (sandboxes have no IPv6: every
/// IPv6 packet is dropped already, so a deny holds and an allow cannot).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    V4(Net),
    V6(String),
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
        Err(_) if looks_like_name(ip) && len.is_none() => Err(bad(
            "domain names are not implemented in Cube yet (use IP addresses or CIDRs)",
        )),
        Err(_) => Err(bad("not an IP address, a CIDR or a domain name")),
    }
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

/// A sandbox's egress rules as the user gave them, checked (and host bits cleared).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    pub allow_out: Vec<String>,
    pub deny_out: Vec<String>,
}

impl Rules {
    /// Checks both lists; the entries are kept in the form the node and the API report.
    pub fn parse(allow_out: &[String], deny_out: &[String]) -> Result<Rules, MasterError> {
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
                }
            }
            out.sort();
            out.dedup();
            Ok(out)
        };
        Ok(Rules {
            allow_out: list("allowOut", allow_out, true)?,
            deny_out: list("denyOut", deny_out, false)?,
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
}

/// What the node's switch gets: (internet on, allow CIDRs, deny CIDRs).
pub fn node_policy(internet: bool, r: &Rules) -> (bool, Vec<String>, Vec<String>) {
    let v4 = |s: &String| match parse_entry("", s) {
        Ok(Entry::V4(n)) => Some(n),
        _ => None,
    };
    let allow: Vec<Net> = r.allow_out.iter().filter_map(v4).collect();
    let all = Net { addr: 0, len: 0 };
    if allow.contains(&all) {
        // Allowed beats denied, and this allows everything.
        return (true, Vec::new(), Vec::new());
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
    (
        internet,
        allow.iter().map(|n| n.to_string()).collect(),
        deny,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn entries_are_checked_and_normalised() {
        let r = Rules::parse(
            &v(&["1.1.1.1", "8.8.8.9/24", "8.8.8.0/24"]),
            &v(&["2001:db8::/32", ALL_TRAFFIC]),
        )
        .unwrap();
        assert_eq!(r.allow_out, v(&["1.1.1.1/32", "8.8.8.0/24"]));
        assert_eq!(r.deny_out, v(&["0.0.0.0/0", "2001:db8::/32"]));
        let err = |a: &[&str], d: &[&str]| Rules::parse(&v(a), &v(d)).unwrap_err().to_string();
        assert!(err(&["example.com"], &[]).contains("domain names are not implemented"));
        assert!(err(&["*.example.com"], &[]).contains("domain names"));
        assert!(err(&[], &["example.com"]).contains("denyOut entry"));
        assert!(err(&["1.2.3.4/33"], &[]).contains("0-32"));
        assert!(err(&["::1"], &[]).contains("no IPv6"));
        assert!(err(&["not an address!"], &[]).contains("not an IP address"));
        let many: Vec<String> = (0..=MAX_ENTRIES)
            .map(|i| format!("1.1.{}.{}", i / 256, i % 256))
            .collect();
        assert!(Rules::parse(&many, &[])
            .unwrap_err()
            .to_string()
            .contains("at most"));
    }

    #[test]
    fn allow_beats_deny_and_deny_all_turns_internet_off() {
        let p = |a: &[&str], d: &[&str], internet| {
            node_policy(internet, &Rules::parse(&v(a), &v(d)).unwrap())
        };
        // Deny all + allow-list.
        assert_eq!(
            p(&["1.1.1.1"], &[ALL_TRAFFIC], true),
            (false, v(&["1.1.1.1/32"]), v(&[]))
        );
        // Allow-all + deny-list.
        assert_eq!(
            p(&[], &["8.8.8.8"], true),
            (true, v(&[]), v(&["8.8.8.8/32"]))
        );
        // An allow covering a deny (or equal to it) wins; a deny around an allow stays.
        assert_eq!(
            p(
                &["8.0.0.0/8", "9.9.9.9"],
                &["8.8.8.8", "9.9.9.9/32", "9.0.0.0/8"],
                true
            ),
            (true, v(&["8.0.0.0/8", "9.9.9.9/32"]), v(&["9.0.0.0/8"]))
        );
        // allow_internet_access false is deny-all; allowing all traffic overrides every deny.
        assert_eq!(p(&[], &[], false), (false, v(&[]), v(&[])));
        assert_eq!(
            p(&[ALL_TRAFFIC], &[ALL_TRAFFIC, "1.2.3.4"], false),
            (true, v(&[]), v(&[]))
        );
        // IPv6 denies are passed on (the switch drops IPv6 anyway).
        assert_eq!(p(&[], &["2001:db8::/32"], true).2, v(&["2001:db8::/32"]));
    }

    #[test]
    fn stored_form_round_trips() {
        let r = Rules::parse(&v(&["1.1.1.1", "10.0.0.0/8"]), &[]).unwrap();
        let s = Rules::encode(&r.allow_out);
        assert_eq!(Rules::decode(&s), r.allow_out);
        assert!(Rules::decode("").is_empty());
    }
}
