"""The Grafana dashboard only queries metrics the daemons define (a renamed metric would leave a
panel silently empty), and it is valid JSON with unique panel ids."""

import json
import os
import re

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "cube-fleet.json")
SOURCES = ["cubelet/src/metrics.rs", "cube-master/src/metrics.rs", "cube-api/src/metrics.rs"]


def dashboard_metrics():
    with open(DASHBOARD) as f:
        d = json.load(f)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    exprs.append(d["templating"]["list"][1]["definition"])
    names = set()
    for e in exprs:
        for m in re.findall(r"\b(cube_[a-z_]+)\b", e):
            names.add(re.sub(r"_(bucket|sum|count)$", "", m))
    return names


def defined_metrics():
    text = ""
    for s in SOURCES:
        with open(os.path.join(REPO, s)) as f:
            text += f.read()
    return set(re.findall(r'"(cube_[a-z_]+)"', text))


def test_dashboard_uses_only_defined_metrics():
    used = dashboard_metrics()
    assert len(used) >= 15
    missing = used - defined_metrics()
    assert not missing, f"dashboard queries metrics no daemon defines: {sorted(missing)}"
