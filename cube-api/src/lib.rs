//! E2B-compatible REST API (:3000) and sandbox edge proxy (:3001).
//!
//! Not built yet: this crate is filled by issue 6. It deliberately exports nothing, so that
//! nothing can depend on behaviour that does not exist.
