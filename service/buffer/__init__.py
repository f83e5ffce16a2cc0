"""The rollout buffer: every finished rollout (and every reported reward) leaves the server here.

With a Redis URL: `RedisBuffer` (stream + local spool). Without: `MemoryBuffer`, read by the drafter
trainer running in the server process (`specroll serve` does that by default). `attach_buffer` wires either
into a server's hooks and metrics.
"""

from service.buffer.attach import BufferCollector, attach_buffer
from service.buffer.codec import BufferedRollout, PayloadError, decode_entry, entry_fields, payload_of
from service.buffer.config import BufferConfig, add_buffer_args, buffer_config_from_args
from service.buffer.memory import MemoryBuffer
from service.buffer.redis_buffer import RedisBuffer
from service.buffer.spool import Spool

__all__ = [
    "BufferCollector", "BufferConfig", "BufferedRollout", "MemoryBuffer", "PayloadError",
    "RedisBuffer", "Spool", "add_buffer_args", "attach_buffer", "buffer_config_from_args", "decode_entry",
    "entry_fields", "payload_of",
]
