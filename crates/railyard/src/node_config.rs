//! The node's config file (`railyard node --config FILE`): TOML, one section
//! per subsystem, every field optional (defaults are the embedded ones).
//!
//! ```toml
//! [bridge]            # the TCP event-bus bridge; see docs/bridge.md
//! port = 7000
//! inbound_permitted = [{ address = "railyard.node.echo" }]
//! outbound_permitted = [{ address_regex = "news\\..+" }]
//!
//! [saga]              # the saga coordinator; see docs/saga.md
//! default_reverse_retries = 3
//! advertise_akka = true
//! ```
//!
//! Sections this version does not know are ignored (a newer file still
//! starts an older node); unknown keys inside a known section are errors.

use std::path::PathBuf;

use anyhow::Context;
use serde::Deserialize;

/// `--config`, flattened into `railyard node`'s options.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ConfigArgs {
    /// TOML config file (sections: bridge, saga); without it, embedded defaults.
    #[arg(long, value_name = "FILE", env = "RAILYARD_CONFIG")]
    config: Option<PathBuf>,
}

/// Everything the config file can hold.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(crate) struct NodeConfig {
    /// The TCP event-bus bridge.
    pub(crate) bridge: railyard_bridge::BridgeConfig,
    /// The saga coordinator.
    pub(crate) saga: railyard_saga::CoordinatorConfig,
}

impl ConfigArgs {
    /// Reads and parses the file, or the defaults when none was given.
    pub(crate) async fn load(&self) -> anyhow::Result<NodeConfig> {
        let Some(path) = &self.config else {
            return Ok(NodeConfig::default());
        };
        let text = tokio::fs::read_to_string(path)
            .await
            .with_context(|| format!("reading the config file {}", path.display()))?;
        toml::from_str(&text).with_context(|| {
            format!(
                "{} is not a valid Railyard config file (see docs/bridge.md for [bridge], docs/saga.md for [saga])",
                path.display()
            )
        })
    }
}
