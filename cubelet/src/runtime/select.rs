//! Which runtime a node runs (`runtime = "namespace" | "microvm" | "auto"`) and why: the
//! strongest isolation the host can give, within what this cubelet is built with.

use crate::config::MicroVmConfig;
use crate::sandbox::{GVISOR, MICROVM, NAMESPACE};
use std::path::{Path, PathBuf};

/// `microvm.guest` value selecting the shim's agent stand-in test guest.
pub const STANDIN_GUEST: &str = "agent-standin";
/// The boot parameter of the guest kernel's PVM patch (deploy/guest-kernel/patches/).
const PVM_PATCH_MARKER: &[u8] = b"cube_pvm";

/// Whether a kernel image carries the `cube_pvm` patch (its parameter name is in the image).
pub fn kernel_has_pvm_patch(kernel: &Path) -> bool {
    let Ok(b) = std::fs::read(kernel) else {
        return false;
    };
    b.windows(PVM_PATCH_MARKER.len() + 1)
        .any(|w| &w[..PVM_PATCH_MARKER.len()] == PVM_PATCH_MARKER && w[PVM_PATCH_MARKER.len()] == 0)
}

/// The runtime a node runs and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub runtime: &'static str,
    pub kvm_kind: String,
    pub reason: String,
}

/// The guest configured for microVMs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Guest {
    Standin,
    Linux(PathBuf),
}

impl Guest {
    pub fn from_config(s: &str) -> Guest {
        if s == STANDIN_GUEST {
            Guest::Standin
        } else {
            Guest::Linux(PathBuf::from(s))
        }
    }
}

/// Whether `/dev/kvm` of kind `kvm_kind` ("none", "pvm", "hardware") can run `guest`, and if
/// not, why.
pub fn can_run(kvm_kind: &str, guest: &Guest, shim: &Path) -> Result<(), String> {
    if !cfg!(feature = "microvm") {
        return Err("this cubelet is built without the microvm runtime".into());
    }
    if kvm_kind == "none" {
        return Err("no /dev/kvm".into());
    }
    if !shim.exists() {
        return Err(format!("cube-shim binary {} not found", shim.display()));
    }
    match guest {
        Guest::Standin => Ok(()),
        Guest::Linux(k) => {
            if !k.exists() {
                return Err(format!("guest kernel {} not found", k.display()));
            }
            // PVM emulates guest kernel mode; a stock kernel stops before user space there.
            if kvm_kind == "pvm" && !kernel_has_pvm_patch(k) {
                return Err(format!(
                    "/dev/kvm is PVM (no VMX/SVM) and guest kernel {} lacks the cube_pvm patch (build it with deploy/guest-kernel/build.sh)",
                    k.display()
                ));
            }
            Ok(())
        }
    }
}

/// Decides the runtime for `configured` ("namespace", "gvisor", "microvm", "auto"), given
/// whether `runsc` works here (`gvisor`).
pub fn select(
    configured: &str,
    kvm_kind: &str,
    cfg: &MicroVmConfig,
    gvisor: Result<(), String>,
) -> Result<Selection, String> {
    let guest = Guest::from_config(&cfg.guest);
    let ok = can_run(kvm_kind, &guest, &cfg.shim_binary);
    let sel = |runtime, reason: String| Selection {
        runtime,
        kvm_kind: kvm_kind.to_string(),
        reason,
    };
    match configured {
        "namespace" => Ok(sel(NAMESPACE, "configured runtime = \"namespace\"".into())),
        "gvisor" => match gvisor {
            Ok(()) => Ok(sel(GVISOR, "configured runtime = \"gvisor\"".into())),
            Err(why) => Err(format!("runtime \"gvisor\" cannot run here: {why}")),
        },
        "microvm" => match ok {
            Ok(()) => Ok(sel(
                MICROVM,
                format!("configured runtime = \"microvm\", guest {:?}", cfg.guest),
            )),
            Err(why) => Err(format!(
                "runtime \"microvm\" cannot run guest {:?} here: {why}",
                cfg.guest
            )),
        },
        // PVM emulates guest kernel mode: a Linux microVM works there (with the cube_pvm kernel)
        // but every system call is emulated, about 1 s per `commands.run`. `auto` does not
        // pick it on such hosts; `runtime = "microvm"` still selects it.
        "auto" => {
            let microvm = match ok {
                Ok(()) if kvm_kind == "pvm" && matches!(guest, Guest::Linux(_)) => Err(
                    "/dev/kvm is PVM, which emulates a Linux guest's kernel mode (slow; set runtime = \"microvm\" to use it anyway)".to_string(),
                ),
                other => other,
            };
            Ok(match (microvm, gvisor) {
                (Ok(()), _) => sel(
                    MICROVM,
                    format!("auto: /dev/kvm ({kvm_kind}) can run guest {:?}", cfg.guest),
                ),
                (Err(why), Ok(())) => sel(
                    GVISOR,
                    format!("auto: microvm unavailable ({why}); runsc works: using gvisor"),
                ),
                (Err(why), Err(g)) => sel(
                    NAMESPACE,
                    format!("auto: microvm unavailable ({why}), gvisor unavailable ({g}); using namespace"),
                ),
            })
        }
        other => Err(format!(
            "unknown runtime {other:?} (use \"namespace\", \"gvisor\", \"microvm\" or \"auto\")"
        )),
    }
}

/// What kind of KVM this host has: "none", "hardware" (VMX/SVM) or "pvm".
pub fn kvm_kind() -> String {
    if !Path::new("/dev/kvm").exists() {
        return "none".into();
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let hw = cpu
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    if hw {
        "hardware".into()
    } else {
        "pvm".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no() -> Result<(), String> {
        Err("no runsc".into())
    }

    fn cfg(guest: &str, shim: &Path) -> MicroVmConfig {
        MicroVmConfig {
            guest: guest.into(),
            shim_binary: shim.to_path_buf(),
            ..MicroVmConfig::default()
        }
    }

    #[test]
    fn auto_picks_microvm_only_where_the_guest_can_run() {
        let d = tempfile::tempdir().unwrap();
        let shim = d.path().join("cube-shim");
        std::fs::write(&shim, b"").unwrap();
        let kernel = d.path().join("vmlinux");
        std::fs::write(&kernel, b"").unwrap();
        let k = kernel.to_str().unwrap();
        // PVM cannot boot a stock Linux: auto falls back, explicit microvm is refused.
        let s = select("auto", "pvm", &cfg(k, &shim), no()).unwrap();
        assert_eq!(s.runtime, "namespace");
        assert!(s.reason.contains("cube_pvm patch"), "{}", s.reason);
        assert!(select("microvm", "pvm", &cfg(k, &shim), no()).is_err());
        // The stand-in runs on any KVM.
        let s = select("auto", "pvm", &cfg(STANDIN_GUEST, &shim), no()).unwrap();
        assert_eq!(s.runtime, "microvm");
        assert_eq!(s.kvm_kind, "pvm");
        assert_eq!(
            select("microvm", "pvm", &cfg(STANDIN_GUEST, &shim), no())
                .unwrap()
                .runtime,
            "microvm"
        );
        // No KVM, or no shim: namespace.
        assert_eq!(
            select("auto", "none", &cfg(STANDIN_GUEST, &shim), no())
                .unwrap()
                .runtime,
            "namespace"
        );
        let missing = d.path().join("nope");
        let s = select("auto", "pvm", &cfg(STANDIN_GUEST, &missing), no()).unwrap();
        assert_eq!(s.runtime, "namespace");
        assert!(s.reason.contains("not found"));
        // Hardware KVM with a kernel: microvm.
        let s = select("auto", "hardware", &cfg(k, &shim), no()).unwrap();
        assert_eq!(s.runtime, "microvm");
        // PVM with a kernel that carries the cube_pvm patch: microvm when asked for, but
        // auto stays on namespaces (guest kernel mode is emulated there).
        std::fs::write(&kernel, b"\x7fELF...cube_pvm\0...").unwrap();
        assert!(kernel_has_pvm_patch(&kernel));
        let s = select("microvm", "pvm", &cfg(k, &shim), no()).unwrap();
        assert_eq!(s.runtime, "microvm");
        let s = select("auto", "pvm", &cfg(k, &shim), no()).unwrap();
        assert_eq!(s.runtime, "namespace");
        assert!(s.reason.contains("emulates"), "{}", s.reason);
        assert_eq!(
            select("namespace", "hardware", &cfg(k, &shim), no())
                .unwrap()
                .runtime,
            "namespace"
        );
        assert!(select("vm", "hardware", &cfg(k, &shim), no()).is_err());
        // gVisor: between the two. Chosen by auto where a microVM is not (PVM, no KVM), never
        // over a microVM on hardware KVM; refused when asked for and runsc does not work.
        let s = select("auto", "pvm", &cfg(k, &shim), Ok(())).unwrap();
        assert_eq!(s.runtime, "gvisor");
        assert_eq!(
            select("auto", "none", &cfg(k, &shim), Ok(()))
                .unwrap()
                .runtime,
            "gvisor"
        );
        assert_eq!(
            select("auto", "hardware", &cfg(k, &shim), Ok(()))
                .unwrap()
                .runtime,
            "microvm"
        );
        assert_eq!(
            select("gvisor", "none", &cfg(k, &shim), Ok(()))
                .unwrap()
                .runtime,
            "gvisor"
        );
        let e = select("gvisor", "hardware", &cfg(k, &shim), no()).unwrap_err();
        assert!(e.contains("no runsc"), "{e}");
    }
}
