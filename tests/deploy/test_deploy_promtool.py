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
