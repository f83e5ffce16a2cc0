"""Rollout records <-> Redis stream entries: small fields for filtering plus one protobuf payload.

Entry fields (all strings except ``payload``): rollout_id, request_id, group_id, policy_version,
drafter_version, num_prompt_tokens, num_output_tokens, finish_reason, finished_at, has_top_k, payload
(a serialized ``specroll.v1.RolloutPayload``). Consumers need nothing but protobuf to read them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.protogen import pb2

PAYLOAD = "payload"


class PayloadError(ValueError):
    """A stream entry that is not a well-formed rollout."""


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


def _text(fields: Mapping[Any, Any], key: str) -> str:
    value = fields.get(key, fields.get(key.encode(), b""))
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_entry(entry_id: str, fields: Mapping[Any, Any]) -> BufferedRollout:
    """Decode a stream entry (bytes or str keys); raises PayloadError for anything malformed."""
    raw = fields.get(PAYLOAD, fields.get(PAYLOAD.encode()))
    if not isinstance(raw, bytes | bytearray):
        raise PayloadError(f"entry {entry_id} has no bytes payload field")
    try:
        msg = pb2.RolloutPayload.FromString(bytes(raw))
    except Exception as exc:  # protobuf's DecodeError
        raise PayloadError(f"entry {entry_id}: payload is not a RolloutPayload: {exc}") from exc
    if not msg.rollout_id or _text(fields, "rollout_id") not in ("", msg.rollout_id):
        raise PayloadError(f"entry {entry_id}: rollout id missing or inconsistent with the payload")
    T = len(msg.output_token_ids)
    if len(msg.logprobs) != T:
        raise PayloadError(f"entry {entry_id}: {len(msg.logprobs)} logprobs for {T} output tokens")
    if msg.top_k and len(msg.top_token_ids) != T * msg.top_k:
        raise PayloadError(f"entry {entry_id}: top-k arrays do not match {T} tokens x k={msg.top_k}")
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
        out.top_k = p.top_k if p.HasField("top_k") else 0
        out.min_p = p.min_p if p.HasField("min_p") else 0.0
    return out
