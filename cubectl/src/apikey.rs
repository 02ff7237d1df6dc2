//! `cubectl apikey create|list|revoke` and `cubectl join-token create`.

use crate::client::{Master, StatusExt};
use crate::output::{self, Table};
use clap::Subcommand;
use cube_proto::master::v1 as pb;
use serde_json::json;

#[derive(Subcommand, Debug)]
pub enum ApiKeyCmd {
    /// Creates a key and prints it on stdout (it is shown only once).
    Create {
        #[arg(long, default_value = "default")]
        name: String,
        /// Team the key acts for (empty = "default").
        #[arg(long, default_value = "")]
        team: String,
    },
    /// Lists keys (their prefixes; keys are stored hashed).
    List,
    /// Revokes a key by id.
    Revoke { id: String },
}

#[derive(Subcommand, Debug)]
pub enum JoinTokenCmd {
    /// Creates a one-time token a new node presents when it registers.
    Create {
        /// Seconds the token stays valid (0 = one hour).
        #[arg(long, default_value_t = 0)]
        ttl: u64,
    },
}

pub fn key_json(k: &pb::ApiKey) -> serde_json::Value {
    json!({"id": k.id, "name": k.name, "team": k.team_id, "prefix": k.prefix,
           "createdAtMs": k.created_at_ms, "revoked": k.revoked})
}

pub async fn run(cmd: ApiKeyCmd, m: &mut Master, as_json: bool) -> anyhow::Result<()> {
    match cmd {
        ApiKeyCmd::Create { name, team } => {
            let r = m
                .create_api_key(pb::CreateApiKeyRequest {
                    name,
                    team_id: team,
                })
                .await
                .ctx("creating an API key")?;
            let k = r.key.unwrap_or_default();
            if as_json {
                let mut v = key_json(&k);
                v["key"] = json!(r.secret);
                output::json(&v);
            } else {
                println!("{}", r.secret);
                eprintln!("created key {} ({}); it is not shown again", k.id, k.name);
            }
        }
        ApiKeyCmd::List => {
            let r = m
                .list_api_keys(pb::ListApiKeysRequest {})
                .await
                .ctx("listing API keys")?;
            if as_json {
                output::json(&r.keys.iter().map(key_json).collect());
            } else {
                let mut t = Table::new(&["ID", "NAME", "TEAM", "PREFIX", "CREATED", "REVOKED"]);
                for k in &r.keys {
                    t.row(vec![
                        k.id.clone(),
                        k.name.clone(),
                        k.team_id.clone(),
                        k.prefix.clone(),
                        output::time_ms(k.created_at_ms),
                        k.revoked.to_string(),
                    ]);
                }
                t.print();
            }
        }
        ApiKeyCmd::Revoke { id } => {
            let r = m
                .revoke_api_key(pb::RevokeApiKeyRequest { id: id.clone() })
                .await
                .ctx(format!("revoking API key {id}"))?;
            if !r.existed {
                anyhow::bail!("no active API key {id}");
            }
            if as_json {
                output::json(&json!({"id": id, "revoked": true}));
            } else {
                println!("revoked {id}");
            }
        }
    }
    Ok(())
}

pub async fn run_join_token(
    cmd: JoinTokenCmd,
    m: &mut Master,
    as_json: bool,
) -> anyhow::Result<()> {
    match cmd {
        JoinTokenCmd::Create { ttl } => {
            let r = m
                .create_join_token(pb::CreateJoinTokenRequest { ttl_s: ttl })
                .await
                .ctx("creating a join token")?;
            if as_json {
                output::json(&json!({"token": r.token, "expiresAtMs": r.expires_at_ms}));
            } else {
                println!("{}", r.token);
                eprintln!(
                    "one-time node join token, valid until {} UTC",
                    output::time_ms(r.expires_at_ms)
                );
            }
        }
    }
    Ok(())
}
