//! The names an egress policy allows: exact names and `*.` wildcards (subdomains only, as E2B
//! defines them), matched case-insensitively.

use std::collections::HashSet;

/// A checked set of allowed names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NameSet {
    exact: HashSet<String>,
    /// ".example.com" for "*.example.com".
    suffixes: Vec<String>,
}

/// A host name in the form names are compared in: lower case, no trailing dot, letters,
/// digits, '-' and '_' in non-empty labels of at most 63 bytes. `None` for anything else
/// (an address literal included: names are for names).
pub fn normalize(host: &str) -> Option<String> {
    let h = host.trim();
    let h = h.strip_suffix('.').unwrap_or(h).to_ascii_lowercase();
    let ok = !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        && h.parse::<std::net::Ipv4Addr>().is_err();
    ok.then_some(h)
}

impl NameSet {
    /// Checks every entry ("name" or "*.name"); the first bad one is the error.
    pub fn parse(entries: &[String]) -> Result<NameSet, String> {
        let mut out = NameSet::default();
        for e in entries {
            let bad = || format!("allowed name {e:?} is not a domain name or a \"*.\" wildcard");
            match e.trim().strip_prefix("*.") {
                Some(rest) => {
                    let n = normalize(rest).ok_or_else(bad)?;
                    if !n.contains('.') {
                        return Err(format!("allowed name {e:?}: a wildcard needs two labels"));
                    }
                    out.suffixes.push(format!(".{n}"));
                }
                None => {
                    out.exact.insert(normalize(e).ok_or_else(bad)?);
                }
            }
        }
        out.suffixes.sort();
        out.suffixes.dedup();
        Ok(out)
    }

    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.suffixes.is_empty()
    }

    /// Whether `host` (as a client sent it) is allowed.
    pub fn allows(&self, host: &str) -> bool {
        let Some(h) = normalize(host) else {
            return false;
        };
        self.exact.contains(&h) || self.suffixes.iter().any(|s| h.ends_with(s.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[&str]) -> NameSet {
        NameSet::parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn exact_and_wildcard_names() {
        let s = set(&["Api.Example.com", "*.cdn.example.org"]);
        assert!(s.allows("api.example.com") && s.allows("API.EXAMPLE.COM."));
        assert!(!s.allows("example.com") && !s.allows("x.api.example.com"));
        // A wildcard is subdomains only, at any depth, never the name itself.
        assert!(s.allows("a.cdn.example.org") && s.allows("a.b.cdn.example.org"));
        assert!(!s.allows("cdn.example.org"));
        assert!(
            !s.allows("evilcdn.example.org"),
            "a suffix must end on a label boundary"
        );
        assert!(!s.allows("") && !s.allows("1.2.3.4") && !s.allows("api.example.com:443"));
        assert!(set(&[]).is_empty());
    }

    #[test]
    fn bad_entries_are_refused() {
        for bad in ["*", "*.com", "a..b", "exa mple.com", "1.2.3.4", "x/24", ""] {
            assert!(
                NameSet::parse(&[bad.to_string()]).is_err(),
                "{bad} was accepted"
            );
        }
    }
}
