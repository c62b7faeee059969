"""What `attn serve`'s endpoints take and answer, as pure functions: a request's fields in, its
lines and search settings out; the search's outputs in, the JSON answer out.

Every refusal of a request is a `Problem` (a 4xx status and a message for the client) raised
here, except the ranges of the search settings, which `translate.DecodeOptions` checks for every
caller (the server answers its AttnError with 422). No HTTP, no torch, no sockets: server.py
reads the bodies and runs the search; tests/serve/test_api.py tests these without a server.
What the client sends is read so that no value of it reaches the search unchecked: JSON without
NaN or infinities, integers of at most 19 digits, nesting as deep as the parser goes (400), each
field of its type (422) and range (422: DecodeOptions'), and the request's work within
--max-request-tokens (422; LibreTranslate's endpoint answers each 400, as LibreTranslate does).
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qs

from ..config import MAX_LEN_B, ServeOptions
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
# are DecodeOptions' (translate.RANGES); the largest beam and nbest are the server's --max-beam.
SEARCH_FIELDS = {"beam": int, "nbest": int, "alpha": float, "max_len_a": float,
                 "max_len_b": int, "stop": str, "sample": bool, "topk": int, "topp": float,
                 "temperature": float, "seed": int, "raw": bool}
V1_FIELDS = {"text", "model", "scores", "api_key", *SEARCH_FIELDS}
# Integers in a body longer than this are refused: every integer a request may send (a beam, a
# seed) fits in 64 bits, and Python refuses to read more than 4,300 digits anyway (an error
# that was a 500).
MAX_INTEGER_DIGITS = 19


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
    """LibreTranslate's fields: a form (what its Python client sends) or JSON (what its
    browser extension sends; also a JSON body that `curl -d` labels as a form)."""
    kind = content_type.split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        raise Problem(415, "send JSON or application/x-www-form-urlencoded, not multipart")
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


def check_key(expected: str | None, headers: Mapping[str, str], fields: dict | None = None
              ) -> None:
    """With --api-key: the key as 'Authorization: Bearer KEY', an X-API-Key header, or an
    `api_key` field (LibreTranslate's way). `headers`: looked up by lower-case name."""
    if not expected:
        return
    bearer = headers.get("authorization", "")
    candidates = [bearer[7:].strip() if bearer[:7].lower() == "bearer " else None,
                  headers.get("x-api-key"), (fields or {}).get("api_key")]
    if not any(isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())
               for given in candidates):
        raise Problem(401, "this server needs its API key: send 'Authorization: Bearer KEY', "
                      "an 'X-API-Key: KEY' header, or an api_key field",
                      {"WWW-Authenticate": "Bearer"})


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
    """A request's work (`Translator.search_work`: output tokens its search may produce, every
    beam counted) within the server's --max-request-tokens, before any search."""
    if work > limit:
        raise Problem(422, f"this request's search may produce {work:,} output tokens (each "
                      "line's beam × its longest allowed output, max_len_a × source tokens + "
                      f"max_len_b), above this server's limit of {limit:,} "
                      "(--max-request-tokens): send fewer lines, or ask for a smaller beam, "
                      "max_len_a or max_len_b")


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _json_type(value) -> str:
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"),
                       (str, "a string"), (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null"


# ------------------------------------------------------------------------ POST /v1/translate


@dataclass(frozen=True)
class V1Request:
    """What a /v1/translate request asks for."""

    lines: list[str]
    settings: dict  # DecodeOptions fields to change
    single: bool  # `text` was one string: the answer has one translation (and score), not lists
    scores: bool  # the answer has the scores (always with nbest > 1)


def v1_request(fields: dict, options: ServeOptions, model_id: str) -> V1Request:
    """A /v1/translate body's lines and settings, or the Problem with it."""
    unknown = sorted(set(fields) - V1_FIELDS)
    if unknown:
        raise Problem(422, f"unknown field {unknown[0]!r} (fields: "
                      f"{', '.join(sorted(V1_FIELDS - {'api_key'}))})")
    model = fields.get("model")
    if model is not None and not isinstance(model, str):
        raise Problem(422, f"model must be a string, not {_json_type(model)}")
    if model is not None and model != model_id:
        raise Problem(404, f"unknown model {model!r}: this server has {model_id!r} "
                      "(GET /v1/models)")
    text = fields.get("text")
    if text is None:
        raise Problem(422, "the body needs a 'text' field: a list of lines")
    lines = [text] if isinstance(text, str) else text
    if not isinstance(lines, list):
        raise Problem(422, f"text must be a list of strings, not {_json_type(text)}")
    check_lines(lines, "text", options)
    scores = fields.get("scores", False)
    if not isinstance(scores, bool):
        raise Problem(422, f"scores must be true or false, not {_json_type(scores)}")
    return V1Request(lines, search_settings(fields, options.max_beam), isinstance(text, str),
                     scores)


def v1_answer(model_id: str, asked: V1Request, outputs: list, nbest: int) -> dict:
    """The answer: each line's translation (with nbest K, its K, as `attn decode --nbest K`
    prints them) and, if asked or nbest > 1, the scores. `outputs`: each line's
    `Translator.outputs`."""
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
    return payload


def _score(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no -inf


# ----------------------------------------------------------------- POST /translate (LibreTranslate)


@dataclass(frozen=True)
class LibreRequest:
    """What a LibreTranslate request asks for."""

    texts: list[list[str]]  # each text's lines: translated one by one, joined again
    settings: dict  # DecodeOptions fields to change
    alternatives: int  # other translations asked for each text
    single: bool  # `q` was one string

    @property
    def lines(self) -> list[str]:
        return [line for text in self.texts for line in text]


def libre_request(fields: dict, options: ServeOptions, langs: tuple[str, str] | None,
                  beam: int) -> LibreRequest:
    """A LibreTranslate body's texts and settings, or the Problem with it. `langs`: the pair
    the server translates (None: any); `beam`: the server's (alternatives need a beam at least
    as wide)."""
    q = fields.get("q")
    if q is None:
        raise Problem(400, "Invalid request: missing q parameter")
    for name in ("source", "target"):
        if not isinstance(fields.get(name), str) or not fields[name]:
            raise Problem(400, f"Invalid request: missing {name} parameter")
    if fields.get("format", "text") != "text":
        raise Problem(400, f"format {fields['format']!r} is not supported: attn translates "
                      "plain text (format 'text')")
    source, target = fields["source"], fields["target"]
    if langs is not None and (source not in (langs[0], "auto") or target != langs[1]):
        raise Problem(400, f"this server translates {langs[0]} to {langs[1]} only, not "
                      f"{source} to {target}")
    texts = [q] if isinstance(q, str) else q
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise Problem(400, "Invalid request: q must be a string or a list of strings")
    try:  # int(), as LibreTranslate reads it: "2" and 2.0 are 2
        alternatives = int(fields.get("alternatives", 0))
    except (TypeError, ValueError, OverflowError):
        raise Problem(400, "Invalid request: alternatives must be an integer") from None
    if not 0 <= alternatives < options.max_beam:
        raise Problem(400, f"Invalid request: alternatives must be 0 to {options.max_beam - 1}")
    # A text is its lines, each translated (LibreTranslate keeps paragraphs), joined again.
    asked = LibreRequest([[line.removesuffix("\r") for line in t.split("\n")] for t in texts],
                         {"nbest": alternatives + 1, "beam": max(beam, alternatives + 1)}
                         if alternatives else {}, alternatives, isinstance(q, str))
    check_lines(asked.lines, "q", options)
    return asked


def libre_answer(asked: LibreRequest, outputs: list) -> dict:
    """Each text's translation, its lines joined again, and the alternatives if asked for.
    `outputs`: each line's `Translator.outputs`, in order."""
    outputs = iter(outputs)
    translated, others = [], []
    for text in asked.texts:
        found = [[line_text for _, line_text in next(outputs)] for _ in text]
        translated.append("\n".join(texts[0] for texts in found))
        others.append(["\n".join(texts[k] for texts in found)
                       for k in range(1, asked.alternatives + 1)])
    payload = {"translatedText": translated[0] if asked.single else translated}
    if asked.alternatives:
        payload["alternatives"] = others[0] if asked.single else others
    return payload


def languages(langs: tuple[str, str] | None) -> list:
    """GET /languages: the server's pair (none: any pair is accepted)."""
    if langs is None:
        return []
    source, target = langs
    return [{"code": source, "name": LANGUAGE_NAMES.get(source, source), "targets": [target]},
            {"code": target, "name": LANGUAGE_NAMES.get(target, target), "targets": []}]


def frontend_settings(options: ServeOptions, langs: tuple[str, str] | None) -> dict:
    """GET /frontend/settings, what LibreTranslate's web page and extensions read."""
    source, target = langs or ("auto", "")
    return {"charLimit": options.max_line_chars, "frontendTimeout": 500,
            "apiKeys": bool(options.api_key), "keyRequired": bool(options.api_key),
            "suggestions": False, "filesTranslation": False, "supportedFilesFormat": [],
            "language": {"source": {"code": source, "name": LANGUAGE_NAMES.get(source, source)},
                         "target": {"code": target,
                                    "name": LANGUAGE_NAMES.get(target, target)}}}
