"""The alert rules pass `promtool check rules` and their unit tests (`promtool test rules`), the scrape config
passes `promtool check config`, and a broken rule is caught."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml
from deploy_utils import DEPLOY, require_binary

PROM = DEPLOY / "prometheus"
OPERATOR_CARES = {"SpecrollEngineNotReady", "SpecrollDrafterAcceptanceCollapsed", "SpecrollBufferDropping",
                  "SpecrollBufferSpooling", "SpecrollRedisDown", "SpecrollWeightPushFailures",
                  "SpecrollSpoolDiskFull", "SpecrollRedisDataLost"}


def _promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rules_check_and_cover_the_failures() -> None:
    out = _promtool("check", "rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    names = {r["alert"] for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    assert names >= OPERATOR_CARES


def test_rules_unit_tests_pass_and_test_every_alert() -> None:
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())
    fired = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"] if case["exp_alerts"]}
    rules = {r["alert"] for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    assert fired == rules
    out = _promtool("test", "rules", "alerts_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_wrong_rule_fails_its_unit_test(tmp_path: Path) -> None:
    shutil.copy(PROM / "alerts_test.yml", tmp_path)
    broken = (PROM / "alerts.yml").read_text().replace("specroll:buffer_redis_up == 0", "specroll:buffer_redis_up == 1")
    (tmp_path / "alerts.yml").write_text(broken)
    out = _promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert out.returncode != 0 and "SpecrollRedisDown" in out.stdout + out.stderr


def test_scrape_config_checks() -> None:
    out = _promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def _push_latency_queries() -> list[str]:
    import json

    panels = json.loads((DEPLOY / "grafana" / "specroll-dashboard.json").read_text())["panels"]
    [panel] = [p for p in panels if p["title"].startswith("Weight push latency")]
    return [t["expr"].replace("$__rate_interval", "1m").replace('"$instance"', '".*"') for t in panel["targets"]]


def test_the_push_latency_panels_show_pushes_minutes_apart(tmp_path: Path) -> None:
    """A trainer pushes every few minutes: a 15 s scrape sees one push's histogram step in one window of the
    hour. Prometheus' own engine (promtool's unit tests) evaluates each panel query 3 minutes after the last
    push: it must return the pushes' latency (each push took 2 s: in the 1-2.5 s bucket; each swap 0.3 s)."""
    step = "15s"
    pushes = "0x19 1x20 2x20 3x20 4x20"  # a push every 5 minutes (20 samples of 15 s), 4 in all
    series = []
    for metric, buckets, hit in (("weight_sync_seconds", ("1.0", "2.5", "+Inf"), "2.5"),
                                 ("weight_swap_seconds", ("0.25", "0.5", "+Inf"), "0.5")):
        for le in buckets:
            values = pushes if float(le) >= float(hit) else "0x99"
            series.append({"series": f'specroll:{metric}_bucket{{instance="s:1", role="target", le="{le}"}}',
                           "values": values})
    sync_p50, sync_max, swap_p99 = _push_latency_queries()
    test = {"evaluation_interval": "1m", "tests": [{
        "interval": step, "input_series": series,
        "promql_expr_test": [
            {"expr": sync_p50, "eval_time": "23m", "exp_samples": [{"labels": '{role="target"}', "value": 1.75}]},
            {"expr": sync_max, "eval_time": "23m", "exp_samples": [{"labels": '{role="target"}', "value": 2.5}]},
            {"expr": swap_p99, "eval_time": "23m", "exp_samples": [{"labels": '{role="target"}', "value": 0.4975}]},
        ]}]}
    (tmp_path / "panels_test.yml").write_text(yaml.safe_dump(test))
    out = _promtool("test", "rules", "panels_test.yml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
