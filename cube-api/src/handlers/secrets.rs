//! E2B secrets: `POST /secrets`, `GET /secrets`, `GET|POST|DELETE /secrets/{id}` (an id or a
//! name). Values are write-only: taken by create and update, never in any response.

use crate::body::Fields;
use crate::error::ApiError;
use crate::extract::{Body, Param, Params, Team};
use crate::rfc3339;
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use cube_proto::master::v1 as pb;
use serde_json::{json, Value};

/// E2B's `Secret`: metadata only, never the value.
fn secret_json(s: &pb::SecretInfo) -> Value {
    json!({
        "secretID": s.secret_id,
        "name": s.name,
        "currentVersion": s.current_version,
        "metadata": s.metadata,
        "createdAt": rfc3339::format(s.created_at_ms),
        "updatedAt": rfc3339::format(s.updated_at_ms),
    })
}

fn required_string(b: &mut Fields, key: &str) -> Result<String, ApiError> {
    b.string(key)?
        .ok_or_else(|| ApiError::bad_request(format!("{key} is required")))
}

/// Ids and names are at most a few hundred bytes; anything longer names nothing.
fn check_ref(id: &str) -> Result<(), ApiError> {
    if id.is_empty() || id.len() > 1024 {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "secret not found"));
    }
    Ok(())
}

fn sref(team: Team, id: String) -> pb::SecretRef {
    pb::SecretRef {
        team_id: team.0,
        secret: id,
    }
}

/// `POST /secrets` `{name, value, metadata?}` → 201 `Secret`; 409 when the name is taken.
pub(super) async fn create(
    State(st): State<AppState>,
    team: Team,
    Body(mut b): Body,
) -> Result<Response, ApiError> {
    let name = required_string(&mut b, "name")?;
    let value = required_string(&mut b, "value")?;
    let metadata = b.string_map("metadata")?;
    b.finish()?;
    let mut m = st.master.clone();
    let s = m
        .create_secret(pb::CreateSecretRequest {
            team_id: team.0,
            name,
            value,
            metadata,
        })
        .await?
        .into_inner();
    Ok((StatusCode::CREATED, Json(secret_json(&s))).into_response())
}

/// `GET /secrets?limit=&nextToken=` → 200 `[Secret]` (oldest first) + `X-Next-Token`.
pub(super) async fn list(
    State(st): State<AppState>,
    team: Team,
    Params(q): Params,
) -> Result<Response, ApiError> {
    let limit = crate::paging::limit(&q)?;
    let mut m = st.master.clone();
    let r = m
        .list_secrets(pb::ListSecretsRequest {
            team_id: team.0,
            limit,
            next_token: crate::paging::next_token(&q),
        })
        .await?
        .into_inner();
    let headers = crate::paging::next_page_headers(&r.next_token);
    let items: Vec<Value> = r.secrets.iter().map(secret_json).collect();
    Ok((StatusCode::OK, headers, Json(Value::Array(items))).into_response())
}

/// `GET /secrets/{id or name}` → 200 `Secret` or 404.
pub(super) async fn get_one(
    State(st): State<AppState>,
    team: Team,
    Param(id): Param,
) -> Result<Response, ApiError> {
    check_ref(&id)?;
    let mut m = st.master.clone();
    let s = m.get_secret(sref(team, id)).await?.into_inner();
    Ok((StatusCode::OK, Json(secret_json(&s))).into_response())
}

/// `POST /secrets/{id or name}` `{value, metadata?}` → 200 `Secret` with the new version;
/// `metadata`, when given, replaces the stored one.
pub(super) async fn update(
    State(st): State<AppState>,
    team: Team,
    Param(id): Param,
    Body(mut b): Body,
) -> Result<Response, ApiError> {
    check_ref(&id)?;
    let value = required_string(&mut b, "value")?;
    let metadata = b.opt_string_map("metadata")?;
    b.finish()?;
    let mut m = st.master.clone();
    let s = m
        .update_secret(pb::UpdateSecretRequest {
            team_id: team.0,
            secret: id,
            value,
            set_metadata: metadata.is_some(),
            metadata: metadata.unwrap_or_default(),
        })
        .await?
        .into_inner();
    Ok((StatusCode::OK, Json(secret_json(&s))).into_response())
}

/// `DELETE /secrets/{id or name}` → 204 or 404.
pub(super) async fn delete(
    State(st): State<AppState>,
    team: Team,
    Param(id): Param,
) -> Result<Response, ApiError> {
    check_ref(&id)?;
    let mut m = st.master.clone();
    m.delete_secret(sref(team, id)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_never_has_a_value_and_times_are_rfc3339() {
        let s = pb::SecretInfo {
            secret_id: "sec_x".into(),
            team_id: "t".into(),
            name: "n".into(),
            current_version: 2,
            metadata: [("k".to_string(), "v".to_string())].into(),
            created_at_ms: 1_700_000_000_000,
            updated_at_ms: 1_700_000_000_500,
        };
        let j = secret_json(&s);
        let mut keys: Vec<&String> = j.as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "createdAt",
                "currentVersion",
                "metadata",
                "name",
                "secretID",
                "updatedAt"
            ]
        );
        assert_eq!(j["createdAt"], "2023-11-14T22:13:20Z");
        assert_eq!(j["updatedAt"], "2023-11-14T22:13:20.5Z");
        assert_eq!(j["metadata"]["k"], "v");
        assert_eq!(j["currentVersion"], 2);
    }
}
