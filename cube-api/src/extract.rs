//! Typed extractors for the handlers. Each refuses with an E2B-shaped [`ApiError`], so a bad
//! id, query or body is answered in the shape the SDKs parse, by the extractor, before the
//! handler runs.

use crate::body::Fields;
use crate::error::ApiError;
use axum::async_trait;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use std::collections::HashMap;

/// The caller's team, put in the request's extensions by the auth middleware.
#[derive(Clone, Debug)]
pub struct Team(pub String);

#[async_trait]
impl<S: Send + Sync> FromRequestParts<S> for Team {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Team, ApiError> {
        // Only a route outside the auth layer can lack it: a routing mistake, not the caller's.
        parts
            .extensions
            .get::<Team>()
            .cloned()
            .ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "Missing API key"))
    }
}

/// E2B's answer for an id that does not exist (or is not the caller's).
pub(crate) fn no_sandbox(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("Sandbox \"{id}\" doesn't exist or you don't have access to it"),
    )
}

/// Sandbox ids are `[a-z0-9]{1,64}`; anything else cannot exist, so it is a 404 without
/// asking the master (and keeps odd bytes out of logs and SQL).
pub(crate) fn check_id(id: &str) -> Result<(), ApiError> {
    if !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        Ok(())
    } else {
        let shown: String = id.chars().take(64).collect();
        Err(no_sandbox(&shown))
    }
}

fn path_error(r: PathRejection) -> ApiError {
    ApiError::new(r.status(), r.body_text())
}

/// The route's one path parameter, as given (a template, secret or snapshot id: the handler
/// checks its form).
pub struct Param(pub String);

#[async_trait]
impl<S: Send + Sync> FromRequestParts<S> for Param {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Param, ApiError> {
        let Path(p) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(path_error)?;
        Ok(Param(p))
    }
}

/// The route's sandbox id (`:id`), checked: an id that cannot exist is E2B's 404.
pub struct SandboxId(pub String);

#[async_trait]
impl<S: Send + Sync> FromRequestParts<S> for SandboxId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<SandboxId, ApiError> {
        let Param(id) = Param::from_request_parts(parts, state).await?;
        check_id(&id)?;
        Ok(SandboxId(id))
    }
}

/// The query string as name → value (handlers refuse names they do not know).
pub struct Params(pub HashMap<String, String>);

#[async_trait]
impl<S: Send + Sync> FromRequestParts<S> for Params {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Params, ApiError> {
        let Query(q) = Query::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map_err(|r: QueryRejection| ApiError::new(r.status(), r.body_text()))?;
        Ok(Params(q))
    }
}

fn body_error(r: BytesRejection) -> ApiError {
    // 413 past `max_body_bytes`, 400 for a body that could not be read.
    ApiError::new(r.status(), r.body_text())
}

/// A JSON object body, read field by field ([`Fields`]); a missing body is refused.
pub struct Body(pub Fields);

#[async_trait]
impl<S: Send + Sync> FromRequest<S> for Body {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Body, ApiError> {
        let b = Bytes::from_request(req, state).await.map_err(body_error)?;
        Ok(Body(Fields::parse(&b, false)?))
    }
}

/// A JSON object body where no body at all means `{}` (older SDKs send none).
pub struct OptionalBody(pub Fields);

#[async_trait]
impl<S: Send + Sync> FromRequest<S> for OptionalBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<OptionalBody, ApiError> {
        let b = Bytes::from_request(req, state).await.map_err(body_error)?;
        Ok(OptionalBody(Fields::parse(&b, true)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body as HttpBody;

    fn request(uri: &str, body: &'static str) -> Request {
        axum::http::Request::builder()
            .uri(uri)
            .body(HttpBody::from(body))
            .unwrap()
    }

    #[tokio::test]
    async fn refusals_are_e2b_errors() {
        let (mut parts, _) = request("/x?a=1", "").into_parts();
        let e = Team::from_request_parts(&mut parts, &()).await.unwrap_err();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        parts.extensions.insert(Team("t".into()));
        assert_eq!(
            Team::from_request_parts(&mut parts, &()).await.unwrap().0,
            "t"
        );
        let Params(q) = Params::from_request_parts(&mut parts, &()).await.unwrap();
        assert_eq!(q.get("a").map(String::as_str), Some("1"));

        let e = Body::from_request(request("/", "  "), &())
            .await
            .err()
            .unwrap();
        assert_eq!(
            (e.status, e.message.as_str()),
            (StatusCode::BAD_REQUEST, "Request body is required")
        );
        let e = Body::from_request(request("/", "[1]"), &())
            .await
            .err()
            .unwrap();
        assert!(e.message.contains("JSON object"), "{}", e.message);
        let OptionalBody(f) = OptionalBody::from_request(request("/", ""), &())
            .await
            .ok()
            .unwrap();
        assert!(f.finish().is_ok());
        let Body(mut f) = Body::from_request(request("/", r#"{"x":true}"#), &())
            .await
            .ok()
            .unwrap();
        assert_eq!(f.bool("x").unwrap(), Some(true));
    }

    #[test]
    fn ids_that_cannot_exist_are_404() {
        assert!(check_id("i0abc").is_ok());
        for bad in ["", "I0ABC", "a/b", "a.b", &"a".repeat(65)] {
            assert_eq!(
                check_id(bad).unwrap_err().status,
                StatusCode::NOT_FOUND,
                "{bad:?}"
            );
        }
    }
}
