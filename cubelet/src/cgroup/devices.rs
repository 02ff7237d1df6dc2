//! The devices a sandbox may open or make, defined once ([`DEVICE_ALLOW`]) and enforced twice
//! where the host has both: the v1 `devices` controller (`devices.allow` lines) and, on the
//! unified hierarchy, a `BPF_PROG_TYPE_CGROUP_DEVICE` program generated from the same list
//! (what cgroup v2 has instead of the controller).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// null, zero, full, random, urandom, tty, ptmx and the pty slaves; nothing else, whatever
/// nodes a sandbox finds or makes. v1 `devices.allow` syntax.
pub const DEVICE_ALLOW: &[&str] = &[
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",
    "c 5:0 rwm",
    "c 5:2 rwm",
    "c 136:* rwm",
];

/// One allow-list entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// `BPF_DEVCG_DEV_BLOCK` (1) or `BPF_DEVCG_DEV_CHAR` (2).
    pub kind: u32,
    pub major: u32,
    /// `None`: any minor.
    pub minor: Option<u32>,
    /// `BPF_DEVCG_ACC_MKNOD` (1) | `_READ` (2) | `_WRITE` (4).
    pub access: u32,
}

/// Parses a `devices.allow` line (`c 1:3 rwm`, `c 136:* rw`).
pub fn parse(line: &str) -> Result<Rule, String> {
    let bad = || format!("bad device rule {line:?}");
    let mut f = line.split_whitespace();
    let kind = match f.next() {
        Some("b") => 1,
        Some("c") => 2,
        _ => return Err(bad()),
    };
    let (maj, min) = f.next().and_then(|d| d.split_once(':')).ok_or_else(bad)?;
    let major = maj.parse().map_err(|_| bad())?;
    let minor = match min {
        "*" => None,
        m => Some(m.parse().map_err(|_| bad())?),
    };
    let mut access = 0;
    for ch in f.next().ok_or_else(bad)?.chars() {
        access |= match ch {
            'm' => 1,
            'r' => 2,
            'w' => 4,
            _ => return Err(bad()),
        };
    }
    if f.next().is_some() || access == 0 {
        return Err(bad());
    }
    Ok(Rule {
        kind,
        major,
        minor,
        access,
    })
}

/// One eBPF instruction (`struct bpf_insn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

impl Insn {
    const fn new(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
        Insn {
            code,
            regs: (src << 4) | dst,
            off,
            imm,
        }
    }
    /// dst = *(u32 *)(src + off)
    const fn ldx_w(dst: u8, src: u8, off: i16) -> Insn {
        Insn::new(0x61, dst, src, off, 0)
    }
    const fn mov(dst: u8, src: u8) -> Insn {
        Insn::new(0xbf, dst, src, 0, 0)
    }
    const fn mov_k(dst: u8, imm: i32) -> Insn {
        Insn::new(0xb7, dst, 0, 0, imm)
    }
    const fn and_k(dst: u8, imm: i32) -> Insn {
        Insn::new(0x57, dst, 0, 0, imm)
    }
    const fn rsh_k(dst: u8, imm: i32) -> Insn {
        Insn::new(0x77, dst, 0, 0, imm)
    }
    /// if dst != imm: skip `off` instructions.
    const fn jne_k(dst: u8, imm: i32, off: i16) -> Insn {
        Insn::new(0x55, dst, 0, off, imm)
    }
    const fn exit() -> Insn {
        Insn::new(0x95, 0, 0, 0, 0)
    }
    fn bytes(&self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[0] = self.code;
        b[1] = self.regs;
        b[2..4].copy_from_slice(&self.off.to_le_bytes());
        b[4..8].copy_from_slice(&self.imm.to_le_bytes());
        b
    }
}

/// The program: allow (return 1) a device access matching a rule, refuse (0) all others.
/// Context `struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }`, where
/// `access_type` is `access << 16 | kind`.
pub fn program(rules: &[Rule]) -> Vec<Insn> {
    let mut p = vec![
        Insn::ldx_w(2, 1, 0),
        Insn::and_k(2, 0xffff), // r2: kind
        Insn::ldx_w(3, 1, 0),
        Insn::rsh_k(3, 16),   // r3: access
        Insn::ldx_w(4, 1, 4), // r4: major
        Insn::ldx_w(5, 1, 8), // r5: minor
    ];
    for r in rules {
        let mut body = Vec::new();
        if r.access != 7 {
            // Refuse an access with any bit outside the rule's.
            body.push(Insn::mov(6, 3));
            body.push(Insn::and_k(6, !(r.access as i32) & 7));
            body.push(Insn::jne_k(6, 0, 0));
        }
        body.push(Insn::jne_k(2, r.kind as i32, 0));
        body.push(Insn::jne_k(4, r.major as i32, 0));
        if let Some(m) = r.minor {
            body.push(Insn::jne_k(5, m as i32, 0));
        }
        body.push(Insn::mov_k(0, 1));
        body.push(Insn::exit());
        // Each test jumps past the rest of this rule's block.
        let n = body.len();
        for (i, insn) in body.iter_mut().enumerate() {
            if insn.code == 0x55 {
                insn.off = (n - i - 1) as i16;
            }
        }
        p.extend(body);
    }
    p.push(Insn::mov_k(0, 0));
    p.push(Insn::exit());
    p
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
/// Programs of ancestors run too, and all must allow: a sandbox can only be narrower.
const BPF_F_ALLOW_MULTI: u32 = 2;

fn bpf(cmd: libc::c_long, attr: &mut [u8; 128]) -> std::io::Result<i64> {
    // SAFETY: bpf(2) with a zeroed attribute buffer the size of the fields we set.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Loads a device program allowing `rules`.
pub fn load(rules: &[Rule]) -> Result<OwnedFd, String> {
    let code: Vec<u8> = program(rules).iter().flat_map(|i| i.bytes()).collect();
    let license = c"GPL";
    let mut log = vec![0u8; 4096];
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_CGROUP_DEVICE.to_ne_bytes());
    attr[4..8].copy_from_slice(&((code.len() / 8) as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(code.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    attr[24..28].copy_from_slice(&1u32.to_ne_bytes());
    attr[28..32].copy_from_slice(&(log.len() as u32).to_ne_bytes());
    attr[32..40].copy_from_slice(&(log.as_mut_ptr() as u64).to_ne_bytes());
    attr[48..58].copy_from_slice(b"cube_devcg");
    let prog = bpf(BPF_PROG_LOAD, &mut attr).map_err(|e| {
        let end = log.iter().position(|&b| b == 0).unwrap_or(0);
        format!(
            "loading the device program: {e}: {}",
            String::from_utf8_lossy(&log[..end]).trim()
        )
    })?;
    // SAFETY: a new fd the kernel just returned to us.
    Ok(unsafe { OwnedFd::from_raw_fd(prog as i32) })
}

/// Attaches a loaded device program to the cgroup (v2) directory `dir`.
pub fn attach(dir: &Path, prog: &OwnedFd) -> Result<(), String> {
    let cg = std::fs::File::open(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&(cg.as_raw_fd() as u32).to_ne_bytes());
    attr[4..8].copy_from_slice(&(prog.as_raw_fd() as u32).to_ne_bytes());
    attr[8..12].copy_from_slice(&BPF_CGROUP_DEVICE.to_ne_bytes());
    attr[12..16].copy_from_slice(&BPF_F_ALLOW_MULTI.to_ne_bytes());
    bpf(BPF_PROG_ATTACH, &mut attr)
        .map_err(|e| format!("attaching the device program to {}: {e}", dir.display()))?;
    // The attachment holds the program; it goes with the cgroup.
    Ok(())
}

/// The allow-list, parsed.
pub fn rules() -> Vec<Rule> {
    // The list is a constant checked by a unit test: every line parses.
    DEVICE_ALLOW.iter().filter_map(|l| parse(l).ok()).collect()
}

/// The [`DEVICE_ALLOW`] program, loaded once per process: one program serves every sandbox
/// cgroup (loading costs about a millisecond of verifier time).
pub fn allow_list_program() -> Result<&'static OwnedFd, String> {
    static PROG: std::sync::OnceLock<OwnedFd> = std::sync::OnceLock::new();
    if let Some(p) = PROG.get() {
        return Ok(p);
    }
    let p = load(&rules())?;
    Ok(PROG.get_or_init(|| p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_and_bad_ones_are_refused() {
        assert_eq!(rules().len(), DEVICE_ALLOW.len());
        assert_eq!(
            parse("c 136:* rw").unwrap(),
            Rule {
                kind: 2,
                major: 136,
                minor: None,
                access: 6
            }
        );
        for bad in [
            "x 1:3 rwm",
            "c 1 rwm",
            "c 1:3",
            "c 1:3 rwx",
            "c a:3 r",
            "c 1:3 r extra",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn program_jumps_stay_inside_it() {
        let p = program(&rules());
        assert_eq!(p.last(), Some(&Insn::exit()));
        for (i, insn) in p.iter().enumerate() {
            if insn.code == 0x55 {
                let to = i as i64 + 1 + i64::from(insn.off);
                assert!(
                    to > i as i64 && (to as usize) < p.len(),
                    "insn {i} jumps to {to}"
                );
            }
        }
    }
}
