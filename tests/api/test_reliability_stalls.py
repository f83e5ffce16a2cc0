"""No client can stall the HTTP server: text prompts are bounded before they are tokenized and tokenized off the
event loop, and a connection that never finishes its request head is closed. Real servers on loopback."""

from __future__ import annotations

import json
import resource
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from service_utils import MAX_MODEL_LEN, auth, running, start_server

from service.api.generation import Limits
from service.app import BackgroundServer

SMALL = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
# A text bound high enough that a text within it takes seconds to tokenize (the default is 16 bytes a token)
LIMITS = Limits(max_tokens=MAX_MODEL_LEN, header_timeout_s=1.0, text_bytes_per_token=4096)


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[BackgroundServer]:
    yield from running(start_server(model_dir, limits=LIMITS))


def words(nbytes: int) -> str:
    vocab = ["the", "cat", "sat", "on", "a", "red", "mat", "and", "jumps", "over", "12", "+", "7"]
    out, size, i = [], 0, 0
    while size < nbytes:
        w = vocab[(i * 7 + i // 13) % len(vocab)]
        out.append(w)
        size += len(w) + 1
        i += 1
    return " ".join(out)


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_huge_text_prompt_is_refused_before_it_is_tokenized(server):
    limit = MAX_MODEL_LEN * LIMITS.text_bytes_per_token
    huge = words(6 * 2**20)  # tokenized, this grew the server by GBs and held the event loop for many seconds
    before = max_rss_mb()
    with httpx.Client(base_url=server.http_url, headers=auth(), timeout=120) as h:
        for path, body in (("/v1/completions", {"prompt": huge, "max_tokens": 4}),
                           ("/v1/completions", {"prompt": ["hi", huge], "max_tokens": 4}),
                           ("/generate", {"text": huge, "sampling_params": {"max_new_tokens": 4}})):
            r = h.post(path, json=body)
            assert r.status_code == 400, r.text
            assert f"over the limit of {limit} bytes" in r.json()["error"]["message"]
        assert h.post("/v1/completions", json=SMALL).status_code == 200
    assert max_rss_mb() - before < 400, "the server's memory grew with the refused prompts"


def test_tokenizing_a_long_text_does_not_stall_other_clients(server):
    """A long text (within its byte bound) takes seconds to tokenize; small requests sent after it reached the
    server complete meanwhile. On the event loop, they would all wait for it."""
    text = words(600_000)
    body = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    sent, answered = threading.Event(), threading.Event()
    reply: list[bytes] = []

    def big() -> None:
        with socket.create_connection((server.server.config.host, server.server.http_port)) as s:
            s.sendall(head + body)
            sent.set()
            while chunk := s.recv(65536):
                reply.append(chunk)
        answered.set()

    thread = threading.Thread(target=big, daemon=True)
    thread.start()
    assert sent.wait(60)
    passed = 0
    with httpx.Client(base_url=server.http_url, timeout=120) as h:
        while not answered.is_set():
            r = h.post("/v1/completions", json=SMALL)
            assert r.status_code == 200
            passed += 0 if answered.is_set() else 1
    thread.join(60)
    status = b"".join(reply).split(b"\r\n", 1)[0]
    assert b" 400 " in status and b"max_model_len" in b"".join(reply)  # tokenized whole, then refused
    assert passed >= 3, f"only {passed} small requests completed while the long text was tokenized"


def test_connections_that_trickle_their_header_are_closed(server):
    socks = []
    for _ in range(300):
        s = socket.create_connection((server.server.config.host, server.server.http_port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        s.setblocking(False)
        socks.append(s)
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    open_ = set(socks)
    deadline = time.monotonic() + 60  # a bound on the test, not on the server: it closes them after 1 s
    try:
        while open_ and time.monotonic() < deadline:
            for s in list(open_):  # one more header byte each, never the end of the head
                try:
                    s.send(b"a")
                except OSError:
                    open_.discard(s)
            for key, _ in sel.select(timeout=0.2):
                try:
                    closed = key.fileobj.recv(4096) == b""
                except OSError:
                    closed = True
                if closed:
                    open_.discard(key.fileobj)
                    sel.unregister(key.fileobj)
        assert not open_, f"{len(open_)} of 300 trickling connections are still open"
        assert httpx.get(server.http_url + "/health", timeout=30).status_code == 200
    finally:
        for s in socks:
            s.close()
