"""Schemathesis hooks for tests/schema (loaded through schemathesis.toml's `hooks`).

Each covers one rule of Cube's API that OpenAPI 3.0 cannot state, on the operations it names;
everything else the document says is checked as written.
"""

import schemathesis


def _int(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


@schemathesis.hook("filter_case").apply_to(method="GET", path="/sandboxes/{id}/metrics")
def metrics_window_in_order(ctx, case):
    """`GET /sandboxes/{id}/metrics?start=&end=`: an `end` before `start` is refused (400 "end
    must not be before start"), a rule between two query parameters that the document can only
    say in words. Such a window is no schema-valid request, so positive cases with it are not
    sent (negative ones are: the 400 is what they expect)."""
    q = case.query or {}
    start, end = _int(q.get("start")), _int(q.get("end"))
    positive = case.meta is None or not case.meta.generation.mode.is_negative
    return not (positive and start is not None and end is not None and end < start)


# What cube-api's OptionalBody takes for no body: nothing but ASCII white space (Rust's
# `is_ascii_whitespace`), as an SDK that sends no body at all.
_BLANK = set(b" \t\n\x0c\r")


@schemathesis.hook("filter_case")
def blank_optional_body_is_no_body(ctx, case):
    """An operation whose request body is optional (pause, connect, fork, ...) reads a body of
    white space as no body, which the document allows; a negative case that sends one as its
    "invalid syntax" is therefore not schema-violating, and is not sent."""
    op = ctx.operation
    if op is None or not any(not b.is_required for b in op.body):
        return True
    negative = case.meta is not None and case.meta.generation.mode.is_negative
    body = case.body
    blank = isinstance(body, (bytes, bytearray)) and all(b in _BLANK for b in body)
    return not (negative and blank)
