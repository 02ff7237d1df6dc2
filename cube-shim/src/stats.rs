//! Memory and CPU accounting of the shim process, from `/proc/self/smaps` (guest RAM range),
//! `/proc/self/smaps_rollup` (whole process) and `getrusage`.

use std::ops::Range;

use crate::protocol::Stats;

/// Sums of the smaps fields we report, in KiB.
#[derive(Default, Debug, Clone, Copy, PartialEq)]
pub struct MemFields {
    pub rss: u64,
    pub pss: u64,
    pub private: u64,
    pub anon: u64,
}

impl MemFields {
    fn add_line(&mut self, line: &str) {
        let mut it = line.split_whitespace();
        let (Some(key), Some(val)) = (it.next(), it.next()) else {
            return;
        };
        let Ok(kib) = val.parse::<u64>() else { return };
        match key {
            "Rss:" => self.rss += kib,
            "Pss:" => self.pss += kib,
            "Private_Clean:" | "Private_Dirty:" => self.private += kib,
            "Anonymous:" => self.anon += kib,
            _ => {}
        }
    }
}

/// Parses a VMA header line (`start-end perms ...`) into its address range.
fn vma_range(line: &str) -> Option<Range<u64>> {
    let first = line.split_whitespace().next()?;
    let (a, b) = first.split_once('-')?;
    Some(u64::from_str_radix(a, 16).ok()?..u64::from_str_radix(b, 16).ok()?)
}

/// Sums smaps fields over the VMAs inside `range` (guest RAM may be split into several VMAs
/// by pause-to-disk overlays).
pub fn smaps_in_range(smaps: &str, range: &Range<u64>) -> MemFields {
    let mut f = MemFields::default();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some(r) = vma_range(line).filter(|_| line.contains(' ') && !line.ends_with(" kB")) {
            inside = r.start >= range.start && r.end <= range.end;
            continue;
        }
        if inside {
            f.add_line(line);
        }
    }
    f
}

pub fn rollup(text: &str) -> MemFields {
    let mut f = MemFields::default();
    for line in text.lines() {
        f.add_line(line);
    }
    f
}

/// Collects [`Stats`]; `guest` is the host address range of guest RAM, if a VM exists.
pub fn collect(guest: Option<Range<u64>>) -> std::io::Result<Stats> {
    let g = match guest {
        Some(r) => smaps_in_range(&std::fs::read_to_string("/proc/self/smaps")?, &r),
        None => MemFields::default(),
    };
    let p = rollup(&std::fs::read_to_string("/proc/self/smaps_rollup")?);
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    Ok(Stats {
        guest_rss_kib: g.rss,
        guest_private_kib: g.private,
        guest_pss_kib: g.pss,
        guest_anon_kib: g.anon,
        process_rss_kib: p.rss,
        process_pss_kib: p.pss,
        process_private_kib: p.private,
        cpu_user_us: us(ru.ru_utime),
        cpu_system_us: us(ru.ru_stime),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_only_vmas_inside_the_range() {
        let smaps = "\
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
Rss:                 100 kB
Pss:                  50 kB
Private_Dirty:        10 kB
Anonymous:            10 kB
7f0000100000-7f0000200000 r--p 00000000 08:01 1234 /tmp/memory.img
Rss:                 200 kB
Pss:                  20 kB
Private_Clean:         4 kB
Private_Dirty:         6 kB
7f0000300000-7f0000400000 rw-p 00000000 00:00 0
Rss:                 999 kB
";
        let f = smaps_in_range(smaps, &(0x7f00_0000_0000..0x7f00_0020_0000));
        assert_eq!(
            f,
            MemFields {
                rss: 300,
                pss: 70,
                private: 20,
                anon: 10
            }
        );
    }

    #[test]
    fn reads_this_process() {
        let s = collect(None).unwrap();
        assert!(s.process_rss_kib > 0);
        assert_eq!(s.guest_rss_kib, 0);
    }
}
