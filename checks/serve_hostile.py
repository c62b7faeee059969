"""Hostile clients against `attn serve` (issue 40): does every abuse get a 4xx/5xx of the right
kind, promptly, while normal requests keep being answered right?

It starts `attn serve -m MODEL --langs en-de` on a free port (without -m it first trains a tiny
model on the bundled Multi30k, about a minute on 2 cores, whose translations are mostly empty:
give a real model for the normal answers' check to mean much), reads `attn decode`'s output for 20
test-set lines (what normal requests must be answered), then runs each case below, one after
another, while a normal client sends one of those lines every 0.2 s throughout:

- search settings: max_len_a 1000 and 1e20, every setting at its maximum, temperature 5e-324 and
  1e308 with sampling, alpha 1e308 with scores; JSON nested 100,000 deep, a 5,000-digit integer,
  LibreTranslate's alternatives Infinity and 1e400;
- load: 30 clients queueing 10,000 sampled lines and hanging up (then how long until /health
  counts no line, and a normal request); a client hanging up in the middle of a search (then
  the server's CPU seconds over the next second: idle is ~0); 4 bytes asking for beam 32 to
  4,096 positions (minutes of search: refused at once by the default budget);
- connections: 1,100 connections that send a request line and a header, then nothing (and a
  normal request meanwhile); 1 MiB and 16 MiB headers; a request line and headers, and a body,
  trickled a byte every 0.5 s; a connection that sends nothing, and one idle after a request.

It prints a table (case, expected, status, message, seconds) and the normal client's record.
With `--soak SECONDS` all the hostile cases then run in loops alongside 4 normal clients for
`--warm-up` (60) seconds and that long more, and it reports the server's resident memory at the
end of the warm-up and at the end (each the median of its last 30 s; target: within 50 MB),
whether every normal answer was `attn decode`'s, and the server's CPU seconds and /health in the
second after the clients stop.

    python -m checks.serve_hostile                      # trains a tiny model first
    python -m checks.serve_hostile -m model.st --soak 300
    python -m checks.serve_hostile -m model.st -- --header-timeout 2 --body-timeout 2

Options after `--` go to `attn serve`. The report is on stdout; exit status 1 if a case got an
answer of the wrong kind, a normal request was answered wrong, or the soak's memory grew past
its target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import attn_command, read_bundled
from tests.serve.client import Server

MEMORY_TARGET_MIB = 50.0
IDLE_CPU_SECONDS = 0.1  # the server's CPU time, in the second after its clients left: idle
TRICKLE_SECONDS = 0.5
CASE_LIMIT = 60.0  # seconds any one case may take before it is reported as hanging


# ------------------------------------------------------------------------------------- clients


async def exchange(server: Server, data: bytes, trickle: bytes = b"",
                   limit: float = CASE_LIMIT) -> tuple[object, str]:
    """Send `data`, then `trickle` a byte every TRICKLE_SECONDS until the server answers; return
    (status or 'closed' / 'open', the error message or the answer's start)."""
    reader, writer = await asyncio.open_connection(server.host, server.port, limit=1 << 24)
    try:
        async def send() -> None:
            try:
                writer.write(data)
                await writer.drain()
                for byte in trickle:
                    await asyncio.sleep(TRICKLE_SECONDS)
                    writer.write(bytes([byte]))
                    await writer.drain()
            except OSError:
                pass
        sending = asyncio.ensure_future(send())
        try:
            return await asyncio.wait_for(read_answer(reader), limit)
        except asyncio.TimeoutError:
            return "open", f"no answer in {limit:g} s"
        except OSError as error:
            return "closed", f"reset ({type(error).__name__})"
        finally:
            sending.cancel()
    finally:
        writer.close()


async def read_answer(reader) -> tuple[object, str]:
    status_line = await reader.readline()
    if not status_line:
        return "closed", "closed without an answer"
    status = int(status_line.split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        if key.strip().lower() == "content-length":
            length = int(value)
    body = await reader.readexactly(length)
    try:
        answer = json.loads(body)
        message = answer.get("error") if isinstance(answer, dict) else None
        return status, message or json.dumps(answer, ensure_ascii=False)
    except ValueError:
        return status, body.decode("utf-8", "replace")


def http_request(method: str, path: str, body: bytes = b"", *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: attn", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def post(path: str, fields) -> bytes:
    body = fields if isinstance(fields, bytes) else json.dumps(fields).encode()
    return http_request("POST", path, body)


async def closes_after(server: Server, data: bytes) -> tuple[object, str]:
    """A connection that sends `data` (a request, or nothing), reads its answer, then waits:
    'closed' once the server closes it."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        if data:
            writer.write(data)
            await read_answer(reader)
        started = time.monotonic()
        left = await asyncio.wait_for(reader.read(), CASE_LIMIT)
        return "closed", f"after {time.monotonic() - started:.1f} s idle" + (
            f" ({len(left)} bytes more)" if left else "")
    except asyncio.TimeoutError:
        return "open", f"still open after {CASE_LIMIT:g} s"
    finally:
        writer.close()


class Normal:
    """One normal client: a line every `every` seconds, its answer checked against decode's:
    right, wrong (a 200 with another text), or refused (another status, counted by status: a
    503 while hostile clients fill the queue is the server's rule, not a wrong answer)."""

    def __init__(self, server: Server, lines: list[str], expected: list[str]):
        self.server, self.lines, self.expected = server, lines, expected
        self.right = self.wrong = 0
        self.refused: dict[str, int] = {}
        self.failures: list[str] = []
        self.slowest = 0.0
        self.going = asyncio.Event()  # cleared: `run` pauses (while the server's CPU is read)
        self.going.set()

    async def one(self, index: int) -> None:
        started = time.monotonic()
        try:
            status, message = await exchange(
                self.server, post("/v1/translate", {"text": [self.lines[index]]}), limit=30)
        except OSError as error:
            status, message = "refused", repr(error)
        self.slowest = max(self.slowest, time.monotonic() - started)
        if status == 200 and json.loads(message)["translations"] == [self.expected[index]]:
            self.right += 1
        elif status == 200:
            self.wrong += 1
            self.failures.append(f"{status} {message[:100]}")
        else:
            self.refused[str(status)] = self.refused.get(str(status), 0) + 1
            self.failures.append(f"{time.strftime('%H:%M:%S')} {status} {message[:100]}")
        return status

    async def run(self, stop: asyncio.Event, every: float = 0.2) -> None:
        index = 0
        while not stop.is_set():
            await self.going.wait()
            await self.one(index % len(self.lines))
            index += 1
            if every:
                await asyncio.sleep(every)

    def report(self) -> str:
        return (f"{self.right} right, {self.wrong} wrong, refused {self.refused or 'none'}, "
                f"slowest {self.slowest:.2f} s"
                + (f"; first failures: {self.failures[:3]}" if self.failures else ""))


# --------------------------------------------------------------------------------------- cases


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def timed(answer):
    """(status, message) of an exchange, with how long it took."""
    started = time.monotonic()
    status, message = await answer
    return status, f"in {time.monotonic() - started:.2f} s: {str(message)[:200]}"


async def hang_up_clients(server: Server, lines: list[str], normal: Normal):
    """30 clients send 333 sampled lines each (9,990: the default queue holds 10,000), hang
    up; then the time until /health counts none waiting, and a normal request."""
    body = post("/v1/translate", {"text": (lines * 17)[:333], "sample": True})
    writers = []
    for _ in range(30):
        _, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(body)
        writers.append(writer)
    await asyncio.sleep(0.5)
    for writer in writers:
        writer.close()
    started = time.monotonic()
    while True:
        status, message = await exchange(server, http_request("GET", "/health"))
        health = json.loads(message) if status == 200 else {}
        if status == 200 and not health.get("queued_lines") and not health.get(
                "searching_lines"):
            break
        if time.monotonic() - started > CASE_LIMIT:
            return status, f"/health still counts lines after {CASE_LIMIT:g} s: {message}"
        await asyncio.sleep(0.05)
    emptied = time.monotonic() - started
    right = normal.right
    status = await normal.one(0)
    return (status, f"queue empty {emptied:.2f} s after they left; a normal request then "
            f"answered {'right' if normal.right > right else 'wrong'}")


async def gone_mid_search(server: Server, lines: list[str], normal: Normal):
    """A slow search (8 lines, beam 32, all 200 steps) whose client hangs up after 0.5 s;
    then the server's CPU seconds over the next second (the normal client paused)."""
    normal.going.clear()
    try:
        return await _gone_mid_search(server, lines)
    finally:
        normal.going.set()


async def _gone_mid_search(server: Server, lines: list[str]):
    _, writer = await asyncio.open_connection(server.host, server.port)
    # within the default budget (--max-request-seconds: one line of 200 positions at beam 32,
    # ~1 s of a worker with the demo model), so that it is searched when the client leaves
    writer.write(post("/v1/translate", {"text": lines[:1], "beam": 32, "max_len_b": 200,
                                        "stop": "limit"}))
    await asyncio.sleep(0.5)
    writer.close()
    await asyncio.sleep(0.1)
    before = cpu_seconds(server.process.pid)
    await asyncio.sleep(1.0)
    spent = cpu_seconds(server.process.pid) - before
    return ("idle" if spent < IDLE_CPU_SECONDS else "busy",
            f"{spent:.2f} CPU s in the second after 0.1 s (the log: "
            + ("499" if any(" 499 1 line" in line for line in server.log) else "no 499")
            + ")")


async def idle_crowd(server: Server, normal: Normal, count: int = 1100):
    """`count` connections that send a request line and a header, then nothing; meanwhile a
    normal request (on a connection of its own)."""
    writers = []
    try:
        for _ in range(count):
            _, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(b"POST /v1/translate HTTP/1.1\r\nHost: attn\r\n")
            writers.append(writer)
        await asyncio.sleep(0.2)
        right, started = normal.right, time.monotonic()
        status = await normal.one(1)
        return (status, f"a normal request among {count} such connections, answered "
                f"{'right' if normal.right > right else 'wrong'} in "
                f"{time.monotonic() - started:.2f} s")
    finally:
        for writer in writers:
            writer.close()


def cases(server: Server, lines: list[str], normal: Normal) -> list[tuple[str, str, object]]:
    """(name, the answer expected, a coroutine function giving (status, message))."""
    translate = "/v1/translate"
    line = lines[0]
    longest = " ".join(["word"] * 180)[:900]
    return [
        ("max_len_a 1000", "422", lambda: exchange(
            server, post(translate, {"text": [line], "max_len_a": 1000}))),
        ("max_len_a 1e20", "422", lambda: exchange(
            server, post(translate, {"text": [line], "max_len_a": 1e20}))),
        ("every setting at its maximum", "422 or 504", lambda: exchange(server, post(
            translate, {"text": [longest] * 1000, "beam": 32, "nbest": 32, "max_len_a": 10,
                        "max_len_b": 4096, "stop": "limit", "scores": True}))),
        ("temperature 5e-324, sampling", "422", lambda: exchange(
            server, post(translate, {"text": [line], "sample": True,
                                     "temperature": 5e-324}))),
        ("temperature 1e308, sampling", "422", lambda: exchange(
            server, post(translate, {"text": [line], "sample": True, "temperature": 1e308}))),
        ("alpha 1e308 with scores", "422", lambda: exchange(
            server, post(translate, {"text": [line], "alpha": 1e308, "scores": True}))),
        ("JSON nested 100,000 deep", "400", lambda: exchange(
            server, post(translate, b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"))),
        ("a 5,000-digit integer", "400 or 422", lambda: exchange(
            server, post(translate, b'{"text": ["a"], "beam": ' + b"9" * 5000 + b"}"))),
        ("alternatives Infinity", "400 or 422", lambda: exchange(server, post(
            "/translate", b'{"q": "a", "source": "en", "target": "de", '
            b'"alternatives": Infinity}'))),
        ("alternatives 1e400", "400 or 422", lambda: exchange(server, post(
            "/translate", b'{"q": "a", "source": "en", "target": "de", '
            b'"alternatives": 1e400}'))),
        ("30 clients queue 10,000 sampled lines, hang up", "200",
         lambda: hang_up_clients(server, lines, normal)),
        ("a client hangs up mid-search", "idle",
         lambda: gone_mid_search(server, lines, normal)),
        ("4 bytes at beam 32 to 4,096 positions (minutes of search)", "422", lambda: timed(
            exchange(server, post(translate, {"text": ["Hi."], "beam": 32, "max_len_b": 4096,
                                              "stop": "limit"})))),
        ("1,100 idle connections + a normal request", "200",
         lambda: idle_crowd(server, normal)),
        ("a 1 MiB header", "431", lambda: exchange(server, http_request(
            "GET", "/health", b"", "X-Big: " + "a" * (1 << 20)))),
        ("a 16 MiB header", "431", lambda: exchange(server, http_request(
            "GET", "/health", b"", "X-Big: " + "a" * (16 << 20)))),
        ("headers trickled, a byte / 0.5 s", "408", lambda: exchange(
            server, b"GET /health HTTP/1.1\r\nHost: attn\r\n", b"X-Slow: " + b"a" * 200)),
        ("a body trickled, a byte / 0.5 s", "408", lambda: exchange(
            server, b"POST /v1/translate HTTP/1.1\r\nHost: attn\r\nContent-Length: 200\r\n"
            b"\r\n", b"a" * 200)),
        ("a connection that sends nothing", "closed", lambda: closes_after(server, b"")),
        ("a keep-alive connection left idle", "closed",
         lambda: closes_after(server, http_request("GET", "/health"))),
    ]


async def run_table(server: Server, lines: list[str], normal: Normal) -> list[tuple]:
    rows = []
    stop = asyncio.Event()
    background = asyncio.ensure_future(normal.run(stop))
    for name, expected, case in cases(server, lines, normal):
        started = time.monotonic()
        try:
            status, message = await case()
        except OSError as error:
            status, message = "refused", repr(error)
        seconds = time.monotonic() - started
        good = str(status) in expected.split(" or ")
        rows.append((name, expected, status, message, seconds, good))
        print(f"{'' if good else '!! '}{name:46} {expected:>10} {status!s:>7}  {seconds:7.2f} s  "
              f"{' '.join(str(message).split())[:110]}", flush=True)
    stop.set()
    await background
    return rows


# ---------------------------------------------------------------------------------------- soak


async def soak(server: Server, lines: list[str], expected: list[str], warm_up: float,
               seconds: float) -> dict:
    """Every hostile case in loops alongside 4 normal clients: `warm_up` seconds, then
    `seconds` more; the server's resident memory every 5 s, and its CPU seconds and queue in
    the second after all clients stop."""
    stop = asyncio.Event()
    normals = [Normal(server, lines, expected) for _ in range(4)]
    hostile = Normal(server, lines, expected)  # the cases' own normal requests, not counted
    counts: dict[str, int] = {}

    async def loop(name, case) -> None:
        while not stop.is_set():
            try:
                await case()
            except OSError:
                await asyncio.sleep(0.1)
            counts[name] = counts.get(name, 0) + 1

    tasks = [asyncio.ensure_future(normal.run(stop, every=0)) for normal in normals]
    tasks += [asyncio.ensure_future(loop(name, case))
              for name, _, case in cases(server, lines, hostile)]
    started, samples = time.monotonic(), []
    while (elapsed := time.monotonic() - started) < warm_up + seconds:
        await asyncio.sleep(5.0)
        samples.append((elapsed + 5, server.resident_mib()))
        if len(samples) % 6 == 0:
            print(f"soak: {samples[-1][0]:5.0f} s, resident {samples[-1][1]:.1f} MiB, normal "
                  f"{sum(n.right for n in normals)} right, {sum(n.wrong for n in normals)} "
                  "wrong", flush=True)
    stop.set()
    await asyncio.wait(tasks, timeout=CASE_LIMIT + 10)
    left = time.monotonic()
    before = cpu_seconds(server.process.pid)
    await asyncio.sleep(1.0)
    idle_cpu = cpu_seconds(server.process.pid) - before
    status, health = await exchange(server, http_request("GET", "/health"))

    def median_before(end: float) -> float:  # of the last 30 s' samples before `end`
        return statistics.median([rss for at, rss in samples if end - 30 < at <= end + 5]
                                 or [samples[-1][1]])

    return {"warm": median_before(warm_up), "end": median_before(samples[-1][0]),
            "peak": max(rss for _, rss in samples), "after": server.resident_mib(),
            "idle_cpu": idle_cpu, "stopped_in": time.monotonic() - left - 1.0,
            "health": health, "normals": normals, "counts": counts}


# ---------------------------------------------------------------------------------------- main


def train_tiny(directory: Path) -> Path:
    """A tiny model on 300 bundled Multi30k pairs, as the tests train theirs."""
    for lang in ("en", "de"):
        lines = read_bundled(f"train.{lang}.gz").splitlines()[:300]
        (directory / f"train.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    attn = attn_command()
    for command in (["vocab", "train.en", "train.de", "-o", "spm.model", "--size", "400"],
                    ["binarize", "--vocab", "spm.model", "train.en", "train.de", "-o",
                     "train.st"],
                    ["train", "train.st", "-o", "run", "--preset", "tiny", "--max-steps", "40",
                     "--device", "cpu"]):
        subprocess.run([*attn, *command], cwd=directory, check=True, capture_output=True)
    return directory / "run" / "checkpoint-40.st"


def allow_open_files(count: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count if hard == resource.RLIM_INFINITY else min(count, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", type=Path, help="a model file [default: train a "
                        "tiny one]")
    parser.add_argument("--soak", type=float, default=0.0, metavar="SECONDS",
                        help="then hostile and normal clients together for this long")
    parser.add_argument("--warm-up", type=float, default=60.0, metavar="SECONDS",
                        help="of the soak's clients before its memory is read (default 60)")
    parser.add_argument("--log", type=Path, help="write the server's stderr here at the end")
    parser.add_argument("serve_options", nargs="*", help="after --: options for attn serve")
    args = parser.parse_args(argv)
    allow_open_files(4096)
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or train_tiny(Path(scratch))
        lines = read_bundled("test_2016_flickr.en.gz").splitlines()[:20]
        decoded = subprocess.run([*attn_command(), "decode", "-m", str(model)],
                                 input="\n".join(lines) + "\n", capture_output=True,
                                 text=True, check=True)
        expected = decoded.stdout.split("\n")[:-1]
        server = Server([*attn_command(), "serve", "-m", str(model), "--port", "0", "--langs",
                         "en-de", *args.serve_options])
        try:
            server.wait_ready()
            return asyncio.run(report(server, lines, expected, args.warm_up, args.soak))
        finally:
            status = server.stop()
            time.sleep(0.2)  # the log reader's last lines
            if args.log:
                args.log.write_text("\n".join(server.log) + "\n", encoding="utf-8")
            print(f"server: exit status {status}; "
                  f"{sum('Traceback' in line for line in server.log)} tracebacks in its log")


async def report(server: Server, lines: list[str], expected: list[str], warm_up: float,
                 soak_seconds: float):
    normal = Normal(server, lines, expected)
    print(f"{'case':46} {'expected':>10} {'status':>7}  {'seconds':>9}  message")
    rows = await run_table(server, lines, normal)
    print(f"normal requests throughout (a line every 0.2 s): {normal.report()}")
    failed = not all(row[-1] for row in rows) or normal.wrong > 0
    if soak_seconds:
        result = await soak(server, lines, expected, warm_up, soak_seconds)
        normals = result["normals"]
        right, wrong = sum(n.right for n in normals), sum(n.wrong for n in normals)
        refused: dict[str, int] = {}
        for normal_client in normals:
            for status, count in normal_client.refused.items():
                refused[status] = refused.get(status, 0) + count
        grown = result["end"] - result["warm"]
        print(f"soak: {warm_up:g} s of warm-up, then {soak_seconds:g} s; resident (median of "
              f"each one's last 30 s) {result['warm']:.1f} → {result['end']:.1f} MiB "
              f"({grown:+.1f}; target: within {MEMORY_TARGET_MIB:g} MB), peak "
              f"{result['peak']:.1f}, {result['after']:.1f} once the clients stopped")
        print(f"soak: normal requests {right} right, {wrong} wrong, refused "
              f"{refused or 'none'} (slowest {max(n.slowest for n in normals):.2f} s)")
        print(f"soak: hostile rounds {sum(result['counts'].values())}: {result['counts']}")
        print(f"soak: the second after the clients stopped: {result['idle_cpu']:.2f} CPU s; "
              f"/health then: {result['health']}")
        if wrong or refused:
            print("soak: first wrong or refused answers: "
                  f"{[failure for n in normals for failure in n.failures][:8]}")
        failed = failed or wrong > 0 or grown > MEMORY_TARGET_MIB
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
