"""What `attn serve` takes and answers (attn_cli/serve/api.py), without a server: each refusal's
status and message, the search settings a request may change, and the answers' shapes from the
search's outputs. test_server.py checks the same over HTTP against `attn decode`."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from attn_cli.config import MAX_LEN_B, SERVE_DEFAULTS, ServeOptions, parse_langs
from attn_cli.errors import AttnError
from attn_cli.formats import Stop
from attn_cli.search import Hypothesis
from attn_cli.serve import api
from attn_cli.serve.api import Problem
from attn_cli.translate import NOT_FOUND, RANGES, DecodeOptions

OPTIONS = ServeOptions(max_lines=4, max_line_chars=20, max_beam=8)


def refused(call, *args) -> tuple[int, str]:
    with pytest.raises(Problem) as problem:
        call(*args)
    return problem.value.status, problem.value.message


def output(*scored: tuple[str, float]) -> list[tuple[Hypothesis, str]]:
    """A line's `Translator.outputs`: (hypothesis, text) pairs."""
    return [(Hypothesis([], score, score), text) for text, score in scored]


# ---------------------------------------------------------------------------------- the options


def test_serve_options_check_themselves_and_the_servers_defaults():
    assert SERVE_DEFAULTS == {field.name: field.default
                              for field in dataclasses.fields(ServeOptions)}
    assert SERVE_DEFAULTS["port"] == 8080 and SERVE_DEFAULTS["max_beam"] == 32
    with pytest.raises(AttnError, match=r"--queue-lines \(5\) must hold a request of "
                                        r"--max-lines \(10\)"):
        ServeOptions(max_lines=10, queue_lines=5)
    options = ServeOptions(max_beam=4)
    options.check_defaults(4, MAX_LEN_B)
    with pytest.raises(AttnError, match=r"--beam \(8\) is above --max-beam \(4\)"):
        options.check_defaults(8, 50)
    with pytest.raises(AttnError, match=f"--max-len-b must be at most {MAX_LEN_B}"):
        options.check_defaults(4, MAX_LEN_B + 1)


def test_parse_langs():
    assert parse_langs("en-de") == ("en", "de") and parse_langs(None) is None
    for wrong in ("english", "en-", "-de", "en-de-fr"):
        with pytest.raises(AttnError, match="--langs takes SOURCE-TARGET"):
            parse_langs(wrong)


# ----------------------------------------------------------------------------------- the bodies


@pytest.mark.parametrize("body, status, fragment", [
    (b'{"text": [', 400, "not valid JSON: Expecting value (line 1, column 11)"),
    (b'{"text": ["\xff\xfe"]}', 400, "not valid UTF-8 (byte 11)"),
    (b'["a"]', 422, "the body must be a JSON object, not an array"),
    (b"", 400, "not valid JSON"),
])
def test_json_fields_refusals(body, status, fragment):
    got, message = refused(api.json_fields, body)
    assert got == status and fragment in message


@pytest.mark.parametrize("body, message", [
    (b'{"alpha": NaN}', "the body holds NaN, which is not JSON: send a finite number"),
    (b'{"alpha": -Infinity}', "the body holds -Infinity, which is not JSON: send a finite "
                              "number"),
    (b'{"alpha": 1e400}', "the body holds the number 1e400, too large for a float"),
    (b'{"alpha": -' + b"9" * 400 + b'.0}', "the body holds the number -99999999999... (403 "
                                            "characters), too large for a float"),
    (b'{"seed": ' + b"7" * 5000 + b"}", "the body holds an integer of 5000 digits; this "
                                          "server reads at most 19"),
    (b'{"seed": -12345678901234567890}', "the body holds an integer of 20 digits; this server "
                                        "reads at most 19"),
    (b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "the body nests arrays or objects too deeply to be read"),
])
def test_json_fields_take_standard_json_only_numbers_a_float_holds_and_bounded_integers(
        body, message):
    """Each of these was a 500 (a traceback's message), or a value no setting should see."""
    assert refused(api.json_fields, body) == (400, message)
    assert api.json_fields(b'{"seed": -1234567890123456789, "alpha": 5e-324, "x": 1e308}') == {
        "seed": -1234567890123456789, "alpha": 5e-324, "x": 1e308}  # within the bounds


def test_libre_fields_a_form_or_json():
    form = "application/x-www-form-urlencoded; charset=utf-8"
    assert api.libre_fields(form, b"q=a&q=b&source=en&target=de&source=fr") == {
        "q": ["a", "b"], "source": "fr", "target": "de"}
    assert api.libre_fields(form, b"q=Hallo+Welt") == {"q": "Hallo Welt"}
    assert api.libre_fields(form, b' {"q": "a"}') == {"q": "a"}  # curl -d's label, JSON inside
    assert api.libre_fields("application/json", b'{"q": ["a"]}') == {"q": ["a"]}
    assert api.libre_fields("", b"  ") == {}
    assert refused(api.libre_fields, "multipart/form-data; boundary=x", b"") == (
        415, "send JSON or application/x-www-form-urlencoded, not multipart")
    status, message = refused(api.libre_fields, form, b"q=%FF")
    assert status == 400 and message.startswith("the form is not valid UTF-8")


# ----------------------------------------------------------------------------------- the checks


def test_the_api_key_in_any_of_its_three_places():
    api.check_key(None, {})  # no key: open
    api.check_key("k", {"authorization": "Bearer k"})
    api.check_key("k", {"authorization": "bearer  k "})
    api.check_key("k", {"x-api-key": "k"})
    api.check_key("k", {}, {"api_key": "k"})
    for headers, fields in (({}, None), ({"authorization": "Bearer wrong"}, None),
                            ({"authorization": "k"}, None), ({}, {"api_key": 7})):
        with pytest.raises(Problem) as problem:
            api.check_key("k", headers, fields)
        assert problem.value.status == 401
        assert problem.value.headers == {"WWW-Authenticate": "Bearer"}


@pytest.mark.parametrize("lines, status, message", [
    (["a"] * 5, 422, "5 lines in one request; this server takes at most 4 (--max-lines)"),
    (["a", 1], 422, "text[1] must be a string, not a number"),
    (["a", None], 422, "text[1] must be a string, not null"),
    (["a\nb"], 422, "text[0] holds a line break: send one line per element"),
    (["a\rb"], 422, "text[0] holds a line break: send one line per element"),
    (["a" * 21], 422, "text[0] is 21 characters; this server takes at most 20 "
                      "(--max-line-chars)"),
    (["ab\ud800"], 400, "text[0] is not valid Unicode (an unpaired surrogate at character 2)"),
])
def test_check_lines(lines, status, message):
    assert refused(api.check_lines, lines, "text", OPTIONS) == (status, message)


def test_search_settings_are_typed_and_within_the_servers_limits():
    assert api.search_settings({"text": ["a"]}, 8) == {}
    settings = api.search_settings({"beam": 2, "alpha": 1, "stop": "best-ends", "raw": True,
                                    "seed": -3, "topp": 0.5}, 8)
    assert settings == {"beam": 2, "alpha": 1.0, "stop": Stop.best_ends, "raw": True,
                        "seed": -3, "topp": 0.5}
    assert isinstance(settings["alpha"], float)
    # Ranges are DecodeOptions' (below): the server's own limits only here.
    assert api.search_settings({"beam": 0, "alpha": -1.0, "topp": math.nan}, 8)["beam"] == 0


@pytest.mark.parametrize("fields, message", [
    ({"beam": "4"}, "beam must be an integer, not a string"),
    ({"beam": True}, "beam must be an integer, not a boolean"),
    ({"beam": 4.0}, "beam must be an integer, not a number"),
    ({"alpha": "0.6"}, "alpha must be a number, not a string"),
    ({"sample": 1}, "sample must be true or false, not a number"),
    ({"stop": None}, "stop must be a string, not null"),
    ({"seed": [1]}, "seed must be an integer, not an array"),
    ({"beam": 9}, "beam 9 is above this server's limit of 8 (--max-beam)"),
    ({"nbest": 9}, "nbest 9 is above this server's limit of 8 (--max-beam)"),
    ({"max_len_b": MAX_LEN_B + 1}, f"max_len_b must be at most {MAX_LEN_B}"),
    ({"stop": "soon"}, "stop must be one of bound, best-ends, limit, not 'soon'"),
])
def test_search_settings_refusals(fields, message):
    assert refused(api.search_settings, fields, 8) == (422, message)


def test_every_search_field_is_a_decode_option_whose_range_decode_options_check():
    """Service.translate answers a DecodeOptions error with 422 and its message, which names the
    field (tests/test_translate.py: those messages)."""
    names = {field.name for field in dataclasses.fields(DecodeOptions)}
    assert set(api.SEARCH_FIELDS) <= names
    numeric = {name for name, kind in api.SEARCH_FIELDS.items() if kind in (int, float)}
    assert numeric - {"seed"} <= set(RANGES)


def test_check_work_names_the_limit_and_what_to_lower():
    api.check_work(1000, 1000)
    status, message = refused(api.check_work, 131_104, 100_000)
    assert status == 422
    assert message == ("this request's search may produce 131,104 output tokens (each line's "
                       "beam × its longest allowed output, max_len_a × source tokens + "
                       "max_len_b), above this server's limit of 100,000 "
                       "(--max-request-tokens): send fewer lines, or ask for a smaller beam, "
                       "max_len_a or max_len_b")


# ------------------------------------------------------------------------ POST /v1/translate


def test_v1_request():
    asked = api.v1_request({"text": ["a", ""], "beam": 2, "scores": True}, OPTIONS, "m")
    assert asked == api.V1Request(["a", ""], {"beam": 2}, single=False, scores=True)
    asked = api.v1_request({"text": "a", "model": "m", "api_key": "k"}, OPTIONS, "m")
    assert asked == api.V1Request(["a"], {}, single=True, scores=False)


@pytest.mark.parametrize("fields, status, message", [
    ({"txt": ["a"]}, 422, "unknown field 'txt' (fields: alpha, beam, max_len_a, max_len_b, "
                          "model, nbest, raw, sample, scores, seed, stop, temperature, text, "
                          "topk, topp)"),
    ({"text": ["a"], "model": "other"}, 404, "unknown model 'other': this server has 'm' "
                                             "(GET /v1/models)"),
    ({"beam": 2}, 422, "the body needs a 'text' field: a list of lines"),
    ({"text": {"a": 1}}, 422, "text must be a list of strings, not an object"),
    ({"text": [1]}, 422, "text[0] must be a string, not a number"),
    ({"text": ["a"], "scores": "yes"}, 422, "scores must be true or false, not a string"),
    ({"text": ["a"], "model": ["m"]}, 422, "model must be a string, not an array"),
    ({"text": ["a"], "beam": 99}, 422, "beam 99 is above this server's limit of 8 (--max-beam)"),
])
def test_v1_request_refusals(fields, status, message):
    assert refused(api.v1_request, fields, OPTIONS, "m") == (status, message)


def test_v1_answers_one_output_per_line_and_k_with_nbest():
    lines = api.V1Request(["a", "b"], {}, single=False, scores=False)
    outputs = [output(("A", -0.5)), output(("B", -1.0))]
    assert api.v1_answer("m", lines, outputs, 1) == {"model": "m", "translations": ["A", "B"]}
    with_scores = dataclasses.replace(lines, scores=True)
    assert api.v1_answer("m", with_scores, outputs, 1)["scores"] == [-0.5, -1.0]
    one = api.V1Request(["a"], {}, single=True, scores=True)
    assert api.v1_answer("m", one, outputs[:1], 1) == {"model": "m", "translations": "A",
                                                       "scores": -0.5}
    # nbest 3: always 3 per line, those not found empty with no score (JSON has no -inf)
    padded = [output(("A", -0.5), ("A2", -0.7)) + [(NOT_FOUND, "")],
              output(("", 0.0)) + [(NOT_FOUND, "")] * 2]
    answer = api.v1_answer("m", lines, padded, 3)
    assert answer == {"model": "m", "translations": [["A", "A2", ""], ["", "", ""]],
                      "scores": [[-0.5, -0.7, None], [0.0, None, None]]}
    assert json.loads(json.dumps(answer)) == answer


# ----------------------------------------------------------------- POST /translate (LibreTranslate)


def test_libre_request():
    fields = {"q": "one\r\ntwo", "source": "auto", "target": "de"}
    asked = api.libre_request(fields, OPTIONS, ("en", "de"), 4)
    assert asked.texts == [["one", "two"]] and asked.lines == ["one", "two"]
    assert asked.single and asked.settings == {} and asked.alternatives == 0
    asked = api.libre_request({**fields, "q": ["a", "b"], "alternatives": "2"}, OPTIONS, None, 1)
    assert not asked.single and asked.texts == [["a"], ["b"]]
    assert asked.settings == {"nbest": 3, "beam": 3}  # a beam at least as wide as the outputs
    asked = api.libre_request({**fields, "alternatives": 2}, OPTIONS, None, 4)
    assert asked.settings == {"nbest": 3, "beam": 4}


@pytest.mark.parametrize("fields, message", [
    ({"source": "en", "target": "de"}, "Invalid request: missing q parameter"),
    ({"q": "a", "target": "de"}, "Invalid request: missing source parameter"),
    ({"q": "a", "source": "en", "target": ""}, "Invalid request: missing target parameter"),
    ({"q": "a", "source": "en", "target": "de", "format": "html"},
     "format 'html' is not supported: attn translates plain text (format 'text')"),
    ({"q": "a", "source": "fr", "target": "de"}, "this server translates en to de only, not fr "
                                                 "to de"),
    ({"q": "a", "source": "en", "target": "fr"}, "this server translates en to de only, not en "
                                                 "to fr"),
    ({"q": ["a", 1], "source": "en", "target": "de"},
     "Invalid request: q must be a string or a list of strings"),
    ({"q": "a", "source": "en", "target": "de", "alternatives": "x"},
     "Invalid request: alternatives must be an integer"),
    ({"q": "a", "source": "en", "target": "de", "alternatives": 8},
     "Invalid request: alternatives must be 0 to 7"),
    ({"q": "a", "source": "en", "target": "de", "alternatives": -1},
     "Invalid request: alternatives must be 0 to 7"),
    ({"q": "a", "source": "en", "target": "de", "alternatives": "Infinity"},
     "Invalid request: alternatives must be an integer"),
    ({"q": "a", "source": "en", "target": "de", "alternatives": "1e400"},
     "Invalid request: alternatives must be an integer"),
    ({"q": "a", "source": "en", "target": "de", "alternatives": math.inf},
     "Invalid request: alternatives must be an integer"),
    ({"q": "a", "source": "en", "target": "de", "alternatives": "9" * 5000},
     "Invalid request: alternatives must be an integer"),
    ({"q": "a", "source": "en", "target": "de", "alternatives": 1e20},
     "Invalid request: alternatives must be 0 to 7"),
])
def test_libre_request_refusals(fields, message):
    assert refused(api.libre_request, fields, OPTIONS, ("en", "de"), 4) == (400, message)


def test_libre_request_checks_the_lines_of_its_texts():
    fields = {"q": "a\nb\nc\nd\ne", "source": "en", "target": "de"}
    assert refused(api.libre_request, fields, OPTIONS, None, 4) == (
        422, "5 lines in one request; this server takes at most 4 (--max-lines)")


def test_libre_answer_joins_each_texts_lines_again():
    asked = api.LibreRequest([["one", "", "two"], ["three"]], {}, 0, single=False)
    outputs = [output(("eins", -1.0)), output(("", 0.0)), output(("zwei", -1.0)),
               output(("drei", -1.0))]
    assert api.libre_answer(asked, outputs) == {"translatedText": ["eins\n\nzwei", "drei"]}
    asked = api.LibreRequest([["one", "two"]], {"nbest": 2, "beam": 4}, 1, single=True)
    outputs = [output(("eins", -1.0), ("ein", -2.0)), output(("zwei", -1.0)) + [(NOT_FOUND, "")]]
    assert api.libre_answer(asked, outputs) == {"translatedText": "eins\nzwei",
                                                "alternatives": ["ein\n"]}


def test_languages_and_frontend_settings():
    assert api.languages(None) == []
    assert api.languages(("en", "xx")) == [
        {"code": "en", "name": "English", "targets": ["xx"]},
        {"code": "xx", "name": "xx", "targets": []}]
    settings = api.frontend_settings(ServeOptions(api_key="k"), None)
    assert settings["charLimit"] == 10_000 and settings["keyRequired"] is True
    assert settings["language"] == {"source": {"code": "auto", "name": "auto"},
                                    "target": {"code": "", "name": ""}}
    assert api.frontend_settings(OPTIONS, ("en", "de"))["language"]["target"] == {
        "code": "de", "name": "German"}


def test_the_api_and_the_server_module_import_neither_torch_nor_starlette():
    """The server sets the environment torch reads at its start before anything imports torch
    (server.tune_process); and the request shapes need no web framework."""
    code = ("import sys; import attn_cli.serve.server; "
            "print(sorted(m for m in ('torch', 'starlette', 'uvicorn') if m in sys.modules))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)
    assert found.stdout == "[]\n"
