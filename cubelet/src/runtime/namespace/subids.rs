//! The host ids a node's sandboxes map to, reserved for owner [`OWNER`] in `/etc/subuid` and
//! `/etc/subgid` (the files `useradd`, podman and `newuidmap` consult), so that no user and no
//! other program's subordinate range overlaps them: a sandbox's root must own nothing on the
//! host but its own files.

use std::path::Path;

/// The owner name of the sandboxes' range in the subordinate id files.
pub const OWNER: &str = "cube";

/// One `owner:start:count` line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Range {
    owner: String,
    start: u64,
    count: u64,
}

fn parse(text: &str) -> Vec<Range> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.trim().splitn(3, ':');
            let owner = f.next()?.to_string();
            let start = f.next()?.parse().ok()?;
            let count = f.next()?.parse().ok()?;
            Some(Range {
                owner,
                start,
                count,
            })
        })
        .collect()
}

fn overlaps(a: u64, n: u64, b: u64, m: u64) -> bool {
    a < b + m && b < a + n
}

/// Ids of `/etc/passwd` (uid, field 3) or `/etc/group` (gid, field 3) entries.
fn account_ids(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            Some((f.first()?.to_string(), f.get(2)?.parse().ok()?))
        })
        .collect()
}

/// Makes sure `subid` (a `/etc/subuid`-style file) reserves `base..base+count` for [`OWNER`]:
/// refuses when the range holds an account of `accounts` (a passwd- or group-style file) or
/// overlaps another owner's range; appends the reservation when it is missing. Returns
/// whether the file was changed.
pub fn reserve(subid: &Path, accounts: &Path, base: u32, count: u32) -> Result<bool, String> {
    let (base, count) = (u64::from(base), u64::from(count));
    let text = match std::fs::read_to_string(subid) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(format!("{}: {e}", subid.display())),
    };
    let acc = std::fs::read_to_string(accounts).unwrap_or_default();
    if let Some((name, id)) = account_ids(&acc)
        .into_iter()
        .find(|(_, id)| overlaps(base, count, *id, 1))
    {
        return Err(format!(
            "sandbox ids {base}..{} include {name:?} (id {id}) of {}: choose another [sandbox] id_base",
            base + count,
            accounts.display()
        ));
    }
    let mut ours = false;
    for r in parse(&text) {
        if r.owner == OWNER && r.start == base && r.count == count {
            ours = true;
        } else if overlaps(base, count, r.start, r.count) {
            return Err(format!(
                "sandbox ids {base}..{} overlap {}:{}:{} in {}: choose another [sandbox] id_base",
                base + count,
                r.owner,
                r.start,
                r.count,
                subid.display()
            ));
        }
    }
    if ours {
        return Ok(false);
    }
    let mut out = text;
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(&format!("{OWNER}:{base}:{count}\n"));
    let tmp = subid.with_extension("cube-tmp");
    std::fs::write(&tmp, out)
        .and_then(|_| std::fs::rename(&tmp, subid))
        .map_err(|e| format!("{}: {e}", subid.display()))?;
    Ok(true)
}

/// The sandboxes' ids as `[sandbox]` configures them (`user_namespace`, `id_base`,
/// `id_count`), reserved in `/etc/subuid` and `/etc/subgid` where other tools look, so no user
/// or other range ever overlaps them; `None` when sandboxes run without a user namespace.
pub fn sandbox_ids(
    cfg: &crate::config::SandboxConfig,
) -> Result<Option<super::init::IdMap>, String> {
    if !cfg.user_namespace {
        return Ok(None);
    }
    for (sub, acc) in [
        ("/etc/subuid", "/etc/passwd"),
        ("/etc/subgid", "/etc/group"),
    ] {
        let added = reserve(Path::new(sub), Path::new(acc), cfg.id_base, cfg.id_count)
            .map_err(|e| format!("user namespace ids: {e}"))?;
        if added {
            tracing::info!(
                file = sub,
                owner = OWNER,
                base = cfg.id_base,
                count = cfg.id_count,
                "reserved the sandboxes' host ids"
            );
        }
    }
    Ok(Some(super::init::IdMap {
        base: cfg.id_base,
        count: cfg.id_count,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserves_once_and_refuses_overlaps() {
        let d = tempfile::tempdir().unwrap();
        let (sub, pw) = (d.path().join("subuid"), d.path().join("passwd"));
        std::fs::write(&sub, "user:100000:65536").unwrap();
        std::fs::write(
            &pw,
            "root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n",
        )
        .unwrap();
        assert_eq!(reserve(&sub, &pw, 1_000_000_000, 65536), Ok(true));
        assert_eq!(reserve(&sub, &pw, 1_000_000_000, 65536), Ok(false));
        let t = std::fs::read_to_string(&sub).unwrap();
        assert_eq!(t, "user:100000:65536\ncube:1000000000:65536\n");
        // Another owner's range, or an account inside the range: refused, file untouched.
        let e = reserve(&sub, &pw, 150_000, 100).unwrap_err();
        assert!(e.contains("user:100000:65536"), "{e}");
        let e = reserve(&sub, &pw, 900, 200).unwrap_err();
        assert!(e.contains("\"user\""), "{e}");
        // Our own range with another size is someone else's now.
        assert!(reserve(&sub, &pw, 1_000_000_000, 100).is_err());
        assert_eq!(std::fs::read_to_string(&sub).unwrap(), t);
        // A missing file is created.
        let fresh = d.path().join("subgid");
        assert_eq!(reserve(&fresh, &pw, 2_000_000_000, 10), Ok(true));
        assert_eq!(
            std::fs::read_to_string(&fresh).unwrap(),
            "cube:2000000000:10\n"
        );
    }
}
