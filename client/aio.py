"""Asyncio client for specroll's gRPC API."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import weights as wt
from client.errors import FailedPrecondition, Overloaded, SpecrollError, Unavailable, from_rpc_error
from client.protogen import pb2, pb2_grpc
from client.types import Completion, PushResult, Sample, ServerInfo, TokenChunk, VersionSpan

logger = logging.getLogger(__name__)

T = TypeVar("T")
SERVICE = "specroll.v1.Rollout"
Prompt = Sequence[int] | str
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "frequency_penalty", "presence_penalty",
             "repetition_penalty")


def _sample(rid: str, f: Any, chunks: list[TokenChunk]) -> Sample:
    return Sample(
        request_id=rid, index=f.index, rollout_id=f.rollout_id, finish_reason=f.finish_reason,
        token_ids=[t for c in chunks for t in c.token_ids], logprobs=[x for c in chunks for x in c.logprobs],
        raw_logprobs=[x for c in chunks for x in c.raw_logprobs],
        top_logprobs=[x for c in chunks for x in c.top_logprobs],
        version_spans=[VersionSpan(s.policy_version, s.drafter_version, s.start, s.end) for s in f.version_spans],
        num_prompt_tokens=f.num_prompt_tokens, num_output_tokens=f.num_output_tokens,
        tokens_per_step=f.spec.tokens_per_step, strategy=f.spec.strategy, text=f.text,
    )


def _chunk(rid: str, c: Any) -> TokenChunk:
    return TokenChunk(rid, c.index, list(c.token_ids), list(c.logprobs), c.policy_version, c.drafter_version,
                      list(c.raw_logprobs), [dict(zip(t.token_ids, t.logprobs, strict=True)) for t in c.top_logprobs])


async def _outcome(call: grpc.Future) -> Any:
    """Await a blocking-API call without blocking the event loop; cancelling the awaiting task cancels the RPC."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake(_: grpc.Future) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    call.add_done_callback(wake)
    try:
        await done
    except asyncio.CancelledError:
        call.cancel()
        raise
    return call.result()  # raises the RPC's error (a grpc.RpcError) if it failed


def _push_result(r: Any) -> PushResult:
    return PushResult(r.role, r.version, r.bytes, r.seconds, r.swap_seconds, r.wait_seconds, list(r.aborted))


class AsyncSpecrollClient:
    """Trainer-side client. Unary calls and not-yet-started streams are retried on UNAVAILABLE."""

    def __init__(self, target: str = "127.0.0.1:50051", *, admin_token: str | None = None,
                 api_token: str | None = None, retries: int = 3, backoff_s: float = 0.2,
                 max_message_bytes: int = 8 * 2**20, timeout_s: float | None = None) -> None:
        self.target = target
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self._admin = (("authorization", f"Bearer {admin_token}"),) if admin_token else ()
        self._api = (("authorization", f"Bearer {api_token or admin_token}"),) if (api_token or admin_token) else ()
        self._options = [("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.max_receive_message_length", max_message_bytes),
                         ("grpc.http2.max_frame_size", 16 * 2**20 - 1), ("grpc.http2.write_buffer_size", 64 * 2**20)]
        self._channel = grpc.aio.insecure_channel(target, options=self._options)
        self._stub = pb2_grpc.RolloutStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._push_channel: grpc.Channel | None = None  # blocking, opened by the first push: see push_weights

    async def close(self) -> None:
        await self._channel.close()
        if self._push_channel is not None:
            self._push_channel.close()

    async def __aenter__(self) -> AsyncSpecrollClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _retry(self, call: Callable[[], Awaitable[T]]) -> T:
        for attempt in range(self.retries + 1):
            try:
                return await call()
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if not isinstance(err, Unavailable) or attempt == self.retries:
                    raise err from None
                await asyncio.sleep(_delay(err, self.backoff_s * 2**attempt))
        raise AssertionError("unreachable")

    # -- status -------------------------------------------------------------------------------------
    async def wait_until_ready(self, timeout_s: float = 120.0) -> ServerInfo:
        """Poll the readiness health check until the model is loaded."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                resp = await self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return await self.server_info()
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):  # type: ignore[attr-defined]
                    raise from_rpc_error(exc) from None
            if time.monotonic() > deadline:
                raise Unavailable(f"server at {self.target} not ready after {timeout_s} s")
            await asyncio.sleep(0.2)

    async def server_info(self) -> ServerInfo:
        msg = await self._retry(lambda: self._stub.GetServerInfo(pb2.ServerInfoRequest(), metadata=self._api,
                                                                 timeout=self.timeout_s))
        return ServerInfo.from_proto(msg)

    # -- generation ---------------------------------------------------------------------------------
    def _request(self, prompt: Prompt, n: int, request_id: str | None, group_id: str | None,
                 metadata: Mapping[str, str] | None, return_text: bool, final_only: bool,
                 stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, top_logprobs: int = 0,
                 raw_logprobs: bool = False, **sampling: Any) -> Any:
        unknown = set(sampling) - set(_SAMPLING)
        if unknown:
            raise TypeError(f"unknown sampling arguments {sorted(unknown)}")
        params = pb2.SamplingParams(stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                    top_logprobs=top_logprobs, raw_logprobs=raw_logprobs,
                                    **{k: v for k, v in sampling.items() if v is not None})
        req = pb2.GenerateRequest(params=params, n=n, request_id=request_id or uuid.uuid4().hex,
                                  group_id=group_id or "", metadata=dict(metadata or {}), return_text=return_text,
                                  final_only=final_only)
        if isinstance(prompt, str):
            req.prompt_text = prompt
        else:
            req.prompt_token_ids.extend(int(t) for t in prompt)
        return req

    async def stream(self, prompt: Prompt, *, n: int = 1, request_id: str | None = None, group_id: str | None = None,
                     metadata: Mapping[str, str] | None = None, return_text: bool = False,
                     final_only: bool = False, **params: Any) -> AsyncIterator[TokenChunk | Sample]:
        """Token chunks as they come, then a Sample per finished sample (with all its tokens). `final_only`: only
        the Samples, each as it finishes; the server then streams nothing while the samples run."""
        req = self._request(prompt, n, request_id, group_id, metadata, return_text, final_only, **params)
        chunks: dict[int, list[TokenChunk]] = {}
        for attempt in range(self.retries + 1):
            got_any = False
            call = self._stub.Generate(req, metadata=self._api, timeout=self.timeout_s)
            try:
                async for msg in call:
                    got_any = True
                    if msg.WhichOneof("kind") == "chunk":
                        c = _chunk(msg.request_id, msg.chunk)
                        chunks.setdefault(c.index, []).append(c)
                        if not final_only:
                            yield c
                    else:
                        yield _sample(msg.request_id, msg.final, chunks.pop(msg.final.index, []))
                return
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if got_any or not isinstance(err, Unavailable) or attempt == self.retries:
                    raise err from None
                await asyncio.sleep(_delay(err, self.backoff_s * 2**attempt))
            finally:
                call.cancel()  # a consumer that stops early ends the request (no-op once finished)

    async def generate_one(self, prompt: Prompt, *, n: int = 1, **kw: Any) -> Completion:
        """The prompt's n samples, whole (the server sends each once it finishes: `stream`'s final_only)."""
        samples: list[Sample] = []
        rid = ""
        async for ev in self.stream(prompt, n=n, final_only=True, **kw):
            if isinstance(ev, Sample):
                samples.append(ev)
                rid = ev.request_id
        samples.sort(key=lambda s: s.index)
        return Completion(rid, [] if isinstance(prompt, str) else list(prompt), samples)

    async def generate(self, prompts: Sequence[Prompt], *, n: int = 1, group_ids: Sequence[str] | None = None,
                       request_ids: Sequence[str] | None = None, **kw: Any) -> list[Completion]:
        """All prompts concurrently (n samples each); results in prompt order.

        `group_ids` gives each prompt its group; `group_id` gives all of them the same one.
        """
        if group_ids is not None and len(group_ids) != len(prompts):
            raise ValueError("group_ids must have one entry per prompt")
        if request_ids is not None and len(request_ids) != len(prompts):
            raise ValueError("request_ids must have one entry per prompt")
        group_id = kw.pop("group_id", None)
        return list(await asyncio.gather(*(
            self.generate_one(p, n=n, group_id=group_ids[i] if group_ids else group_id,
                              request_id=request_ids[i] if request_ids else None, **kw)
            for i, p in enumerate(prompts))))

    # -- weights ------------------------------------------------------------------------------------
    async def push_weights(self, weights: Mapping[str, Any] | str | Path, version: str, *, role: str = "target",
                           mode: str = "wait", dtype: Any = None, chunk_bytes: int = wt.CHUNK_BYTES,
                           hash_threads: int = 4, cast: bool = False, delta_from: wt.PushedState | None = None,
                           sparse_below: float = wt.SPARSE_BELOW, checksum: str = wt.checksums.DEFAULT,
                           ) -> PushResult:
        """Push a state_dict (Hugging Face names) or a safetensors folder; the server swaps atomically. The
        tensors must be in the served dtype, or `cast=True` asks the server to cast them (`dtype` casts here,
        before sending). `checksum`: each tensor's integrity check, xxh3_128 | crc32c | sha256.

        `delta_from` (a state_dict push): send only what changed since the version it recorded (`push_delta`),
        in full when it recorded none or the server refuses the delta (it serves another version, or takes no
        deltas); it then records this push as the base of the next."""
        if delta_from is None:
            tensors = (wt.from_folder(weights) if isinstance(weights, str | Path)
                       else wt.from_state_dict(weights, dtype))
            return await self._push(tensors, role, version, mode, cast, chunk_bytes, hash_threads,
                                    checksum=checksum)
        if not isinstance(weights, Mapping):
            raise ValueError("delta_from takes a state_dict, not a folder")
        state = wt.on_cpu(weights, dtype)
        result = None
        if delta_from.version is not None:
            try:
                result = await self.push_delta(state, version, base=delta_from.tensors,
                                               base_version=delta_from.version, role=role, mode=mode, cast=cast,
                                               chunk_bytes=chunk_bytes, hash_threads=hash_threads,
                                               sparse_below=sparse_below, checksum=checksum)
            except FailedPrecondition as exc:
                logger.info("delta push refused, pushing %s in full: %s", version, exc)
        if result is None:
            result = await self._push(wt.from_state_dict(state), role, version, mode, cast, chunk_bytes,
                                      hash_threads, checksum=checksum)
        delta_from.record(state, version)
        return result

    async def push_delta(self, weights: Mapping[str, Any], version: str, *, base: Mapping[str, Any],
                         base_version: str, role: str = "target", mode: str = "wait", dtype: Any = None,
                         chunk_bytes: int = wt.CHUNK_BYTES, hash_threads: int = 4, cast: bool = False,
                         sparse_below: float = wt.SPARSE_BELOW, checksum: str = wt.checksums.DEFAULT,
                         ) -> PushResult:
        """Push only what changed from `base` (the weights the server serves as `base_version`) to `weights`:
        tensors whose bits differ, sparse where few elements did. The server applies it to a copy of the serving
        weights; it refuses (FailedPrecondition, nothing changed) unless it serves `base_version`."""
        state = wt.on_cpu(weights, dtype)
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
        if len(dtypes) != 1:
            raise ValueError(f"a push has one checkpoint dtype; these tensors have {dtypes} (pass dtype= to cast)")
        tensors = await asyncio.to_thread(wt.delta, wt.on_cpu(base, dtype), state, sparse_below)
        return await self._push(tensors, role, version, mode, cast, chunk_bytes, hash_threads, base_version,
                                dtypes[0], checksum)

    async def _push(self, tensors: list[wt.TensorBytes], role: str, version: str, mode: str, cast: bool,
                    chunk_bytes: int, hash_threads: int, base_version: str = "", dtype: str = "",
                    checksum: str = wt.checksums.DEFAULT) -> PushResult:
        await asyncio.to_thread(wt.hash_all, tensors, hash_threads, checksum)
        manifest = wt.manifest(tensors, role, version, mode, cast, base_version, dtype, checksum)

        async def call() -> Any:
            head = pb2.PushWeightsRequest(manifest=manifest)
            requests = itertools.chain([head], wt.iter_chunks(tensors, chunk_bytes))
            return await _outcome(self._push_rpc().future(requests, metadata=self._admin, timeout=self.timeout_s))

        return _push_result(await self._retry(call))

    def _push_rpc(self) -> grpc.StreamUnaryMultiCallable:
        """A push runs on grpc's blocking API, not on asyncio's. The server refuses a bad push (no token, a wrong
        manifest) as soon as it knows, while the client is still sending; grpc's asyncio client then reports
        INTERNAL "Internal error from Core" in place of the server's status in about 1 push in 50 (a late write
        overwrites it: grpc/grpc#36066). The blocking client stops sending and keeps the server's status."""
        if self._push_channel is None:
            self._push_channel = grpc.insecure_channel(self.target, options=self._options)
        return self._push_channel.stream_unary("/specroll.v1.Rollout/PushWeights", request_serializer=wt.serialize_push,
                                               response_deserializer=pb2.WeightsReply.FromString)

    async def push_weights_shm(self, weights: Mapping[str, Any], version: str, *, role: str = "target",
                               mode: str = "wait", dtype: Any = None, cast: bool = False,
                               shm_dir: str | Path = wt.SHM_DIR) -> PushResult:
        """A same-host push through shared memory: the state dict is written once into a safetensors file in a
        private folder under `shm_dir` (tmpfs), the server reads each tensor once from it into its spare
        (`load_weights`), and the folder is removed when the call returns, whatever happened. The server must
        run on this host as a user that can read the folder, with `shm_dir` under a `--load-root` if it sets
        any. No checksum: the bytes never cross a wire."""
        tensors = await asyncio.to_thread(wt.from_state_dict, weights, dtype)
        folder = await asyncio.to_thread(wt.write_safetensors_folder, tensors, shm_dir)
        try:
            return await self.load_weights(str(folder), version, role=role, mode=mode, cast=cast)
        finally:
            await asyncio.to_thread(shutil.rmtree, folder, True)

    async def push_weights_memfd(self, weights: Mapping[str, Any], version: str, *, role: str = "target",
                                 mode: str = "wait", dtype: Any = None, cast: bool = False) -> PushResult:
        """A same-host push through a sealed memfd (Linux): the state dict is written once into an anonymous
        in-memory file, sealed so no byte can change, and the server reads each tensor once from it into its
        spare (`load_weights` on its `/proc/<pid>/fd/<fd>` path). No file is left anywhere, whatever happens:
        the memory goes with the fd, closed when the call returns. The server must run on this host, in this
        PID namespace, as a user allowed to read this process's files; no `--load-root` is involved."""
        tensors = await asyncio.to_thread(wt.from_state_dict, weights, dtype)
        fd = await asyncio.to_thread(wt.write_sealed_memfd, tensors)
        try:
            return await self.load_weights(wt.memfd_path(fd), version, role=role, mode=mode, cast=cast)
        finally:
            os.close(fd)

    async def load_weights(self, path: str, version: str, *, role: str = "target", mode: str = "wait",
                           cast: bool = False) -> PushResult:
        req = pb2.LoadWeightsRequest(role=role, version=version, path=str(path), mode=mode, cast=cast)
        return _push_result(await self._retry(lambda: self._stub.LoadWeights(req, metadata=self._admin,
                                                                             timeout=self.timeout_s)))

    # -- control ------------------------------------------------------------------------------------
    async def pause(self, mode: str = "wait") -> list[str]:
        """Pause generation; returns once nothing runs (wait) with the ids of aborted requests (abort)."""
        resp = await self._retry(lambda: self._stub.Pause(pb2.PauseRequest(mode=mode), metadata=self._admin))
        return list(resp.aborted)

    async def resume(self) -> None:
        await self._retry(lambda: self._stub.Resume(pb2.ResumeRequest(), metadata=self._admin))

    async def abort(self, request_id: str | None = None, *, all: bool = False) -> list[str]:
        req = pb2.AbortRequest(request_id=request_id or "", all=all)
        return list((await self._retry(lambda: self._stub.Abort(req, metadata=self._admin))).aborted)

    async def report_rewards(self, rewards: Mapping[str, float]) -> int:
        req = pb2.ReportRewardsRequest(rewards={k: float(v) for k, v in rewards.items()})
        return int((await self._retry(lambda: self._stub.ReportRewards(req, metadata=self._admin))).accepted)


__all__ = ["AsyncSpecrollClient", "SpecrollError"]


def _delay(err: SpecrollError, backoff_s: float) -> float:
    return max(backoff_s, err.retry_after_s) if isinstance(err, Overloaded) else backoff_s
