//! One process per sandbox hosting the VMM in-process, with a control API for cubelet.
//!
//! Not built yet: this crate is filled by issue 7. It deliberately exports nothing, so that
//! nothing can depend on behaviour that does not exist.
