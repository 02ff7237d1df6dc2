//! gRPC definitions shared by cube-master, cubelet and cube-api.
//!
//! Not built yet: this crate is filled by issue 4. It deliberately exports nothing, so that
//! nothing can depend on behaviour that does not exist.
