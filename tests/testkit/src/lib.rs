//! Gating for tests that need root, `/dev/kvm` or other host features.
//!
//! A privileged test calls [`require`] (or the [`require_priv!`]/[`require_kvm!`] macros) first.
//! When the capability is missing the test is skipped with a printed reason, unless CI asked for
//! it with `CUBE_REQUIRE_PRIV=1` / `CUBE_REQUIRE_KVM=1`, in which case the test fails loudly: a
//! machine that should run everything can never go green by skipping.
//!
//! Every outcome is appended to the file named by `CUBE_SUITE_LOG`: `SKIPPED`/`FAILED` when the
//! gate decides, and `RAN` only when the test's [`Gate`] is dropped at its end without a panic
//! (a later [`skip`] turns that into `SKIPPED`). `tests/suites.py` checks the log against the
//! checked-in list of tests that must run.

use std::cell::RefCell;
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

#[cfg(test)]
thread_local! {
    /// The self-tests' own log (their gates must not reach CI's suite log).
    static LOG_OVERRIDE: RefCell<Option<std::path::PathBuf>> = const { RefCell::new(None) };
}

fn required(need: Need) -> bool {
    std::env::var(need.env_var())
        .map(|v| v == "1" || v.eq_ignore_ascii_case("true"))
        .unwrap_or(false)
}

/// Appends one line to the suite log `tests/run.sh` prints (for suites gated by something
/// other than [`require`], such as a database).
pub fn log_line(line: &str) {
    #[cfg(test)]
    let path = LOG_OVERRIDE
        .with(|o| o.borrow().clone())
        .map(|p| p.display().to_string())
        .ok_or(());
    #[cfg(not(test))]
    let path = std::env::var("CUBE_SUITE_LOG");
    if let Ok(path) = path {
        if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(path) {
            // One write per line: test binaries run side by side append to the same file, and
            // `writeln!` may split a line into several writes that interleave with theirs.
            let _ = f.write_all(format!("{line}\n").as_bytes());
        }
    }
}

/// A gated test that may run. Logs `RAN` when dropped at the end of the test, `FAILED` when
/// dropped by a panic, and `SKIPPED` when the test called [`skip`] after the gate.
#[must_use = "the test counts as ran only when its gate is dropped at the end"]
#[derive(Debug)]
pub struct Gate {
    label: String,
    test: String,
}

thread_local! {
    /// Why the test on this thread gave up after its gate (see [`skip`]).
    static SKIPPED: RefCell<Option<String>> = const { RefCell::new(None) };
}

impl Gate {
    /// A gate for a test that needs something other than [`Need`] (a database, say): `label`
    /// names the need in the log.
    pub fn new(label: &str, test: &str) -> Gate {
        SKIPPED.with(|s| s.borrow_mut().take());
        Gate {
            label: label.to_string(),
            test: test.to_string(),
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        let (label, test) = (&self.label, &self.test);
        if std::thread::panicking() {
            log_line(&format!("FAILED  {label} {test}: panicked"));
        } else if let Some(why) = SKIPPED.with(|s| s.borrow().clone()) {
            log_line(&format!("SKIPPED {label} {test}: {why}"));
        } else {
            log_line(&format!("RAN     {label} {test}"));
        }
    }
}

/// A gated test that cannot go on after its gate (an input was not built): its gates log
/// `SKIPPED` with `why` instead of `RAN`. The caller still returns; under CI the suite check
/// fails on the skip.
pub fn skip(why: &str) {
    eprintln!("SKIPPED: {why}");
    SKIPPED.with(|s| *s.borrow_mut() = Some(why.to_string()));
}

/// Returns the test's [`Gate`] when it may run. Returns `None` (after logging `SKIPPED`) when
/// the host lacks what the test needs and CI did not require it; panics when CI required it.
pub fn require(test: &str, needs: &[Need]) -> Option<Gate> {
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
            return None;
        }
    }
    let labels: Vec<&str> = needs.iter().map(|n| n.label()).collect();
    Some(Gate::new(&labels.join("+"), test))
}

/// `require_priv!("name")` — return early from a test that needs root when it cannot run; the
/// gate it holds until the end of the calling block logs whether the test ran to its end.
#[macro_export]
macro_rules! require_priv {
    ($name:expr) => {
        let _cube_gate = match $crate::require($name, &[$crate::Need::Priv]) {
            Some(g) => g,
            None => return,
        };
    };
}

/// `require_kvm!("name")` — return early from a test that needs `/dev/kvm` when it cannot run.
#[macro_export]
macro_rules! require_kvm {
    ($name:expr) => {
        let _cube_gate = match $crate::require($name, &[$crate::Need::Kvm]) {
            Some(g) => g,
            None => return,
        };
    };
}

/// Where [`reserve_port`] and tests/ports.py keep one lock file per port they hand out.
const PORT_LOCKS: &str = "/tmp/cube-test-ports";

/// Lock files of the ports this process holds (released when it exits).
static HELD_PORTS: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());

/// A TCP port for a daemon a test starts. Binding port 0 and closing would hand out a port
/// from the kernel's ephemeral range that any outgoing connection may take before the daemon
/// binds it; this one lies below that range (the kernel never picks it), was free when picked,
/// and is held against every other test process (Rust or Python, tests/ports.py) by a lock
/// file for the rest of this process's life.
pub fn reserve_port() -> u16 {
    reserve_ports(1)
}

/// `n` consecutive ports, as [`reserve_port`] holds them: the first is returned (for a daemon
/// that takes a base port and the ones after it).
pub fn reserve_ports(n: u16) -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // 8,000 ports below the ephemeral range, at least 1024 and above.
    let (lo, hi) = (low.saturating_sub(8000).max(1024), low.saturating_sub(n));
    assert!(
        hi > lo + 100,
        "ip_local_port_range starts at {low}: no room below it"
    );
    let _ = std::fs::create_dir_all(PORT_LOCKS);
    let _ = std::fs::set_permissions(
        PORT_LOCKS,
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    );
    let span = u32::from(hi - lo);
    let start = std::process::id().wrapping_mul(2654435761) % span;
    let mut held = HELD_PORTS.lock().unwrap_or_else(|e| e.into_inner());
    'next: for k in 0..span {
        let base = lo + ((start + k * 7) % span) as u16;
        let mut locks = Vec::new();
        for port in base..base + n {
            match hold(port) {
                Some(f) => locks.push(f),
                None => continue 'next, // the ones already taken are released with `locks`
            }
        }
        held.extend(locks);
        return base;
    }
    panic!("no {n} free ports in {lo}..{hi}");
}

/// The port's lock file, locked, if no other test process holds it and nothing listens there.
fn hold(port: u16) -> Option<std::fs::File> {
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(format!("{PORT_LOCKS}/{port}"))
        .ok()?;
    f.try_lock().ok()?;
    std::net::TcpListener::bind(("0.0.0.0", port)).ok()?;
    Some(f)
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

    /// The lines a gate writes, into a log of the test's own (not CI's suite log).
    fn logged(f: impl FnOnce() + std::panic::UnwindSafe + Send + 'static) -> String {
        let dir = std::env::temp_dir().join(format!("cube-testkit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join(format!("{:?}.log", std::thread::current().id()));
        let _ = std::fs::remove_file(&log);
        // A thread of its own: CUBE_SUITE_LOG is read per line, and the outer test's own value
        // must not see these lines.
        let path = log.clone();
        let _ = std::thread::spawn(move || {
            LOG_OVERRIDE.with(|o| *o.borrow_mut() = Some(path));
            let _ = std::panic::catch_unwind(f);
        })
        .join();
        std::fs::read_to_string(&log).unwrap_or_default()
    }

    #[test]
    fn a_gate_logs_ran_only_at_the_end_of_a_test_that_did_not_give_up() {
        let ran = logged(|| drop(Gate::new("priv", "t_ran")));
        assert_eq!(ran, "RAN     priv t_ran\n");
        let panicked = logged(|| {
            let _g = Gate::new("kvm", "t_panic");
            panic!("a failing assertion");
        });
        assert_eq!(panicked, "FAILED  kvm t_panic: panicked\n");
        let skipped = logged(|| {
            let _g = Gate::new("priv", "t_skip");
            skip("input not built");
        });
        assert_eq!(skipped, "SKIPPED priv t_skip: input not built\n");
        // The next gate on a thread does not inherit an earlier test's skip.
        let both = logged(|| {
            drop(Gate::new("priv", "t_a"));
            skip("x");
            drop(Gate::new("priv", "t_b"));
        });
        assert_eq!(both, "RAN     priv t_a\nRAN     priv t_b\n");
    }

    #[test]
    fn reserved_ports_are_distinct_below_the_ephemeral_range_and_locked() {
        let a = reserve_port();
        let b = reserve_ports(2);
        assert!(a != b && a != b + 1, "{a} overlaps {b}..={}", b + 1);
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(a < low && b < low, "{a} {b} not below {low}");
        // Held: another open of its lock file cannot take it.
        let f = OpenOptions::new()
            .write(true)
            .open(format!("{PORT_LOCKS}/{a}"))
            .unwrap();
        assert!(f.try_lock().is_err(), "port {a} is not held");
        for p in [b, b + 1] {
            let f = OpenOptions::new()
                .write(true)
                .open(format!("{PORT_LOCKS}/{p}"))
                .unwrap();
            assert!(f.try_lock().is_err(), "port {p} is not held");
        }
        // And it is bindable by the daemon it is for.
        drop(std::net::TcpListener::bind(("127.0.0.1", a)).unwrap());
    }

    #[test]
    fn an_unrequired_missing_capability_skips_and_a_present_one_gates() {
        // Missing for an unprivileged user; as root this takes the "present" path.
        let missing = Need::Priv.missing();
        if missing.is_some() && required(Need::Priv) {
            return; // require() panics here by design; the KVM test covers that path.
        }
        // (Its gate logs nothing: the self-tests write only to logs of their own.)
        let gate = require("testkit_gate", &[Need::Priv]);
        assert_eq!(gate.is_some(), missing.is_none());
    }
}
