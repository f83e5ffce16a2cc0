"""Randomized gRPC fuzzing against a real server: random-valued messages and corrupt bytes for every RPC.

Messages are built from the proto descriptors (every field type, edge values, unicode, long repeated fields
within the message limit), sent with the admin token, a wrong token or none. Every answer must be a clean
status (OK or a client-side error code), never INTERNAL / UNKNOWN / a hang, and the server must still serve a
normal Generate afterwards. Seeded, so a failure reproduces.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pbd
from google.protobuf.message import Message
from service_utils import ADMIN, running, start_server

from service.api.generation import Limits
from service.app import BackgroundServer
from service.protogen import pb2, pb2_grpc

logger = logging.getLogger(__name__)

SEED = 12
MESSAGES_PER_RPC = 100
RAW_PER_RPC = 20
CALL_TIMEOUT_S = 30.0
VOCAB = 512
LIMITS = Limits(max_tokens=8, max_n=4, max_message_bytes=2**20)
SERVICE = pb2.DESCRIPTOR.services_by_name["Rollout"]
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}
INT_EDGES = [0, 1, -1, 2, 7, 16, 511, 512, 513, 2**31 - 1, -(2**31), 4096, 10**6]
FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, -1e30, float("inf"), float("-inf"), float("nan")]
TEXT_ALPHABET = "ab z0\n\t\x00é中文🙂\u202e\ufeff\\\"'<>/"
MODES = ["wait", "abort", "keep", "", "WAIT", "bogus"]


@dataclass
class FuzzLog:
    calls: int = 0
    by_code: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def record(self, rpc: str, request: Message | bytes, code: grpc.StatusCode, details: str) -> None:
        self.calls += 1
        self.by_code[code.name] = self.by_code.get(code.name, 0) + 1
        if code not in BAD_CODES:
            return
        self.failures.append(f"{rpc} -> {code.name} {details[:160]!r} for {_show(request)}")


def _show(request: Message | bytes) -> str:
    text = repr(request[:64]) if isinstance(request, bytes) else str(request).replace("\n", " ")
    return text[:300]


def _message_class(desc: pbd.Descriptor) -> type[Message]:
    return getattr(pb2, desc.name)


def _text(rng: random.Random) -> str:
    size = rng.choice([0, 1, 5, 40, 300])
    return "".join(rng.choice(TEXT_ALPHABET) for _ in range(size))


def _scalar(rng: random.Random, fd: pbd.FieldDescriptor) -> Any:
    t = fd.type
    if t in (fd.TYPE_INT32, fd.TYPE_SINT32, fd.TYPE_SFIXED32):
        return rng.choice(INT_EDGES) if rng.random() < 0.6 else rng.randint(-(2**31), 2**31 - 1)
    if t in (fd.TYPE_INT64, fd.TYPE_SINT64, fd.TYPE_SFIXED64):
        return rng.choice([*INT_EDGES, 2**63 - 1, -(2**63)])
    if t in (fd.TYPE_UINT32, fd.TYPE_FIXED32):
        return rng.choice([0, 1, 7, 2**32 - 1])
    if t in (fd.TYPE_UINT64, fd.TYPE_FIXED64):
        return rng.choice([0, 1, 7, 2**63, 2**64 - 1])
    if t in (fd.TYPE_FLOAT, fd.TYPE_DOUBLE):
        return rng.choice(FLOAT_EDGES) if rng.random() < 0.6 else rng.uniform(-3, 3)
    if t == fd.TYPE_BOOL:
        return rng.random() < 0.5
    if t == fd.TYPE_STRING:
        return rng.choice(MODES) if fd.name in ("mode", "role", "dtype") and rng.random() < 0.5 else _text(rng)
    if t == fd.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 3, 64, 4096]))
    raise AssertionError(f"unhandled field type {t} of {fd.full_name}")


def _repeated_len(rng: random.Random) -> int:
    return rng.choice([0, 1, 3, 8, 20_000]) if rng.random() < 0.2 else rng.choice([0, 1, 2, 5])


def _fill(rng: random.Random, msg: Message, depth: int = 0) -> Message:
    for fd in msg.DESCRIPTOR.fields:
        if rng.random() < 0.35:
            continue
        if fd.containing_oneof is not None and msg.WhichOneof(fd.containing_oneof.name) is not None:
            continue
        target = getattr(msg, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            for _ in range(rng.choice([0, 1, 3, 50])):
                target[_scalar(rng, key_fd)] = _scalar(rng, value_fd)
        elif fd.is_repeated and fd.message_type is not None:
            for _ in range(min(_repeated_len(rng), 50) if depth < 2 else 0):
                _fill(rng, target.add(), depth + 1)
        elif fd.is_repeated:
            n = _repeated_len(rng)
            small = fd.type not in (fd.TYPE_STRING, fd.TYPE_BYTES)
            target.extend(_scalar(rng, fd) if not small or rng.random() < 0.3 else rng.randint(0, VOCAB + 2)
                          for _ in range(n if small else min(n, 20)))
        elif fd.message_type is not None:
            if depth < 3:
                _fill(rng, target, depth + 1)
                if not target.ListFields():
                    msg.ClearField(fd.name)
        else:
            setattr(msg, fd.name, _scalar(rng, fd))
    return msg


def _generate_request(rng: random.Random) -> Message:
    """Mostly valid Generate requests with one or two random fields, so they reach the engine."""
    req = pb2.GenerateRequest(prompt_token_ids=[rng.randint(1, VOCAB - 1) for _ in range(rng.randint(1, 12))], n=1)
    req.params.max_tokens = rng.randint(1, 8)
    extra = _fill(rng, pb2.GenerateRequest())
    for fd, value in extra.ListFields():
        if rng.random() < 0.5:
            if fd.message_type is not None and not fd.is_repeated:
                getattr(req, fd.name).MergeFrom(value)
            else:
                req.ClearField(fd.name)
                if fd.is_repeated:
                    target = getattr(req, fd.name)
                    target.update(value) if hasattr(target, "update") else target.extend(value)
                else:
                    setattr(req, fd.name, value)
    return req


def _explicit_generate() -> list[Message]:
    """Edge cases every run sends first, whatever the seed draws."""
    def req(**params: Any) -> Message:
        return pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], params=pb2.SamplingParams(**{"max_tokens": 4, **params}))
    return [req(top_logprobs=VOCAB + 1), req(top_logprobs=2**31 - 1), req(top_logprobs=-1), req(top_logprobs=VOCAB),
            req(temperature=float("nan")), req(temperature=float("inf")), req(top_p=-1.0), req(top_k=-5),
            req(min_p=2.0), req(stop_token_ids=[-1, VOCAB, 2**31 - 1]), req(max_tokens=0), req(max_tokens=-3),
            req(seed=2**64 - 1), pb2.GenerateRequest(prompt_token_ids=[1] * 20_000),
            pb2.GenerateRequest(prompt_token_ids=[-1]), pb2.GenerateRequest(prompt_text="\x00" * 50, n=-1),
            pb2.GenerateRequest(prompt_token_ids=[3], n=2**31 - 1)]


def _metadata(rng: random.Random) -> tuple[tuple[str, str], ...]:
    roll = rng.random()
    if roll < 0.6:
        return (("authorization", f"Bearer {ADMIN}"),)
    if roll < 0.8:
        return ()
    return (("authorization", rng.choice(["Bearer wrong", ADMIN, "Bearer ", "Basic eA=="])),)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    load_root: Path = tmp_path_factory.mktemp("load-root")
    yield from running(start_server(model_dir, limits=LIMITS, load_root=str(load_root)))


def _call(channel: grpc.Channel, method: pbd.MethodDescriptor, request: Message | bytes | list,
          metadata: tuple[tuple[str, str], ...]) -> tuple[grpc.StatusCode, str]:
    path = f"/{SERVICE.full_name}/{method.name}"
    identity: Callable[[Any], Any] = lambda b: b
    serialize = identity if isinstance(request, bytes) or (
        isinstance(request, list) and request and isinstance(request[0], bytes)) else (lambda m: m.SerializeToString())
    try:
        if method.client_streaming:
            stub = channel.stream_unary(path, request_serializer=serialize, response_deserializer=identity)
            stub(iter(request if isinstance(request, list) else [request]), metadata=metadata, timeout=CALL_TIMEOUT_S)
        elif method.server_streaming:
            stub = channel.unary_stream(path, request_serializer=serialize, response_deserializer=identity)
            for _ in stub(request, metadata=metadata, timeout=CALL_TIMEOUT_S):
                pass
        else:
            stub = channel.unary_unary(path, request_serializer=serialize, response_deserializer=identity)
            stub(request, metadata=metadata, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _resume(channel: grpc.Channel) -> None:
    pb2_grpc.RolloutStub(channel).Resume(pb2.ResumeRequest(), metadata=(("authorization", f"Bearer {ADMIN}"),),
                                         timeout=CALL_TIMEOUT_S)


def _normal_generate(channel: grpc.Channel) -> list[Any]:
    req = pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], n=2,
                              params=pb2.SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=3))
    responses = list(pb2_grpc.RolloutStub(channel).Generate(req, timeout=CALL_TIMEOUT_S))
    return [r.final for r in responses if r.WhichOneof("kind") == "final"]


def _fuzz(channel: grpc.Channel, rng: random.Random, log: FuzzLog) -> None:
    for request in _explicit_generate():
        code, details = _call(channel, SERVICE.methods_by_name["Generate"], request, _metadata(rng))
        log.record("Generate", request, code, details)
    for method in SERVICE.methods:
        cls = _message_class(method.input_type)
        for i in range(MESSAGES_PER_RPC + RAW_PER_RPC):
            request: Any
            if i >= MESSAGES_PER_RPC:
                request = rng.randbytes(rng.choice([1, 2, 7, 64, 1000]))
            elif method.name == "Generate" and rng.random() < 0.7:
                request = _generate_request(rng)
            else:
                request = _fill(rng, cls())
            if method.client_streaming and not isinstance(request, bytes):
                request = [request, *(_fill(rng, cls()) for _ in range(rng.choice([0, 1, 4])))]
            code, details = _call(channel, method, request, _metadata(rng))
            first = request[0] if isinstance(request, list) else request
            log.record(method.name, first, code, details)
            if method.name == "Pause":
                _resume(channel)


def test_grpc_fuzz_no_internal_errors(server: BackgroundServer) -> None:
    log = FuzzLog()
    options = [("grpc.max_send_message_length", 4 * LIMITS.max_message_bytes),
               ("grpc.max_receive_message_length", 4 * LIMITS.max_message_bytes)]
    with grpc.insecure_channel(server.grpc_target, options=options) as channel:
        _fuzz(channel, random.Random(SEED), log)
        _resume(channel)
        finals = _normal_generate(channel)
    logger.warning("gRPC fuzz: %d calls over %d RPCs; codes %s", log.calls, len(SERVICE.methods),
                   dict(sorted(log.by_code.items())))
    assert log.calls == len(SERVICE.methods) * (MESSAGES_PER_RPC + RAW_PER_RPC) + len(_explicit_generate())
    assert log.by_code.get("OK", 0) > 20 and log.by_code.get("INVALID_ARGUMENT", 0) > 20, log.by_code
    assert not log.failures, "\n".join(log.failures[:30])
    assert sorted(f.index for f in finals) == [0, 1]
    assert all(f.num_output_tokens == 6 and f.finish_reason == "length" for f in finals)
