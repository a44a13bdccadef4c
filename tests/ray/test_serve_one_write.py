"""actors.serve.one_write against a real uvicorn server (a subprocess on 127.0.0.1, each
of its HTTP implementations) and a raw socket: the app starts its answer, waits, then
sends the body. uvicorn alone writes the headers at once; with the replicas' change
nothing leaves before the body, and a server killed in between leaves the client an
empty connection (which HAProxy retries), never a cut answer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from tests.ray.helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAUSE_S = 1.0

SERVER = """
import asyncio, sys
import uvicorn
from actors.serve.one_write import answer_in_one_write

port, http, one_write = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
if one_write:
    assert answer_in_one_write()

async def app(scope, receive, send):
    stream = scope["path"] == "/stream"
    headers = [(b"content-type", b"text/plain")]
    if not stream:
        headers.append((b"content-length", b"5"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    print("started", flush=True)
    await asyncio.sleep(%r)
    await send({"type": "http.response.body", "body": b"hello", "more_body": stream})
    if stream:
        await asyncio.sleep(%r)
        await send({"type": "http.response.body", "body": b"world"})

uvicorn.run(app, host="127.0.0.1", port=port, http=http, log_level="warning")
""" % (PAUSE_S, PAUSE_S)


def _server(http: str, one_write: bool):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), http, str(int(one_write))],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("uvicorn did not listen")


def _ask(port: int, path: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


def _first_read(sock: socket.socket, within: float) -> bytes | None:
    """What one read returns within ``within`` seconds (None: nothing came)."""
    sock.settimeout(within)
    try:
        return sock.recv(65536)
    except socket.timeout:
        return None


@pytest.fixture(params=["h11", "httptools"])
def http(request):
    pytest.importorskip(request.param)
    return request.param


@contextmanager
def _serving(http: str, one_write: bool) -> Iterator[tuple[subprocess.Popen, int]]:
    proc, port = _server(http, one_write)
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_uvicorn_alone_writes_the_headers_before_the_body(http):
    with _serving(http, one_write=False) as (proc, port):
        sock = _ask(port, "/")
        first = _first_read(sock, PAUSE_S / 2)
        assert first is not None and first.startswith(b"HTTP/1.1 200") and first.endswith(b"\r\n\r\n")
        sock.close()


def test_an_answer_leaves_whole(http):
    with _serving(http, one_write=True) as (proc, port):
        sock = _ask(port, "/")
        assert _first_read(sock, PAUSE_S / 2) is None  # the headers wait for the body
        whole = _first_read(sock, 10)
        assert whole.startswith(b"HTTP/1.1 200") and whole.endswith(b"\r\n\r\nhello"), whole
        sock.close()
        # a stream: its headers go out with the first chunk, later chunks as they come
        sock = _ask(port, "/stream")
        assert _first_read(sock, PAUSE_S / 2) is None
        first = _first_read(sock, 10)
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"5\r\nhello\r\n"), first
        rest = b""
        while not rest.endswith(b"0\r\n\r\n"):
            rest += _first_read(sock, 10)
        assert rest == b"5\r\nworld\r\n0\r\n\r\n"
        sock.close()


def test_a_server_killed_before_the_body_leaves_nothing_behind(http):
    with _serving(http, one_write=True) as (proc, port):
        sock = _ask(port, "/")
        assert proc.stdout.readline().strip() == "started"  # headers given to uvicorn
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        got = b""
        sock.settimeout(10)
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            got += data
        assert got == b""  # an empty response: HAProxy's retry-on empty-response resends it
        sock.close()
