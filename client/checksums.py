"""The integrity checks a weight push may carry, one per push (the manifest's `checksum` field).

xxh3_128 (the default) and crc32c run at memory speed; sha256 is several times slower and stays accepted because
clients that predate the field send it. Client and server use this one table, so a name means the same hash on
both sides; every kind is hex-encoded, one digest per tensor (per body for an HTTP upload).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol

DEFAULT = "xxh3_128"
LEGACY = "sha256"  # what a manifest without a `checksum` field means


class Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


def _xxh3_128() -> Hasher:
    import xxhash

    return xxhash.xxh3_128()  # type: ignore[no-any-return]


def _crc32c() -> Hasher:
    try:
        import crc32c
    except ImportError as exc:  # the client installs it only with the `crc32c` extra
        raise ValueError("checksum crc32c needs the crc32c package (pip install crc32c)") from exc
    return crc32c.CRC32CHash()  # type: ignore[no-any-return]


def _sha256() -> Hasher:
    return hashlib.sha256()


_KINDS: dict[str, tuple[Callable[[], Hasher], int]] = {  # kind -> (new hasher, hex digits)
    "xxh3_128": (_xxh3_128, 32),
    "crc32c": (_crc32c, 8),
    "sha256": (_sha256, 64),
}
KINDS = tuple(_KINDS)


def kind_of(name: str | None) -> str:
    """The checksum kind a push names ("" or None: the legacy sha256); ValueError for an unknown one."""
    kind = (name or LEGACY).lower()
    if kind not in _KINDS:
        raise ValueError(f"checksum must be one of {list(KINDS)}, got {name!r}")
    return kind


def new(kind: str) -> Hasher:
    return _KINDS[kind_of(kind)][0]()


def hex_digits(kind: str) -> int:
    return _KINDS[kind_of(kind)][1]


def well_formed(kind: str, digest: str) -> bool:
    """Whether `digest` has the form of a hex digest of `kind`."""
    return len(digest) == hex_digits(kind) and all(c in "0123456789abcdef" for c in digest.lower())


def digest_of(kind: str, data: Any) -> str:
    h = new(kind)
    h.update(data)
    return h.hexdigest()
