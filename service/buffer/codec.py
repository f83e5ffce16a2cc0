"""Rollout records <-> Redis stream entries: small fields for filtering plus one protobuf payload.

Entry fields (all strings except ``payload``): rollout_id, request_id, group_id, policy_version,
drafter_version, num_prompt_tokens, num_output_tokens, finish_reason, finished_at, has_top_k, payload
(a serialized ``specroll.v1.RolloutPayload``). Consumers need nothing but protobuf to read them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.protogen import pb2

PAYLOAD = "payload"


class PayloadError(ValueError):
    """A stream entry that is not a well-formed rollout. `reason` names the kind of fault with a short, fixed word
    (a metric label): encoding, protobuf, missing, shape, token_range, non_finite, params."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


def _params(params: Any) -> Any:
    if params is None:
        return None
    return pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                              min_p=params.min_p, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)


def payload_of(record: Any, top_k: int = 0) -> Any:
    """A RolloutRecord (service.backend.events) as a RolloutPayload. Top-k logprobs are kept (up to `top_k` per
    token) only when the record carries them; sampling params only when it has them."""
    msg = pb2.RolloutPayload(
        rollout_id=record.rollout_id, request_id=record.request_id, index=record.index,
        group_id=record.group_id or "", prompt_token_ids=record.prompt_token_ids,
        output_token_ids=record.output_token_ids, logprobs=record.logprobs,
        raw_logprobs=record.raw_logprobs or [], finish_reason=record.finish_reason,
        policy_version=record.policy_version, drafter_version=record.drafter_version,
        metadata=dict(record.metadata or {}), created_at=record.created_at, finished_at=record.finished_at,
    )
    for s in record.version_spans:
        msg.version_spans.add(policy_version=s.policy_version, drafter_version=s.drafter_version, start=s.start,
                              end=s.end)
    params = _params(getattr(record, "params", None))
    if params is not None:
        msg.params.CopyFrom(params)
    tops = getattr(record, "top_logprobs", None)
    if top_k > 0 and tops and len(tops) == len(record.output_token_ids):
        k = min(top_k, min(len(t) for t in tops))
        if k > 0:
            msg.top_k = k
            for row in tops:
                best = sorted(row.items(), key=lambda kv: -kv[1])[:k]
                msg.top_token_ids.extend(int(t) for t, _ in best)
                msg.top_logprobs.extend(float(v) for _, v in best)
    return msg


def entry_fields(payload: Any) -> dict[str, str | bytes]:
    """The fields of the stream entry for one RolloutPayload."""
    return {
        "rollout_id": payload.rollout_id, "request_id": payload.request_id, "group_id": payload.group_id,
        "policy_version": payload.policy_version, "drafter_version": payload.drafter_version,
        "num_prompt_tokens": str(len(payload.prompt_token_ids)),
        "num_output_tokens": str(len(payload.output_token_ids)), "finish_reason": payload.finish_reason,
        "finished_at": repr(payload.finished_at), "has_top_k": str(payload.top_k),
        PAYLOAD: payload.SerializeToString(),
    }


def spool_rollout(payload: Any) -> bytes:
    return pb2.SpoolRecord(rollout=payload).SerializeToString()  # type: ignore[no-any-return]


def spool_reward(rollout_id: str, reward: float) -> bytes:
    rec = pb2.RewardRecord(rollout_id=rollout_id, reward=reward, reported_at=time.time())
    return pb2.SpoolRecord(reward=rec).SerializeToString()  # type: ignore[no-any-return]


@dataclass(slots=True)
class BufferedRollout:
    """One rollout as a consumer sees it (decoded from an entry); `reward` once one was joined."""

    entry_id: str
    rollout_id: str
    group_id: str
    policy_version: str
    drafter_version: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_versions: list[str]  # of the spans, in order
    temperature: float | None = None  # None: the server did not record sampling params
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    top_ids: list[int] = field(default_factory=list)  # [T * k] row-major
    top_values: list[float] = field(default_factory=list)
    top_count: int = 0  # k of top_ids (0: none)
    metadata: dict[str, str] = field(default_factory=dict)
    finished_at: float = 0.0
    reward: float | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def _text(entry_id: str, fields: Mapping[Any, Any], key: str) -> str:
    value = fields.get(key, fields.get(key.encode(), b""))
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode()
    except UnicodeDecodeError as exc:
        raise PayloadError(f"entry {entry_id}: field {key!r} is not UTF-8: {exc}", "encoding") from exc


def _check_ids(entry_id: str, what: str, ids: Any, vocab_size: int | None) -> None:
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise PayloadError(f"entry {entry_id}: {len(bad)} {what} outside {bound}, e.g. {bad[:3]}", "token_range")


def _check_params(entry_id: str, p: Any) -> None:
    """The bounds the server puts on a request's sampling params (service/params.py), read back."""
    reals = [(name, getattr(p, name)) for name in ("temperature", "top_p", "min_p") if p.HasField(name)]
    problems = [f"{name}={v}" for name, v in reals if not math.isfinite(v)]
    if p.HasField("temperature") and p.temperature < 0:
        problems.append(f"temperature={p.temperature}")
    if p.HasField("top_p") and not 0 < p.top_p <= 1:
        problems.append(f"top_p={p.top_p}")
    if p.HasField("top_k") and p.top_k < -1:
        problems.append(f"top_k={p.top_k}")
    if p.HasField("min_p") and not 0 <= p.min_p <= 1:
        problems.append(f"min_p={p.min_p}")
    if problems:
        raise PayloadError(f"entry {entry_id}: sampling params out of range: {', '.join(problems)}", "params")


def decode_entry(entry_id: str, fields: Mapping[Any, Any], vocab_size: int | None = None) -> BufferedRollout:
    """Decode a stream entry (bytes or str keys); raises PayloadError, never anything else, for an entry that
    is not a well-formed rollout: undecodable fields, arrays whose lengths disagree, token ids that are negative
    or (given `vocab_size`) outside the vocabulary, logprobs that are NaN or infinite, sampling params outside
    the bounds the server accepts."""
    raw = fields.get(PAYLOAD, fields.get(PAYLOAD.encode()))
    if not isinstance(raw, bytes | bytearray):
        raise PayloadError(f"entry {entry_id} has no bytes payload field", "missing")
    try:
        msg = pb2.RolloutPayload.FromString(bytes(raw))
    except Exception as exc:  # protobuf's DecodeError (invalid UTF-8 in a string field included)
        raise PayloadError(f"entry {entry_id}: payload is not a RolloutPayload: {exc}", "protobuf") from exc
    if not msg.rollout_id or _text(entry_id, fields, "rollout_id") not in ("", msg.rollout_id):
        raise PayloadError(f"entry {entry_id}: rollout id missing or inconsistent with the payload", "missing")
    T = len(msg.output_token_ids)
    if len(msg.logprobs) != T:
        raise PayloadError(f"entry {entry_id}: {len(msg.logprobs)} logprobs for {T} output tokens", "shape")
    if msg.top_k < 0 or (msg.top_k and not len(msg.top_token_ids) == len(msg.top_logprobs) == T * msg.top_k):
        raise PayloadError(f"entry {entry_id}: top-k arrays ({len(msg.top_token_ids)} ids, {len(msg.top_logprobs)} "
                           f"logprobs) do not match {T} tokens x k={msg.top_k}", "shape")
    _check_ids(entry_id, "prompt token ids", msg.prompt_token_ids, vocab_size)
    _check_ids(entry_id, "output token ids", msg.output_token_ids, vocab_size)
    _check_ids(entry_id, "top-k token ids", msg.top_token_ids, vocab_size)
    if not all(math.isfinite(v) for v in msg.logprobs):  # a sampled token had a positive probability
        raise PayloadError(f"entry {entry_id}: a sampled token's logprob is not finite", "non_finite")
    if any(math.isnan(v) or v == math.inf for v in msg.top_logprobs):  # -inf: a token processing removed
        raise PayloadError(f"entry {entry_id}: a top-k logprob is NaN or +inf", "non_finite")
    if msg.HasField("params"):
        _check_params(entry_id, msg.params)
    out = BufferedRollout(
        entry_id=entry_id, rollout_id=msg.rollout_id, group_id=msg.group_id, policy_version=msg.policy_version,
        drafter_version=msg.drafter_version, prompt_token_ids=list(msg.prompt_token_ids),
        output_token_ids=list(msg.output_token_ids), logprobs=list(msg.logprobs), finish_reason=msg.finish_reason,
        policy_versions=[s.policy_version for s in msg.version_spans] or [msg.policy_version],
        top_ids=list(msg.top_token_ids), top_values=list(msg.top_logprobs), top_count=msg.top_k,
        metadata=dict(msg.metadata), finished_at=msg.finished_at,
    )
    if msg.HasField("params"):
        p = msg.params
        out.temperature = p.temperature if p.HasField("temperature") else 1.0
        out.top_p = p.top_p if p.HasField("top_p") else 1.0
        out.top_k = max(p.top_k, 0) if p.HasField("top_k") else 0  # -1 disables, like 0
        out.min_p = p.min_p if p.HasField("min_p") else 0.0
    return out
