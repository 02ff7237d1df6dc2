//! What boundary each sandbox runtime puts between untrusted code and the host: one table for
//! cube-api's sandbox detail, cubectl and the logs.

/// The isolation of sandboxes of `runtime` (a runtime name as cubelet reports it).
pub fn of(runtime: &str) -> &'static str {
    match runtime {
        // Its own guest kernel behind KVM.
        "microvm" => "hardware-virtualization",
        // A user-space kernel between the sandbox and the host's.
        "gvisor" => "user-space-kernel",
        // The host's own kernel: namespaces, seccomp allow-list, no_new_privs.
        "namespace" => "shared-kernel",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_runtime_names_its_boundary() {
        assert_eq!(super::of("microvm"), "hardware-virtualization");
        assert_eq!(super::of("namespace"), "shared-kernel");
        assert_eq!(super::of("gvisor"), "user-space-kernel");
        assert_eq!(super::of(""), "unknown");
    }
}
