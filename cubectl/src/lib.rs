//! Operator CLI for templates, snapshots, sandboxes, nodes, API keys and single-host install.
//!
//! Not built yet: this crate is filled by issue 6. It deliberately exports nothing, so that
//! nothing can depend on behaviour that does not exist.
