//! eBPF virtual switch: per-sandbox addressing, isolation and egress policy.
//!
//! Not built yet: this crate is filled by issue 5. It deliberately exports nothing, so that
//! nothing can depend on behaviour that does not exist.
