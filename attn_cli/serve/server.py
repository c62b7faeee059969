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

The HTTP side runs on uvicorn's event loop; translation runs in `request_queue.RequestQueue`'s
search workers, which batch the lines of requests arriving together. The server listens before
the model is loaded (`/health` says when it is ready), answers SIGTERM by refusing new
connections, finishing the requests it has, and exiting 0, and logs one line per request on
stderr (id, method, path, status, lines, milliseconds). stdout stays empty.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

from ..errors import AttnError
from ..formats import MODEL_FORMAT, Stop

EXTRA = "pip install 'attn[serve]'"

# ISO 639-1 names for /languages (LibreTranslate lists a name with each code).
LANGUAGE_NAMES = {
    "ar": "Arabic", "bg": "Bulgarian", "ca": "Catalan", "cs": "Czech", "da": "Danish",
    "de": "German", "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian",
    "fi": "Finnish", "fr": "French", "he": "Hebrew", "hi": "Hindi", "hu": "Hungarian",
    "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean", "lt": "Lithuanian",
    "lv": "Latvian", "nl": "Dutch", "no": "Norwegian", "pl": "Polish", "pt": "Portuguese",
    "ro": "Romanian", "ru": "Russian", "sk": "Slovak", "sl": "Slovenian", "sv": "Swedish",
    "tr": "Turkish", "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese",
}

# A request's search settings: field → (type, smallest value). The largest beam and nbest are
# the server's --max-beam; the rest are `DecodeOptions`' own checks.
SETTINGS = {"beam": (int, 1), "nbest": (int, 1), "alpha": (float, 0.0),
            "max_len_a": (float, 0.0), "max_len_b": (int, 0), "stop": (str, None),
            "sample": (bool, None), "topk": (int, 0), "topp": (float, None),
            "temperature": (float, None), "seed": (int, None), "raw": (bool, None)}
MAX_LEN_B = 4096  # a request cannot ask for outputs longer than this (each step costs)
V1_FIELDS = {"text", "model", "scores", "api_key", *SETTINGS}
KERNEL_CACHE = 128  # oneDNN kernels kept (see `serve`)


@dataclass(frozen=True)
class ServeOptions:
    """What `attn serve` takes besides the models and their search settings."""

    host: str = "127.0.0.1"
    port: int = 8080
    name: str | None = None  # the model's id in requests and /v1/models (default: file stems)
    langs: tuple[str, str] | None = None  # (source, target) codes
    api_key: str | None = None
    max_body: int = 1 << 20  # bytes
    max_lines: int = 1000  # per request
    max_line_chars: int = 10_000
    queue_lines: int = 10_000  # lines waiting for a search worker, all requests together
    max_beam: int = 32
    gather_ms: float = 3.0
    max_connections: int = 1024


class Problem(Exception):
    """An answer other than 200: its status, a message for the client, extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def parse_langs(value: str | None) -> tuple[str, str] | None:
    """'en-de' → ('en', 'de')."""
    if value is None:
        return None
    source, _, target = value.partition("-")
    if not source or not target or "-" in target:
        raise AttnError(f"--langs takes SOURCE-TARGET language codes, e.g. en-de, not {value!r}")
    return source, target


class Service:
    """The models (loaded in the background), the queue, and what the endpoints answer."""

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

    # --------------------------------------------------------------------------------- loading

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

    # ------------------------------------------------------------------------------ translating

    async def translate(self, request, lines: list[str], settings: dict):
        """The job of `lines` searched with `settings`, once every line has its output."""
        from .request_queue import Job, QueueFull

        request.state.lines = len(lines)
        if self.translator is None:
            raise Problem(503, "the model is still loading (GET /health says when it is ready)",
                          {"Retry-After": "1"})
        try:
            translator = self.translator.with_options(**settings)
        except AttnError as error:
            raise Problem(422, str(error)) from None
        loop = asyncio.get_running_loop()
        answered = loop.create_future()

        def done(job) -> None:  # from a search worker
            loop.call_soon_threadsafe(_resolve, answered, job)

        job = Job(lines, translator, done, name=f"serve: request #{request.state.id}")
        try:
            self.queue.submit(job)
        except QueueFull as error:
            raise Problem(503, f"the server is busy ({error}): try again shortly",
                          {"Retry-After": "1"}) from None
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({answered, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not answered.done():
            job.cancelled = True  # its waiting lines leave the queue unsearched
            raise Problem(499, "the client went away")
        if job.error is not None:
            raise Problem(500, f"the search failed: {job.error}")
        self.lines_translated += len(lines)
        return job

    def check_model(self, name) -> None:
        if name is not None and name != self.model_id:
            raise Problem(404, f"unknown model {name!r}: this server has {self.model_id!r} "
                          "(GET /v1/models)")

    def check_pair(self, source, target) -> None:
        """LibreTranslate's source (or 'auto') and target must be the server's pair."""
        if self.langs is None:
            return
        have_source, have_target = self.langs
        if source not in (have_source, "auto") or target != have_target:
            raise Problem(400, f"this server translates {have_source} to {have_target} only, "
                          f"not {source} to {target}")

    def check_key(self, request, fields: dict | None = None) -> None:
        """With --api-key: the key as 'Authorization: Bearer KEY', an X-API-Key header, or an
        `api_key` field (LibreTranslate's way)."""
        expected = self.options.api_key
        if not expected:
            return
        bearer = request.headers.get("authorization", "")
        candidates = [bearer[7:].strip() if bearer[:7].lower() == "bearer " else None,
                      request.headers.get("x-api-key"), (fields or {}).get("api_key")]
        if not any(isinstance(given, str) and hmac.compare_digest(given.encode(),
                                                                  expected.encode())
                   for given in candidates):
            raise Problem(401, "this server needs its API key: send 'Authorization: Bearer "
                          "KEY', an 'X-API-Key: KEY' header, or an api_key field",
                          {"WWW-Authenticate": "Bearer"})

    def check_lines(self, lines: list, field: str) -> None:
        """Every line a string without a line break, within the server's limits."""
        limit = self.options.max_lines
        if len(lines) > limit:
            raise Problem(422, f"{len(lines)} lines in one request; this server takes at most "
                          f"{limit} (--max-lines)")
        for index, line in enumerate(lines):
            where = f"{field}[{index}]"
            if not isinstance(line, str):
                raise Problem(422, f"{where} must be a string, not {_json_type(line)}")
            if "\n" in line or "\r" in line:
                raise Problem(422, f"{where} holds a line break: send one line per element")
            if len(line) > self.options.max_line_chars:
                raise Problem(422, f"{where} is {len(line)} characters; this server takes at "
                              f"most {self.options.max_line_chars} (--max-line-chars)")
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as error:
                raise Problem(400, f"{where} is not valid Unicode (an unpaired surrogate at "
                              f"character {error.start})") from None

    def settings_of(self, fields: dict) -> dict:
        """The search settings a /v1/translate body asks for, type- and range-checked."""
        settings = {}
        for name, (kind, least) in SETTINGS.items():
            if name not in fields:
                continue
            value = fields[name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise Problem(422, f"{name} must be {_TYPE_NAMES[kind]}, not {_json_type(value)}")
            if kind is float and not math.isfinite(value):
                raise Problem(422, f"{name} must be a finite number")
            if least is not None and value < least:
                raise Problem(422, f"{name} must be at least {least}")
            settings[name] = value
        for name in ("beam", "nbest"):
            if settings.get(name, 0) > self.options.max_beam:
                raise Problem(422, f"{name} {settings[name]} is above this server's limit of "
                              f"{self.options.max_beam} (--max-beam)")
        if settings.get("max_len_b", 0) > MAX_LEN_B:
            raise Problem(422, f"max_len_b must be at most {MAX_LEN_B}")
        if "stop" in settings:
            try:
                settings["stop"] = Stop(settings["stop"])
            except ValueError:
                raise Problem(422, f"stop must be one of {', '.join(s.value for s in Stop)}, "
                              f"not {settings['stop']!r}") from None
        return settings

    def describe(self) -> dict:
        """The model as /v1/models lists it."""
        config = json.loads(self.metadata.get("config", "{}"))
        options = self.translator.options if self.translator is not None else None
        return {"id": self.model_id, "object": "model", "ready": self.translator is not None,
                "files": [str(path) for path in self.paths],
                "source": self.langs[0] if self.langs else None,
                "target": self.langs[1] if self.langs else None,
                "config": {key: config[key] for key in
                           ("d_model", "d_ff", "heads", "encoder_layers", "decoder_layers",
                            "src_vocab_size", "tgt_vocab_size") if key in config},
                "defaults": None if options is None else
                {"beam": options.beam, "alpha": options.alpha, "max_len_a": options.max_len_a,
                 "max_len_b": options.max_len_b, "stop": options.stop.value},
                "limits": {"max_lines": self.options.max_lines,
                           "max_line_chars": self.options.max_line_chars,
                           "max_body_bytes": self.options.max_body,
                           "max_beam": self.options.max_beam}}


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _json_type(value) -> str:
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"),
                       (str, "a string"), (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null"


def _resolve(future, job) -> None:
    if not future.done():
        future.set_result(job)


async def _client_gone(request) -> None:
    """Returns when the client disconnects (its body has been read: only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _score(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no -inf


# ---------------------------------------------------------------------------------- the bodies


async def read_body(request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes, before or while it arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Problem(413, f"the body is {declared} bytes; this server takes at most {limit} "
                      "(--max-body)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Problem(413, f"the body is over {limit} bytes, this server's limit "
                          "(--max-body)")
        chunks.append(chunk)
    return b"".join(chunks)


def _text(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Problem(400, f"the body is not valid UTF-8 (byte {error.start})") from None


def parse_json(body: bytes) -> dict:
    text = _text(body)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise Problem(400, f"the body is not valid JSON: {error.msg} (line {error.lineno}, "
                      f"column {error.colno})") from None
    if not isinstance(value, dict):
        raise Problem(422, f"the body must be a JSON object, not {_json_type(value)}")
    return value


def parse_fields(request, body: bytes) -> dict:
    """LibreTranslate's fields: a form (what its Python client sends) or JSON (what its
    browser extension sends; also a JSON body that `curl -d` labels as a form)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        raise Problem(415, "send JSON or application/x-www-form-urlencoded, not multipart")
    if kind == "application/x-www-form-urlencoded" and not body.lstrip().startswith(b"{"):
        try:
            pairs = parse_qs(_text(body), keep_blank_values=True, errors="strict")
        except UnicodeDecodeError as error:
            raise Problem(400, f"the form is not valid UTF-8 ({error.reason})") from None
        return {key: values if key == "q" and len(values) > 1 else values[-1]
                for key, values in pairs.items()}
    return parse_json(body) if body.strip() else {}


# ------------------------------------------------------------------------------- the endpoints


def build_app(service: Service, log):
    """The Starlette application of a service."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    def answer(payload, status: int = 200, headers: dict | None = None) -> Response:
        return Response(json.dumps(payload, ensure_ascii=False), status, headers,
                        media_type="application/json")

    def endpoint(handler):
        """A handler whose Problems (and bugs) become JSON error answers."""
        async def handle(request):
            try:
                return await handler(request)
            except Problem as problem:
                return answer({"error": problem.message}, problem.status, problem.headers)
            except Exception as error:  # a bug: one line in the log, a 500, the server goes on
                log(f"serve: request #{request.state.id}: internal error: {error!r}")
                return answer({"error": f"internal error: {error}"}, 500)
        return handle

    async def health(request):
        if service.translator is None:
            return answer({"status": "loading", "model": service.model_id}, 503,
                          {"Retry-After": "1"})
        return answer({"status": "ok", "model": service.model_id,
                       "queued_lines": service.queue.waiting})

    async def models(request):
        service.check_key(request)
        return answer({"object": "list", "data": [service.describe()]})

    async def translate_v1(request):
        body = await read_body(request, service.options.max_body)
        fields = parse_json(body)
        service.check_key(request, fields)
        unknown = sorted(set(fields) - V1_FIELDS)
        if unknown:
            raise Problem(422, f"unknown field {unknown[0]!r} (fields: "
                          f"{', '.join(sorted(V1_FIELDS - {'api_key'}))})")
        service.check_model(fields.get("model"))
        text = fields.get("text")
        if text is None:
            raise Problem(422, "the body needs a 'text' field: a list of lines")
        lines = [text] if isinstance(text, str) else text
        if not isinstance(lines, list):
            raise Problem(422, f"text must be a list of strings, not {_json_type(text)}")
        service.check_lines(lines, "text")
        scores = fields.get("scores", False)
        if not isinstance(scores, bool):
            raise Problem(422, f"scores must be true or false, not {_json_type(scores)}")
        job = await service.translate(request, lines, service.settings_of(fields))
        nbest = job.translator.options.nbest
        translations, line_scores = [], []
        for hypotheses, texts in job.outputs:
            if nbest == 1:
                translations.append(texts[0])
                line_scores.append(_score(hypotheses[0].score))
            else:  # always K per line, as `attn decode --nbest K` prints them
                missing = nbest - len(texts)
                translations.append(list(texts) + [""] * missing)
                line_scores.append([_score(h.score) for h in hypotheses] + [None] * missing)
        payload = {"model": service.model_id,
                   "translations": translations[0] if isinstance(text, str) else translations}
        if scores or nbest > 1:
            payload["scores"] = line_scores[0] if isinstance(text, str) else line_scores
        return answer(payload)

    async def translate_libre(request):
        body = await read_body(request, service.options.max_body)
        fields = parse_fields(request, body)
        service.check_key(request, fields)
        q = fields.get("q")
        if q is None:
            raise Problem(400, "Invalid request: missing q parameter")
        for name in ("source", "target"):
            if not isinstance(fields.get(name), str) or not fields[name]:
                raise Problem(400, f"Invalid request: missing {name} parameter")
        if fields.get("format", "text") != "text":
            raise Problem(400, f"format {fields['format']!r} is not supported: attn translates "
                          "plain text (format 'text')")
        service.check_pair(fields["source"], fields["target"])
        texts = [q] if isinstance(q, str) else q
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise Problem(400, "Invalid request: q must be a string or a list of strings")
        try:
            alternatives = int(fields.get("alternatives", 0))
        except (TypeError, ValueError):
            raise Problem(400, "Invalid request: alternatives must be an integer") from None
        if not 0 <= alternatives < service.options.max_beam:
            raise Problem(400, f"Invalid request: alternatives must be 0 to "
                          f"{service.options.max_beam - 1}")
        # A text is its lines, each translated (LibreTranslate keeps paragraphs), joined again.
        split = [[line.removesuffix("\r") for line in t.split("\n")] for t in texts]
        lines = [line for parts in split for line in parts]
        service.check_lines(lines, "q")
        settings = {}
        if alternatives:
            settings["nbest"] = alternatives + 1
            settings["beam"] = max(service.translator.options.beam if service.translator
                                   else 1, alternatives + 1)
        job = await service.translate(request, lines, settings)
        outputs = iter(job.outputs)
        translated, others = [], []
        for parts in split:
            found = [next(outputs)[1] for _ in parts]
            translated.append("\n".join(texts[0] for texts in found))
            others.append(["\n".join(texts[k] if k < len(texts) else "" for texts in found)
                           for k in range(1, alternatives + 1)])
        payload = {"translatedText": translated[0] if isinstance(q, str) else translated}
        if alternatives:
            payload["alternatives"] = others[0] if isinstance(q, str) else others
        return answer(payload)

    async def languages(request):
        if service.langs is None:
            return answer([])
        source, target = service.langs
        return answer([{"code": source, "name": LANGUAGE_NAMES.get(source, source),
                        "targets": [target]},
                       {"code": target, "name": LANGUAGE_NAMES.get(target, target),
                        "targets": []}])

    async def frontend_settings(request):
        source, target = service.langs or ("auto", "")
        return answer({"charLimit": service.options.max_line_chars,
                       "frontendTimeout": 500, "apiKeys": bool(service.options.api_key),
                       "keyRequired": bool(service.options.api_key), "suggestions": False,
                       "filesTranslation": False, "supportedFilesFormat": [],
                       "language": {"source": {"code": source,
                                               "name": LANGUAGE_NAMES.get(source, source)},
                                    "target": {"code": target,
                                               "name": LANGUAGE_NAMES.get(target, target)}}})

    routes = [Route("/health", endpoint(health), methods=["GET"]),
              Route("/v1/models", endpoint(models), methods=["GET"]),
              Route("/v1/translate", endpoint(translate_v1), methods=["POST"]),
              Route("/translate", endpoint(translate_libre), methods=["POST"]),
              Route("/languages", endpoint(languages), methods=["GET", "POST"]),
              Route("/frontend/settings", endpoint(frontend_settings), methods=["GET"])]

    async def not_found(request, exc):
        status = getattr(exc, "status_code", 404)
        message = ("no such endpoint (POST /v1/translate, GET /v1/models, GET /health, POST "
                   "/translate, GET /languages)" if status == 404 else
                   f"{request.method} is not allowed here" if status == 405 else str(exc))
        return answer({"error": message}, status)

    application = Starlette(routes=routes, exception_handlers={404: not_found,
                                                               405: not_found})
    return RequestLog(application, service, log)


class RequestLog:
    """ASGI middleware: a request number for each request (the X-Request-Id header), and one
    stderr line per request: number, method, path, status, lines, milliseconds."""

    def __init__(self, app, service: Service, log):
        self.app, self.service, self.log = app, service, log

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
            self.log(f"serve: #{number} {scope['method']} {scope['path']} "
                     f"{status[0] or 'no answer'}"
                     + (f" {lines} line{'s' if lines != 1 else ''}" if lines is not None else "")
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
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise AttnError(f"attn serve needs its web server: {EXTRA}") from None

    service = Service(model_paths, options, load, log)
    sock = listening_socket(options.host, options.port)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(build_app(service, log), log_config=None, access_log=False,
                            lifespan="off", limit_concurrency=options.max_connections,
                            timeout_graceful_shutdown=None, server_header=False)
    server = uvicorn.Server(config)

    async def run() -> None:
        loop = asyncio.get_running_loop()

        def stop() -> None:  # from the loading thread
            loop.call_soon_threadsafe(setattr, server, "should_exit", True)

        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.005)
        if server.started:
            shown = f"[{host}]" if ":" in host else host
            log(f"serve: listening on http://{shown}:{port} ({service.model_id}: loading; "
                "GET /health says when it is ready)")
            loader = threading.Thread(target=service.load, args=(stop,), daemon=True,
                                      name="attn-serve-load")
            loader.start()
        await serving
        if server.started:
            await asyncio.to_thread(loader.join)

    # uvicorn catches SIGTERM and Ctrl-C for its graceful stop and raises the signal again once
    # stopped: with these handlers in place that second one does nothing, and a stop asked for
    # is an exit with status 0 (a second Ctrl-C still cuts the wait for open requests short).
    # The event loop shares the GIL with the search workers, whose steps at small batches are
    # mostly Python: hand the GIL over every 0.5 ms (CPython's default: 5 ms), so that a request
    # waits less for the loop to read it.
    sys.setswitchinterval(0.0005)
    # oneDNN keeps the kernels it made for every matrix shape it has seen, in two caches of 1024
    # each (the packed linear layers': ~1 GB for the demo model), and a server's batches keep
    # bringing new shapes: bounded so, its memory stays flat. The environment may say otherwise.
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(KERNEL_CACHE))
    handlers = {number: signal.signal(number, lambda *_: None)
                for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        asyncio.run(run())
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
