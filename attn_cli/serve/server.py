"""`attn serve`: the models loaded once, translating over HTTP (pip install 'attn[serve]').

Endpoints (JSON in and out; errors are `{"error": "..."}` with a 4xx/5xx status):
- `POST /v1/translate` `{"text": [lines], "model"?, "beam"?, "nbest"?, "alpha"?, "max_len_a"?,
  "max_len_b"?, "stop"?, "sample"?, "topk"?, "topp"?, "temperature"?, "seed"?, "raw"?,
  "scores"?}` → `{"model", "translations": [...], "scores"?: [...]}`: one output per line, in
  order, an empty line for an empty line, the same text as `attn decode` with those options
  (with nbest K > 1, each output is a list of K, as decode's K lines).
- `GET /v1/models`, `GET /health` (200 once the model is loaded, 503 before).
- LibreTranslate's API, so its clients, apps and browser extensions work unchanged:
  `POST /translate` (`q` a string or a list, `source`, `target`, `format`, `alternatives`,
  `api_key`; JSON or a form) → `{"translatedText"}`, `GET /languages`, `GET /frontend/settings`.

The HTTP side runs on uvicorn's event loop, behind http.py's connection limits (the time and size
of what a client sends, the number of connections); translation runs in
`request_queue.RequestQueue`'s search workers, which batch the lines of requests arriving together.
The server listens before the model is loaded (`/health` says when it is ready), answers SIGTERM by
refusing new connections, finishing the requests it has, and exiting 0, and logs one line per
request on stderr (id, method, path, status, lines, milliseconds). stdout stays empty.

What a request may ask and what it is answered are api.py's pure functions. Here: the `Service`
(the models, the queue, the search of a request's lines), the endpoints that read a request and
call api.py, and the process (`serve`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from ..config import ModelConfig, ServeOptions, parse_langs
from ..errors import AttnError
from ..formats import MODEL_FORMAT
from . import api
from .api import Problem

EXTRA = "pip install 'attn[serve]'"
KERNEL_CACHE = 128  # oneDNN kernels kept (see `tune_process`)


class Service:
    """The models (loaded in the background), the queue, and the search behind the endpoints."""

    def __init__(self, model_paths: list[Path], options: ServeOptions, load, log):
        from .. import stfile

        self.paths, self.options, self.log = model_paths, options, log
        self._load = load  # () → Translator, the slow part (torch, the weights)
        # The headers now: a missing or wrong file is an error before the server listens.
        headers = [stfile.read_attn_header(path, MODEL_FORMAT, "model file")
                   for path in model_paths]
        self.metadata = headers[0].metadata
        self.model_id = options.name or "+".join(Path(path).stem for path in model_paths)
        self.langs = options.langs or parse_langs(self.metadata.get("langs"))
        self.translator = None  # set once loaded: the service is ready
        self.queue = None
        self.failure: str | None = None
        self.requests = itertools.count(1)
        self.lines_translated = 0

    def load(self, stop) -> None:
        """Load the models, warm the search up, start the workers; on failure, say why and
        `stop()` the server."""
        started = time.perf_counter()
        try:
            from .request_queue import RequestQueue

            translator = self._load()
            translator.search(translator.encode(["warm up"], 1))  # kernels made once, here
            options = translator.options
            self.queue = RequestQueue(options.workers, options.worker_threads,
                                      self.options.queue_lines, self.options.gather_ms / 1000)
            self.translator = translator
        except Exception as error:  # told in one line; the server stops with status 2
            self.failure = str(error) if isinstance(error, AttnError) else repr(error)
            stop()
            return
        self.log(f"serve: {self.model_id} loaded in {time.perf_counter() - started:.2f}s, ready "
                 f"({translator.device}, {options.workers} search worker(s) × "
                 f"{options.worker_threads} thread(s), batches of {options.batch_tokens} "
                 "source tokens × beam)")

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()

    @property
    def default_beam(self) -> int:
        """The beam of a request that asks for none (1 while loading: then refused anyway)."""
        return self.translator.options.beam if self.translator is not None else 1

    async def translate(self, lines: list[str], settings: dict, client_gone,
                        name: str = "request"):
        """The job of `lines` searched with `settings` (DecodeOptions fields), once every line
        has its output: refused (422) before any search if its work is over
        --max-request-tokens, cancelled if its client goes away first (`client_gone()`
        returns: 499) or --request-timeout passes (504). `name` names the request in
        warnings."""
        if self.translator is None:
            raise Problem(503, "the model is still loading (GET /health says when it is ready)",
                          {"Retry-After": "1"})
        from ..translate import OutOfRange  # torch: never before `tune_process`
        from .request_queue import Job, QueueFull

        try:
            translator = self.translator.with_options(**settings)
        except OutOfRange as error:  # DecodeOptions' ranges, naming the JSON field
            raise Problem(422, f"{error.field} {error.rule}") from None
        except AttnError as error:  # the settings that go together
            raise Problem(422, str(error)) from None
        loop = asyncio.get_running_loop()
        answered = loop.create_future()

        def done(job) -> None:  # from a search worker
            loop.call_soon_threadsafe(_resolve, answered, job)

        job = Job(lines, translator, done, name=name)
        api.check_work(job.work, self.options.max_request_tokens)
        try:
            self.queue.submit(job)
        except QueueFull as error:
            raise Problem(503, f"the server is busy ({error}): try again shortly",
                          {"Retry-After": "1"}) from None
        await self._answered(job, answered, client_gone)
        if job.error is not None:
            raise Problem(500, f"the search failed: {job.error}")
        self.lines_translated += len(lines)
        return job

    async def _answered(self, job, answered, client_gone) -> None:
        """Until `answered` is; if the client goes away or the deadline passes first, or this
        task is cancelled, the job is called off (`RequestQueue.cancel`: its lines stop costing
        within a search step) and the request refused."""
        gone = asyncio.ensure_future(client_gone())
        timeout = self.options.request_timeout
        try:
            await asyncio.wait({answered, gone}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            client_left = gone.done()
        finally:
            gone.cancel()
            if not answered.done():
                self.queue.cancel(job)
        if answered.done():
            return
        if client_left:
            raise Problem(499, "the client went away")
        raise Problem(504, f"no answer within {timeout:g} s, this server's limit for a request "
                      "(--request-timeout): send fewer lines, or ask for a smaller beam or "
                      "max_len_b")

    def describe(self) -> dict:
        """The model as /v1/models lists it."""
        config = ModelConfig.from_json(self.metadata["config"])
        options = self.translator.options if self.translator is not None else None
        return {"id": self.model_id, "object": "model", "ready": self.translator is not None,
                "files": [str(path) for path in self.paths],
                "source": self.langs[0] if self.langs else None,
                "target": self.langs[1] if self.langs else None,
                "config": {key: getattr(config, key) for key in
                           ("d_model", "d_ff", "heads", "encoder_layers", "decoder_layers",
                            "src_vocab_size", "tgt_vocab_size")},
                "defaults": None if options is None else
                {"beam": options.beam, "alpha": options.alpha, "max_len_a": options.max_len_a,
                 "max_len_b": options.max_len_b, "stop": options.stop.value},
                "limits": {"max_lines": self.options.max_lines,
                           "max_line_chars": self.options.max_line_chars,
                           "max_body_bytes": self.options.max_body,
                           "max_beam": self.options.max_beam,
                           "max_request_tokens": self.options.max_request_tokens,
                           "request_timeout_s": self.options.request_timeout}}


def _resolve(future, job) -> None:
    if not future.done():
        future.set_result(job)


# ------------------------------------------------------------------------------- the endpoints
# Each reads the Service from `request.app.state.service`, the body through `read_body`, and
# leaves the rest to api.py; a Problem it raises becomes the JSON error answer (`endpoint`).


async def health(request):
    service = request.app.state.service
    if service.translator is None:
        return answer({"status": "loading", "model": service.model_id}, 503,
                      {"Retry-After": "1"})
    return answer({"status": "ok", "model": service.model_id,
                   "queued_lines": service.queue.waiting,
                   "searching_lines": service.queue.searching})


async def models(request):
    service = request.app.state.service
    api.check_key(service.options.api_key, request.headers)
    return answer({"object": "list", "data": [service.describe()]})


async def translate_v1(request):
    service = request.app.state.service
    fields = api.json_fields(await read_body(request, service.options.max_body))
    api.check_key(service.options.api_key, request.headers, fields)
    asked = api.v1_request(fields, service.options, service.model_id)
    job = await _search(request, asked.lines, asked.settings)
    return answer(api.v1_answer(service.model_id, asked, job.outputs,
                                job.translator.options.nbest))


async def translate_libre(request):
    service = request.app.state.service
    body = await read_body(request, service.options.max_body)
    try:
        fields = api.libre_fields(request.headers.get("content-type", ""), body)
        api.check_key(service.options.api_key, request.headers, fields)
        asked = api.libre_request(fields, service.options, service.langs, service.default_beam)
        job = await _search(request, asked.lines, asked.settings)
    except Problem as problem:
        # LibreTranslate answers every bad value 400 (its clients look for that), where
        # /v1/translate tells a body that does not parse (400) from a value out of bounds (422).
        if problem.status == 422:
            raise Problem(400, problem.message, problem.headers) from None
        raise
    return answer(api.libre_answer(asked, job.outputs))


async def languages(request):
    return answer(api.languages(request.app.state.service.langs))


async def frontend_settings(request):
    service = request.app.state.service
    return answer(api.frontend_settings(service.options, service.langs))


async def not_found(request, exc):
    status = getattr(exc, "status_code", 404)
    message = ("no such endpoint (POST /v1/translate, GET /v1/models, GET /health, POST "
               "/translate, GET /languages)" if status == 404 else
               f"{request.method} is not allowed here" if status == 405 else str(exc))
    return answer({"error": message}, status)


ROUTES = [("/health", health, ["GET"]), ("/v1/models", models, ["GET"]),
          ("/v1/translate", translate_v1, ["POST"]), ("/translate", translate_libre, ["POST"]),
          ("/languages", languages, ["GET", "POST"]),
          ("/frontend/settings", frontend_settings, ["GET"])]


def build_app(service: Service):
    """The ASGI application of a service: the routes, inside the request log."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    routes = [Route(path, endpoint(handler), methods=methods)
              for path, handler, methods in ROUTES]
    application = Starlette(routes=routes, exception_handlers={404: not_found,
                                                               405: not_found})
    application.state.service = service
    return RequestLog(application, service)


def endpoint(handler):
    """A handler whose Problems (and bugs) become JSON error answers."""
    async def handle(request):
        try:
            return await handler(request)
        except Problem as problem:
            return answer({"error": problem.message}, problem.status, problem.headers)
        except Exception as error:  # a bug: one line in the log, a 500, the server goes on
            request.app.state.service.log(f"serve: request #{request.state.id}: internal "
                                          f"error: {error!r}")
            return answer({"error": f"internal error: {error}"}, 500)
    return handle


def answer(payload, status: int = 200, headers: dict | None = None):
    from starlette.responses import Response

    return Response(json.dumps(payload, ensure_ascii=False), status, headers,
                    media_type="application/json")


async def read_body(request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes, before or while it arrives; 499
    if the client goes away first (or http.py's guard closes it: a slow body)."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Problem(413, f"the body is {declared} bytes; this server takes at most {limit} "
                      "(--max-body)")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Problem(413, f"the body is over {limit} bytes, this server's limit "
                              "(--max-body)")
            chunks.append(chunk)
    except ClientDisconnect:
        raise Problem(499, "the client went away") from None
    return b"".join(chunks)


async def _search(request, lines: list[str], settings: dict):
    """The service's job for a request's lines (counted in its log line), cancelled if its
    client goes away."""
    request.state.lines = len(lines)
    return await request.app.state.service.translate(
        lines, settings, lambda: _client_gone(request), name=f"serve: request #{request.state.id}")


async def _client_gone(request) -> None:
    """Returns when the client disconnects (its body has been read: only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class RequestLog:
    """ASGI middleware: a request number for each request (the X-Request-Id header), and one
    stderr line per request: number, method, path, status, lines, milliseconds."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        number = next(self.service.requests)
        state = scope.setdefault("state", {})
        state["id"] = number
        started, status = time.perf_counter(), [None]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", str(number).encode())]}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            lines = state.get("lines")
            self.service.log(f"serve: #{number} {scope['method']} {scope['path']} "
                             f"{status[0] or 'no answer'}"
                             + (f" {lines} line{'s' if lines != 1 else ''}"
                                if lines is not None else "")
                             + f" {1000 * (time.perf_counter() - started):.1f} ms")


# ----------------------------------------------------------------------------------- running


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: any free port), or one error line."""
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, protocol)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        raise AttnError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.setblocking(False)
    return sock


def serve(model_paths: list[Path], options: ServeOptions, load, log) -> None:
    """Serve until SIGTERM or Ctrl-C. `load()` makes the Translator (in the background)."""
    try:
        import httptools  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise AttnError(f"attn serve needs its web server: {EXTRA}") from None
    from .http import LINGER, Connections, allow_open_files

    service = Service(model_paths, options, load, log)
    allow_open_files(options.max_connections)
    sock = listening_socket(options.host, options.port)
    # uvicorn's HTTP protocol behind http.py's guard, which holds the connection limits (the
    # count, the timeouts, the header size). uvicorn's own keep-alive timeout only backs the
    # guard's up: it outlasts the guard's idle timeout and the linger of a refused connection.
    connections = Connections(options, log)
    server = uvicorn.Server(uvicorn.Config(
        connections.watch(build_app(service)), http=connections.protocol, ws="none",
        interface="asgi3", log_config=None, access_log=False, lifespan="off",
        limit_concurrency=None, timeout_keep_alive=options.idle_timeout + LINGER + 1,
        timeout_graceful_shutdown=None, server_header=False))
    tune_process()
    # uvicorn catches SIGTERM and Ctrl-C for its graceful stop and raises the signal again once
    # stopped: with these handlers in place that second one does nothing, and a stop asked for
    # is an exit with status 0 (a second Ctrl-C still cuts the wait for open requests short).
    handlers = {number: signal.signal(number, lambda *_: None)
                for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        asyncio.run(_serve_while_loading(server, sock, service))
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        service.close()
        sock.close()
    if service.failure is not None:
        raise AttnError(service.failure)
    requests, lines = next(service.requests) - 1, service.lines_translated
    log(f"serve: stopped ({requests} request{'s' if requests != 1 else ''}, {lines} "
        f"line{'s' if lines != 1 else ''} translated)")
    sys.stderr.flush()


async def _serve_while_loading(server, sock: socket.socket, service: Service) -> None:
    """uvicorn serving on `sock` while the models load in another thread; returns once it has
    stopped (SIGTERM, Ctrl-C, or a failed load) and the loading is over."""
    loop = asyncio.get_running_loop()

    def stop() -> None:  # from the loading thread
        loop.call_soon_threadsafe(setattr, server, "should_exit", True)

    # The socket listens already: a connection waits in its backlog until uvicorn accepts it.
    # So the line is true now and the loading may start, without waiting for uvicorn, which
    # tells of its start only by a flag (`Server.started`) that would have to be polled.
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    service.log(f"serve: listening on http://{shown}:{port} ({service.model_id}: loading; "
                "GET /health says when it is ready)")
    loader = threading.Thread(target=service.load, args=(stop,), daemon=True,
                              name="attn-serve-load")
    loader.start()
    await server.serve(sockets=[sock])
    await asyncio.to_thread(loader.join)


def tune_process() -> None:
    """The process-wide settings of a server. The order matters: this runs before torch is
    imported (the loading thread imports it, later), because torch and oneDNN read the kernel
    caches' sizes from the environment once, when they start; set after that, they do nothing.
    So nothing before `serve`'s call of this may import torch."""
    # The event loop shares the GIL with the search workers, whose steps at small batches are
    # mostly Python: hand the GIL over every 0.5 ms (CPython's default: 5 ms), so that a request
    # waits less for the loop to read it.
    sys.setswitchinterval(0.0005)
    # oneDNN keeps the kernels it made for every matrix shape it has seen, in two caches of 1024
    # each (the packed linear layers' weigh much), and a server's batches keep bringing new
    # shapes: bounded so, its memory stays flat. The environment may say otherwise.
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(KERNEL_CACHE))
