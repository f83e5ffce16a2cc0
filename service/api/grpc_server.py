"""The gRPC API (specroll.v1.Rollout on grpc.aio), plus grpc.health.v1 and server reflection."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.api.context import ServiceContext
from service.api.errors import message_of, retry_after, status_of
from service.api.generation import InvalidRequest, ServiceError, make_params
from service.api.push_protocol import Manifest, PushError, PushResult, TensorEntry
from service.api.wire import ChunkView, Corrupt, add_rollout_servicer
from service.backend.base import NotReady
from service.backend.events import Chunk, Failed, GenRequest, RequestHandle, SampleDone, whole_chunks
from service.protogen import pb2, pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["Rollout"].full_name


def _auth(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return str(value)
    return None


def _manifest(m: Any) -> Manifest:
    """Without `checksum` (a client that predates it) each tensor's sha256 field holds its digest."""
    tensors = [TensorEntry(t.name, t.dtype, tuple(int(d) for d in t.shape), int(t.nbytes),
                           t.digest if m.checksum else t.sha256, t.encoding or "dense") for t in m.tensors]
    if m.checksum.lower() == "sha256":
        for e, t in zip(tensors, m.tensors, strict=True):
            e.digest = e.digest or t.sha256
    return Manifest(m.role or "target", m.version, m.dtype, tensors, m.mode or "wait", m.cast, m.base_version,
                    checksum=m.checksum or "sha256")


def _weights_reply(r: PushResult) -> Any:
    return pb2.WeightsReply(role=r.role, version=r.version, bytes=r.nbytes, seconds=r.seconds,
                            swap_seconds=r.swap_seconds, wait_seconds=r.wait_seconds, aborted=r.aborted)


class RolloutServicer(pb2_grpc.RolloutServicer):  # type: ignore[misc]
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    async def _fail(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        status = status_of(exc)
        after = retry_after(exc)  # overloaded: when to try again, in seconds (like HTTP's Retry-After)
        trailers = (("retry-after", str(after)),) if after is not None else ()
        await context.abort(status.grpc, message_of(exc, status), trailing_metadata=trailers)

    def _params(self, request: Any) -> Any:
        p = request.params
        opt = {f: getattr(p, f) for f in ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                                          "frequency_penalty", "presence_penalty", "repetition_penalty")
               if p.HasField(f)}
        return make_params(self.ctx.limits, n=request.n or 1, stop_token_ids=list(p.stop_token_ids),
                           ignore_eos=p.ignore_eos, top_logprobs=p.top_logprobs, raw_logprobs=p.raw_logprobs, **opt)

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        ctx = self.ctx
        try:
            ctx.auth.check_api(_auth(context))
            tokenizer = ctx.tokenizer()
            if request.prompt_token_ids and request.prompt_text:
                raise InvalidRequest("give prompt_token_ids or prompt_text, not both")
            ids = list(request.prompt_token_ids) or ((await ctx.tokenize([request.prompt_text]))[0]
                                                     if request.prompt_text else [])
            params = self._params(request)
            prompt = ctx.validate(ids, params)
            rid = request.request_id or uuid.uuid4().hex
            handle = RequestHandle(rid, params.n, _running_loop())
            whole = request.final_only  # no chunks until a sample ends (the engine sends none for it)
            ctx.backend.submit_all([(GenRequest(prompt, params, rid, request.group_id or None,
                                                dict(request.metadata), stream=not whole), handle)])
        except Exception as exc:
            await self._fail(context, exc)
            return
        try:
            async for ev in handle.events(ctx.limits.stream_interval):
                if isinstance(ev, Chunk):
                    if not whole:
                        yield pb2.GenerateResponse(request_id=rid, chunk=_chunk(ev))
                elif isinstance(ev, SampleDone):
                    for c in whole_chunks(ev) if whole else ():
                        yield pb2.GenerateResponse(request_id=rid, chunk=_chunk(c))
                    text = tokenizer.decode(ev.token_ids) if request.return_text and tokenizer else ""
                    yield pb2.GenerateResponse(request_id=rid, final=_final(ev, text))
                elif isinstance(ev, Failed):
                    await self._fail(context, InvalidRequest(ev.message) if ev.invalid else ServiceError(ev.message))
        finally:
            if not handle.finished:
                with contextlib.suppress(NotReady):
                    ctx.backend.abort(rid, "client")

    async def _admin(self, context: grpc.aio.ServicerContext, work: Any) -> Any:
        try:
            self.ctx.auth.check_admin(_auth(context))
            return await work()
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await self._fail(context, exc)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            return pb2.AbortResponse(aborted=await self.ctx.abort(request.request_id, request.all))
        return await self._admin(context, work)

    async def Pause(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            return pb2.PauseResponse(paused=True, aborted=await self.ctx.pause(request.mode or "wait"))
        return await self._admin(context, work)

    async def Resume(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            await self.ctx.resume()
            return pb2.ResumeResponse(paused=False)
        return await self._admin(context, work)

    async def PushWeights(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            first = await anext(aiter(request_iterator), None)
            if isinstance(first, Corrupt):
                raise PushError(first.error)
            if first is None or isinstance(first, ChunkView) or first.WhichOneof("kind") != "manifest":
                raise PushError("the first message of a push must be its manifest")

            async def chunks() -> AsyncIterator[tuple[int, Any]]:
                async for msg in request_iterator:
                    if isinstance(msg, Corrupt):
                        raise PushError(msg.error)
                    if not isinstance(msg, ChunkView):
                        raise PushError("only chunks may follow the manifest")
                    yield msg.offset, msg.data

            return _weights_reply(await self.ctx.pushes.push_stream(_manifest(first.manifest), chunks()))
        return await self._admin(context, work)

    async def LoadWeights(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            r = await self.ctx.pushes.load_path(request.role or "target", request.version, request.path,
                                                 request.mode or "wait", request.cast)
            return _weights_reply(r)
        return await self._admin(context, work)

    async def ReportRewards(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            return pb2.ReportRewardsResponse(accepted=self.ctx.report_rewards(dict(request.rewards)))
        return await self._admin(context, work)

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self.ctx.auth.check_api(_auth(context))
            return pb2.ServerInfo(**self.ctx.info(admin=self.ctx.auth.is_admin(_auth(context))))
        except Exception as exc:
            await self._fail(context, exc)


def _running_loop() -> Any:
    import asyncio

    return asyncio.get_running_loop()


def _chunk(ev: Chunk) -> Any:
    tops = [pb2.TopLogprobs(token_ids=list(d), logprobs=list(d.values())) for d in ev.top_logprobs or []]
    return pb2.TokenChunk(index=ev.index, token_ids=ev.token_ids, logprobs=ev.logprobs,
                          raw_logprobs=ev.raw_logprobs or [], top_logprobs=tops,
                          policy_version=ev.policy_version, drafter_version=ev.drafter_version)


def _final(ev: SampleDone, text: str) -> Any:
    spans = [pb2.VersionSpan(policy_version=s.policy_version, drafter_version=s.drafter_version, start=s.start,
                             end=s.end) for s in ev.version_spans]
    spec = pb2.SpecStats(num_steps=ev.num_steps, tokens_per_step=ev.tokens_per_step, strategy=ev.strategy)
    return pb2.Final(index=ev.index, rollout_id=ev.rollout_id, finish_reason=ev.finish_reason,
                     num_prompt_tokens=ev.num_prompt_tokens, num_output_tokens=ev.num_output_tokens,
                     version_spans=spans, spec=spec, text=text)


def build_grpc_server(ctx: ServiceContext, address: str) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A grpc.aio server bound to `address`; returns it, its health servicer and the bound port."""
    limit = ctx.limits.max_message_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", limit),
                                      ("grpc.http2.max_frame_size", 16 * 2**20 - 1),
                                      ("grpc.so_reuseport", 0)])
    add_rollout_servicer(RolloutServicer(ctx), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind gRPC to {address}")
    return server, health_servicer, port


async def set_health(servicer: health.aio.HealthServicer, ready: bool) -> None:
    """Liveness is the empty service name; readiness is the Rollout service."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    await servicer.set("", serving)
    await servicer.set(SERVICE_NAME, serving if ready else not_serving)
