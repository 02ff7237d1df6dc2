//! In-sandbox agent: PID 1 and the E2B envd protocol on port 49983.
//!
//! Not built yet: this crate is filled by issue 2. It deliberately exports nothing, so that
//! nothing can depend on behaviour that does not exist.
