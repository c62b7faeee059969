"""`attn serve`: the models loaded once, translating over HTTP (pip install 'attn[serve]').

Endpoints (JSON in and out; errors are `{"error": "..."}` with a 4xx/5xx status):
- `POST /v1/translate` `{"text": [lines], "model"? or "source"? and "target"?, "split"?,
  "beam"?, "nbest"?, "alpha"?, "max_len_a"?, "max_len_b"?, "stop"?, "sample"?, "topk"?,
  "topp"?, "temperature"?, "seed"?, "raw"?, "scores"?}` → `{"model", "translations": [...],
  "scores"?: [...]}`: one output per line, in order, an empty line for an empty line, the same
  text as `attn decode` with those options (with nbest K > 1, each output is a list of K, as
  decode's K lines); `split: true` cuts each line into sentences (api.joined_outputs).
- `GET /v1/models` (every model), `GET /health` (200 once every model is loaded, 503 before).
- `GET /metrics` (Prometheus), the translation cache and --req-limit's 429: operations.py.
- LibreTranslate's API, so its clients, apps and browser extensions work unchanged:
  `POST /translate` (`q` a string or a list, `source` (or "auto"), `target`, `format` ("text"
  or "html"), `alternatives`, `api_key`; JSON or a form) → `{"translatedText",
  "alternatives"?, "detectedLanguage"?}`, each text cut into sentences and joined again (HTML:
  its markup put back by the words' alignments, decode/markup.py); `POST /detect` (detect.py); `POST
  /translate_file` (.txt, .html, .htm) → `{"translatedFileUrl"}` and `GET
  /download_file/<name>` (downloads.py); `GET /languages`, `GET /frontend/settings`.

A server holds one model per language pair (`-m en-de=a.st -m de-en=b.st`, `model_groups`), each
its own Translator, all behind one RequestQueue; requests pick theirs by `source` and `target`
(or /v1/translate's `model`).

The HTTP side runs on uvicorn's event loop, behind http.py's connection limits (the time and size
of what a client sends, the number of connections); translation runs in
`request_queue.RequestQueue`'s search workers, which batch the lines of requests arriving together.
The server listens before the models are loaded (`/health` says when it is ready), answers
SIGTERM by refusing new connections, finishing the requests it has, and exiting 0, and logs one
line per request on stderr (id, method, path, status, lines, milliseconds). stdout stays empty.

What a request may ask and what it is answered are api.py's pure functions. Here: the `Service`
(the models, the queue, the search of a request's lines), the endpoints that read a request and
call api.py, and the process (`serve`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
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
from .downloads import FILE_SECONDS, Downloads
from .keys import Keys
from .operations import Operations

EXTRA = "pip install 'attn[serve]'"
KERNEL_CACHE = 128  # oneDNN kernels kept (see `tune_process`)
# -m SOURCE-TARGET=FILE: letters only on each side, so that a path is seldom taken for a pair;
# several pairs of one model as SOURCE-TARGET,SOURCE-TARGET=FILE.
PAIR = r"[A-Za-z]{2,8}-[A-Za-z]{2,8}"
PAIRED_MODEL = re.compile(rf"((?:{PAIR},)*{PAIR})=(.+)")


class Model:
    """One model the server translates with (an ensemble: several files) and its pair:
    `served`, as requests name it; `translator`, once loaded."""

    def __init__(self, served: api.Served, paths: list[Path], metadata: dict):
        self.served, self.paths, self.metadata = served, paths, metadata
        self.translator = None


def model_groups(values: list[str], options: ServeOptions) -> list[tuple]:
    """`-m` values as the models of a server: (pair or None, files) each. `SOURCE-TARGET=FILE`
    serves FILE for that pair, and the same pair again makes an ensemble of its files (`attn
    decode`'s -m twice, per pair); plain FILEs are one model (an ensemble if several) whose
    pair is --langs or its metadata's. A path that only looks like a pair is written ./en-de=x.
    `en-fr,en-de=multi.st` is `en-fr=multi.st -m en-de=multi.st`: a model of several target
    languages (tags.py) served for each, the file loaded once (`Service.load`)."""
    paired, plain = {}, []
    for value in values:
        match = PAIRED_MODEL.fullmatch(value)
        if match:
            for pair in match[1].split(","):
                source, target = pair.split("-")
                paired.setdefault((source, target), []).append(Path(match[2]))
        else:
            plain.append(Path(value))
    if paired and plain:
        raise AttnError(f"-m {plain[0]} names no language pair, but other -m do: give each "
                        "its pair (-m SOURCE-TARGET=FILE), or none (one model, or an ensemble)")
    if paired and options.langs:
        raise AttnError("--langs is the pair of a model given without one; here each -m names "
                        "its pair (SOURCE-TARGET=FILE)")
    if paired and options.name:
        raise AttnError("--name is the id of a server's one model; with SOURCE-TARGET=FILE "
                        "each model's id is its pair (en-de)")
    return list(paired.items()) or [(None, plain)]


class Service:
    """The models (loaded in the background), the queue, and the search behind the endpoints."""

    def __init__(self, groups: list[tuple], options: ServeOptions, load, log):
        from .. import stfile

        self.options, self.log = options, log
        self._load = load  # (files) → Translator, the slow part (torch, the weights)
        self.models: list[Model] = []
        for langs, paths in groups:
            # The headers now: a missing or wrong file is an error before the server listens.
            headers = [stfile.read_attn_header(path, MODEL_FORMAT, "model file")
                       for path in paths]
            metadata = headers[0].metadata
            if langs is None:
                model_id = options.name or "+".join(Path(path).stem for path in paths)
                langs = options.langs or parse_langs(metadata.get("langs"))
            else:
                model_id = "-".join(langs)
                written = metadata.get("langs")
                if written and written != model_id:  # told, not refused: -m says what it is
                    log(f"serve: {paths[0]} says it translates {written}; serving it as "
                        f"{model_id}, as -m says")
            self.models.append(Model(api.Served(model_id, langs), paths, metadata))
        self.served = [model.served for model in self.models]
        self.by_id = {model.served.id: model for model in self.models}
        self.model_id = ", ".join(self.by_id)  # what the log calls the models
        self.detector = None  # detect.Detector, with two source languages or more
        self.downloads = Downloads()  # /translate_file's translations
        self.queue = None  # set once every model is loaded: the service is ready
        self.failure: str | None = None
        self.requests = itertools.count(1)
        self.lines_translated = 0
        # what one request's search may cost (Translator.search_work): --max-request-tokens,
        # or --max-request-seconds of one search worker here, measured once loaded
        self.work_budget = options.max_request_tokens or None
        # --api-key's one key, --api-keys' file of keys with their own limits (keys.py)
        self.keys = Keys(options.api_key, options.api_keys)
        # /metrics, the translation cache and the request rates (operations.py)
        self.operations = Operations(options, lambda: self.queue, self.keys)

    def admit(self, request, fields: dict | None = None) -> ServeOptions:
        """A request's key (401 without one the server takes), its key's rate where the key was
        in the body (429), and the options it is held to (the key's character limit)."""
        key = api.find_key(self.keys, request.headers, fields)
        if key is not None:
            self.operations.charge_key(request.scope, key)
        return api.options_for(self.options, key)

    @property
    def ready(self) -> bool:
        return self.queue is not None

    def load(self, stop) -> None:
        """Load the models (and the language detector), warm the search up, start the workers;
        on failure, say why and `stop()` the server."""
        started = time.perf_counter()
        try:
            from .request_queue import RequestQueue

            sources = api.source_languages(self.served)
            if len(sources) > 1:
                from .detect import Detector

                self.detector = Detector(sources)
            loaded = {}  # the pairs of one file (or ensemble) share its loaded models
            for model in self.models:
                translator = loaded.get(tuple(model.paths))
                if translator is None:
                    translator = loaded[tuple(model.paths)] = self._load(model.paths)
                    translator.search(translator.encode(["warm up"], 1))  # kernels made once
                    if not self.options.max_request_tokens:
                        budget = self.options.max_request_seconds * work_rate(translator)
                        self.work_budget = min(self.work_budget or budget, budget)
                model.translator = translator = tagged(translator, model)
            options = translator.options
            # One queue for every model: its workers (as many as `attn decode` would run: the
            # cores, on a CPU) search whichever pair's lines wait first, never mixing models in
            # a batch (Job.shares_batches_with). A queue per pair would run that many workers
            # per pair, overcommitting the cores whenever two pairs are busy, and split
            # --queue-lines.
            self.queue = RequestQueue(options.workers, options.worker_threads,
                                      self.options.queue_lines, self.options.gather_ms / 1000,
                                      self.operations.metrics.batch_formed)
        except Exception as error:  # told in one line; the server stops with status 2
            self.failure = str(error) if isinstance(error, AttnError) else repr(error)
            stop()
            return
        self.work_budget = int(self.work_budget)
        measured = "" if self.options.max_request_tokens else \
            f" (--max-request-seconds {self.options.max_request_seconds:g} of one worker here)"
        self.log(f"serve: {self.model_id} loaded in {time.perf_counter() - started:.2f}s, ready "
                 f"({translator.device}, {options.workers} search worker(s) × "
                 f"{options.worker_threads} thread(s), batches of {options.batch_tokens} "
                 f"source tokens × beam; a request may cost {self.work_budget:,} hypothesis "
                 f"steps{measured})")

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
        self.downloads.close()

    @property
    def default_beam(self) -> int:
        """The beam of a request that asks for none (1 while loading: then refused anyway)."""
        return self.models[0].translator.options.beam if self.ready else 1

    def detect(self, text: str, candidates: list[str]) -> list[tuple[str, float]]:
        """`candidates` (source languages served) ranked for `text`, confidence 0-100."""
        if self.detector is None:  # one source language: it
            return [(code, 100.0) for code in candidates]
        return self.detector.rank(text, candidates)

    async def translate(self, parts: list[tuple[api.Served, list[str]]], settings: dict,
                        client_gone, name: str = "request",
                        controls: api.RequestControls | None = None) -> list:
        """The jobs of a request, one per model it needs (`parts`: each model with its lines),
        searched with `settings` (DecodeOptions fields), once every line has its output:
        refused (422) before any search if their work together is over --max-request-tokens,
        cancelled if the client goes away first (`client_gone()` returns: 499) or
        --request-timeout passes (504). `name` names the request in warnings. `controls`: the
        request's prefixes, phrases and glossary (`api.v1_controls`; prefixes and phrases for
        a request of one part only); a model's --glossary applies to every request."""
        if not self.ready:
            raise Problem(503, "the models are still loading (GET /health says when they are "
                          "ready)", {"Retry-After": "1"})
        from ..decode.options import OutOfRange  # torch: never before `tune_process`
        from .request_queue import Job, QueueFull

        loop = asyncio.get_running_loop()
        jobs, answers, lookups = [], [], []
        for served, lines in parts:
            try:
                translator = self.by_id[served.id].translator.with_options(**settings)
            except OutOfRange as error:  # DecodeOptions' ranges, naming the JSON field
                raise Problem(422, f"{error.field} {error.rule}") from None
            except AttnError as error:  # the settings that go together
                raise Problem(422, str(error)) from None
            answered = loop.create_future()

            def done(job, answered=answered) -> None:  # from a search worker
                loop.call_soon_threadsafe(_resolve, answered, job)

            line_controls = (controls or api.RequestControls()).line_controls(translator, lines)
            # those found are not searched
            cached = self.operations.look_up(translator, lines, line_controls)
            jobs.append(Job(cached.to_search, translator, done, name=name,
                            controls=line_controls))
            answers.append(answered)
            lookups.append(cached)
        api.check_work(sum(job.work for job in jobs), self.work_budget)
        submitted = []
        try:
            for job in jobs:
                self.queue.submit(job)
                submitted.append(job)
        except QueueFull as error:
            for job in submitted:
                self.queue.cancel(job)
            raise Problem(503, f"the server is busy ({error}): try again shortly",
                          {"Retry-After": "1"}) from None
        await self._answered(jobs, answers, client_gone)
        failed = next((job.error for job in jobs if job.error is not None), None)
        if failed is not None:
            raise Problem(500, f"the search failed: {failed}")
        for cached, job in zip(lookups, jobs):
            self.operations.answered(cached, job)
        self.lines_translated += sum(len(lines) for _, lines in parts)
        return jobs

    async def _answered(self, jobs: list, answers: list, client_gone) -> None:
        """Until every job is answered; if the client goes away or the deadline passes first,
        or this task is cancelled, the jobs are called off (`RequestQueue.cancel`: their lines
        stop costing within a search step) and the request refused."""
        gone = asyncio.ensure_future(client_gone())
        every = asyncio.gather(*answers)
        # Whatever ends them, their outcome is read: a gather cancelled before its answers ends
        # with a CancelledError set as its exception (Python 3.11), and a future whose exception
        # nobody reads is logged with a traceback when collected ("_GatheringFuture exception
        # was never retrieved"), long after the client went away.
        for future in (gone, every):
            future.add_done_callback(_outcome_read)
        timeout = self.options.request_timeout
        try:
            await asyncio.wait({every, gone}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            client_left = gone.done()
        finally:
            gone.cancel()
            for job, answered in zip(jobs, answers):
                if not answered.done():
                    self.queue.cancel(job)
            if not every.done():
                every.cancel()
        if every.done() and not every.cancelled():
            return
        if client_left:
            raise Problem(499, "the client went away")
        raise Problem(504, f"no answer within {timeout:g} s, this server's limit for a request "
                      "(--request-timeout): send fewer lines, or ask for a smaller beam or "
                      "max_len_b")

    def describe(self, model: Model) -> dict:
        """A model as /v1/models lists it."""
        config = ModelConfig.from_json(model.metadata["config"])
        options = model.translator.options if model.translator is not None else None
        langs = model.served.langs
        tags = {} if options is None or not options.source_tags else {
            "source_tags": [model.translator.src_vocab.piece(index)
                            for index in options.source_tags]}
        return {"id": model.served.id, "object": "model", "ready": model.translator is not None,
                **tags,
                "files": [str(path) for path in model.paths],
                "source": langs[0] if langs else None, "target": langs[1] if langs else None,
                "config": {key: getattr(config, key) for key in
                           ("d_model", "d_ff", "heads", "encoder_layers", "decoder_layers",
                            "src_vocab_size", "tgt_vocab_size")},
                "defaults": None if options is None else
                {"beam": options.beam, "alpha": options.alpha, "max_len_a": options.max_len_a,
                 "max_len_b": options.max_len_b, "stop": options.stop.value},
                "limits": {"max_lines": self.options.max_lines,
                           "max_line_chars": self.options.max_line_chars,
                           "char_limit": self.options.char_limit,
                           "max_body_bytes": self.options.max_body,
                           "max_beam": self.options.max_beam,
                           "max_request_tokens": self.work_budget,
                           "request_timeout_s": self.options.request_timeout}}


def tagged(translator, model: Model):
    """The translator of a served pair: where the model knows target-language tags (tags.py), a
    view whose sources start with the tag of the pair's target (`Translator.with_target`); a
    model whose languages are tokens (NLLB-200, M2M-100), a view whose sources start with the
    pair's source code and whose outputs with its target's; a model without them, as it is.
    A model of several targets served without a pair (or for a target it has no tag for) is
    refused: its translations would be of no chosen language."""
    from ..tags import vocabulary_tags

    langs, path = model.served.langs, model.paths[0]
    if translator.metadata.get("lang_codes"):  # NLLB-200, M2M-100: the languages are tokens
        if langs is None:
            raise AttnError(f"{path} translates between many languages (NLLB-200 or M2M-100): "
                            f"serve it for each pair, -m en-fr,en-de={path}")
        return translator.with_target(langs[1], f"model file {path}", "-m", source=langs[0])
    targets = vocabulary_tags(translator.src_vocab).targets
    if not targets:
        return translator
    if langs is None:
        example = ",".join(f"SOURCE-{code}" for code in sorted(targets)[:3])
        raise AttnError(f"{path} translates into several languages (its target tags: "
                        f"{', '.join(sorted(targets))}): serve it for each pair, "
                        f"-m {example}={path}")
    if langs[1] not in targets:
        raise AttnError(f"{path} has no tag for {langs[1]}, the target of {'-'.join(langs)} "
                        f"(its target tags: {', '.join(sorted(targets))}): serve it for the "
                        "targets it knows")
    return translator.with_target(langs[1])


def work_rate(translator) -> float:
    """`Translator.search_work`'s units one search worker gets through in a second here: a
    search of known cost (beam 8, every hypothesis to 96 positions), on a worker's threads, the
    faster of two. What --max-request-seconds turns into the default budget of a request."""
    import torch

    from ..formats import Stop

    probe = translator.with_options(beam=8, nbest=1, sample=False, max_len_a=0.0, max_len_b=96,
                                    stop=Stop.limit)
    ids = probe.encode(["How long does a search take on this machine?"], 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(translator.options.worker_threads)
    try:
        seconds = []
        for _ in range(2):
            started = time.perf_counter()
            probe.search(ids)
            seconds.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return probe.search_work(ids) / max(min(seconds), 1e-6)


def _resolve(future, job) -> None:
    if not future.done():
        future.set_result(job)


def _outcome_read(future) -> None:
    """A done callback: the future's exception, if it has one, counted as read."""
    if not future.cancelled():
        future.exception()


# ------------------------------------------------------------------------------- the endpoints
# Each reads the Service from `request.app.state.service`, the body through `read_body`, and
# leaves the rest to api.py; a Problem it raises becomes the JSON error answer (`endpoint`).


async def health(request):
    service = request.app.state.service
    loaded = {model.served.id: "ok" if model.translator is not None else "loading"
              for model in service.models}
    if not service.ready:
        return answer({"status": "loading", "model": service.model_id, "models": loaded}, 503,
                      {"Retry-After": "1"})
    return answer({"status": "ok", "model": service.model_id, "models": loaded,
                   "queued_lines": service.queue.waiting,
                   "searching_lines": service.queue.searching})


async def models(request):
    service = request.app.state.service
    service.admit(request)
    return answer({"object": "list", "data": [service.describe(model)
                                              for model in service.models]})


async def translate_v1(request):
    service = request.app.state.service
    fields = api.json_fields(await read_body(request, service.options.max_body))
    options = service.admit(request, fields)
    asked = api.v1_request(fields, options, service.served)
    controls = api.v1_controls(fields, asked)
    if asked.split:
        source = asked.model.langs[0] if asked.model.langs else None
        routes = [api.Route(asked.model, source)] * len(asked.lines)
        split = api.split_sentences(asked.lines, [source] * len(asked.lines), options,
                                    "text", asked.single)
        outputs, nbest = await _translate_split(request, split, routes, asked.settings,
                                                controls)
    else:
        (job,) = await _search(request, [(asked.model, asked.lines)], asked.settings,
                               controls)
        outputs, nbest = job.outputs, job.translator.options.nbest
        if asked.alignment:
            # a teacher-forced pass of the model over the request's lines (`Translator.align`),
            # off the event loop as `_translate_html`'s; the lines as sent (the cache blanks
            # those it answers in `job.lines`)
            alignments = await asyncio.to_thread(api.output_alignments, asked.lines, outputs,
                                                 job.translator.align)
            return answer(api.v1_answer(asked.model.id, asked, outputs, nbest, alignments))
    return answer(api.v1_answer(asked.model.id, asked, outputs, nbest))


def libre_statuses(handler):
    """LibreTranslate answers every bad value 400 (its clients look for that), where
    /v1/translate tells a body that does not parse (400) from a value out of bounds (422)."""
    async def handle(request):
        try:
            return await handler(request)
        except Problem as problem:
            if problem.status == 422:
                raise Problem(400, problem.message, problem.headers) from None
            raise
    return handle


@libre_statuses
async def translate_libre(request):
    """Each text of `q` cut into sentences, which are searched as the lines of the request
    (in batches with other requests' lines), and joined again with the text's own spacing.
    `format: "html"`: each text an HTML document whose runs' sentences are searched so, then
    aligned, and the document rendered with its markup (`_translate_html`); `alternatives`
    K with HTML: alternative k renders each sentence's k-th best (its best where the search
    found fewer), aligned on its own."""
    service = request.app.state.service
    body = await read_body(request, service.options.max_body)
    fields = api.libre_fields(request.headers.get("content-type", ""), body)
    options = service.admit(request, fields)
    asked = api.libre_request(fields, options, service.default_beam)
    # HTML is slow to read (about 1 s for a 600 KB page): off the event loop. Texts within
    # --char-limit are split in place (a thread hop would cost short requests more).
    outputs, routes = await _translate_texts(request, asked.texts, asked.source, asked.target,
                                             asked.html, asked.settings, "q", asked.single,
                                             off_loop=asked.html, options=options)
    return answer(api.libre_answer(asked, outputs, routes))


async def _translate_texts(request, texts: list[str], source: str, target: str, html: bool,
                           settings: dict, field: str, single: bool, off_loop: bool,
                           options) -> tuple[list, list]:
    """LibreTranslate's texts translated (`api.libre_texts`, in a thread if `off_loop`) under
    `options` (the server's, or its API key's: `Service.admit`): each text's outputs
    (`api.joined_outputs`' shape) and routes."""
    service = request.app.state.service

    def prepare() -> api.Texts:
        return api.libre_texts(texts, source, target, html, service.served, service.detect,
                               options, field, single)

    prepared = await asyncio.to_thread(prepare) if off_loop else prepare()
    if html:
        outputs = await _translate_html(request, prepared, settings)
    else:
        outputs, _ = await _translate_split(request, prepared.split, prepared.routes, settings)
    return outputs, prepared.routes


@libre_statuses
async def detect(request):
    service = request.app.state.service
    body = await read_body(request, service.options.max_body)
    fields = api.libre_fields(request.headers.get("content-type", ""), body)
    options = service.admit(request, fields)
    text = api.detect_request(fields, options)
    candidates = api.source_languages(service.served)
    if not candidates:
        raise Problem(400, "this server does not know the language it translates from "
                      "(attn serve --langs, or -m SOURCE-TARGET=FILE): it cannot detect")
    if not service.ready:
        raise Problem(503, "the models are still loading (GET /health says when they are "
                      "ready)", {"Retry-After": "1"})
    return answer(api.detections(service.detect(text, candidates)))


@libre_statuses
async def translate_file(request):
    """A .txt file translated as one text of /translate (sentence by sentence, its line
    breaks and spacing kept), an .html or .htm file as one HTML document, a .docx, .srt or .vtt
    document paragraph by paragraph or cue by cue (documents.py), answered with the URL to
    download the translation from."""
    service = request.app.state.service
    body = await read_body(request, service.options.max_body)
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "multipart/form-data":
        raise Problem(400, "Invalid request: send the file as multipart/form-data (fields "
                      "file, source, target)")
    fields, files = api.multipart_fields(content_type, body)
    options = service.admit(request, fields)
    asked = await asyncio.to_thread(api.file_request, fields, files)  # a .docx is unzipped
    if asked.document is not None:  # .docx, .srt, .vtt: its texts as HTML, written back
        document = asked.document
        outputs = []
        if document.texts:
            outputs, _ = await _translate_texts(request, document.texts, asked.source,
                                                asked.target, True, {}, "file", False,
                                                off_loop=True, options=options)
        data = await asyncio.to_thread(document.rebuild, [output[0][1] for output in outputs])
    else:
        # a file may be long (--max-body): detected and read off the event loop
        outputs, _ = await _translate_texts(request, [asked.text], asked.source, asked.target,
                                            asked.html, {}, "file", True, off_loop=True,
                                            options=options)
        data = (("\ufeff" if asked.bom else "") + outputs[0][0][1]).encode("utf-8")
    stored = await asyncio.to_thread(service.downloads.add, api.download_name(asked.name),
                                     data)
    return answer({"translatedFileUrl": f"{request.base_url}download_file/{stored}"})


async def download_file(request):
    found = await asyncio.to_thread(request.app.state.service.downloads.get,
                                    request.path_params["name"])
    if found is None:
        raise Problem(404, "no such file: a translated file is kept for "
                      f"{FILE_SECONDS / 60:g} minutes after POST /translate_file answers its "
                      "URL")
    data, name = found
    from starlette.responses import Response

    return Response(data, 200, {"Content-Disposition": f'attachment; filename="{name}"'},
                    media_type=api.media_type(name))


async def languages(request):
    return answer(api.languages(request.app.state.service.served))


async def frontend_settings(request):
    service = request.app.state.service
    return answer(api.frontend_settings(service.options, service.served))


PAGE = Path(__file__).parent / "page" / "index.html"
# The page's scripts and styles are its own (inline); it fetches from this server only.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


async def page(request):
    """GET /: the web page (page/index.html), for people; outside --api-key (it asks for the
    key and sends it with each request)."""
    from starlette.responses import Response

    return Response(PAGE.read_bytes(), 200, PAGE_HEADERS, media_type="text/html; charset=utf-8")


async def not_found(request, exc):
    status = getattr(exc, "status_code", 404)
    message = ("no such endpoint (GET / for the web page, POST /v1/translate, GET /v1/models, "
               "GET /health, POST /translate, POST /detect, POST /translate_file, GET "
               "/languages)"
               if status == 404 else
               f"{request.method} is not allowed here" if status == 405 else str(exc))
    return answer({"error": message}, status)


ROUTES = [("/", page, ["GET"]), ("/health", health, ["GET"]), ("/v1/models", models, ["GET"]),
          ("/v1/translate", translate_v1, ["POST"]), ("/translate", translate_libre, ["POST"]),
          ("/detect", detect, ["POST"]), ("/translate_file", translate_file, ["POST"]),
          ("/download_file/{name}", download_file, ["GET"]),
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
    paths = [route.path for route in routes]
    return RequestLog(service.operations.middleware(application, paths), service)


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


async def _search(request, parts: list[tuple[api.Served, list[str]]], settings: dict,
                  controls: api.RequestControls | None = None) -> list:
    """The service's jobs for a request's lines (`parts`: each model's; counted in its log
    line), cancelled if its client goes away."""
    request.state.lines = sum(len(lines) for _, lines in parts)
    return await request.app.state.service.translate(
        parts, settings, lambda: _client_gone(request), name=f"serve: request #{request.state.id}",
        controls=controls)


async def _translate_split(request, split, routes: list[api.Route], settings: dict,
                           controls: api.RequestControls | None = None) -> tuple[list, int]:
    """Texts cut into sentences (`split`), each text's sentences searched by its route's
    model, all in one request's jobs: each text's outputs (`api.joined_outputs`) and nbest.
    `controls`: a request's glossary (its terms found in each sentence)."""
    groups = api.grouped(routes)
    jobs = await _search(request, [(model, api.group_sentences(split, texts))
                                   for model, texts in groups], settings, controls)
    nbest = jobs[0].translator.options.nbest if jobs else settings.get("nbest", 1)
    outputs = api.regrouped(split, groups, [job.outputs for job in jobs])
    return api.joined_outputs(split, outputs, nbest), nbest


async def _translate_html(request, prepared: api.Texts, settings: dict) -> list:
    """HTML documents (`prepared`: `api.libre_texts`' with html) translated: their sentences
    searched as the lines of the request, like `_translate_split`'s; then, in a thread, the
    outputs aligned with their sentences (`Translator.align`: one teacher-forced pass of
    each model over its lines) and each document rendered (`api.html_outputs`). Each
    document's outputs, in `api.joined_outputs`' shape."""
    groups = api.grouped(prepared.routes)
    # The lines as sent, from this list: the cache blanks those it answers in `job.lines`.
    parts = [(model, api.group_sentences(prepared.split, texts)) for model, texts in groups]
    jobs = await _search(request, parts, settings)
    nbest = jobs[0].translator.options.nbest if jobs else settings.get("nbest", 1)

    def render() -> list:
        aligned = [api.aligned_outputs(lines, job.outputs, nbest, job.translator.align)
                   for job, (_, lines) in zip(jobs, parts)]
        return api.html_outputs(prepared.documents,
                                api.regrouped(prepared.split, groups, aligned), nbest)

    return await asyncio.to_thread(render)


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


def serve(model_values: list[str], options: ServeOptions, load, log) -> None:
    """Serve until SIGTERM or Ctrl-C. `model_values`: the -m values (`model_groups`);
    `load(files)` makes a model's Translator (in the background)."""
    try:
        import httptools  # noqa: F401
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise AttnError(f"attn serve needs its web server: {EXTRA}") from None
    from .http import LINGER, Connections, allow_open_files

    service = Service(model_groups(model_values, options), options, load, log)
    if len(api.source_languages(service.served)) > 1:
        try:
            import py3langid  # noqa: F401
        except ImportError:
            raise AttnError("serving several source languages needs py3langid (source "
                            f"'auto', /detect): {EXTRA}") from None
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
    if options.api_keys is not None and hasattr(signal, "SIGHUP"):  # --api-keys read again
        handlers[signal.SIGHUP] = signal.signal(
            signal.SIGHUP, lambda *_: threading.Thread(target=service.keys.reload,
                                                       daemon=True).start())
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
