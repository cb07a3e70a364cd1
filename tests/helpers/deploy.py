"""The operator files shipped in ``deploy/``: the Grafana dashboard, the Prometheus alert rules, and the series they use."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvdi-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kvdi-alerts.yml"
_SERIES = re.compile(r"\bvllm:[A-Za-z0-9_:]+")


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def queries() -> dict[str, str]:
    """Every PromQL expression of the dashboard and the rules, by where it is."""
    out = {f"panel {p['title']!r} {t['refId']}": t["expr"] for p in dashboard()["panels"] for t in p["targets"]}
    for var in dashboard()["templating"]["list"]:
        if var.get("type") == "query":
            out[f"variable {var['name']}"] = var["query"]
    out.update({f"alert {rule['alert']}": rule["expr"] for rule in alert_rules()})
    return out


def series_used() -> dict[str, set[str]]:
    """Each series name (``vllm:...``) the dashboard and rules query, with where it is used."""
    used: dict[str, set[str]] = {}
    for where, expr in queries().items():
        for name in _SERIES.findall(expr):
            used.setdefault(name, set()).add(where)
    return used
