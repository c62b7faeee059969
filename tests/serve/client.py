"""An `attn serve` started in a subprocess, and HTTP clients for it: what the server tests talk
to it with, and what benchmarks/serve_load.py measures it with (the benchmark imports this; tests
never import benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path


class Server:
    """`attn serve` in a subprocess: its address once it listens, its stderr lines kept."""

    def __init__(self, command: list[str], env: dict | None = None):
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        env=env)
        self.log: list[str] = []
        self._listening = threading.Event()
        self.host, self.port = None, None
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        for raw in self.process.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.log.append(line)
            found = re.search(r"listening on http://\[?([^\]\s]+?)\]?:(\d+)", line)
            if found:
                self.host, self.port = found.group(1), int(found.group(2))
                self._listening.set()
        self._listening.set()

    def wait_listening(self, timeout: float = 60.0) -> None:
        if not self._listening.wait(timeout) or self.port is None:
            raise RuntimeError("attn serve did not start:\n" + "\n".join(self.log[-20:]))

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until GET /health says 200."""
        self.wait_listening(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("attn serve stopped:\n" + "\n".join(self.log[-20:]))
            status, _ = asyncio.run(request(self.host, self.port, "GET", "/health"))
            if status == 200:
                return
            time.sleep(0.05)
        raise RuntimeError("attn serve was not ready in time")

    def resident_mib(self) -> float:
        """The server's resident memory (Linux /proc)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@contextlib.contextmanager
def running_server(command: list[str], env: dict | None = None, ready: bool = True):
    server = Server(command, env)
    try:
        server.wait_ready() if ready else server.wait_listening()
        yield server
    finally:
        server.stop()


class Connection:
    """One keep-alive HTTP/1.1 connection (asyncio streams: the load generator must cost the
    machine little next to the server it measures)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def send(self, method: str, path: str, body: bytes = b"",
                   headers: dict | None = None) -> tuple[int, dict, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        headers = {"Content-Type": "application/json", **(headers or {})}
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 f"Content-Length: {len(body)}",
                 *(f"{key}: {value}" for key, value in headers.items())]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        answer_headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            answer_headers[key.strip().lower()] = value.strip()
        payload = await self.reader.readexactly(int(answer_headers.get("content-length", 0)))
        if answer_headers.get("connection", "").lower() == "close":
            await self.close()
        return status, answer_headers, payload

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
            self.reader = self.writer = None


async def request(host: str, port: int, method: str, path: str, payload=None,
                  headers: dict | None = None) -> tuple[int, dict | list | None]:
    """One request on its own connection: (status, the JSON answer)."""
    connection = Connection(host, port)
    try:
        body = b"" if payload is None else json.dumps(payload).encode()
        status, _, answer = await connection.send(method, path, body, headers)
    except OSError:
        return 0, None
    finally:
        await connection.close()
    return status, json.loads(answer) if answer else None


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]] | None = None,
              boundary: str = "attn-form-boundary-7MA4YWxkTrZu0gW") -> tuple[str, bytes]:
    """(Content-Type, body) of a multipart/form-data form, as browsers and `curl -F` send one:
    text fields, then files (name → (filename, bytes))."""
    parts = [b'Content-Disposition: form-data; name="%s"\r\n\r\n%s'
             % (name.encode(), value.encode()) for name, value in fields.items()]
    parts += [b'Content-Disposition: form-data; name="%s"; filename="%s"\r\nContent-Type: '
              b"text/plain\r\n\r\n%s" % (name.encode(), filename.encode(), data)
              for name, (filename, data) in (files or {}).items()]
    delimiter = b"--" + boundary.encode()
    body = b"".join(delimiter + b"\r\n" + part + b"\r\n" for part in parts) + delimiter + b"--\r\n"
    return f"multipart/form-data; boundary={boundary}", body


async def run_clients(host: str, port: int, lines: list[str], clients: int,
                      fields: dict | None = None) -> dict:
    """`clients` connections sending `lines` one request per line, each the next line as soon
    as its answer is back. Returns the outputs (in line order), latencies, statuses, wall time."""
    return await _closed_loop(
        host, port, "/v1/translate", len(lines), clients,
        lambda index: {"text": [lines[index]], **(fields or {})},
        lambda answer: answer["translations"][0])


async def run_libre_clients(host: str, port: int, texts: list[str], clients: int,
                            source: str = "en", target: str = "de") -> dict:
    """As `run_clients`, through LibreTranslate's API: each text one `POST /translate` of
    {q, source, target}, its answer's `translatedText` kept. What benchmarks/serve_load.py sends
    `attn serve` and LibreTranslate (or a stand-in with its API) alike."""
    return await _closed_loop(
        host, port, "/translate", len(texts), clients,
        lambda index: {"q": texts[index], "source": source, "target": target,
                       "format": "text"},
        lambda answer: answer["translatedText"])


async def _closed_loop(host: str, port: int, path: str, count: int, clients: int,
                       payload, output) -> dict:
    """`clients` keep-alive connections POSTing `payload(i)` to `path` for i in 0..count-1,
    each the next as soon as its answer is back; `output(answer)` of each 200 kept."""
    outputs: list = [None] * count
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    following = iter(range(count))

    async def client() -> None:
        connection = Connection(host, port)
        try:
            for index in following:
                body = json.dumps(payload(index)).encode()
                started = time.perf_counter()
                status, _, answer = await connection.send("POST", path, body)
                latencies.append(time.perf_counter() - started)
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    outputs[index] = output(json.loads(answer))
        finally:
            await connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return {"outputs": outputs, "latencies": latencies, "statuses": statuses,
            "seconds": time.perf_counter() - started}


def call(server: Server, method: str, path: str, payload=None, headers=None):
    return asyncio.run(request(server.host, server.port, method, path, payload, headers))


def raw_call(server: Server, method: str, path: str, body: bytes, headers=None):
    """(status, headers, JSON answer) of a request with exactly these body bytes."""
    async def send():
        connection = Connection(server.host, server.port)
        try:
            return await connection.send(method, path, body, headers)
        finally:
            await connection.close()
    status, answer_headers, answer = asyncio.run(send())
    return status, answer_headers, json.loads(answer) if answer else None


def wait_for(condition, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)
