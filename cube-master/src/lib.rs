//! Scheduler and source of truth: sandbox state machine, nodes, templates, in SQL.
//!
//! Not built yet: this crate is filled by issue 6. It deliberately exports nothing, so that
//! nothing can depend on behaviour that does not exist.
