"""The Grafana dashboard against a real Prometheus: Debian's `prometheus` binary scrapes a real specroll server
(`python3 -m service.cli serve`, tiny demo model, speculative decoding on, Redis buffer) and the drafter-trainer
sidecar's metrics port, with the scrape config derived from deploy/prometheus/prometheus.yml and the alert rules
loaded. A workload with SD, two weight pushes, aborts and rewards runs; then every panel query of
deploy/grafana/specroll-dashboard.json (the server) and specroll-rollouts-dashboard.json (rollout buffer and
drafter trainer) is evaluated through Prometheus' HTTP API and must return data."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from deploy_utils import DEPLOY, POLL_S, REPO, STARTING, http_ok, require_binary
from helpers import stop_process
from probes import metric, wait_for
from service_utils import checkpoint_tensors, perturbed

from client import SpecrollClient
from service.cli import build_parser
from service.netutil import free_port

logger = logging.getLogger(__name__)

TOKEN = "prometheus-test-admin-token"
SCRAPE_S = 1
RATE_INTERVAL = "20s"  # what $__rate_interval stands for at this scrape interval
WORKLOAD_S = 14.0
SERVER_JOB, TRAINER_JOB = "specroll", "specroll-drafter-trainer"
PROMPTS = ["3+a4=", "12+b7+c1=", "5+d2=", "a9+8+e3=", "1+2+3+f4="]


DASHBOARDS = ("specroll-dashboard.json", "specroll-rollouts-dashboard.json")


def _dashboard(name: str = DASHBOARDS[0]) -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana" / name).read_text())


def _panel_queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for name in DASHBOARDS for p in _dashboard(name)["panels"]
            for t in p.get("targets", [])]


def _grafana_to_promql(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace('"$instance"', '".*"')


class Proc:
    """A child process with its output in a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.log = name, log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                         env={**os.environ, **(env or {})})

    def tail(self) -> str:
        return f"--- {self.name} (exit {self.proc.poll()}) ---\n" + self.log.read_text(errors="replace")[-4000:]

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"{self.name} exited early:\n{self.tail()}")
        return True

    def stop(self) -> None:
        stop_process(self.proc, 20)


def _scrape_config(server_http: int, trainer_metrics: int, rules: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with its targets moved to our loopback ports, after checking that the
    file's ports are the ones the server and the compose sidecar listen on."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    sidecar = compose["services"]["drafter-trainer"]["command"]
    expected = {SERVER_JOB: ("specroll", str(build_parser().parse_args(["serve"]).http_port), server_http),
                TRAINER_JOB: ("drafter-trainer", sidecar[sidecar.index("--metrics-port") + 1], trainer_metrics)}
    assert {job["job_name"] for job in config["scrape_configs"]} == set(expected)
    for job in config["scrape_configs"]:
        host, port, local = expected[job["job_name"]]
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert job["static_configs"] == [{"targets": [f"{host}:{port}"]}]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{local}"]}]
        job["scrape_interval"] = f"{SCRAPE_S}s"
    config["global"] = {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"}
    config["rule_files"] = [str(rules)]
    return config


@pytest.fixture(scope="module")
def stack(redis_server: str, tmp_path_factory: pytest.TempPathFactory,
          tiny_demo_model: Path) -> Iterator[dict[str, Any]]:
    prometheus = require_binary("prometheus")
    work = tmp_path_factory.mktemp("prom-stack")
    model = tiny_demo_model
    http_port, grpc_port, metrics_port, prom_port = free_port(), free_port(), free_port(), free_port()
    env = {"SPECROLL_ADMIN_TOKEN": TOKEN, "SPECROLL_CACHE": str(work / "cache"), "SPECROLL_REDIS_URL": redis_server,
           "OMP_NUM_THREADS": "1"}
    procs: list[Proc] = []
    try:
        server = Proc("server", [sys.executable, "-m", "service.cli", "serve", "--model", str(model),
                                 "--drafter", str(model / "draft"), "--spec", "fixed", "--spec-k", "3",
                                 "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--threads", "1",
                                 "--max-model-len", "512"], work / "server.log", env)
        procs.append(server)
        wait_for(lambda: server.alive() and http_ok(f"http://127.0.0.1:{http_port}/ready"), 180, "the server's /ready",
                 every=POLL_S, ignoring=STARTING, detail=server.tail)
        trainer = Proc("drafter-trainer", [sys.executable, "-m", "service.cli", "drafter-trainer",
                                           "--server", f"127.0.0.1:{grpc_port}", "--metrics-port", str(metrics_port),
                                           "--checkpoint-dir", str(work / "ckpt")], work / "trainer.log", env)
        procs.append(trainer)
        wait_for(lambda: trainer.alive() and http_ok(f"http://127.0.0.1:{metrics_port}/"), 180,
                 "the trainer's /metrics", every=POLL_S, ignoring=STARTING, detail=trainer.tail)
        config = work / "prometheus.yml"
        config.write_text(yaml.safe_dump(_scrape_config(http_port, metrics_port,
                                                        DEPLOY / "prometheus" / "alerts.yml")))
        prom = Proc("prometheus", [prometheus, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{prom_port}"], work / "prometheus.log")
        procs.append(prom)
        api = f"http://127.0.0.1:{prom_port}/api/v1"

        def targets_up() -> bool:
            prom.alive()
            active = httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
            return len(active) == 2 and all(t["health"] == "up" for t in active)

        wait_for(targets_up, 60, "both scrape targets up", every=POLL_S, ignoring=STARTING, detail=prom.tail)
        yield {"api": api, "http": http_port, "grpc": grpc_port, "model": model, "procs": procs}
    finally:
        for p in reversed(procs):
            logger.info("%s", p.tail())
            p.stop()


def _server_counter(http_port: int, name: str) -> float:
    return metric(httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=5).text, name)


def _long_requests(grpc_port: int, started: threading.Event) -> None:
    with SpecrollClient(f"127.0.0.1:{grpc_port}") as client:
        try:
            for _ in client.stream(PROMPTS[1], n=4, max_tokens=480, temperature=1.0, ignore_eos=True):
                started.set()  # generating: the abort below finds it running, however fast the engine is
        except Exception as exc:  # an aborted request may end with an error; that is the point here
            logger.info("aborted request ended with %r", exc)
        finally:
            started.set()


def _abort_running(client: SpecrollClient, grpc_port: int, http_port: int) -> None:
    """Start a long request and abort everything from the admin API once it streams (until the server counted
    an abort)."""
    before = _server_counter(http_port, "specroll:requests_aborted_total")
    for _ in range(10):
        started = threading.Event()
        long = threading.Thread(target=_long_requests, args=(grpc_port, started))
        long.start()
        started.wait(60)
        client.abort(all=True)
        long.join(timeout=120)
        if _server_counter(http_port, "specroll:requests_aborted_total") > before:
            return
    pytest.fail("no request was aborted")


@pytest.fixture(scope="module")
def window(stack: dict[str, Any]) -> tuple[float, float]:
    """Generation with SD for WORKLOAD_S seconds (gRPC and HTTP), two target pushes, aborts and rewards; returns
    its wall-clock start and end; the panels are evaluated at the end, once Prometheus scraped past it."""
    client = SpecrollClient(f"127.0.0.1:{stack['grpc']}", admin_token=TOKEN)
    base = f"http://127.0.0.1:{stack['http']}"
    tensors = checkpoint_tensors(stack["model"])
    wall_start = time.time()
    start = time.monotonic()
    step = 0
    pushed = aborted = rewarded = 0
    # Generation goes on for a few scrapes after the last push and abort: a rate over the window needs two samples
    # of a counter series, and the aborted-requests series begins at the abort. A server still compiling its
    # forwards in the background runs slow steps, and an abort in the workload's last iteration left that panel
    # empty (one CI run).
    last_event = start
    while (time.monotonic() - start < WORKLOAD_S or pushed < 2 or not aborted or not rewarded
           or time.monotonic() - last_event < 4 * SCRAPE_S):
        results = client.generate(PROMPTS, n=2, max_tokens=48, temperature=1.0, seed=step)
        r = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPTS[step % len(PROMPTS)], "max_tokens": 24,
                                                         "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        elapsed = time.monotonic() - start
        if pushed < 1 or (pushed < 2 and elapsed > WORKLOAD_S / 2):
            pushed += 1
            result = client.push_weights(perturbed(tensors, seed=pushed, scale=0.05), version=f"v{pushed}")
            assert result.version == f"v{pushed}"
            last_event = time.monotonic()
        if not aborted and elapsed > WORKLOAD_S / 2:
            _abort_running(client, stack["grpc"], stack["http"])
            _abort_running(client, stack["grpc"], stack["http"])
            aborted = 1
            last_event = time.monotonic()
        rewards = {s.rollout_id: float(i % 2) for c in results for i, s in enumerate(c.samples)}
        rewarded += client.report_rewards(rewards)
        step += 1
    client.close()
    end = time.time()
    time.sleep(3 * SCRAPE_S)  # let Prometheus scrape past the end
    return wall_start, end


@pytest.fixture(scope="module")
def workload(window: tuple[float, float]) -> float:
    return window[1]


def _query(api: str, promql: str, at: float) -> list[dict[str, Any]]:
    r = httpx.get(f"{api}/query", params={"query": promql, "time": f"{at:.3f}"}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{promql}: {body}"
    return body["data"]["result"]


def test_every_panel_query_returns_data(stack: dict[str, Any], workload: float) -> None:
    queries = _panel_queries()
    assert len(queries) >= 30
    empty = []
    for title, expr in queries:
        result = _query(stack["api"], _grafana_to_promql(expr), workload)
        values = [float(s["value"][1]) for s in result]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{title}: {expr} -> {values}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_panels_show_the_workload(stack: dict[str, Any], workload: float) -> None:
    def value(promql: str) -> float:
        [sample] = _query(stack["api"], promql, workload)
        return float(sample["value"][1])

    assert value("sum(specroll:spec_decode_num_drafts_total)") > 0
    assert value("sum(specroll:weight_sync_total{role=\"target\", result=\"ok\"})") >= 2
    assert value("sum(specroll:buffer_written_total{kind=\"reward\"})") > 0
    assert value("sum(specroll:requests_aborted_total)") > 0
    versions = _query(stack["api"], "specroll:weight_version{role=\"target\"}", workload)
    assert [s["metric"]["version"] for s in versions] == ["v2"]
    # a wrong metric or label does not pass for data
    assert _query(stack["api"], _grafana_to_promql(
        'sum(rate(specroll:generation_tokens_total{instance=~"$instance", role="x"}[$__rate_interval]))'),
        workload) == []


def test_instance_variable_and_alert_rules_load(stack: dict[str, Any], workload: float) -> None:
    assert sorted(p.name for p in (DEPLOY / "grafana").glob("*.json")) == sorted(DASHBOARDS)
    for name in DASHBOARDS:
        variable = next(v for v in _dashboard(name)["templating"]["list"] if v["name"] == "instance")
        metric = variable["query"]["query"].split("(")[1].split(",")[0]
        r = httpx.get(f"{stack['api']}/series", params={"match[]": metric}, timeout=10).json()
        assert {s["instance"] for s in r["data"]} == {f"127.0.0.1:{stack['http']}"}
    groups = httpx.get(f"{stack['api']}/rules", timeout=10).json()["data"]["groups"]
    rules = [rule for g in groups for rule in g["rules"]]
    assert rules and all(rule["health"] == "ok" for rule in rules), rules
    firing = {rule["name"] for rule in rules if rule["state"] != "inactive"}
    assert not firing & {"SpecrollDown", "SpecrollRedisDown", "SpecrollBufferDropping"}


def test_key_panels_render(stack: dict[str, Any], window: tuple[float, float], tmp_path: Path) -> None:
    """deploy/grafana/render_panels.py draws the key panels from this Prometheus ($SPECROLL_DASHBOARD_PNG: where
    to keep the picture, e.g. docs/dashboard.png)."""
    out = Path(os.environ.get("SPECROLL_DASHBOARD_PNG") or tmp_path / "dashboard.png")
    api = stack["api"].removesuffix("/api/v1")
    cmd = [sys.executable, str(DEPLOY / "grafana" / "render_panels.py"), "--prometheus", api,
           "--start", f"{window[0] - 5:.3f}", "--end", f"{window[1] + 2:.3f}", "--out", str(out),
           "--rate-interval", RATE_INTERVAL]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
