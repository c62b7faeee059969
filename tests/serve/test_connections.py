"""`attn serve`'s connection limits (attn_cli/serve/http.py) over real sockets, with limits small
enough to be reached in a second: a request line and headers trickled slowly (408, closed), a
body trickled slowly (408), headers over --max-header-bytes (431), connections idle for
--idle-timeout (closed), and --max-connections: the idle and incomplete make room for a new
client, and only when every connection is being answered is one refused (503). Each waits on
a socket timeout, never on the server alone."""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest

from ..conftest import assert_clean_error, run_attn
from .client import Server

pytest.importorskip("uvicorn", reason="attn[serve] is not installed")

pytestmark = pytest.mark.slow

TIMEOUT = 1.0  # --header-timeout, --body-timeout and --idle-timeout alike
MAX_HEADER_BYTES = 4096
MAX_CONNECTIONS = 8


@pytest.fixture(scope="module")
def server(trained):
    model, _ = trained
    process = Server([sys.executable, "-m", "attn_cli", "serve", "-m", str(model), "--port", "0",
                      "--threads", "1", "--workers", "1", "--header-timeout", str(TIMEOUT),
                      "--body-timeout", str(TIMEOUT), "--idle-timeout", str(TIMEOUT),
                      "--max-header-bytes", str(MAX_HEADER_BYTES),
                      "--max-connections", str(MAX_CONNECTIONS)])
    process.wait_ready()
    yield process
    assert process.stop() == 0


def connect(server: Server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=5)


def trickle(sock: socket.socket, data: bytes, seconds: float = 0.1) -> None:
    """`data` a byte every `seconds` (each read is quick, the whole is slow), until the server
    answers or `data` runs out."""
    for byte in data:
        sock.sendall(bytes([byte]))
        sock.settimeout(seconds)
        try:
            if sock.recv(1, socket.MSG_PEEK):
                return
        except TimeoutError:
            pass


def head(path: str = "/health", method: str = "GET", *headers: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: x", *headers, "", ""]).encode()


def read_answer(sock: socket.socket, wait: float = 5.0):
    """(status, headers, JSON body) of the next answer on `sock`, or None at a close."""
    sock.settimeout(wait)
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        received += chunk
    top, _, rest = received.partition(b"\r\n\r\n")
    status_line, *lines = top.decode("latin-1").split("\r\n")
    headers = {key.strip().lower(): value.strip()
               for key, _, value in (line.partition(":") for line in lines)}
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of an answer"
        rest += chunk
    return int(status_line.split()[1]), headers, json.loads(rest) if length else None


def closed(sock: socket.socket, wait: float) -> bool:
    """Whether the server closes `sock` within `wait` seconds (what it still sends dropped)."""
    sock.settimeout(wait)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def translate(server: Server, sock: socket.socket | None = None) -> tuple[int, dict]:
    """A normal request, on `sock` or a connection of its own."""
    own = sock is None
    sock = sock or connect(server)
    try:
        body = json.dumps({"text": ["A dog runs."], "beam": 1}).encode()
        sock.sendall(head("/v1/translate", "POST", f"Content-Length: {len(body)}") + body)
        status, _, answer = read_answer(sock)
        return status, answer
    finally:
        if own:
            sock.close()


def test_a_slow_request_line_and_headers_get_408_and_are_closed(server):
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        trickle(sock, b"X-Slow: " + b"a" * 100)
        status, headers, answer = read_answer(sock)
        seconds = time.monotonic() - started
        assert status == 408 and headers["connection"] == "close"
        assert "--header-timeout" in answer["error"]
        assert TIMEOUT <= seconds < TIMEOUT + 1, seconds
        assert closed(sock, 2)
    assert translate(server)[0] == 200


def test_a_slow_body_gets_408_and_the_request_is_dropped(server):
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(head("/v1/translate", "POST", "Content-Length: 100"))
        trickle(sock, b'{"text": ["' + b"a" * 100)
        status, _, answer = read_answer(sock)
        assert status == 408 and "--body-timeout" in answer["error"]
        assert TIMEOUT <= time.monotonic() - started < TIMEOUT + 1
        assert closed(sock, 2)
    deadline = time.monotonic() + 5  # the application saw its client go (not a 500)
    while not any("POST /v1/translate 499" in line for line in server.log):
        assert time.monotonic() < deadline, server.log[-5:]
        time.sleep(0.05)
    assert not any("internal error" in line for line in server.log)
    assert translate(server)[0] == 200


@pytest.mark.parametrize("extra", [
    ["X-Big: " + "a" * (1 << 20)],  # one header of 1 MiB
    [f"X-{index}: {'a' * 40}" for index in range(200)],  # many small ones
    [],  # a request line of 8 KiB (below)
])
def test_headers_over_the_limit_get_431(server, extra):
    path = "/health" if extra else "/health?" + "a" * 8192
    with connect(server) as sock:
        try:
            sock.sendall(head(path, "GET", *extra))
        except OSError:  # the server closed before reading it all: its answer is still there
            pass
        status, headers, answer = read_answer(sock)
        assert status == 431 and "--max-header-bytes" in answer["error"]
        assert closed(sock, 2)
    with connect(server) as sock:  # just within the limit
        sock.sendall(head("/health", "GET", "X-Big: " + "a" * (MAX_HEADER_BYTES - 100)))
        assert read_answer(sock)[0] == 200


def test_idle_connections_are_closed_and_busy_ones_kept(server):
    started = time.monotonic()
    fresh, used = connect(server), connect(server)
    try:
        assert translate(server, used)[0] == 200
        time.sleep(TIMEOUT / 2)  # each request within the idle timeout: the connection stays
        assert translate(server, used)[0] == 200
        assert closed(fresh, TIMEOUT + 1)  # sent nothing for TIMEOUT
        assert TIMEOUT - 0.1 <= time.monotonic() - started < TIMEOUT + 1
        assert closed(used, TIMEOUT + 1)  # nothing since its second answer
    finally:
        fresh.close()
        used.close()


def test_the_cap_sheds_idle_and_incomplete_connections_first(server):
    """MAX_CONNECTIONS held by clients that sent nothing or half a request: each new client
    closes the oldest of them (503) and is answered; with every connection being answered, a
    new one that sends nothing gets 503 at once, and the busy ones are not cut short."""
    hostile, normal = [], []
    try:
        for index in range(MAX_CONNECTIONS):
            sock = connect(server)
            if index % 2:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            hostile.append(sock)
        time.sleep(0.05)
        for _ in range(MAX_CONNECTIONS):  # kept open: each new one must make room
            normal.append(connect(server))
            normal[-1].sendall(head("/health"))
            assert read_answer(normal[-1])[0] == 200
        for sock in hostile:
            status, headers, answer = read_answer(sock, 2)
            assert status == 503 and headers["retry-after"] == "1"
            assert "--max-connections" in answer["error"]
            assert closed(sock, 2)
    finally:
        for sock in hostile + normal:
            sock.close()
    # A burst past the cap, a normal request among it: the others make room.
    burst = [connect(server) for _ in range(2)]
    try:
        burst[1].sendall(head("/health"))
        burst += [connect(server) for _ in range(MAX_CONNECTIONS + 2)]
        assert read_answer(burst[1])[0] == 200
        assert closed(burst[0], 2)
    finally:
        for sock in burst:
            sock.close()
    # Every connection busy with a long search (8 lines, beam 32, all 200 steps: seconds).
    body = json.dumps({"text": ["A man is riding a bike."] * 8, "beam": 32, "max_len_b": 200,
                       "stop": "limit"}).encode()
    busy = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in busy:
            sock.sendall(head("/v1/translate", "POST", f"Content-Length: {len(body)}") + body)
        time.sleep(0.2)
        with connect(server) as sock:
            status, _, answer = read_answer(sock, 2)
            assert status == 503 and "--max-connections" in answer["error"]
        assert not any(closed(sock, 0.01) for sock in busy)
    finally:
        for sock in busy:
            sock.close()
    deadline = time.monotonic() + 5  # their searches called off: the server is free again
    while translate(server)[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.parametrize("option", ["--header-timeout", "--body-timeout", "--idle-timeout"])
def test_refuses_timeouts_that_are_not_positive(trained, option):
    model, _ = trained
    for seconds in ("0", "nan", "inf"):
        assert_clean_error(run_attn("serve", "-m", model, option, seconds), option)
