"""Schema-driven fuzzing of the HTTP API (schemathesis) against a real server: no 5xx, and the server still serves.

Every operation of the server's own `/openapi.json` gets schema-conforming and schema-violating cases (seeded,
a few per operation) sent with the admin token, so admin endpoints run too. The server's limits keep the cases
cheap (a few tokens per sample).
A case that pauses the server (/pause, /pause_generation) is followed by a resume so later cases run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from service_utils import auth, running, start_server

from service.api.generation import Limits
from service.app import BackgroundServer

logger = logging.getLogger(__name__)

EXAMPLES_PER_MODE = 40  # per operation and generation mode (positive / negative)
MIN_CASES = 400
SAMPLING_CASES = 250  # typed-key fuzz of the sampling fields the schema leaves open (`dict[str, Any]`)
REQUEST_TIMEOUT_S = 60.0
# A server error closes its connection; a fresh connection per case keeps the next case from reusing it.
FRESH_CONNECTION = {"connection": "close"}
LIMITS = Limits(max_tokens=8, max_n=4, max_prompts=4, max_stop=4, max_request_bytes=2**20,
                max_upload_bytes=2**20)


@dataclass
class FuzzLog:
    cases: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)
    no_negative: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    load_root: Path = tmp_path_factory.mktemp("load-root")
    yield from running(start_server(model_dir, limits=LIMITS, load_root=str(load_root)))


def _fuzz_operation(op: schemathesis.APIOperation, base_url: str, session: requests.Session, log: FuzzLog,
                    mode: GenerationMode) -> None:
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        headers = {**(case.headers or {}), **auth(), **FRESH_CONNECTION}
        try:
            response = case.call(base_url=base_url, session=session, headers=headers, timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:  # a hang or a dropped connection is a server failure too
            log.server_errors.append(f"{op.method.upper()} {op.path}: {type(exc).__name__} {exc} for {case!r}")
            return
        finally:
            if op.path in ("/pause", "/pause_generation"):
                session.post(f"{base_url}/resume", headers=auth(), timeout=REQUEST_TIMEOUT_S)
        log.cases += 1
        log.by_status[response.status_code] = log.by_status.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            line = (f"{op.method.upper()} {op.path} -> {response.status_code} {response.text[:200]!r} "
                    f"for body={case.body!r} query={case.query!r}")
            log.server_errors.append(line)

    try:
        run()
    except Unsatisfiable:  # an operation without parameters or body has no schema-violating case
        assert mode == GenerationMode.NEGATIVE, f"{op.method} {op.path}: no positive case could be generated"
        log.no_negative.append(f"{op.method.upper()} {op.path}")


def _assert_still_serving(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
        http.post("/resume", headers=auth())
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
                                               "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"


def test_http_api_fuzz_no_server_errors(server: BackgroundServer) -> None:
    base_url = server.http_url
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15, [f"{o.method} {o.path}" for o in operations]
    log = FuzzLog()
    with requests.Session() as session:
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _fuzz_operation(op, base_url, session, log, mode)
    logger.warning("HTTP fuzz: %d cases over %d operations; statuses %s",
                   log.cases, len(operations), dict(sorted(log.by_status.items())))
    logger.warning("operations without schema-violating cases: %s", log.no_negative)
    assert log.cases >= MIN_CASES
    assert not log.server_errors, "\n".join(log.server_errors[:30])
    _assert_still_serving(base_url)


ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8), st.lists(st.integers(-5, 600), max_size=6), st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
SGLANG_KEYS = ("temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop_token_ids", "n", "sampling_seed",
               "stop", "ignore_eos", "custom_params")
OPENAI_KEYS = ("max_tokens", "temperature", "top_p", "n", "seed", "stop", "logprobs", "top_k", "min_p",
               "stop_token_ids", "ignore_eos")


def _typed_fields(keys: tuple[str, ...]) -> st.SearchStrategy[dict]:
    return st.dictionaries(st.sampled_from(keys), ANY_VALUE, max_size=4)


def test_sampling_fields_fuzz_no_server_errors(server: BackgroundServer) -> None:
    """The sampling fields every API knows, each with a value of any JSON type: 4xx or 200, never 5xx."""
    base_url = server.http_url
    log = FuzzLog()

    @given(sp=_typed_fields(SGLANG_KEYS), openai=_typed_fields(OPENAI_KEYS), stream=st.booleans())
    @settings(max_examples=SAMPLING_CASES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(sp: dict, openai: dict, stream: bool) -> None:
        calls = (("/generate", {"input_ids": [3, 4, 5], "sampling_params": sp, "stream": stream}),
                 ("/v1/completions", {"prompt": [3, 4, 5], **openai, "stream": stream}))
        for path, body in calls:
            try:
                r = http.post(path, json=body, headers={**auth(), **FRESH_CONNECTION})
            except httpx.HTTPError as exc:
                log.server_errors.append(f"POST {path}: {type(exc).__name__} {exc} for {body!r}")
                continue
            log.cases += 1
            log.by_status[r.status_code] = log.by_status.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                line = f"POST {path} -> {r.status_code} {r.text[:200]!r} for {body!r}"
                log.server_errors.append(line)

    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
        run()
    logger.warning("sampling-field fuzz: %d cases; statuses %s", log.cases, dict(sorted(log.by_status.items())))
    assert log.cases >= SAMPLING_CASES
    assert not log.server_errors, "\n".join(log.server_errors[:30])
    _assert_still_serving(base_url)
