"""The Grafana dashboard and Prometheus alert rules in ``deploy/`` parse and are complete (that their series exist
on a real ``vllm serve`` is checked by tests/real_vllm/test_vllm_fleet.py)."""

from __future__ import annotations

from tests.helpers.deploy import alert_rules, dashboard, queries, series_used


def test_the_dashboard_is_grafana_json_with_a_query_in_every_panel() -> None:
    """Every panel has a datasource, a position and at least one target with a PromQL expression."""
    board = dashboard()
    assert board["uid"] and board["panels"]
    for panel in board["panels"]:
        assert panel["gridPos"]["w"] > 0 and panel["datasource"]["type"] == "prometheus"
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_every_alert_rule_has_an_expression_a_severity_and_a_summary() -> None:
    """The rules file is Prometheus rule YAML: each rule names an alert, an expression, a severity, a summary."""
    rules = alert_rules()
    assert len(rules) >= 4
    for rule in rules:
        assert rule["alert"] and rule["expr"].strip() and rule["labels"]["severity"] in ("critical", "warning", "info")
        assert rule["annotations"]["summary"]


def test_queries_balance_their_brackets_and_name_kvdi_series() -> None:
    """Each expression's brackets balance, and together they use kvdi's counters, gauges and histograms."""
    for where, expr in queries().items():
        for opening, closing in ("()", "[]", "{}"):
            assert expr.count(opening) == expr.count(closing), where
    used = set(series_used())
    assert {"vllm:kvdi_hit_blocks_total", "vllm:kvdi_in_flight_bytes", "vllm:kvdi_store_bytes"} <= used
    assert "vllm:kvdi_load_seconds_bucket" in used and "vllm:kvdi_evicted_blocks_total" in used


def test_the_kubernetes_example_parses_and_checks_before_it_serves() -> None:
    """deploy/kubernetes/vllm-kvdi.yaml is YAML documents with kinds; the Deployment runs ``kvdi check`` in an init
    container, probes /health, mounts the shared store, and its transfer config is JSON kvdi's adapter reads."""
    import json

    import yaml

    from tests.helpers.deploy import ROOT

    docs = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/vllm-kvdi.yaml").read_text())}
    assert {"Deployment", "ConfigMap", "PersistentVolumeClaim", "Service", "Secret"} <= set(docs)
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["command"][:2] == ["kvdi", "check"]
    (vllm,) = pod["containers"]
    assert all(vllm[p]["httpGet"]["path"] == "/health" for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert {"name": "kv", "mountPath": "/mnt/kv"} in vllm["volumeMounts"]
    config = json.loads(docs["ConfigMap"]["data"]["kv-transfer-config"])
    assert config["kv_connector"] == "KvdiConnector"
    assert config["kv_connector_extra_config"]["kvdi.shared_storage.path"] == "/mnt/kv"
