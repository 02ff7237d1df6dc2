//! What the numbers were measured on: CPU, memory, KVM kind (VMX, SVM, PVM or none), kernel.

use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    pub hostname: String,
    pub cpu_model: String,
    /// Logical CPUs online.
    pub cores: usize,
    pub mem_total_mib: u64,
    /// `VMX`, `SVM`, `PVM` or `none`.
    pub kvm_kind: String,
    /// How the KVM kind was decided.
    pub kvm_detail: String,
    pub kernel: String,
}

fn read(p: &str) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// A field of /proc/meminfo in KiB.
pub fn meminfo_kib(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// `MemAvailable` of this host, KiB.
pub fn mem_available_kib() -> Option<u64> {
    meminfo_kib(&read("/proc/meminfo"), "MemAvailable")
}

/// Decides the KVM kind from /proc/cpuinfo flags, /dev/kvm and the PVM module: hardware
/// virtualisation shows as the `vmx`/`svm` flag; PVM (paravirtualised KVM inside a cloud VM)
/// loads `kvm_pvm` and exposes /dev/kvm without either flag.
pub fn kvm_kind(cpuinfo: &str, dev_kvm: bool, pvm_module: bool) -> (String, String) {
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    let has = |f: &str| flags.contains(&f);
    if !dev_kvm {
        return ("none".into(), "no /dev/kvm".into());
    }
    if pvm_module {
        return (
            "PVM".into(),
            "/dev/kvm with the kvm_pvm module loaded".into(),
        );
    }
    if has("vmx") {
        return ("VMX".into(), "/dev/kvm, cpu flag vmx".into());
    }
    if has("svm") {
        return ("SVM".into(), "/dev/kvm, cpu flag svm".into());
    }
    (
        "PVM".into(),
        "/dev/kvm without vmx/svm cpu flags (paravirtualised KVM)".into(),
    )
}

pub fn detect() -> Machine {
    let cpuinfo = read("/proc/cpuinfo");
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|r| r.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let (kvm_kind, kvm_detail) = kvm_kind(
        &cpuinfo,
        Path::new("/dev/kvm").exists(),
        Path::new("/sys/module/kvm_pvm").exists(),
    );
    Machine {
        hostname: read("/proc/sys/kernel/hostname").trim().to_string(),
        cpu_model,
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        mem_total_mib: meminfo_kib(&read("/proc/meminfo"), "MemTotal").unwrap_or(0) / 1024,
        kvm_kind,
        kvm_detail,
        kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
    }
}

impl Machine {
    /// One line for table captions and plot titles.
    pub fn short(&self) -> String {
        format!(
            "{} ×{} cores, {} GiB, KVM {}",
            self.cpu_model,
            self.cores,
            (self.mem_total_mib + 512) / 1024,
            self.kvm_kind
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields() {
        let t = "MemTotal:       24684084 kB\nMemFree:  1 kB\nMemAvailable:   22968552 kB\n";
        assert_eq!(meminfo_kib(t, "MemAvailable"), Some(22968552));
        assert_eq!(meminfo_kib(t, "MemTotal"), Some(24684084));
        assert_eq!(meminfo_kib(t, "Mem"), None);
        assert_eq!(meminfo_kib(t, "SwapTotal"), None);
    }

    #[test]
    fn kvm_kinds() {
        let vmx = "flags\t\t: fpu vme vmx sse\n";
        let svm = "flags\t\t: fpu svm\n";
        let none = "flags\t\t: fpu hypervisor\n";
        assert_eq!(kvm_kind(vmx, true, false).0, "VMX");
        assert_eq!(kvm_kind(svm, true, false).0, "SVM");
        assert_eq!(kvm_kind(none, true, false).0, "PVM");
        assert_eq!(kvm_kind(vmx, true, true).0, "PVM");
        assert_eq!(kvm_kind(vmx, false, false).0, "none");
        // A flag must match a whole word.
        assert_eq!(kvm_kind("flags : vmxfoo\n", true, false).0, "PVM");
    }
}
