//! What runs around every handler: the API key check and rate limits, request metrics, and
//! the E2B error shape for the framework's own refusals.

use crate::error::ApiError;
use crate::extract::Team;
use crate::ratelimit::{retry_after_secs, Class};
use crate::state::AppState;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use cube_proto::master::v1 as pb;
use std::time::Instant;

/// Any path no route matches.
pub(crate) async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "Not found")
}

/// Turns the framework's own plain-text refusals (405, 413, 415, bad query or path) into the
/// E2B `{code, message}` shape the SDKs parse, keeping their headers (`Allow`, `Retry-After`).
pub(crate) async fn json_errors(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let st = resp.status();
    if !(st.is_client_error() || st.is_server_error()) {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let message = if text.is_empty() {
        st.canonical_reason().unwrap_or("Error").to_string()
    } else {
        text
    };
    let mut r = ApiError::new(st, message).into_response();
    for (k, v) in parts.headers.iter() {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            r.headers_mut().insert(k.clone(), v.clone());
        }
    }
    r
}

/// Request count and latency by route pattern (never the raw path: ids would explode labels).
pub(crate) async fn track(State(st): State<AppState>, req: Request, next: Next) -> Response {
    // Static labels only: a client can send any method token.
    let method = match req.method().as_str() {
        "GET" => "GET",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "PATCH" => "PATCH",
        "HEAD" => "HEAD",
        "OPTIONS" => "OPTIONS",
        _ => "OTHER",
    };
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let t0 = Instant::now();
    let resp = next.run(req).await;
    st.metrics
        .latency
        .with_label_values(&[method, &route])
        .observe(t0.elapsed().as_secs_f64());
    st.metrics
        .requests
        .with_label_values(&[method, &route, resp.status().as_str()])
        .inc();
    resp
}

/// Resolves `X-API-Key` to the caller's [`Team`] (401 without a valid one) and applies the
/// key's rate limits (429 with `Retry-After`).
pub(crate) async fn auth(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    let key = match req.headers().get("x-api-key") {
        None => "".to_string(),
        // Keys are `e2b_<hex>`: other bytes or absurd lengths cannot be a key.
        Some(v) => match v.to_str() {
            Ok(k) if k.len() <= 256 && k.bytes().all(|b| b.is_ascii_graphic()) => k.to_string(),
            _ => return ApiError::new(StatusCode::UNAUTHORIZED, "Invalid API key").into_response(),
        },
    };
    if key.is_empty() {
        return ApiError::new(StatusCode::UNAUTHORIZED, "Missing API key").into_response();
    }
    let mut m = st.master.clone();
    match m
        .validate_api_key(pb::ValidateApiKeyRequest { key: key.clone() })
        .await
    {
        Ok(r) => {
            let class = Class::of(req.method(), req.uri().path());
            if let Err(wait) = st.limiter.check(&key, class) {
                let (label, what) = match class {
                    Class::Create => ("create", "sandbox creates"),
                    Class::Other | Class::EdgeLookup => ("other", "requests"),
                };
                st.metrics.rate_limited.with_label_values(&[label]).inc();
                let secs = retry_after_secs(wait);
                let mut resp = ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!("Rate limit exceeded for {what} with this API key, retry in {secs} s"),
                )
                .into_response();
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(secs));
                return resp;
            }
            req.extensions_mut().insert(Team(r.into_inner().team_id));
            next.run(req).await
        }
        Err(s) if s.code() == tonic::Code::Unauthenticated => {
            ApiError::new(StatusCode::UNAUTHORIZED, "Invalid API key").into_response()
        }
        Err(s) => ApiError::from(s).into_response(),
    }
}
