//! The `log_format` setting shared by the daemons: `"text"` (default, for terminals) or
//! `"json"` (one JSON object per line, for journald/Loki/Elasticsearch pipelines).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}
