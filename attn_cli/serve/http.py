"""The connections of `attn serve`: time and size limits on what a client sends, and a cap on
how many connections are open, in front of uvicorn's HTTP protocol.

uvicorn bounds neither the time a request's line, headers or body take to arrive nor the size
of its headers, and answers a full connection table with 503 for everyone, so that clients who
open connections and send nothing more keep out all others. A `Guard` stands between each
connection and uvicorn's protocol: it parses the same bytes with its own httptools parser (the
one uvicorn uses) to know what the client is sending, passes them on unchanged, and

- answers 408 and closes when a request's line and headers take over `header_timeout` seconds
  from their first byte, or its body over `body_timeout` from the end of the headers (time in
  all, not between reads: a client that trickles a byte a second is cut off as surely);
- answers 431 and closes when the line and headers are over `max_header_bytes`;
- closes a connection that sends nothing for `idle_timeout`, new or between requests;
- keeps at most `max_connections` open: one more makes room by closing the one that has been
  idle, or without a complete request, the longest (503 with Retry-After, but for a connection
  idle after an answer, which is closed as keep-alive connections are). New connections are
  read before any is chosen, so a burst of them may pass the cap for a moment (up to twice it,
  beyond which they are refused at once), and those being answered are not cut short: they
  leave when answered.

Its answers are JSON errors like the application's, sent with `Connection: close`; then the
guard stops writing and reads (and drops) what the client still sends for up to a second before
closing, so that the client reads the answer rather than a reset. It relies only on what
uvicorn's `Config(http=...)` promises a protocol class (its constructor's keywords), on the
asyncio Protocol contract between a transport and uvicorn's protocol, on httptools' public
parser, and on the ASGI scope's `client`, through which `watch`ed applications say when a
request has been answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

IDLE, HEAD, BODY = "idle", "head", "body"  # what a connection is receiving
LINGER = 1.0  # seconds a refused connection is read (and dropped) before it is closed
REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large",
           503: "Service Unavailable"}


class Refused(Exception):
    """Raised in a parser callback to stop the parsing of a connection just refused."""


class Connections:
    """The open connections of one server: `protocol` is what uvicorn makes each one's protocol
    with, `watch(app)` the application that tells them when a request has been answered."""

    def __init__(self, options, log):
        self.options, self.log = options, log  # ServeOptions: the limits; log: one stderr line
        self.open: set[Guard] = set()
        self.sheddable: dict[Guard, None] = {}  # idle or incomplete, in the order they became so
        self.by_client: dict[tuple, Guard] = {}  # (host, port) → its connection
        # Connections accepted too lately for the event loop to have read what they sent: in a
        # burst of accepts, a client whose request waits unread would look idle. They count, but
        # may be closed only once the loop has turned twice (`settle`): till then a burst may
        # pass the cap (up to twice it), and what it brought is read before any is chosen.
        self.unread: set[Guard] = set()
        self.settling: set[Guard] = set()
        self.protocol = functools.partial(Guard, self)

    def admit(self, guard: Guard) -> bool:
        """Count a new connection in (False past twice the cap), and `trim`."""
        if len(self.open) >= 2 * self.options.max_connections:
            return False
        self.open.add(guard)
        if guard.client is not None:
            self.by_client[guard.client] = guard
        if not self.unread and not self.settling:
            asyncio.get_running_loop().call_later(0, self.settle)
        self.unread.add(guard)
        self.trim()
        return True

    def trim(self) -> None:
        """While more than the cap are open, close the one idle, or sending an incomplete
        request, the longest. (Those being answered are not cut short: they leave when
        answered, `Guard.answered`.)"""
        while len(self.open) > self.options.max_connections and self.sheddable:
            next(iter(self.sheddable)).shed()

    def settle(self) -> None:
        """A turn of the loop (a 0-second timer runs after the turn's reads): the connections
        accepted before the last turn have been read, and may be closed."""
        settled, self.settling, self.unread = self.settling, self.unread, set()
        for guard in settled:
            self.mark(guard, guard.waiting_for is not None)
        self.trim()
        if self.settling:
            asyncio.get_running_loop().call_later(0, self.settle)

    def release(self, guard: Guard) -> None:
        self.open.discard(guard)
        self.sheddable.pop(guard, None)
        self.unread.discard(guard)
        self.settling.discard(guard)
        if self.by_client.get(guard.client) is guard:
            del self.by_client[guard.client]

    def mark(self, guard: Guard, sheddable: bool) -> None:
        """Whether `guard` may make room for another (idle or incomplete), counted from now."""
        self.sheddable.pop(guard, None)
        if sheddable and guard in self.open and guard not in self.unread and (
                guard not in self.settling):
            self.sheddable[guard] = None

    def watch(self, app):
        """`app`, telling each request's connection when it has been answered."""
        async def watched(scope, receive, send):
            guard = self.by_client.get(scope.get("client")) if scope["type"] == "http" else None
            try:
                await app(scope, receive, send)
            finally:
                if guard is not None:
                    guard.answered()
        return watched


class Guard(asyncio.Protocol):
    """One connection: uvicorn's protocol (`inner`) behind the limits (see the module's doc)."""

    def __init__(self, connections: Connections, **uvicorn_arguments):
        self.connections, self.options = connections, connections.options
        self.inner = HttpToolsProtocol(**uvicorn_arguments)
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # as uvicorn sets its own (httptools ≥ 0.6.3)
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport = None
        self.client: tuple | None = None
        self.attached = False  # `inner` knows of the connection and is given its bytes
        self.closing = False  # refused or closed: what arrives now is dropped
        self.tracking = True  # the parser follows the requests (not after an upgrade or error)
        self.phase = IDLE  # what is arriving: nothing, a request's line and headers, its body
        self.unanswered = 0  # requests whose headers are in and whose answer is not out
        self.began = 0  # requests begun, to tell whether one began in the bytes just parsed
        self.head_bytes = 0  # the request line and headers so far, as parsed
        self.head_chunks = 0  # bytes received in whole while the head was incomplete
        self.waiting_for: str | None = None  # which limit the timer stands for
        self.timer: asyncio.TimerHandle | None = None
        self.linger: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ the transport's calls

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        if not self.connections.admit(self):
            count = self.options.max_connections
            self.refuse(503, f"this server has twice its --max-connections ({count}) open: "
                        "try again shortly", retry=True)
            return
        self.attached = True
        self.inner.connection_made(transport)
        self.update()

    def data_received(self, data: bytes) -> None:
        if self.closing or not self.attached:
            return
        if self.tracking:
            began = self.began
            try:
                self.parser.feed_data(data)
            except (httptools.HttpParserUpgrade, httptools.HttpParserError):
                if self.closing:  # a callback refused the request
                    return
                self.tracking = False  # uvicorn answers a malformed request with 400 and closes
            if self.phase == HEAD and self.began == began:  # all of `data` was head
                self.head_chunks += len(data)
                if self.head_chunks > self.options.max_header_bytes:
                    self.refuse_large_head()
                    return
        self.inner.data_received(data)

    def eof_received(self):
        if self.closing or not self.attached:
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self.closing = True
        self.cancel_timers()
        if self.linger is not None:
            self.linger.cancel()
        self.connections.release(self)
        if self.attached:
            self.attached = False
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.attached:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.attached:
            self.inner.resume_writing()

    # ------------------------------------------------------------ the parser's calls (httptools)

    def on_message_begin(self) -> None:
        self.began += 1
        self.phase, self.head_bytes, self.head_chunks = HEAD, 0, 0
        self.update(restart=True)

    def on_url(self, url: bytes) -> None:
        self.count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.count_head(len(name) + len(value) + 4)  # ": " and CRLF

    def on_headers_complete(self) -> None:
        self.phase = BODY
        self.unanswered += 1
        self.update(restart=True)

    def on_message_complete(self) -> None:
        self.phase = IDLE
        self.update(restart=True)

    def count_head(self, size: int) -> None:
        self.head_bytes += size
        if self.head_bytes > self.options.max_header_bytes:
            self.refuse_large_head()
            raise Refused

    # ---------------------------------------------------------------------- the limits

    def answered(self) -> None:
        """The application has answered one of this connection's requests."""
        if self.closing:
            return
        self.unanswered = max(0, self.unanswered - 1)
        if not self.tracking:  # what follows cannot be followed: the connection ends here
            self.close()
            return
        self.update()
        self.connections.trim()  # past the cap after a burst: room again

    def update(self, restart: bool = False) -> None:
        """The timer that fits what the connection is doing now, and whether it may be shed.
        While an earlier request is being answered, nothing is timed (nor read, for long: uvicorn
        pauses the reading of a request that waits behind another)."""
        if self.closing:
            return
        answering = self.unanswered > (1 if self.phase == BODY else 0)
        waiting_for = None if answering else self.phase
        if waiting_for != self.waiting_for or restart:
            self.cancel_timers()
            self.waiting_for = waiting_for
            if waiting_for is not None:
                seconds = {IDLE: self.options.idle_timeout, HEAD: self.options.header_timeout,
                           BODY: self.options.body_timeout}[waiting_for]
                self.timer = self.loop.call_later(seconds, self.expired)
            self.connections.mark(self, waiting_for is not None)

    def expired(self) -> None:
        self.timer = None
        if self.waiting_for == IDLE:
            self.close()
        elif self.waiting_for == HEAD:
            self.refuse(408, "the request line and headers did not arrive within "
                        f"{self.options.header_timeout:g} s (--header-timeout)")
        elif self.unanswered == 0:  # its answer is out already (a 413, say): nothing to say
            self.close()
        else:
            self.refuse(408, "the request body did not arrive within "
                        f"{self.options.body_timeout:g} s (--body-timeout)")

    def shed(self) -> None:
        """Make room for another connection: one idle after an answer is closed, as keep-alive
        connections are (its client retries); a new one or an incomplete request is refused."""
        if self.phase == IDLE and self.unanswered == 0 and self.began:
            self.close()
        else:
            count = self.options.max_connections
            self.refuse(503, f"this server keeps at most {count} connections "
                        "(--max-connections) and closed this one, the longest without a "
                        "complete request: try again shortly", retry=True)

    def refuse_large_head(self) -> None:
        self.refuse(431, "the request line and headers are over "
                    f"{self.options.max_header_bytes} bytes (--max-header-bytes)")

    def refuse(self, status: int, message: str, retry: bool = False) -> None:
        """Answer `status` with `message` in place of the application, and close."""
        if self.closing:
            return
        self.detach()
        if self.transport.is_closing():  # closed by uvicorn a moment ago: nothing to answer
            return
        self.connections.log(f"serve: connection from {self.describe_client()}: {status}, "
                             f"{message}")
        body = json.dumps({"error": message}).encode()
        head = [f"HTTP/1.1 {status} {REASONS[status]}", "content-type: application/json",
                f"content-length: {len(body)}", "connection: close",
                *(["retry-after: 1"] if retry else [])]
        transport = self.transport
        transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        # Closed now, with what the client sent still unread, the connection would be reset and
        # the answer lost: so only our side is shut, and the rest read until the client closes
        # (`eof_received`) or a second passes.
        transport.resume_reading()
        try:
            if transport.can_write_eof():
                transport.write_eof()
        except OSError:  # the client is gone already
            transport.abort()
            return
        self.linger = self.loop.call_later(LINGER, transport.abort)

    def close(self) -> None:
        if not self.closing:
            self.detach()
            self.transport.close()

    def detach(self) -> None:
        """Stop timing and counting the connection, and tell uvicorn's protocol that its client
        is gone (a request in the application sees a disconnect), leaving the transport open."""
        self.closing = True
        self.cancel_timers()
        self.connections.release(self)
        if self.attached:
            self.attached = False
            self.inner.connection_lost(ConnectionAbortedError("closed by attn serve"))

    def cancel_timers(self) -> None:
        self.waiting_for = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def describe_client(self) -> str:
        if self.client is None:
            return "?"
        host, port = self.client
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def allow_open_files(connections: int) -> None:
    """Raise this process's soft limit on open files (often 1,024) so that `connections` fit,
    twice over (a burst, `Connections.admit`), with room for those refused (open for up to
    LINGER seconds more) and the process's own: at the limit, the event loop could accept no one
    for a second at a time."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = 3 * connections + 256
        if hard != resource.RLIM_INFINITY:
            wanted = min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ImportError, ValueError, OSError):  # no such limit here, or not ours to raise
        pass
