//! Parsing of `/proc/self/mountinfo`, to mount only what is not mounted yet.

/// One mount: where it is and what filesystem type it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub mount_point: String,
    pub fs_type: String,
}

/// Undoes the kernel's octal escaping (`\040` for space, etc.).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = (oct[0] - b'0') as u32 * 64
                    + (oct[1] - b'0') as u32 * 8
                    + (oct[2] - b'0') as u32;
                if let Ok(v) = u8::try_from(v) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text. Malformed lines are skipped.
pub fn parse(text: &str) -> Vec<Mount> {
    let mut mounts = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        // id parent maj:min root mount_point options [optional...] - fstype source superopts
        if fields.len() < 7 {
            continue;
        }
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if sep < 6 || sep + 1 >= fields.len() {
            continue;
        }
        mounts.push(Mount {
            mount_point: unescape(fields[4]),
            fs_type: fields[sep + 1].to_string(),
        });
    }
    mounts
}

/// Whether `path` is a mount point in the parsed table.
pub fn is_mounted(mounts: &[Mount], path: &str) -> bool {
    mounts.iter().any(|m| m.mount_point == path)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
23 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
24 22 0:5 / /dev rw,nosuid shared:2 master:3 - devtmpfs udev rw,size=1k
25 22 0:40 / /mnt/with\\040space rw - tmpfs tmpfs rw
garbage line
26 22 0:41 / /x rw no-separator here tmpfs
";

    #[test]
    fn parses_mount_points_and_types() {
        let m = parse(SAMPLE);
        assert_eq!(m.len(), 4);
        assert!(is_mounted(&m, "/proc"));
        assert!(is_mounted(&m, "/dev"));
        assert!(!is_mounted(&m, "/sys"));
        assert!(!is_mounted(&m, "/x"));
        assert_eq!(m[2].fs_type, "devtmpfs");
        assert_eq!(m[3].mount_point, "/mnt/with space");
    }

    #[test]
    fn parses_real_table() {
        let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let m = parse(&text);
        assert!(is_mounted(&m, "/"));
        assert!(m.iter().any(|x| x.fs_type == "proc"));
    }

    #[test]
    fn unescape_edge_cases() {
        assert_eq!(unescape("a\\134b"), "a\\b");
        assert_eq!(unescape("trailing\\"), "trailing\\");
        assert_eq!(unescape("\\09x"), "\\09x");
    }
}
