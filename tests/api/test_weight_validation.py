"""The one weight validation on every path of a real server (issue 49, items 2 and 3): folders that escape the
load root (index entries with `..` or absolute paths, shard symlinks), NaN / Inf weights, mixed dtypes, a dtype
other than the served one without an explicit cast, a tensor in two shards, and safetensors headers that lie.
Each is refused with a 4xx and a message (gRPC: INVALID_ARGUMENT / PERMISSION_DENIED) on `/weights/load`,
`/update_weights_from_disk`, gRPC LoadWeights, gRPC PushWeights and `/weights/upload`; the old weights serve on."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers import default_checkpoint
from safetensors.torch import save, save_file
from service_utils import (
    ADMIN,
    auth,
    checkpoint_tensors,
    engine_config,
    perturbed,
    running,
    start_server,
    write_checkpoint,
)

from client import SpecrollClient
from client.errors import InvalidArgument, PermissionDenied, SpecrollError
from service.app import BackgroundServer
from service.engine.llm_engine import LLMEngine
from service.params import SamplingParams

PROBE = [9, 8, 7, 6]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
VICTIM = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return default_checkpoint(tied=False)


@pytest.fixture(scope="module")
def new(base_dir: Path) -> dict[str, torch.Tensor]:
    return perturbed(checkpoint_tensors(base_dir), seed=3)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The load root and a folder outside it."""
    return tmp_path_factory.mktemp("load-root"), tmp_path_factory.mktemp("elsewhere")


@pytest.fixture(scope="module")
def server(base_dir: Path, dirs: tuple[Path, Path]) -> Iterator[BackgroundServer]:
    yield from running(start_server(base_dir, load_root=str(dirs[0])))


def _with(tensors: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**tensors, name: value}


def _nan(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    bad = t[VICTIM].clone()
    bad[3, 5] = float("nan")
    return _with(t, VICTIM, bad)


def _inf(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    bad = t[VICTIM].clone()
    bad[-1, -1] = float("-inf")
    return _with(t, VICTIM, bad)


def _lie_about_shape(path: Path) -> None:
    """Rewrite a safetensors file whose header gives one tensor twice its rows (its offsets unchanged)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header[VICTIM]["shape"][0] *= 2
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _shards(folder: Path, tensors: dict[str, torch.Tensor], extra: dict[str, torch.Tensor] | None = None,
            index: Callable[[str], str] | None = None) -> None:
    """Two shards (the second holding `extra` too) and, when `index` is given, an index mapping each name."""
    names = sorted(tensors)
    half = len(names) // 2
    a = {k: tensors[k].contiguous() for k in names[:half]}
    b = {k: tensors[k].contiguous() for k in names[half:]} | (extra or {})
    save_file(a, str(folder / "model-00001-of-00002.safetensors"))
    save_file(b, str(folder / "model-00002-of-00002.safetensors"))
    if index is not None:
        weight_map = {k: index("model-00001-of-00002.safetensors") for k in a}
        weight_map |= {k: index("model-00002-of-00002.safetensors") for k in b}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


FOLDERS: dict[str, tuple[int, str]] = {
    # case: (HTTP status, a piece of the message)
    "index-dotdot": (400, "index entries must name files inside"),
    "index-absolute": (400, "index entries must name files inside"),
    "symlinked-shard": (403, "resolves to a file outside"),
    "nan": (400, "NaN or infinite"),
    "inf": (400, "NaN or infinite"),
    "mixed-dtypes": (400, "mixes dtypes"),
    "float16-uncast": (400, "ask for a cast explicitly"),
    "duplicate-across-shards": (400, "listed twice"),
    "duplicate-in-index": (400, "but the index maps it to"),
    "header-lies-shape": (400, "the header lies about tensor"),
    "header-lies-truncated": (400, "past the"),
    "header-duplicate-key": (400, "names tensor"),
    "header-garbage": (400, "the header claims"),
}


@pytest.fixture(scope="module")
def folders(dirs: tuple[Path, Path], new: dict[str, torch.Tensor], base_dir: Path) -> dict[str, Path]:
    root, elsewhere = dirs
    outside = write_checkpoint(base_dir, new, elsewhere / "ckpt")
    out: dict[str, Path] = {}

    def folder(case: str) -> Path:
        f = root / case
        f.mkdir()
        out[case] = f
        return f

    _shards(outside, new)  # shards the escaping indexes point at
    _shards(folder("index-dotdot"), new, index=lambda n: os.path.relpath(outside / n, root / "index-dotdot"))
    _shards(folder("index-absolute"), new, index=lambda n: str(outside / n))
    (folder("symlinked-shard") / "model.safetensors").symlink_to(outside / "model.safetensors")
    write_checkpoint(base_dir, _nan(new), folder("nan"))
    write_checkpoint(base_dir, _inf(new), folder("inf"))
    write_checkpoint(base_dir, _with(new, VICTIM, new[VICTIM].half()), folder("mixed-dtypes"))
    write_checkpoint(base_dir, {k: v.half() for k, v in new.items()}, folder("float16-uncast"))
    twice = {sorted(new)[0]: new[sorted(new)[0]] * 2}  # a name of shard 1, again (other values) in shard 2
    _shards(folder("duplicate-across-shards"), new, extra=twice)
    _shards(folder("duplicate-in-index"), new, extra=twice, index=lambda n: n)
    _lie_about_shape(write_checkpoint(base_dir, new, folder("header-lies-shape")) / "model.safetensors")
    lying = write_checkpoint(base_dir, new, folder("header-lies-truncated")) / "model.safetensors"
    lying.write_bytes(lying.read_bytes()[:-64])
    dup = write_checkpoint(base_dir, new, folder("header-duplicate-key")) / "model.safetensors"
    raw = dup.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + n].decode()
    first = text.index('"model.')  # the first tensor's entry, given a second time at the end of the header
    entry = text[first : text.index("}", first) + 1]
    text = text.rstrip().removesuffix("}") + "," + entry + "}"
    dup.write_bytes(struct.pack("<Q", len(text)) + text.encode() + raw[8 + n :])
    (write_checkpoint(base_dir, new, folder("header-garbage")) / "model.safetensors").write_bytes(
        struct.pack("<Q", 2**40) + b"{}")
    write_checkpoint(base_dir, {k: v.half() for k, v in new.items()}, root / "float16-cast")
    write_checkpoint(base_dir, new, root / "good")
    return out


def _probe(c: SpecrollClient) -> list[int]:
    return c.generate_one(PROBE, **GREEDY).samples[0].token_ids


def _probe_of(model_dir: Path) -> list[int]:
    engine = LLMEngine(engine_config(model_dir))
    [out] = engine.generate([PROBE], SamplingParams(**GREEDY))
    return list(out.outputs[0].token_ids)


def _http_load(srv: BackgroundServer, folder: Path, version: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{srv.http_url}/weights/load", json={"path": str(folder), "version": version, **extra},
                      headers=auth(), timeout=60)


def _http_disk(srv: BackgroundServer, folder: Path, version: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{srv.http_url}/update_weights_from_disk",
                      json={"model_path": str(folder), "weight_version": version, **extra}, headers=auth(), timeout=60)


PATHS = ["weights/load", "update_weights_from_disk", "grpc-LoadWeights"]


def _load(srv: BackgroundServer, c: SpecrollClient, path: str, folder: Path, version: str, **extra: Any) -> None:
    """Load a folder over `path`; raises SpecrollError (gRPC) or the HTTP status and message as an AssertionError."""
    if path == "grpc-LoadWeights":
        c.load_weights(str(folder), version, **extra)
        return
    r = (_http_load if path == "weights/load" else _http_disk)(srv, folder, version, **extra)
    if r.status_code != 200:
        raise AssertionError(r.status_code, r.json()["error"]["message"])


@pytest.fixture(scope="module")
def client(server: BackgroundServer, dirs: tuple[Path, Path], folders: dict[str, Path]) -> Iterator[SpecrollClient]:
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.load_weights(str(dirs[0] / "good"), "good")
        yield c


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(FOLDERS))
def test_a_bad_folder_is_refused_with_its_reason(server, client, folders, path, case):
    status, needle = FOLDERS[case]
    if path == "grpc-LoadWeights":
        with pytest.raises(SpecrollError) as err:
            _load(server, client, path, folders[case], f"bad-{case}")
        assert isinstance(err.value, PermissionDenied if status == 403 else InvalidArgument), err.value
        assert needle in str(err.value), err.value
    else:
        with pytest.raises(AssertionError) as failed:
            _load(server, client, path, folders[case], f"bad-{case}")
        assert failed.value.args == (status, failed.value.args[1]) and needle in failed.value.args[1], failed.value
    assert client.server_info().policy_version == "good"


@pytest.mark.parametrize("path", PATHS)
def test_after_refused_folders_the_old_weights_serve_and_a_cast_asked_for_is_done(server, client, dirs, base_dir,
                                                                                  new, tmp_path, path):
    client.load_weights(str(dirs[0] / "good"), "good")
    before = _probe(client)
    for case in FOLDERS:
        with pytest.raises((SpecrollError, AssertionError)):
            _load(server, client, path, dirs[0] / case, f"bad-{case}")
    assert client.server_info().policy_version == "good" and _probe(client) == before
    _load(server, client, path, dirs[0] / "float16-cast", f"f16-cast-{path}", cast=True)
    assert client.server_info().policy_version == f"f16-cast-{path}"
    want = _probe_of(write_checkpoint(base_dir, {k: v.half().float() for k, v in new.items()}, tmp_path / "ref"))
    assert _probe(client) == want  # the float16 weights, cast to the served float32


def test_bad_tensors_are_refused_by_push_weights(server, new, base_dir, tmp_path):
    """NaN, Inf and float16 state dicts, and a NaN folder the client sends as is."""
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(new, "good-push")
        before = _probe(c)
        for name, tensors, needle in (("nan", _nan(new), "NaN or infinite"), ("inf", _inf(new), "NaN or infinite"),
                                      ("f16", {k: v.half() for k, v in new.items()}, "ask for a cast explicitly")):
            with pytest.raises(InvalidArgument, match=needle):
                c.push_weights(tensors, f"bad-{name}")
        nan_folder = write_checkpoint(base_dir, _nan(new), tmp_path / "nan")  # the client sends a folder as is
        with pytest.raises(InvalidArgument, match="NaN or infinite"):
            c.push_weights(nan_folder, "bad-nan-folder")
        assert c.server_info().policy_version == "good-push" and _probe(c) == before
        assert c.push_weights({k: v.half() for k, v in new.items()}, "f16-cast", cast=True).version == "f16-cast"


def test_bad_uploads_are_refused(server, new, folders):
    url = f"{server.http_url}/weights/upload"
    with SpecrollClient(server.grpc_target, admin_token=ADMIN) as c:
        c.push_weights(new, "good-upload")
        before = _probe(c)
        half = save({k: v.half().contiguous() for k, v in new.items()})
        bodies = {"nan": (save(_nan(new)), "NaN or infinite"), "f16": (half, "ask for a cast explicitly"),
                  "mixed": (save(_with(new, VICTIM, new[VICTIM].half())), "mixes dtypes"),
                  "header-duplicate-key": ((folders["header-duplicate-key"] / "model.safetensors").read_bytes(),
                                           "names tensor"),
                  "header-lies": ((folders["header-lies-shape"] / "model.safetensors").read_bytes(), "safetensors")}
        for case, (body, needle) in bodies.items():
            r = httpx.post(url, params={"version": f"bad-{case}"}, content=body, headers=auth(), timeout=60)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], (case, r.text)
        assert c.server_info().policy_version == "good-upload" and _probe(c) == before
        r = httpx.post(url, params={"version": "f16-upload", "cast": "true"}, content=half, headers=auth(), timeout=60)
        assert r.status_code == 200, r.text
        assert c.server_info().policy_version == "f16-upload"
