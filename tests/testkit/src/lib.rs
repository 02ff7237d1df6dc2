//! Gating for tests that need root, `/dev/kvm` or other host features.
//!
//! A privileged test calls [`require`] (or the [`require_priv!`]/[`require_kvm!`] macros) first.
//! When the capability is missing the test is skipped with a printed reason, unless CI asked for
//! it with `CUBE_REQUIRE_PRIV=1` / `CUBE_REQUIRE_KVM=1`, in which case the test fails loudly: a
//! machine that should run everything can never go green by skipping.
//!
//! Every decision is also appended to the file named by `CUBE_SUITE_LOG`, so `tests/run.sh` can
//! print which privileged and KVM suites really ran.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;

/// What a test needs from the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Root (CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_BPF …).
    Priv,
    /// A usable `/dev/kvm`.
    Kvm,
}

impl Need {
    fn env_var(self) -> &'static str {
        match self {
            Need::Priv => "CUBE_REQUIRE_PRIV",
            Need::Kvm => "CUBE_REQUIRE_KVM",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Need::Priv => "priv",
            Need::Kvm => "kvm",
        }
    }

    /// Why the host lacks this, or `None` when it is there.
    pub fn missing(self) -> Option<String> {
        match self {
            Need::Priv => {
                // SAFETY: geteuid has no preconditions and cannot fail.
                let euid = unsafe { libc_geteuid() };
                (euid != 0).then(|| format!("not root (euid {euid})"))
            }
            Need::Kvm => {
                let p = Path::new("/dev/kvm");
                if !p.exists() {
                    return Some("/dev/kvm does not exist".into());
                }
                match OpenOptions::new().read(true).write(true).open(p) {
                    Ok(_) => None,
                    Err(e) => Some(format!("cannot open /dev/kvm: {e}")),
                }
            }
        }
    }
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

fn required(need: Need) -> bool {
    std::env::var(need.env_var())
        .map(|v| v == "1" || v.eq_ignore_ascii_case("true"))
        .unwrap_or(false)
}

/// Appends one line to the suite log `tests/run.sh` prints (for suites gated by something
/// other than [`require`], such as a database).
pub fn log_line(line: &str) {
    if let Ok(path) = std::env::var("CUBE_SUITE_LOG") {
        if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(path) {
            // One write per line: test binaries run side by side append to the same file, and
            // `writeln!` may split a line into several writes that interleave with theirs.
            let _ = f.write_all(format!("{line}\n").as_bytes());
        }
    }
}

/// Returns true when the test may run. Returns false (after printing `SKIPPED`) when the host
/// lacks what the test needs and CI did not require it; panics when CI required it.
pub fn require(test: &str, needs: &[Need]) -> bool {
    for &need in needs {
        if let Some(why) = need.missing() {
            if required(need) {
                log_line(&format!("FAILED  {} {test}: {why}", need.label()));
                panic!(
                    "{test}: required capability missing ({}=1): {why}",
                    need.env_var()
                );
            }
            log_line(&format!("SKIPPED {} {test}: {why}", need.label()));
            eprintln!("SKIPPED {test}: {why}");
            return false;
        }
    }
    let labels: Vec<&str> = needs.iter().map(|n| n.label()).collect();
    log_line(&format!("RAN     {} {test}", labels.join("+")));
    true
}

/// `require_priv!("name")` — return early from a test that needs root when it cannot run.
#[macro_export]
macro_rules! require_priv {
    ($name:expr) => {
        if !$crate::require($name, &[$crate::Need::Priv]) {
            return;
        }
    };
}

/// `require_kvm!("name")` — return early from a test that needs `/dev/kvm` when it cannot run.
#[macro_export]
macro_rules! require_kvm {
    ($name:expr) => {
        if !$crate::require($name, &[$crate::Need::Kvm]) {
            return;
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    extern "C" {
        fn ioctl(fd: i32, request: u64, ...) -> i32;
    }

    #[test]
    fn kvm_probe_agrees_with_the_device() {
        use std::os::fd::AsRawFd;
        let p = Path::new("/dev/kvm");
        match Need::Kvm.missing() {
            // "Present" must mean a KVM this process can drive: the API version answers 12.
            None => {
                let f = OpenOptions::new().read(true).write(true).open(p).unwrap();
                // SAFETY: KVM_GET_API_VERSION (_IO(0xAE, 0)) takes no argument.
                let v = unsafe { ioctl(f.as_raw_fd(), 0xAE00) };
                assert_eq!(
                    v, 12,
                    "/dev/kvm opened but KVM_GET_API_VERSION answered {v}"
                );
            }
            Some(why) if !p.exists() => assert!(why.contains("does not exist"), "{why}"),
            Some(why) => {
                assert!(why.starts_with("cannot open /dev/kvm"), "{why}");
                assert!(OpenOptions::new().read(true).write(true).open(p).is_err());
            }
        }
        // Where CI requires KVM, the probe must find it (or every KVM suite would fail late).
        if required(Need::Kvm) {
            assert_eq!(Need::Kvm.missing(), None, "{}=1", Need::Kvm.env_var());
        }
    }

    #[test]
    fn unrequired_missing_capability_skips() {
        // A need that is missing for an unprivileged user; as root this runs the "present" path.
        let ran = require("testkit_self_check", &[Need::Priv]);
        assert_eq!(ran, Need::Priv.missing().is_none());
    }
}
