"""What the operators of `attn serve` need besides the translations: Prometheus metrics (`GET
/metrics`), a cache of translated lines (`--cache-lines`), and a request rate per client
(`--req-limit`, LibreTranslate's option of that meaning).

- `Metrics`: the service's own registry (not prometheus_client's global one: two services in one
  process, as in the tests, keep their counts apart), read in the text exposition format.
  `/metrics` is outside `--api-key` (a Prometheus scrape carries no client's key); with
  `--metrics-auth-token` (LibreTranslate's name) it needs that token as `Authorization: Bearer`.
- `TranslationCache`: each line's outputs under its model, the settings that decide them and the
  line itself; a request's lines found there skip the search (`Operations.look_up`), and are
  answered exactly what the search answered the first time.
- `RequestRate`: a token bucket per client (the API key it sends in a header, else its address):
  `--req-limit` requests at once (or the key's own rate, from `--api-keys`), then one every
  60 / N seconds; past it, 429 with Retry-After.
- `OperationsMiddleware`: the ASGI wrapper that serves /metrics, refuses what is over the rate,
  and counts every request; it sits inside server.py's RequestLog, so each is logged too.

No torch here, and prometheus_client is imported when the metrics are made: the module stays
testable in-process (tests/serve/test_operations.py).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

# The cache's second bound: this many characters (source and output texts) per line it may
# hold, on average (nbest outputs are long). Measured, the outputs' token lists included:
# 10,000 lines of 120 characters hold 23 MiB; full to this bound (2.56 M characters), 32 MiB.
CACHE_CHARS_PER_LINE = 256
# Not in a cache key: DecodeOptions fields that only say how the search is run, never what it
# finds (the search is independent of the batching). A field added later is in the key until
# named here: a cache that misses more, never one that answers wrong.
NOT_IN_OUTPUTS = frozenset({"batch_tokens", "buffer_size", "workers", "worker_threads"})
# Never rate-limited: what load balancers and Prometheus poll.
UNLIMITED_PATHS = frozenset({"/health", "/metrics", "/"})  # and the web page
# The text format every Prometheus reads (generate_latest writes it; newer prometheus_client
# versions label it 1.0.0, which older servers do not know).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_LINE_BUCKETS = tuple(2 ** n for n in range(13))  # 1 ... 4096
BATCH_TOKEN_BUCKETS = tuple(2 ** n for n in range(4, 18))  # 16 ... 131,072


# ------------------------------------------------------------------------------------ metrics


class Metrics:
    """The service's counters, gauges and histograms in a registry of its own. `queue()`: the
    RequestQueue, or None while the model loads; `cache`: the TranslationCache, or None."""

    def __init__(self, queue: Callable, cache: TranslationCache | None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        into = {"registry": self.registry}
        self.requests = Counter("attn_serve_requests", "Requests answered, by endpoint (the "
                                "route's path; 'other' for no route) and status ('none': no "
                                "answer, the client went away first)",
                                ["endpoint", "status"], **into)
        self.latency = Histogram("attn_serve_request_seconds", "Seconds from a request's "
                                 "arrival to its answer, by endpoint", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, **into)
        self.lines = Counter("attn_serve_translated_lines", "Lines translated: those of the "
                             "requests answered 200", **into)
        self.sentences = Counter("attn_serve_translated_sentences", "Non-empty lines (or "
                                 "sentences, where a text is cut into them) translated, by "
                                 "the search or from the cache", **into)
        self.rate_limited = Counter("attn_serve_rate_limited_requests", "Requests refused 429, "
                                    "over --req-limit or an API key's rate", **into)
        # by the key's name in --api-keys (or "api-key" for --api-key's), never its value; a
        # key sent in the body (LibreTranslate's api_key field) is named once it is read
        # (Operations.charge_key)
        self.key_requests = Counter("attn_serve_key_requests", "Requests that carried an API "
                                    "key, by the key's name and the status",
                                    ["key", "status"], **into)
        self.key_rate_limited = Counter("attn_serve_key_rate_limited_requests", "Requests "
                                        "refused 429 over their API key's rate, by the key's "
                                        "name", ["key"], **into)
        self.cache_hits = Counter("attn_serve_cache_hits", "Lines answered from the cache",
                                  **into)
        self.cache_misses = Counter("attn_serve_cache_misses", "Lines looked up in the cache "
                                    "and not found (so searched)", **into)
        self.batch_lines = Histogram("attn_serve_batch_lines", "Lines in each search batch",
                                     buckets=BATCH_LINE_BUCKETS, **into)
        self.batch_tokens = Histogram("attn_serve_batch_source_tokens", "Source tokens in "
                                      "each search batch, padding included (what "
                                      "--batch-tokens bounds, divided by the beam)",
                                      buckets=BATCH_TOKEN_BUCKETS, **into)
        Gauge("attn_serve_queued_lines", "Lines waiting for a search worker",
              **into).set_function(lambda: queue().waiting if queue() is not None else 0)
        Gauge("attn_serve_searching_lines", "Lines being searched",
              **into).set_function(lambda: queue().searching if queue() is not None else 0)
        if cache is not None:
            Gauge("attn_serve_cache_lines", "Lines the cache holds",
                  **into).set_function(lambda: len(cache))
            Gauge("attn_serve_cache_characters", "Characters (sources and outputs) the cache "
                  "holds", **into).set_function(lambda: cache.chars)

    def batch_formed(self, lines: int, padded_tokens: int) -> None:
        """RequestQueue's hook, from a search worker as it takes a batch."""
        self.batch_lines.observe(lines)
        self.batch_tokens.observe(padded_tokens)

    def request_done(self, endpoint: str, status: int | None, seconds: float,
                     lines: int | None) -> None:
        self.requests.labels(endpoint, str(status or "none")).inc()
        self.latency.labels(endpoint).observe(seconds)
        if status == 200 and lines:
            self.lines.inc(lines)

    def text(self) -> bytes:
        """The exposition text, as GET /metrics answers it."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ------------------------------------------------------------------------------------ the cache


class TranslationCache:
    """Outputs of lines searched before, the least recently used leaving first: at most
    `max_lines` lines and `max_chars` characters (each line's source and output texts).
    Thread-safe."""

    def __init__(self, max_lines: int, max_chars: int):
        self.max_lines, self.max_chars = max_lines, max_chars
        self._entries: OrderedDict = OrderedDict()  # key → (outputs, characters)
        self._lock = threading.Lock()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key):
        """The outputs kept under `key` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key, outputs, chars: int) -> None:
        """Keep `outputs` under `key`, making room; one larger than the whole cache is not
        kept (it would empty the cache for itself)."""
        if chars > self.max_chars or self.max_lines < 1:
            return
        with self._lock:
            previous = self._entries.pop(key, None)
            if previous is not None:
                self.chars -= previous[1]
            self._entries[key] = (outputs, chars)
            self.chars += chars
            while len(self._entries) > self.max_lines or self.chars > self.max_chars:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.chars -= dropped


def search_key(translator) -> tuple:
    """What decides a line's outputs besides the line: the models (a server of several pairs
    has a translator each) and every search setting but those in NOT_IN_OUTPUTS."""
    options = translator.options
    return (translator.model, tuple((field.name, getattr(options, field.name))
                                    for field in dataclasses.fields(options)
                                    if field.name not in NOT_IN_OUTPUTS))


@dataclasses.dataclass
class Lookup:
    """A request's lines against the cache. `found[i]`: line i's cached outputs, or None;
    `keys[i]`: its key, None for a line not cached (empty, or no cache)."""

    lines: list[str]
    found: list
    keys: list

    @property
    def to_search(self) -> list[str]:
        """The lines, those found blanked: an empty line is answered without a search, and
        every line keeps its place (a sampled line's random numbers depend on it; warnings
        name it)."""
        return [line if outputs is None else "" for line, outputs in zip(self.lines, self.found)]


# ----------------------------------------------------------------------------- the request rate


class RequestRate:
    """A token bucket per client: `per_minute` requests at once, then one more every
    60 / per_minute seconds (a client may have its own `per_minute`: an API key's, from
    --api-keys; 0 is no limit). `clock()`: seconds, monotonic (tests pass their own)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.per_minute, self.clock = per_minute, clock
        self._buckets: dict = {}  # client → (tokens, when they were counted, its per_minute)
        self._lock = threading.Lock()
        self._pruned = clock()

    def wait(self, client, per_minute: int | None = None) -> float:
        """0.0, and one request of `client` counted, if it may send one now; else the seconds
        until it may (nothing counted: a refused request costs no token). `per_minute`: the
        client's own rate (default: the server's)."""
        rate = self.per_minute if per_minute is None else per_minute
        if rate == 0:
            return 0.0
        refill = rate / 60  # tokens a second
        with self._lock:
            now = self.clock()
            tokens, counted, _ = self._buckets.get(client, (rate, now, rate))
            tokens = min(rate, tokens + (now - counted) * refill)
            if tokens < 1:
                self._buckets[client] = (tokens, now, rate)
                return (1 - tokens) / refill
            self._buckets[client] = (tokens - 1, now, rate)
            if now - self._pruned > 60:
                self._prune(now)
            return 0.0

    def _prune(self, now: float) -> None:  # the lock held
        """Forget the clients whose bucket has refilled (a full one is as good as none; any
        refills within a minute), so that memory follows the clients of the last minute or
        two, not all there ever were. Once a minute: each client costs its entry's check."""
        self._buckets = {client: (tokens, counted, rate)
                         for client, (tokens, counted, rate) in self._buckets.items()
                         if tokens + (now - counted) * rate / 60 < rate}
        self._pruned = now

    def __len__(self) -> int:
        return len(self._buckets)


def client_of(scope: dict, keys) -> tuple[tuple, object]:
    """Whose bucket a request draws on, and its key (serve/keys.py's Key, or None): the API
    key's it carries in a header, where the server takes that key, else its address's. A key
    the server does not take counts as none: a client cannot get a fresh bucket by making keys
    up. (A key sent as LibreTranslate's `api_key` field is in the body, not yet read here: such
    requests count by address here, and by their key once it is read: Operations.charge_key.)"""
    if keys is not None and keys.required:
        for name, value in scope.get("headers", ()):
            given = (value[7:].strip() if name == b"authorization"
                     and value[:7].lower() == b"bearer " else value if name == b"x-api-key"
                     else None)
            key = keys.find(given) if given is not None else None
            if key is not None:
                return ("key", key.name), key
    client = scope.get("client")
    return ("address", client[0] if client else "unknown"), None


# ------------------------------------------------------------------------------ the operations


class Operations:
    """The metrics, the cache (None with --cache-lines 0) and the rate (None without
    --req-limit) of one service, and what the service and its app call of them."""

    def __init__(self, options, queue: Callable, keys=None):
        lines = options.cache_lines
        self.cache = TranslationCache(lines, lines * CACHE_CHARS_PER_LINE) if lines else None
        # a rate per client with --req-limit, or where --api-keys gives a key its own
        self.rate = RequestRate(options.req_limit) \
            if options.req_limit or getattr(options, "api_keys", None) else None
        self.metrics = Metrics(queue, self.cache)
        self.keys, self.metrics_token = keys, options.metrics_auth_token

    def look_up(self, translator, lines: list[str], controls: list | None = None) -> Lookup:
        """The lines of a request to be searched with `translator`, against the cache, each
        with its controls (`controls[i]`: `controls.Controls`, in the key). A line with a
        target prefix of its own is neither looked up nor kept: autocompletion's prefixes
        change at every keystroke (a model's target-language token, which every line of the
        language starts with, is not one)."""
        count = len(lines)
        if self.cache is None:
            return Lookup(lines, [None] * count, [None] * count)
        searched_as = search_key(translator)
        starts = len(translator.options.target_start)
        # A sampled line's outputs depend on its place in the request too (search.py's
        # sentence_uniforms): in its key. A beam search's do not (batch independence).
        sampled = translator.options.sample
        keys = [(searched_as, line, place if sampled else None,
                 controls[place] if controls else None)
                if line.strip() and not (controls and controls[place].prefix[starts:])
                else None
                for place, line in enumerate(lines)]
        found = [None if key is None else self.cache.get(key) for key in keys]
        hits = sum(1 for outputs in found if outputs is not None)
        self.metrics.cache_hits.inc(hits)
        self.metrics.cache_misses.inc(sum(1 for key in keys if key is not None) - hits)
        return Lookup(lines, found, keys)

    def answered(self, lookup: Lookup, job) -> None:
        """A job of `lookup.to_search` done: the lines found take their cached outputs in
        `job.outputs`, and those searched are kept."""
        for place, (outputs, key) in enumerate(zip(lookup.found, lookup.keys)):
            if outputs is not None:
                job.outputs[place] = outputs
            elif key is not None:
                searched = job.outputs[place]
                chars = len(key[1]) + sum(len(text) for _, text in searched)
                self.cache.put(key, searched, chars)
        self.metrics.sentences.inc(sum(1 for line in lookup.lines if line.strip()))

    def charge_key(self, scope: dict, key) -> None:
        """A request whose key was in its body (LibreTranslate's `api_key` field), which the
        middleware could not see: drawn from its key's bucket now, 429 (a Problem) past the
        key's own rate; and named for the key's counters. A key sent in a header was charged
        by the middleware already."""
        state = scope.setdefault("state", {})
        state["key"] = key.name
        if state.get("charged_key") == key.name or self.rate is None or \
                key.requests_per_minute is None:
            return
        wait = self.rate.wait(("key", key.name), key.requests_per_minute)
        if wait > 0:
            from .api import Problem

            self.metrics.rate_limited.inc()
            self.metrics.key_rate_limited.labels(key.name).inc()
            raise Problem(429, rate_message(key.requests_per_minute, key, wait),
                          {"Retry-After": str(math.ceil(wait))})

    def middleware(self, app, paths) -> OperationsMiddleware:
        """`app` inside the ASGI wrapper; `paths`: its routes' paths (the endpoint labels)."""
        return OperationsMiddleware(app, self, frozenset(paths) | {"/metrics"})


class OperationsMiddleware:
    """ASGI: GET /metrics answered here; a request over its client's rate refused 429; every
    request counted by endpoint and status, and timed."""

    def __init__(self, app, operations: Operations, paths: frozenset):
        self.app, self.operations, self.paths = app, operations, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, operations = scope["path"], self.operations
        started, status = time.perf_counter(), [None]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        key = None
        try:
            if path == "/metrics":
                await self._metrics(scope, sending)
                return
            client, key = client_of(scope, operations.keys)
            if operations.rate is not None and path not in UNLIMITED_PATHS:
                own = key.requests_per_minute if key is not None else None
                wait = operations.rate.wait(client, own)
                if wait > 0:
                    operations.metrics.rate_limited.inc()
                    if key is not None:
                        operations.metrics.key_rate_limited.labels(key.name).inc()
                    limit = operations.rate.per_minute if own is None else own
                    await respond(sending, 429, json_body(rate_message(
                        limit, key if own is not None else None, wait)),
                        {"retry-after": str(math.ceil(wait))})
                    return
                if key is not None:
                    scope.setdefault("state", {})["charged_key"] = key.name
            await self.app(scope, receive, sending)
        finally:
            operations.metrics.request_done(
                path if path in self.paths else "other", status[0],
                time.perf_counter() - started, scope.get("state", {}).get("lines"))
            name = key.name if key is not None else scope.get("state", {}).get("key")
            if name is not None:
                operations.metrics.key_requests.labels(name, str(status[0] or "none")).inc()

    async def _metrics(self, scope, send) -> None:
        token = self.operations.metrics_token
        if scope["method"] not in ("GET", "HEAD"):
            await respond(send, 405, json_body(f"{scope['method']} is not allowed here"))
        elif token and not bearer_is(scope, token):
            await respond(send, 401, json_body(
                "/metrics needs this server's --metrics-auth-token: send 'Authorization: "
                "Bearer TOKEN'"), {"www-authenticate": "Bearer"})
        else:
            await respond(send, 200, self.operations.metrics.text(), content_type=(
                METRICS_CONTENT_TYPE), head=scope["method"] == "HEAD")


def rate_message(limit: int, key, wait: float) -> str:
    """429's words: the rate, whose it is (the key's, or each client's --req-limit), when to
    try again."""
    whose = (f"from the key {key.name!r} (--api-keys)" if key is not None
             else f"from each client (--req-limit {limit})")
    return (f"too many requests: this server answers {limit} a minute {whose}; try again in "
            f"{math.ceil(wait)} s")


def bearer_is(scope: dict, token: str) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return hmac.compare_digest(value[7:].strip(), token.encode())
    return False


def json_body(message: str) -> bytes:
    return json.dumps({"error": message}, ensure_ascii=False).encode()


async def respond(send, status: int, body: bytes, headers: dict | None = None,
                  content_type: str = "application/json", head: bool = False) -> None:
    """An answer sent by hand (this runs outside Starlette's app)."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(body)).encode()),
                            *((name.encode(), value.encode())
                              for name, value in (headers or {}).items())]})
    await send({"type": "http.response.body", "body": b"" if head else body})
