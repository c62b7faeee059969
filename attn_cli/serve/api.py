"""What `attn serve`'s endpoints take and answer, as pure functions: a request's fields in, its
lines and search settings out; the search's outputs in, the JSON answer out.

Every refusal of a request is a `Problem` (a 4xx status and a message for the client) raised
here, except the ranges of the search settings, which `decode.options.DecodeOptions` checks for
every caller (the server answers its AttnError with 422). No HTTP, no torch, no sockets: server.py
reads the bodies and runs the search; tests/serve/test_api.py tests these without a server.
What the client sends is read so that no value of it reaches the search unchecked: JSON without
NaN or infinities, integers of at most 19 digits, nesting as deep as the parser goes (400), each
field of its type (422) and range (422: DecodeOptions'), and the request's work within
--max-request-tokens (422; LibreTranslate's endpoints answer each 400, as LibreTranslate does).

Also here: which served model a request reaches (`Served`: by id, by pair, or with source
"auto" by the language detected, `libre_routes`), texts cut into sentences and their outputs
joined again (`split_sentences`, `joined_outputs`), HTML documents read into sentences and
rendered with their translations and alignments (`libre_texts`, `aligned_outputs`,
`html_outputs`: decode/markup.py), and multipart forms (`multipart_fields`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qs

from ..config import MAX_LEN_B, ServeOptions
from ..decode import sentences
from ..decode.markup import HtmlDocument, Run, read_markup, split_runs
from ..decode.sentences import Paragraph, SplitTexts
from ..formats import Stop

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

# The search settings a /v1/translate request may change: field → its JSON type. Their ranges
# are DecodeOptions' (decode/options.py's RANGES); the largest beam and nbest are --max-beam.
SEARCH_FIELDS = {"beam": int, "nbest": int, "alpha": float, "max_len_a": float,
                 "max_len_b": int, "stop": str, "sample": bool, "topk": int, "topp": float,
                 "temperature": float, "seed": int, "raw": bool}
V1_FIELDS = {"text", "model", "source", "target", "split", "scores", "alignment", "prefix",
             "constraints", "glossary", "api_key",
             *SEARCH_FIELDS}
# The most terms a request's own glossary may hold (a server's --glossary has no limit): each is
# cut into pieces and indexed per request.
MAX_REQUEST_GLOSSARY = 1000
# Integers in a body longer than this are refused: every integer a request may send (a beam, a
# seed) fits in 64 bits, and Python refuses to read more than 4,300 digits anyway (an error
# that was a 500).
MAX_INTEGER_DIGITS = 19
# What /translate_file translates (LibreTranslate's `supportedFilesFormat`): text, or HTML.
FILE_FORMATS = (".txt", ".html", ".htm", ".docx", ".srt", ".vtt")  # the last three: documents.py
HTML_FILES = frozenset({".html", ".htm"})
# What /translate's `format` may be.
LIBRE_FORMATS = ("text", "html")
# A text of at most this many characters is too short to tell its language by itself: with
# source "auto" it gets what the request's texts together are detected as (LibreTranslate's).
SHORT_TEXT = 40


class Problem(Exception):
    """An answer other than 200: its status, a message for the client, extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


# ---------------------------------------------------------------------------------- the bodies


def json_fields(body: bytes) -> dict:
    """A JSON body's fields (/v1/translate's): standard JSON (no NaN, no Infinity, numbers a
    float holds), integers of at most MAX_INTEGER_DIGITS, nesting no deeper than the parser's
    recursion allows (about 1,000 levels; any nesting where a field wants a string or a number
    is that field's 422)."""
    text = _text(body)
    try:
        value = json.loads(text, parse_int=_json_integer, parse_float=_json_float,
                           parse_constant=_json_constant)
    except json.JSONDecodeError as error:
        raise Problem(400, f"the body is not valid JSON: {error.msg} (line {error.lineno}, "
                      f"column {error.colno})") from None
    except RecursionError:  # the parser recurses once per level
        raise Problem(400, "the body nests arrays or objects too deeply to be read") from None
    if not isinstance(value, dict):
        raise Problem(422, f"the body must be a JSON object, not {_json_type(value)}")
    return value


def _json_integer(literal: str) -> int:
    digits = len(literal.lstrip("-"))
    if digits > MAX_INTEGER_DIGITS:
        raise Problem(400, f"the body holds an integer of {digits} digits; this server reads "
                      f"at most {MAX_INTEGER_DIGITS}")
    return int(literal)


def _json_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise Problem(400, f"the body holds the number {_shortened(literal)}, too large for a "
                      "float")
    return value


def _json_constant(name: str):
    raise Problem(400, f"the body holds {name}, which is not JSON: send a finite number")


def _shortened(literal: str) -> str:
    return literal if len(literal) <= 20 else f"{literal[:12]}... ({len(literal)} characters)"


def libre_fields(content_type: str, body: bytes) -> dict:
    """LibreTranslate's fields: a form (what its Python client sends; multipart too, as a
    browser's FormData sends it) or JSON (what its browser extension sends; also a JSON body
    that `curl -d` labels as a form)."""
    kind = content_type.split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        return multipart_fields(content_type, body)[0]
    if kind == "application/x-www-form-urlencoded" and not body.lstrip().startswith(b"{"):
        try:
            pairs = parse_qs(_text(body), keep_blank_values=True, errors="strict")
        except UnicodeDecodeError as error:
            raise Problem(400, f"the form is not valid UTF-8 ({error.reason})") from None
        return {key: values if key == "q" and len(values) > 1 else values[-1]
                for key, values in pairs.items()}
    return json_fields(body) if body.strip() else {}


def _text(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Problem(400, f"the body is not valid UTF-8 (byte {error.start})") from None


# ---------------------------------------------------------------------------------- the checks


def find_key(keys, headers: Mapping[str, str], fields: dict | None = None):
    """With --api-key or --api-keys (serve/keys.py's Keys): the key as 'Authorization: Bearer
    KEY', an X-API-Key header, or an `api_key` field (LibreTranslate's way): its Key, or 401
    without one the server takes. None where the server needs no key. `headers`: looked up by
    lower-case name."""
    if keys is None or not keys.required:
        return None
    bearer = headers.get("authorization", "")
    candidates = [bearer[7:].strip() if bearer[:7].lower() == "bearer " else None,
                  headers.get("x-api-key"), (fields or {}).get("api_key")]
    found = next((key for key in (keys.find(given) for given in candidates
                                  if isinstance(given, str)) if key is not None), None)
    if found is None:
        raise Problem(401, "this server needs an API key it knows: send 'Authorization: Bearer "
                      "KEY', an 'X-API-Key: KEY' header, or an api_key field",
                      {"WWW-Authenticate": "Bearer"})
    return found


def options_for(options: ServeOptions, key) -> ServeOptions:
    """The server's options, with the key's own character limit where --api-keys gives it."""
    if key is None or key.char_limit is None:
        return options
    return dataclasses.replace(options, char_limit=key.char_limit)


def check_lines(lines: list, field: str, options: ServeOptions) -> None:
    """Every line a string without a line break, within the server's limits."""
    if len(lines) > options.max_lines:
        raise Problem(422, f"{len(lines)} lines in one request; this server takes at most "
                      f"{options.max_lines} (--max-lines)")
    for index, line in enumerate(lines):
        where = f"{field}[{index}]"
        if not isinstance(line, str):
            raise Problem(422, f"{where} must be a string, not {_json_type(line)}")
        if "\n" in line or "\r" in line:
            raise Problem(422, f"{where} holds a line break: send one line per element")
        if len(line) > options.max_line_chars:
            raise Problem(422, f"{where} is {len(line)} characters; this server takes at most "
                          f"{options.max_line_chars} (--max-line-chars)")
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as error:
            raise Problem(400, f"{where} is not valid Unicode (an unpaired surrogate at "
                          f"character {error.start})") from None


def search_settings(fields: dict, max_beam: int) -> dict:
    """The search settings a /v1/translate body asks for, as DecodeOptions fields: each of its
    JSON type, the beam and nbest within --max-beam, max_len_b within MAX_LEN_B."""
    settings = {}
    for name, kind in SEARCH_FIELDS.items():
        if name not in fields:
            continue
        value = fields[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise Problem(422, f"{name} must be {_TYPE_NAMES[kind]}, not {_json_type(value)}")
        settings[name] = value
    for name in ("beam", "nbest"):
        if settings.get(name, 0) > max_beam:
            raise Problem(422, f"{name} {settings[name]} is above this server's limit of "
                          f"{max_beam} (--max-beam)")
    if settings.get("max_len_b", 0) > MAX_LEN_B:
        raise Problem(422, f"max_len_b must be at most {MAX_LEN_B}")
    if "stop" in settings:
        try:
            settings["stop"] = Stop(settings["stop"])
        except ValueError:
            raise Problem(422, f"stop must be one of {', '.join(s.value for s in Stop)}, "
                          f"not {settings['stop']!r}") from None
    return settings


def check_work(work: int, limit: int) -> None:
    """A request's work (`Translator.search_work`: the hypothesis steps its search may take,
    every beam counted, long outputs weighed more) within the server's budget, before any
    search."""
    if work > limit:
        raise Problem(422, f"this request's search may take {work:,} hypothesis steps (each "
                      "line's beam × its longest allowed output, max_len_a × source tokens + "
                      f"max_len_b, the later positions weighed more), above this server's limit "
                      f"of {limit:,} (--max-request-tokens; by default what one search worker "
                      "does in --max-request-seconds): send fewer lines, or ask for a smaller "
                      "beam, max_len_a or max_len_b")


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _json_type(value) -> str:
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"),
                       (str, "a string"), (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null"


# ------------------------------------------------------------------ the models and their pairs


@dataclass(frozen=True)
class Served:
    """A model as requests name it: its id, and its pair (None: not known; the server has this
    one model and takes any pair)."""

    id: str
    langs: tuple[str, str] | None


def describe_pairs(served: Sequence[Served]) -> str:
    """'en to de, de to en': what error messages say a server translates."""
    return ", ".join(f"{model.langs[0]} to {model.langs[1]}" for model in served
                     if model.langs is not None)


def by_pair(served: Sequence[Served], source: str, target: str) -> Served | None:
    """The model of a pair; the model of a server that takes any pair; or None."""
    if len(served) == 1 and served[0].langs is None:
        return served[0]
    return next((model for model in served if model.langs == (source, target)), None)


def source_languages(served: Sequence[Served], target: str | None = None) -> list[str]:
    """The source languages served (into `target`, if given), in the order of the models."""
    return list(dict.fromkeys(model.langs[0] for model in served if model.langs is not None
                              and target in (None, model.langs[1])))


# ------------------------------------------------------------------------ sentences, joined


@dataclass(frozen=True)
class Joined:
    """A text's output made of its sentences' outputs (`joined_outputs`): its `score` and
    `log_prob` are the sums of theirs (a hypothesis as `v1_answer` reads one)."""

    score: float
    log_prob: float


def split_sentences(texts: Sequence[str], langs: Sequence[str | None], options: ServeOptions,
                    field: str, single: bool) -> SplitTexts:
    """Each text cut into sentences by its language's rules (`sentences.split`; a code the
    segmenter does not read: English's), the sentences within the server's limits: at most
    --max-lines in the request (the lines its search holds), each of at most --max-line-chars.
    `field` names the texts in a refusal (`q`, or `q[2]` unless `single`)."""
    split = SplitTexts(tuple(sentences.split(text, _segmenter_code(lang))
                             for text, lang in zip(texts, langs)))
    check_sentences(split, options, field, single)
    return split


def _segmenter_code(lang: str | None) -> str | None:
    """`lang`, or None (English's rules) where it is not a language code the segmenter reads
    (a server that takes any pair knows no codes)."""
    try:
        sentences.segmenter_language(lang)
    except ValueError:
        return None
    return lang


def check_sentences(split: SplitTexts, options: ServeOptions, field: str, single: bool) -> None:
    """A request's sentences within the server's limits: at most --max-lines in all (the lines
    its search holds), each of at most --max-line-chars."""
    count = sum(len(paragraph.sentences) for paragraph in split.paragraphs)
    if count > options.max_lines:
        raise Problem(422, f"{field} holds {count} sentences; this server searches at most "
                      f"{options.max_lines} in one request (--max-lines)")
    for index, paragraph in enumerate(split.paragraphs):
        longest = max(map(len, paragraph.sentences), default=0)
        if longest > options.max_line_chars:
            where = field if single else f"{field}[{index}]"
            raise Problem(422, f"{where} holds a sentence of {longest} characters; this server "
                          f"takes at most {options.max_line_chars} (--max-line-chars)")


def grouped(routes: Sequence[Route]) -> list[tuple[Served, list[int]]]:
    """The texts (their places) each model translates, the models in the order they come."""
    groups: dict[str, tuple[Served, list[int]]] = {}
    for place, route in enumerate(routes):
        groups.setdefault(route.model.id, (route.model, []))[1].append(place)
    return list(groups.values())


def group_sentences(split: SplitTexts, texts: Sequence[int]) -> list[str]:
    """The sentences of the texts at `texts`, text after text: one model's lines."""
    return [sentence for place in texts for sentence in split.paragraphs[place].sentences]


def regrouped(split: SplitTexts, groups: Sequence[tuple[Served, list[int]]],
              outputs: Sequence[Sequence]) -> list:
    """The outputs of each group's lines (`group_sentences`), back in `split.sentences`'
    order."""
    by_text: list = [None] * len(split.paragraphs)
    for (_, texts), group_outputs in zip(groups, outputs):
        found = iter(group_outputs)
        for place in texts:
            by_text[place] = [next(found) for _ in split.paragraphs[place].sentences]
    return [output for text in by_text for output in text]


def joined_outputs(split: SplitTexts, outputs: Sequence, nbest: int) -> list:
    """Each text's outputs from its sentences' (`Translator.outputs`, in `split.sentences`'
    order), in the same shape: `nbest` (hypothesis, text) pairs, the text its sentences'
    translations joined with its own spacing (`Paragraph.join`). Output k joins each
    sentence's k-th best, or its best where the search found fewer than k + 1: no output
    drops a sentence. Its score is the sum of the sentences' scores (each as `attn decode`
    reports it); a text without a sentence (whitespace alone) is its spacing, score 0."""
    outputs = iter(outputs)
    joined = []
    for paragraph in split.paragraphs:
        found = [next(outputs) for _ in paragraph.sentences]
        texts = []
        for k in range(nbest):
            chosen = [kth_best(output, k) for output in found]
            texts.append((Joined(sum(hypothesis.score for hypothesis, _ in chosen),
                                 sum(hypothesis.log_prob for hypothesis, _ in chosen)),
                          paragraph.join([text for _, text in chosen])))
        joined.append(texts)
    return joined


def kth_best(output: Sequence, k: int):
    """A sentence's output k (`Translator.outputs`' (hypothesis, text)), or its best where the
    search found fewer than k + 1 (an output not found has score -inf)."""
    return output[k] if k < len(output) and math.isfinite(output[k][0].score) else output[0]


# ------------------------------------------------------------------------------------- HTML


def html_text(document: str) -> str:
    """What a language detector reads of an HTML document: the text of its runs (decode/markup.py),
    a line each, without the markup, nor what is never translated (scripts, styles,
    comments, `translate="no"`)."""
    texts = (piece.tree()[0].strip() for piece in split_runs(read_markup(document))
             if isinstance(piece, Run))
    return "\n".join(text for text in texts if text)


def read_html(texts: Sequence[str], langs: Sequence[str | None]
              ) -> tuple[list[HtmlDocument], SplitTexts]:
    """Each text read as an HTML document, its runs cut into sentences by its language's rules,
    and the sentences of each as a paragraph (for `grouped` and `check_sentences`; its spacing
    is never joined: a document renders itself, `html_outputs`)."""
    documents = [HtmlDocument.read(text, _segmenter_code(lang))
                 for text, lang in zip(texts, langs)]
    return documents, SplitTexts(tuple(
        Paragraph(tuple(document.sentences), ("",) * (len(document.sentences) + 1))
        for document in documents))


def aligned_outputs(lines: Sequence[str], outputs: Sequence, nbest: int,
                    align: Callable[[list[str], list[list[int]]], list]) -> list:
    """Each line's `nbest` outputs as (hypothesis, text, alignment): output k its k-th best
    (`kth_best`), aligned with the line by `align(lines, token ids)` (`Translator.align`:
    one teacher-forced pass for all of them)."""
    chosen = [[kth_best(output, k) for k in range(nbest)] for output in outputs]
    alignments = iter(align([line for line, picked in zip(lines, chosen) for _ in picked],
                            [hypothesis.tokens for picked in chosen for hypothesis, _ in picked]))
    return [[(hypothesis, text, next(alignments)) for hypothesis, text in picked]
            for picked in chosen]


def html_outputs(documents: Sequence[HtmlDocument], outputs: Sequence, nbest: int) -> list:
    """Each document's outputs in `joined_outputs`' shape: `nbest` (scores, HTML) pairs, output
    k the document with each sentence replaced by its output k, the markup put back by its
    alignment (`HtmlDocument.render`). `outputs`: each sentence's `aligned_outputs`, in the
    documents' order."""
    outputs = iter(outputs)
    rendered = []
    for document in documents:
        found = [next(outputs) for _ in document.sentences]
        texts = []
        for k in range(nbest):
            chosen = [output[k] for output in found]
            texts.append((Joined(sum(hypothesis.score for hypothesis, _, _ in chosen),
                                 sum(hypothesis.log_prob for hypothesis, _, _ in chosen)),
                          document.render([text for _, text, _ in chosen],
                                          [alignment for _, _, alignment in chosen])))
        rendered.append(texts)
    return rendered


# ------------------------------------------------------------------------ POST /v1/translate


@dataclass(frozen=True)
class V1Request:
    """What a /v1/translate request asks for."""

    lines: list[str]
    settings: dict  # DecodeOptions fields to change
    single: bool  # `text` was one string: the answer has one translation (and score), not lists
    scores: bool  # the answer has the scores (always with nbest > 1)
    model: Served  # the model it asks for
    split: bool = False  # each line cut into sentences, searched apart, joined again
    alignment: bool = False  # the answer has each translation's word alignment


def v1_request(fields: dict, options: ServeOptions, served: Sequence[Served]) -> V1Request:
    """A /v1/translate body's lines, settings and model, or the Problem with it."""
    unknown = sorted(set(fields) - V1_FIELDS)
    if unknown:
        raise Problem(422, f"unknown field {unknown[0]!r} (fields: "
                      f"{', '.join(sorted(V1_FIELDS - {'api_key'}))})")
    model = pick_model(fields, served)
    text = fields.get("text")
    if text is None:
        raise Problem(422, "the body needs a 'text' field: a list of lines")
    lines = [text] if isinstance(text, str) else text
    if not isinstance(lines, list):
        raise Problem(422, f"text must be a list of strings, not {_json_type(text)}")
    check_lines(lines, "text", options)
    flags = {}
    for name in ("scores", "split", "alignment"):
        flags[name] = fields.get(name, False)
        if not isinstance(flags[name], bool):
            raise Problem(422, f"{name} must be true or false, not {_json_type(flags[name])}")
    if flags["split"] and flags["alignment"]:
        # `attn decode --split-sentences --alignment` renumbers the sentences' words within
        # the line; the server does not yet
        raise Problem(422, "alignment is of lines searched whole: send one sentence per line "
                      "without split")
    if flags["alignment"] and fields.get("raw") is True:
        # the pairs number the words of the detokenized text, which raw does not answer
        raise Problem(422, "alignment numbers the words of the detokenized translation: drop "
                      "raw")
    return V1Request(lines, search_settings(fields, options.max_beam), isinstance(text, str),
                     flags["scores"], model, flags["split"], flags["alignment"])


def v1_prefixes(fields: dict, asked: V1Request) -> list[str] | None:
    """The `prefix` field of a /v1/translate body (`attn decode --prefix`): each line's target
    prefix, its outputs starting with it; a list of strings (or nulls: no prefix), one per
    line, or one string for one `text`; null or absent: none. Or the Problem with it."""
    value = fields.get("prefix")
    if value is None:
        return None
    if asked.split:
        raise Problem(422, "prefix starts one output, and split searches a text as several "
                      "sentences: send one sentence per line without split")
    prefixes = [value] if asked.single and isinstance(value, str) else value
    shape = "a string, as text is" if asked.single else "a list of strings, one per line"
    if not isinstance(prefixes, list) or len(prefixes) != len(asked.lines) or not all(
            prefix is None or isinstance(prefix, str) for prefix in prefixes):
        raise Problem(422, f"prefix must be {shape} (or null), not {_json_type(value)}"
                      + (f" of {len(value)}" if isinstance(value, list) else ""))
    return [prefix or "" for prefix in prefixes]


@dataclass
class RequestControls:
    """What a /v1/translate body controls besides its text (`attn decode --prefix`,
    `--constraints`, `--glossary`): each line's prefix and phrases, as texts; its own glossary."""

    prefixes: list[str] | None = None
    constraints: list[list[str]] | None = None
    glossary: object = None  # glossary.Glossary

    def line_controls(self, translator, lines: list[str]) -> list | None:
        """Each line's `controls.Controls` for `translator` (its vocabulary; its own glossary,
        from --glossary, added), or None where no line has any; the Problem of the first text
        with a piece outside the vocabulary."""
        from ..decode.controls import NONE, Controls, GlossaryPhrases

        vocab, unk = translator.tgt_vocab, translator.config.unk_id

        def encoded(texts: list[str], field: str, place: int) -> list[tuple[int, ...]]:
            ids = vocab.encode(texts) if texts else []
            for text, pieces in zip(texts, ids):
                if unk in pieces:
                    where = field if len(lines) == 1 else f"{field}[{place}]"
                    raise Problem(422, f"{where} {text!r} has characters outside the model's "
                                  "target vocabulary: remove them")
            return [tuple(pieces) for pieces in ids]

        prefixes = [encoded([text], "prefix", place)[0] if text else ()
                    for place, text in enumerate(self.prefixes or [""] * len(lines))]
        phrases = [encoded(texts, "constraints", place)
                   for place, texts in enumerate(self.constraints or [[]] * len(lines))]
        glossary = None
        if self.glossary is not None:
            from ..errors import AttnError

            try:
                glossary = GlossaryPhrases(self.glossary, vocab, unk)
            except AttnError as error:
                raise Problem(422, str(error)) from None
        controls = []
        for line, prefix, line_phrases in zip(lines, prefixes, phrases):
            control = translator.controls_of(line, Controls(prefix, tuple(
                dict.fromkeys(line_phrases))))
            if glossary is not None:
                control = control.with_phrases(glossary.phrases(line))
            controls.append(control)
        if translator.options.sample and any(control.phrases for control in controls):
            raise Problem(422, "constraints and glossary terms need beam search, not sample "
                          "(this server's --glossary too, where a line holds its terms)")
        return None if all(control == NONE for control in controls) else controls


def v1_controls(fields: dict, asked: V1Request) -> RequestControls:
    """The `prefix`, `constraints` and `glossary` fields of a /v1/translate body: `prefix` one
    string per line (or null); `constraints` a list of phrases per line (or null), for one
    `text` a list of strings; `glossary` an object of source: target terms or a list of
    [source, target] pairs, at most MAX_REQUEST_GLOSSARY. Or the Problem with them."""
    asked_for = RequestControls(v1_prefixes(fields, asked))
    value = fields.get("constraints")
    if value is not None:
        if asked.split:
            raise Problem(422, "constraints are a line's, and split searches a text as several "
                          "sentences: send one sentence per line without split (a glossary "
                          "goes with split)")
        per_line = [value] if asked.single else value
        shape = "a list of strings" if asked.single else \
            "a list with a list of strings (or null) per line"

        def phrases_of(item) -> bool:
            return item is None or (isinstance(item, list) and all(
                isinstance(phrase, str) and phrase.strip() for phrase in item))
        if not isinstance(per_line, list) or len(per_line) != len(asked.lines) or not all(
                map(phrases_of, per_line)):
            raise Problem(422, f"constraints must be {shape}, each phrase a non-empty string")
        asked_for.constraints = [item or [] for item in per_line]
    value = fields.get("glossary")
    if value is not None and value != {} and value != []:  # an app's empty glossary: none
        from ..decode.glossary import Glossary
        from ..errors import AttnError

        if isinstance(value, (list, dict)) and len(value) > MAX_REQUEST_GLOSSARY:
            raise Problem(422, f"glossary holds {len(value)} terms, over this server's "
                          f"{MAX_REQUEST_GLOSSARY} per request: start the server with "
                          "--glossary for a large one")
        try:
            asked_for.glossary = Glossary.from_pairs(value, "glossary")
        except AttnError as error:
            raise Problem(422, str(error)) from None
    return asked_for


def pick_model(fields: dict, served: Sequence[Served]) -> Served:
    """The model a /v1/translate body names: by `model` (its id), or by `source` and
    `target` (its pair); neither, the server's only one."""
    named = {}
    for name in ("model", "source", "target"):
        value = fields.get(name)
        if value is not None and not isinstance(value, str):
            raise Problem(422, f"{name} must be a string, not {_json_type(value)}")
        if value is not None:
            named[name] = value
    ids = ", ".join(repr(model.id) for model in served)
    if "model" in named:
        model = next((model for model in served if model.id == named["model"]), None)
        if model is None:
            raise Problem(404, f"unknown model {named['model']!r}: this server has {ids} "
                          "(GET /v1/models)")
    if ("source" in named) != ("target" in named):
        raise Problem(422, "source and target go together: name both, or name the model")
    if "source" in named:
        pair = named["source"], named["target"]
        paired = by_pair(served, *pair)
        if paired is None:
            raise Problem(404, f"no model translates {pair[0]} to {pair[1]}: this server "
                          f"translates {describe_pairs(served)} (GET /v1/models)")
        if "model" in named and paired is not model:
            raise Problem(422, f"model {model.id!r} does not translate {pair[0]} to "
                          f"{pair[1]}: name one or the other")
        return paired
    if "model" in named:
        return model
    if len(served) > 1:
        raise Problem(422, f"this server has several models ({ids}): name one with model, "
                      "or source and target")
    return served[0]


def v1_answer(model_id: str, asked: V1Request, outputs: list, nbest: int,
              alignments: list | None = None) -> dict:
    """The answer: each line's translation (with nbest K, its K, as `attn decode --nbest K`
    prints them) and, if asked or nbest > 1, the scores. `outputs`: each line's
    `Translator.outputs` (split: `joined_outputs`). `alignments` (asked with `alignment`):
    each output's (`output_alignments`), answered beside the translations and in their shape,
    each a list of [source word, output word] pairs (`attn decode --alignment`'s)."""
    translations, scores = [], []
    for output in outputs:
        texts = [text for _, text in output]
        line_scores = [_score(hypothesis.score) for hypothesis, _ in output]
        translations.append(texts[0] if nbest == 1 else texts)
        scores.append(line_scores[0] if nbest == 1 else line_scores)
    payload = {"model": model_id,
               "translations": translations[0] if asked.single else translations}
    if asked.scores or nbest > 1:
        payload["scores"] = scores[0] if asked.single else scores
    if alignments is not None:
        pairs = [[[list(pair) for pair in alignment] for alignment in line]
                 for line in alignments]
        pairs = [line[0] for line in pairs] if nbest == 1 else pairs
        payload["alignments"] = pairs[0] if asked.single else pairs
    return payload


def output_alignments(lines: Sequence[str], outputs: Sequence,
                      align: Callable[[list[str], list[list[int]]], list]) -> list:
    """The alignment of every output of each line (`Translator.outputs`' (hypothesis, text),
    one not found aligning nothing) with the line, by `align(lines, token ids)`
    (`Translator.align`: one teacher-forced pass for all of them), in `outputs`' shape. Unlike
    `aligned_outputs`, an output not found stays as it is: the answer's texts do not change
    with `alignment`."""
    aligned = iter(align([line for line, output in zip(lines, outputs) for _ in output],
                         [hypothesis.tokens for output in outputs for hypothesis, _ in output]))
    return [[next(aligned) for _ in output] for output in outputs]


def _score(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no -inf


# ----------------------------------------------------------------- POST /translate (LibreTranslate)


@dataclass(frozen=True)
class LibreRequest:
    """What a LibreTranslate request asks for."""

    texts: list[str]
    source: str  # a language code, or "auto"
    target: str
    settings: dict  # DecodeOptions fields to change
    alternatives: int  # other translations asked for each text
    single: bool  # `q` was one string
    html: bool = False  # format "html": each text an HTML document (decode/markup.py)


@dataclass(frozen=True)
class Route:
    """Where a text goes: the model that translates it, its source language (None: not known),
    and, with source "auto", what was detected (`{"confidence", "language"}`)."""

    model: Served
    source: str | None
    detected: dict | None = None


def libre_request(fields: dict, options: ServeOptions, beam: int) -> LibreRequest:
    """A LibreTranslate body's texts and settings, or the Problem with it: `q` within
    --char-limit (all its texts together, as LibreTranslate counts). `beam`: the server's
    (alternatives need a beam at least as wide)."""
    q = fields.get("q")
    if q is None:
        raise Problem(400, "Invalid request: missing q parameter")
    for name in ("source", "target"):
        if not isinstance(fields.get(name), str) or not fields[name]:
            raise Problem(400, f"Invalid request: missing {name} parameter")
    text_format = fields.get("format", "text")
    if text_format not in LIBRE_FORMATS:
        raise Problem(400, f"Invalid request: format {text_format!r} is not supported: send "
                      "format 'text' or 'html'")
    texts = [q] if isinstance(q, str) else q
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise Problem(400, "Invalid request: q must be a string or a list of strings")
    check_char_limit(texts, options.char_limit)
    check_unicode(texts, "q", isinstance(q, str))
    try:  # int(), as LibreTranslate reads it: "2" and 2.0 are 2
        alternatives = int(fields.get("alternatives", 0))
    except (TypeError, ValueError, OverflowError):
        raise Problem(400, "Invalid request: alternatives must be an integer") from None
    if not 0 <= alternatives < options.max_beam:
        raise Problem(400, f"Invalid request: alternatives must be 0 to {options.max_beam - 1}")
    settings = ({"nbest": alternatives + 1, "beam": max(beam, alternatives + 1)}
                if alternatives else {})
    return LibreRequest(texts, fields["source"], fields["target"], settings, alternatives,
                        isinstance(q, str), text_format == "html")


def check_char_limit(texts: Sequence[str], limit: int) -> None:
    """LibreTranslate's --char-limit: the characters of all of a request's texts (-1: none)."""
    chars = sum(map(len, texts))
    if limit != -1 and chars > limit:
        raise Problem(400, f"Invalid request: request ({chars} characters) exceeds text limit "
                      f"({limit}, this server's --char-limit)")


def check_unicode(texts: Sequence[str], field: str, single: bool) -> None:
    """Texts that UTF-8 can encode (JSON may carry an unpaired surrogate)."""
    for index, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            where = field if single else f"{field}[{index}]"
            raise Problem(400, f"{where} is not valid Unicode (an unpaired surrogate at "
                          f"character {error.start})") from None


def libre_routes(texts: Sequence[str], source: str, target: str, served: Sequence[Served],
                 detect: Callable[[str, list[str]], list[tuple[str, float]]],
                 text_of: Callable[[str], str] | None = None) -> list[Route]:
    """Each text's model: the pair asked for, or with source "auto", the pair from the
    language detected among the sources served into `target` (`detect(text, candidates)`: the
    candidates with their confidence, 0-100, best first). A text of at most SHORT_TEXT
    characters, too short to tell, is given what all the texts together are detected as
    (LibreTranslate's rule). A pair not served is a 400 naming those that are. `text_of`: what
    detection reads of a text (HTML: `html_text`), read only where there is something to
    detect."""
    if source != "auto":
        model = by_pair(served, source, target)
        if model is None:
            raise Problem(400, f"this server translates {describe_pairs(served)} only, not "
                          f"{source} to {target}")
        return [Route(model, source)] * len(texts)
    if by_pair(served, source, target) is not None:  # any pair: nothing to detect among
        return [Route(served[0], None)] * len(texts)
    candidates = source_languages(served, target)
    if not candidates:
        raise Problem(400, f"this server translates {describe_pairs(served)} only: no source "
                      f"language into {target}")
    if len(candidates) > 1 and text_of is not None:
        texts = [text_of(text) for text in texts]
    together = None
    routes = []
    for text in texts:
        if len(candidates) == 1:
            ranked = [(candidates[0], 100.0)]
        elif len(text) > SHORT_TEXT:
            ranked = detect(text, candidates)
        else:
            together = together or detect("\n".join(texts), candidates)
            ranked = together
        language, confidence = ranked[0]
        routes.append(Route(by_pair(served, language, target), language,
                            {"confidence": confidence, "language": language}))
    return routes


@dataclass(frozen=True)
class Texts:
    """A LibreTranslate request's texts made ready to search: each text's route, its
    sentences (`split`: those of all the texts, in order), and with HTML each text's document
    (whose sentences `split` holds)."""

    routes: list[Route]
    split: SplitTexts
    documents: list[HtmlDocument] | None = None


def libre_texts(texts: Sequence[str], source: str, target: str, html: bool,
                served: Sequence[Served], detect: Callable, options: ServeOptions, field: str,
                single: bool) -> Texts:
    """`libre_routes`, then each text cut into sentences by its route's language: as text
    (`split_sentences`) or as an HTML document (`read_html`; detection reads its text, not its
    markup). The sentences within the server's limits. HTML costs: a 600 KB page is read in
    about a second (off the event loop)."""
    routes = libre_routes(texts, source, target, served, detect, html_text if html else None)
    langs = [route.source for route in routes]
    if not html:
        return Texts(routes, split_sentences(texts, langs, options, field, single))
    documents, split = read_html(texts, langs)
    check_sentences(split, options, field, single)
    return Texts(routes, split, documents)


def libre_answer(asked: LibreRequest, outputs: list, routes: Sequence[Route]) -> dict:
    """Each text's translation, the alternatives if asked for, and with source "auto" the
    language detected (LibreTranslate's `detectedLanguage`). `outputs`: each text's
    (`joined_outputs`)."""
    translated = [output[0][1] for output in outputs]
    others = [[text for _, text in output[1:asked.alternatives + 1]] for output in outputs]
    payload = {"translatedText": translated[0] if asked.single else translated}
    if asked.alternatives:
        payload["alternatives"] = others[0] if asked.single else others
    detected = [route.detected for route in routes]
    if asked.source == "auto" and None not in detected:
        payload["detectedLanguage"] = detected[0] if asked.single else detected
    return payload


def detect_request(fields: dict, options: ServeOptions) -> str:
    """POST /detect's text (`q`: a string; a list is detected as one text), within
    --char-limit."""
    q = fields.get("q")
    if not q:
        raise Problem(400, "Invalid request: missing q parameter")
    texts = [q] if isinstance(q, str) else q
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise Problem(400, "Invalid request: q must be a string or a list of strings")
    check_char_limit(texts, options.char_limit)
    check_unicode(texts, "q", isinstance(q, str))
    return "\n".join(texts)


def detections(ranked: Sequence[tuple[str, float]]) -> list:
    """LibreTranslate's answer to /detect: the candidates, best first."""
    return [{"confidence": round(confidence, 2), "language": language}
            for language, confidence in ranked]


def languages(served: Sequence[Served]) -> list:
    """GET /languages: each language served, as a source with its targets (a language that is
    only a target has none), as LibreTranslate lists them. A server that takes any pair: []."""
    targets: dict[str, list[str]] = {}
    for model in served:
        if model.langs is not None:
            source, target = model.langs
            targets.setdefault(source, []).append(target)
            targets.setdefault(target, [])
    return [{"code": code, "name": LANGUAGE_NAMES.get(code, code), "targets": to}
            for code, to in targets.items()]


def frontend_settings(options: ServeOptions, served: Sequence[Served]) -> dict:
    """GET /frontend/settings, what LibreTranslate's web page and extensions read: the first
    pair is the page's default."""
    first = next((model.langs for model in served if model.langs is not None), None)
    source, target = first or ("auto", "")
    return {"charLimit": options.char_limit, "frontendTimeout": 500,
            "apiKeys": bool(options.api_key or options.api_keys),
            "keyRequired": bool(options.api_key or options.api_keys),
            "suggestions": False, "filesTranslation": True,
            "supportedFilesFormat": list(FILE_FORMATS),
            "language": {"source": {"code": source, "name": LANGUAGE_NAMES.get(source, source)},
                         "target": {"code": target,
                                    "name": LANGUAGE_NAMES.get(target, target)}}}


# ------------------------------------------------- POST /translate_file, GET /download_file


@dataclass(frozen=True)
class FileRequest:
    """A file to translate: its name as sent, its text (a UTF-8 byte order mark taken off, to
    be put back), the pair."""

    name: str
    text: str
    bom: bool
    source: str
    target: str
    html: bool = False  # an .html or .htm file: translated as HTML (decode/markup.py)
    # a .docx, .srt or .vtt file: its texts (HTML fragments) and how to write it back
    # (documents.py); `text` is then empty
    document: object = None


def file_request(fields: dict, files: dict) -> FileRequest:
    """/translate_file's form (LibreTranslate's: `file`, `source`, `target`, `api_key`): a
    .txt, .html or .htm file of UTF-8 text, or a .docx, .srt or .vtt document (documents.py)."""
    if "file" not in files:
        raise Problem(400, "Invalid request: missing file parameter")
    for name in ("source", "target"):
        if not isinstance(fields.get(name), str) or not fields[name]:
            raise Problem(400, f"Invalid request: missing {name} parameter")
    name, data = files["file"]
    if not name:
        raise Problem(400, "Invalid request: empty file (the file field has no filename)")
    extension = os.path.splitext(name)[1].lower()
    if extension not in FILE_FORMATS:
        raise Problem(400, f"Invalid request: file format not supported: file {name!r}; this "
                      f"server translates {', '.join(FILE_FORMATS)} files")
    from .documents import SUBTITLE_FILES, WORD_FILES, DocumentError, read_document

    if extension in WORD_FILES + SUBTITLE_FILES:
        try:
            document = read_document(name, extension, data)
        except DocumentError as error:
            raise Problem(400, str(error)) from None
        return FileRequest(name, "", False, fields["source"], fields["target"], True,
                           document)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Problem(400, f"file {name!r} is not valid UTF-8 (byte {error.start})") from None
    bom = text.startswith("\ufeff")
    return FileRequest(name, text[1:] if bom else text, bom, fields["source"], fields["target"],
                       extension in HTML_FILES)


def media_type(name: str) -> str:
    """The Content-Type of a translated file by its name: HTML as HTML, Word and subtitles as
    theirs, the rest as text."""
    from .documents import MEDIA_TYPES

    extension = os.path.splitext(name)[1].lower()
    if extension in MEDIA_TYPES:
        return MEDIA_TYPES[extension]
    return f"text/{'html' if extension in HTML_FILES else 'plain'}; charset=utf-8"


def download_name(name: str) -> str:
    """A sent file's name as the name of its translation: its last path part, letters, digits,
    '.', '-' and '_' only (what a URL path and a Content-Disposition carry unquoted)."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", name.replace("\\", "/").rsplit("/", 1)[-1])
    base = base.lstrip("._") or "file"
    stem, extension = os.path.splitext(base)
    return f"{stem[:80] or 'file'}{extension.lower()}"


# ------------------------------------------------------------------------------- multipart


def multipart_fields(content_type: str, body: bytes) -> tuple[dict, dict]:
    """A multipart/form-data body's fields (name → text) and files (name → (filename,
    bytes)), read with the standard library's MIME parser (Starlette reads forms only with
    python-multipart, which attn does not depend on for this). The parts' bytes are kept
    exactly."""
    from email import policy
    from email.parser import BytesParser

    if "\r" in content_type or "\n" in content_type:
        raise Problem(400, "the Content-Type header holds a line break")
    message = BytesParser(policy=policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1", "replace") + b"\r\n\r\n" + body)
    broken = [type(defect).__name__ for defect in message.defects]
    if not message.is_multipart() or broken:
        raise Problem(400, "the multipart body cannot be read"
                      + (f" ({', '.join(broken)})" if broken else "")
                      + ": send multipart/form-data with its boundary")
    fields, files = {}, {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            continue  # not a form field
        data = part.get_payload(decode=True) or b""
        filename = part.get_filename()
        if filename is not None:
            files[name] = (filename, data)
            continue
        try:
            fields[name] = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise Problem(400, f"the form field {name!r} is not valid UTF-8 (byte "
                          f"{error.start})") from None
    return fields, files
