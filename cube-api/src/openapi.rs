//! The OpenAPI 3 document of the REST API, served at `GET /openapi.json`.
//!
//! Hand-written (`cube-api/openapi.json`) because the handlers parse bodies by hand to give
//! E2B-shaped errors; a test keeps it in step with every `.route(...)` in this crate.

use axum::http::header;
use axum::response::{IntoResponse, Response};

pub const DOCUMENT: &str = include_str!("../openapi.json");

pub async fn serve() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], DOCUMENT).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// `(METHOD, /path/{param})` of every `.route("...", get(..).post(..))` in the crate's
    /// sources, found textually so that a route added in any module is covered.
    fn routes_in_sources() -> BTreeSet<(String, String)> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
        let mut out = BTreeSet::new();
        // Every `.rs` file below `src/` (the handlers are in a folder).
        let mut files = Vec::new();
        let mut dirs = vec![std::path::PathBuf::from(dir)];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).expect("src dir") {
                let p = e.expect("dir entry").path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.extension().is_some_and(|e| e == "rs") {
                    files.push(p);
                }
            }
        }
        files.sort();
        for f in files {
            // The metrics listener is not the REST API; this file only talks about routes.
            if f.ends_with("metrics.rs") || f.ends_with("openapi.rs") {
                continue;
            }
            let src = std::fs::read_to_string(&f).expect("read source");
            let mut rest = src.as_str();
            while let Some(i) = rest.find(".route(") {
                rest = &rest[i + ".route(".len()..];
                let Some(q0) = rest.find('"') else { break };
                let after = &rest[q0 + 1..];
                let Some(q1) = after.find('"') else { break };
                let path = &after[..q1];
                // The method calls up to the matching close paren of `.route(`.
                let mut depth = 1usize;
                let mut end = 0;
                for (j, c) in rest.char_indices() {
                    match c {
                        '(' => depth += 1,
                        ')' => {
                            depth -= 1;
                            if depth == 0 {
                                end = j;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                let args = &rest[q0 + 1 + q1 + 1..end];
                let openapi_path = path
                    .split('/')
                    .map(|seg| match seg.strip_prefix(':') {
                        Some(p) => format!("{{{p}}}"),
                        None => seg.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join("/");
                let mut found = false;
                for m in ["get", "post", "put", "delete", "patch"] {
                    let bare = format!("{m}(");
                    let chained = format!(".{m}(");
                    let starts = args.trim_start().trim_start_matches(',').trim_start();
                    if starts.starts_with(&bare) || args.contains(&chained) {
                        out.insert((m.to_uppercase(), openapi_path.clone()));
                        found = true;
                    }
                }
                assert!(found, "no method found for route {path} in {}", f.display());
            }
        }
        out
    }

    fn routes_in_document() -> BTreeSet<(String, String)> {
        let doc: serde_json::Value = serde_json::from_str(DOCUMENT).expect("openapi.json parses");
        assert_eq!(doc["openapi"].as_str().map(|v| &v[..2]), Some("3."));
        let mut out = BTreeSet::new();
        for (path, ops) in doc["paths"].as_object().expect("paths") {
            for (m, op) in ops.as_object().expect("operations") {
                assert!(op["responses"].is_object(), "{m} {path} has no responses");
                out.insert((m.to_uppercase(), path.clone()));
            }
        }
        out
    }

    #[test]
    fn document_matches_router() {
        let src = routes_in_sources();
        let doc = routes_in_document();
        assert!(
            src.contains(&("POST".into(), "/v2/sandboxes".into())),
            "route scan is broken: {src:?}"
        );
        let missing: Vec<_> = src.difference(&doc).collect();
        let extra: Vec<_> = doc.difference(&src).collect();
        assert!(
            missing.is_empty(),
            "routes missing from openapi.json: {missing:?}"
        );
        assert!(
            extra.is_empty(),
            "openapi.json documents routes the router lacks: {extra:?}"
        );
    }

    /// Every object a request body describes, the body's own and those nested in it, says
    /// `additionalProperties: false`: the handlers refuse a field they do not know (body.rs),
    /// so a document that allowed one would describe requests that are refused.
    #[test]
    fn request_bodies_allow_no_unknown_fields() {
        let doc: serde_json::Value = serde_json::from_str(DOCUMENT).expect("parses");
        fn walk(doc: &serde_json::Value, s: &serde_json::Value, at: &str, seen: &mut usize) {
            if let Some(r) = s["$ref"].as_str() {
                let name = r.trim_start_matches("#/components/schemas/");
                return walk(doc, &doc["components"]["schemas"][name], at, seen);
            }
            if let Some(props) = s["properties"].as_object() {
                *seen += 1;
                assert_eq!(
                    s["additionalProperties"],
                    serde_json::Value::Bool(false),
                    "{at}: an object that takes fields must refuse unknown ones"
                );
                for (k, p) in props {
                    walk(doc, p, &format!("{at}.{k}"), seen);
                }
            }
            // Maps (`additionalProperties` or `patternProperties` as a schema) and lists; `anyOf`
            // and `not` only constrain the fields above.
            if s["additionalProperties"].is_object() {
                walk(doc, &s["additionalProperties"], &format!("{at}.*"), seen);
            }
            for p in s["patternProperties"].as_object().into_iter().flatten() {
                walk(doc, p.1, &format!("{at}.*"), seen);
            }
            if s["items"].is_object() {
                walk(doc, &s["items"], &format!("{at}[]"), seen);
            }
        }
        let mut seen = 0;
        for (path, ops) in doc["paths"].as_object().expect("paths") {
            for (m, op) in ops.as_object().expect("ops") {
                let body = &op["requestBody"]["content"]["application/json"]["schema"];
                if !body.is_null() {
                    walk(&doc, body, &format!("{m} {path} body"), &mut seen);
                }
            }
        }
        // NewSandbox, its network and autoResume, the network update, secrets, ...
        assert!(seen >= 15, "only {seen} objects found: the walk is broken");
    }

    #[test]
    fn every_error_response_is_the_error_schema() {
        let doc: serde_json::Value = serde_json::from_str(DOCUMENT).expect("parses");
        for (path, ops) in doc["paths"].as_object().expect("paths") {
            for (m, op) in ops.as_object().expect("ops") {
                for (code, r) in op["responses"].as_object().expect("responses") {
                    if code.starts_with('4') || code.starts_with('5') {
                        assert_eq!(
                            r["content"]["application/json"]["schema"]["$ref"],
                            "#/components/schemas/Error",
                            "{m} {path} {code}"
                        );
                    }
                }
            }
        }
    }
}
