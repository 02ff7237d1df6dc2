//! The optional TOML configuration file (`/etc/cube-agent.toml`).

use serde::Deserialize;
use std::net::Ipv4Addr;
use std::path::Path;

/// Errors reading or parsing the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: String,
        source: toml::de::Error,
    },
    #[error("invalid address {0:?}: expected a.b.c.d/prefix with prefix 0..=32")]
    Address(String),
}

/// Agent configuration. Every field has a default so a missing file means defaults.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Hostname to set when acting as init.
    pub hostname: String,
    pub network: NetworkConfig,
    /// The optional code-interpreter server (off by default).
    pub interpreter: crate::interpreter::InterpreterConfig,
}

/// The guest's single network interface. Same identity in every sandbox (see ARCHITECTURE.md).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkConfig {
    pub interface: String,
    /// CIDR, e.g. `169.254.77.2/30`.
    pub address: String,
    pub gateway: Ipv4Addr,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            hostname: "sandbox".into(),
            network: NetworkConfig::default(),
            interpreter: crate::interpreter::InterpreterConfig::default(),
        }
    }
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            interface: "eth0".into(),
            address: "169.254.77.2/30".into(),
            gateway: Ipv4Addr::new(169, 254, 77, 1),
        }
    }
}

impl NetworkConfig {
    /// The address and prefix length parsed from `address`.
    pub fn cidr(&self) -> Result<(Ipv4Addr, u8), ConfigError> {
        parse_cidr(&self.address)
    }
}

/// Parses `a.b.c.d/len`.
pub fn parse_cidr(s: &str) -> Result<(Ipv4Addr, u8), ConfigError> {
    let bad = || ConfigError::Address(s.to_string());
    let (a, p) = s.split_once('/').ok_or_else(bad)?;
    let addr: Ipv4Addr = a.parse().map_err(|_| bad())?;
    let prefix: u8 = p.parse().map_err(|_| bad())?;
    if prefix > 32 {
        return Err(bad());
    }
    Ok((addr, prefix))
}

impl Config {
    /// Parses a config from TOML text.
    pub fn parse(text: &str, path: &str) -> Result<Self, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: path.to_string(),
            source,
        })?;
        cfg.network.cidr()?;
        Ok(cfg)
    }

    /// Loads the file; a missing file yields the defaults.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(&text, &path.display().to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Config::default()),
            Err(source) => Err(ConfigError::Read {
                path: path.display().to_string(),
                source,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_file_is_defaults() {
        let c = Config::load(Path::new("/nonexistent/cube-agent.toml")).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.network.interface, "eth0");
        assert_eq!(
            c.network.cidr().unwrap(),
            (Ipv4Addr::new(169, 254, 77, 2), 30)
        );
    }

    #[test]
    fn partial_file_keeps_other_defaults() {
        let c =
            Config::parse("hostname = \"box\"\n[network]\ninterface = \"ens3\"\n", "t").unwrap();
        assert_eq!(c.hostname, "box");
        assert_eq!(c.network.interface, "ens3");
        assert_eq!(c.network.gateway, Ipv4Addr::new(169, 254, 77, 1));
    }

    #[test]
    fn rejects_bad_address_and_unknown_keys() {
        assert!(Config::parse("[network]\naddress = \"1.2.3.4\"\n", "t").is_err());
        assert!(Config::parse("[network]\naddress = \"1.2.3.4/33\"\n", "t").is_err());
        assert!(Config::parse("bogus = 1\n", "t").is_err());
        assert!(Config::parse("hostname = [", "t").is_err());
    }
}
