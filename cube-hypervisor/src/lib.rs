//! Cube's KVM microVM monitor: boot a guest once, snapshot its complete state, restore copies of
//! it into pre-created VM shells, pause and resume.

pub mod devices;
