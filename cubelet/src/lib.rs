//! Node daemon: templates, storage, network, pools and sandbox runtimes.
//!
//! Not built yet: this crate is filled by issue 4. It deliberately exports nothing, so that
//! nothing can depend on behaviour that does not exist.
