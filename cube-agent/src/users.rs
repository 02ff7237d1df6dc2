//! Unix accounts from `/etc/passwd` and `/etc/group`.
//!
//! Parsed directly rather than through NSS: the agent is a static binary, and glibc's NSS does not
//! work reliably from one.

use std::path::PathBuf;

/// A Unix account, with everything needed to run a process or do file work as it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    pub shell: String,
    /// Supplementary groups (including the primary group), as `initgroups` would set them.
    pub groups: Vec<u32>,
}

#[derive(Debug, Clone)]
struct PasswdEntry {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
    shell: String,
}

#[derive(Debug, Clone)]
struct GroupEntry {
    name: String,
    gid: u32,
    members: Vec<String>,
}

fn parse_passwd(text: &str) -> Vec<PasswdEntry> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 7 {
                return None;
            }
            Some(PasswdEntry {
                name: f[0].to_string(),
                uid: f[2].parse().ok()?,
                gid: f[3].parse().ok()?,
                home: f[5].to_string(),
                shell: f[6].to_string(),
            })
        })
        .collect()
}

fn parse_group(text: &str) -> Vec<GroupEntry> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 4 {
                return None;
            }
            Some(GroupEntry {
                name: f[0].to_string(),
                gid: f[2].parse().ok()?,
                members: f[3]
                    .split(',')
                    .filter(|m| !m.is_empty())
                    .map(str::to_string)
                    .collect(),
            })
        })
        .collect()
}

/// A snapshot of the account databases.
pub struct Accounts {
    passwd: Vec<PasswdEntry>,
    group: Vec<GroupEntry>,
}

impl Accounts {
    /// Reads the system files (missing files mean no entries).
    pub fn load() -> Self {
        Self::from_text(
            &std::fs::read_to_string("/etc/passwd").unwrap_or_default(),
            &std::fs::read_to_string("/etc/group").unwrap_or_default(),
        )
    }

    pub fn from_text(passwd: &str, group: &str) -> Self {
        Accounts {
            passwd: parse_passwd(passwd),
            group: parse_group(group),
        }
    }

    fn build(&self, p: &PasswdEntry) -> User {
        let mut groups = vec![p.gid];
        for g in &self.group {
            if g.members.iter().any(|m| m == &p.name) && !groups.contains(&g.gid) {
                groups.push(g.gid);
            }
        }
        User {
            name: p.name.clone(),
            uid: p.uid,
            gid: p.gid,
            home: PathBuf::from(if p.home.is_empty() { "/" } else { &p.home }),
            shell: p.shell.clone(),
            groups,
        }
    }

    pub fn by_name(&self, name: &str) -> Option<User> {
        self.passwd
            .iter()
            .find(|p| p.name == name)
            .map(|p| self.build(p))
    }

    pub fn by_uid(&self, uid: u32) -> Option<User> {
        self.passwd
            .iter()
            .find(|p| p.uid == uid)
            .map(|p| self.build(p))
    }

    pub fn user_name(&self, uid: u32) -> String {
        self.passwd
            .iter()
            .find(|p| p.uid == uid)
            .map(|p| p.name.clone())
            .unwrap_or_else(|| uid.to_string())
    }

    pub fn group_name(&self, gid: u32) -> String {
        self.group
            .iter()
            .find(|g| g.gid == gid)
            .map(|g| g.name.clone())
            .unwrap_or_else(|| gid.to_string())
    }
}

/// Looks a user up by name in the system files.
pub fn lookup(name: &str) -> Option<User> {
    Accounts::load().by_name(name)
}

/// The account the agent itself runs as (synthesised if it is not in `/etc/passwd`).
pub fn current() -> User {
    // SAFETY: geteuid/getegid cannot fail.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    Accounts::load().by_uid(uid).unwrap_or(User {
        name: if uid == 0 {
            "root".into()
        } else {
            uid.to_string()
        },
        uid,
        gid,
        home: PathBuf::from(if uid == 0 { "/root" } else { "/" }),
        shell: "/bin/sh".into(),
        groups: vec![gid],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nbad line\nnohome:x:7:7:::/bin/sh\n";
    const GROUP: &str = "root:x:0:\nuser:x:1000:\nsudo:x:27:user,other\ndocker:x:999:other\n";

    #[test]
    fn resolves_users_and_groups() {
        let a = Accounts::from_text(PASSWD, GROUP);
        let u = a.by_name("user").unwrap();
        assert_eq!((u.uid, u.gid), (1000, 1000));
        assert_eq!(u.home, PathBuf::from("/home/user"));
        assert_eq!(u.groups, vec![1000, 27]);
        assert!(a.by_name("other").is_none());
        assert_eq!(a.by_uid(0).unwrap().name, "root");
        assert_eq!(a.user_name(4242), "4242");
        assert_eq!(a.group_name(27), "sudo");
        assert_eq!(a.by_name("nohome").unwrap().home, PathBuf::from("/"));
    }

    #[test]
    fn current_user_exists() {
        let me = current();
        assert!(!me.name.is_empty());
    }
}
