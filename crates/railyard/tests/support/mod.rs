//! Helpers shared by this crate's integration tests (`mod support;`); each
//! test binary uses only some of them.
#![allow(dead_code)]

pub(crate) mod log;
pub(crate) mod saga_node;
