"""gRPC handler registration with a zero-copy reader for weight chunks.

A PushWeightsRequest carrying a chunk is parsed by hand (it is three fields) so its data stays a memoryview of
the received message instead of being copied twice by protobuf; anything else, or anything unexpected, goes
through the generated protobuf parser. The wire format is the standard one: any protobuf client can push.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from service.protogen import pb2

SERVICE = pb2.DESCRIPTOR.services_by_name["Rollout"]


@dataclass(slots=True)
class ChunkView:
    offset: int
    data: memoryview


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _parse_chunk(buf: memoryview) -> ChunkView | None:
    """PushWeightsRequest{chunk{offset, data}} -> ChunkView, or None when it is something else."""
    if len(buf) < 2 or buf[0] != 0x12:  # field 2 (chunk), length-delimited
        return None
    size, pos = _varint(buf, 1)
    if pos + size != len(buf):
        return None
    offset, data = 0, memoryview(b"")
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        if tag == 0x08:  # offset
            offset, pos = _varint(buf, pos)
        elif tag == 0x12:  # data
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                return None
            data, pos = buf[pos : pos + n], pos + n
        else:
            return None
    return ChunkView(offset, data)


@dataclass(slots=True)
class Corrupt:
    """A message that did not parse; the handler answers INVALID_ARGUMENT (gRPC itself would say UNKNOWN)."""

    error: str


def _parser(request_cls: Any) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return request_cls.FromString(raw)
        except DecodeError as exc:
            return Corrupt(f"corrupt {request_cls.DESCRIPTOR.name} message: {exc}")

    return parse


def _unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Corrupt):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return await fn(request, context)

    return handle


def _unary_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Corrupt):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        async for item in fn(request, context):
            yield item

    return handle


def parse_push_request(raw: bytes) -> Any:
    try:
        view = _parse_chunk(memoryview(raw))
    except ValueError:
        view = None
    if view is not None:
        return view
    try:
        msg = pb2.PushWeightsRequest.FromString(raw)
    except DecodeError as exc:
        return Corrupt(f"corrupt PushWeightsRequest message: {exc}")
    if msg.WhichOneof("kind") == "chunk":
        return ChunkView(msg.chunk.offset, memoryview(msg.chunk.data))
    return msg


_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_rollout_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Like the generated add_RolloutServicer_to_server, with the chunk reader for PushWeights."""
    handlers = {}
    for method in SERVICE.methods:
        request_cls = getattr(pb2, method.input_type.name)
        response_cls = getattr(pb2, method.output_type.name)
        factory = _FACTORIES[(method.client_streaming, method.server_streaming)]
        deserialize = parse_push_request if method.name == "PushWeights" else _parser(request_cls)
        fn = getattr(servicer, method.name)
        if not method.client_streaming:
            fn = _unary_stream(fn) if method.server_streaming else _unary(fn)
        handlers[method.name] = factory(fn, request_deserializer=deserialize,
                                        response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE.full_name, handlers)
