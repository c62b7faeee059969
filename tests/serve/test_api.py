"""What `attn serve` takes and answers (attn_cli/serve/api.py), without a server: each refusal's
status and message, the search settings a request may change, and the answers' shapes from the
search's outputs. test_server.py checks the same over HTTP against `attn decode`."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attn_cli.config import MAX_LEN_B, SERVE_DEFAULTS, ServeOptions, parse_langs
from attn_cli.decode.options import RANGES, DecodeOptions
from attn_cli.decode.translator import NOT_FOUND
from attn_cli.errors import AttnError
from attn_cli.formats import Stop
from attn_cli.search import Hypothesis
from attn_cli.serve import api
from attn_cli.serve.api import Problem
from attn_cli.serve.downloads import Downloads
from attn_cli.serve.keys import Keys
from attn_cli.serve.server import model_groups

from .client import multipart

OPTIONS = ServeOptions(max_lines=4, max_line_chars=20, max_beam=8, char_limit=60)
ONE = [api.Served("m", ("en", "de"))]
ANY = [api.Served("m", None)]  # a server whose model's pair is not known: any pair accepted
PAIRS = [api.Served("en-de", ("en", "de")), api.Served("de-en", ("de", "en")),
         api.Served("fr-de", ("fr", "de"))]


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
    content_type, body = multipart({"q": "Grüße. Zwei", "source": "de"})
    assert api.libre_fields(content_type, body) == {"q": "Grüße. Zwei", "source": "de"}
    status, message = refused(api.libre_fields, "multipart/form-data; boundary=x", b"")
    assert status == 400 and message.startswith("the multipart body cannot be read")
    status, message = refused(api.libre_fields, form, b"q=%FF")
    assert status == 400 and message.startswith("the form is not valid UTF-8")


# ----------------------------------------------------------------------------------- the checks


def admitted(keys, options, headers, fields=None):
    """The options a request is held to, as Service.admit finds them (its rate aside)."""
    return api.options_for(options, api.find_key(keys, headers, fields))


def test_the_api_key_in_any_of_its_three_places():
    options = ServeOptions()
    assert admitted(Keys(), options, {}) is options  # no key: open
    keys = Keys("k")
    for headers, fields in (({"authorization": "Bearer k"}, None),
                            ({"authorization": "bearer  k "}, None), ({"x-api-key": "k"}, None),
                            ({}, {"api_key": "k"})):
        assert admitted(keys, options, headers, fields) is options
    for headers, fields in (({}, None), ({"authorization": "Bearer wrong"}, None),
                            ({"authorization": "k"}, None), ({}, {"api_key": 7})):
        with pytest.raises(Problem) as problem:
            admitted(keys, options, headers, fields)
        assert problem.value.status == 401
        assert problem.value.headers == {"WWW-Authenticate": "Bearer"}


def test_a_key_of_the_key_file_holds_a_request_to_its_own_character_limit(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("small key-s 0 20\nplain key-p 0 -\n")
    options = ServeOptions(char_limit=1000, api_keys=path)
    keys = Keys(path=path)
    assert admitted(keys, options, {"x-api-key": "key-p"}) is options
    small = admitted(keys, options, {}, {"api_key": "key-s"})
    assert small.char_limit == 20 and small.max_lines == options.max_lines
    with pytest.raises(Problem) as problem:
        api.libre_request({"q": "x" * 21, "source": "en", "target": "de"}, small, 4)
    assert problem.value.status == 400 and "20" in problem.value.message


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
    ({"stop": "soon"}, "stop must be one of bound, patience, best-ends, limit, not 'soon'"),
])
def test_search_settings_refusals(fields, message):
    assert refused(api.search_settings, fields, 8) == (422, message)


def test_every_search_field_is_a_decode_option_whose_range_decode_options_check():
    """Service.translate answers a DecodeOptions error with 422 and its message, which names the
    field (tests/decode/test_options.py: those messages)."""
    names = {field.name for field in dataclasses.fields(DecodeOptions)}
    assert set(api.SEARCH_FIELDS) <= names
    numeric = {name for name, kind in api.SEARCH_FIELDS.items() if kind in (int, float)}
    assert numeric - {"seed"} <= set(RANGES)


def test_check_work_names_the_limit_and_what_to_lower():
    api.check_work(1000, 1000)
    status, message = refused(api.check_work, 131_104, 100_000)
    assert status == 422
    assert message == ("this request's search may take 131,104 hypothesis steps (each line's "
                       "beam × its longest allowed output, max_len_a × source tokens + "
                       "max_len_b, the later positions weighed more), above this server's "
                       "limit of 100,000 (--max-request-tokens; by default what one search "
                       "worker does in --max-request-seconds): send fewer lines, or ask for a "
                       "smaller beam, max_len_a or max_len_b")


# ------------------------------------------------------------------------ POST /v1/translate


def test_v1_request():
    asked = api.v1_request({"text": ["a", ""], "beam": 2, "scores": True}, OPTIONS, ONE)
    assert asked == api.V1Request(["a", ""], {"beam": 2}, single=False, scores=True,
                                  model=ONE[0])
    asked = api.v1_request({"text": "a", "model": "m", "api_key": "k", "split": True}, OPTIONS,
                           ONE)
    assert asked == api.V1Request(["a"], {}, single=True, scores=False, model=ONE[0],
                                  split=True)


def test_v1_request_picks_a_model_by_id_or_pair():
    def picked(fields, served=PAIRS):
        return api.v1_request({"text": ["a"], **fields}, OPTIONS, served).model.id

    assert picked({"model": "de-en"}) == "de-en"
    assert picked({"source": "de", "target": "en"}) == "de-en"
    assert picked({"model": "fr-de", "source": "fr", "target": "de"}) == "fr-de"
    assert picked({"model": None, "source": None, "target": None}, ONE) == "m"
    assert picked({"source": "xx", "target": "yy"}, ANY) == "m"  # any pair


@pytest.mark.parametrize("fields, served, status, message", [
    ({"txt": ["a"]}, ONE, 422, "unknown field 'txt' (fields: alignment, alpha, beam, "
                               "constraints, glossary, max_len_a, "
                               "max_len_b, model, nbest, prefix, raw, sample, scores, seed, "
                               "source, split, stop, "
                               "target, temperature, text, topk, topp)"),
    ({"text": ["a"], "model": "other"}, ONE, 404, "unknown model 'other': this server has 'm' "
                                                  "(GET /v1/models)"),
    ({"text": ["a"], "model": "x"}, PAIRS, 404, "unknown model 'x': this server has 'en-de', "
                                                "'de-en', 'fr-de' (GET /v1/models)"),
    ({"text": ["a"]}, PAIRS, 422, "this server has several models ('en-de', 'de-en', 'fr-de'): "
                                  "name one with model, or source and target"),
    ({"text": ["a"], "source": "en"}, PAIRS, 422, "source and target go together: name both, "
                                                  "or name the model"),
    ({"text": ["a"], "source": "en", "target": "fr"}, PAIRS, 404,
     "no model translates en to fr: this server translates en to de, de to en, fr to de "
     "(GET /v1/models)"),
    ({"text": ["a"], "model": "en-de", "source": "de", "target": "en"}, PAIRS, 422,
     "model 'en-de' does not translate de to en: name one or the other"),
    ({"text": ["a"], "source": 1, "target": "de"}, PAIRS, 422,
     "source must be a string, not a number"),
    ({"text": ["a"], "target": ["de"]}, PAIRS, 422, "target must be a string, not an array"),
    ({"beam": 2}, ONE, 422, "the body needs a 'text' field: a list of lines"),
    ({"text": {"a": 1}}, ONE, 422, "text must be a list of strings, not an object"),
    ({"text": [1]}, ONE, 422, "text[0] must be a string, not a number"),
    ({"text": ["a"], "scores": "yes"}, ONE, 422, "scores must be true or false, not a string"),
    ({"text": ["a"], "split": 1}, ONE, 422, "split must be true or false, not a number"),
    ({"text": ["a"], "model": ["m"]}, ONE, 422, "model must be a string, not an array"),
    ({"text": ["a"], "beam": 99}, ONE, 422, "beam 99 is above this server's limit of 8 "
                                            "(--max-beam)"),
])
def test_v1_request_refusals(fields, served, status, message):
    assert refused(api.v1_request, fields, OPTIONS, served) == (status, message)


def test_v1_answers_one_output_per_line_and_k_with_nbest():
    lines = api.V1Request(["a", "b"], {}, single=False, scores=False, model=ONE[0])
    outputs = [output(("A", -0.5)), output(("B", -1.0))]
    assert api.v1_answer("m", lines, outputs, 1) == {"model": "m", "translations": ["A", "B"]}
    with_scores = dataclasses.replace(lines, scores=True)
    assert api.v1_answer("m", with_scores, outputs, 1)["scores"] == [-0.5, -1.0]
    one = api.V1Request(["a"], {}, single=True, scores=True, model=ONE[0])
    assert api.v1_answer("m", one, outputs[:1], 1) == {"model": "m", "translations": "A",
                                                       "scores": -0.5}
    # nbest 3: always 3 per line, those not found empty with no score (JSON has no -inf)
    padded = [output(("A", -0.5), ("A2", -0.7)) + [(NOT_FOUND, "")],
              output(("", 0.0)) + [(NOT_FOUND, "")] * 2]
    answer = api.v1_answer("m", lines, padded, 3)
    assert answer == {"model": "m", "translations": [["A", "A2", ""], ["", "", ""]],
                      "scores": [[-0.5, -0.7, None], [0.0, None, None]]}
    assert json.loads(json.dumps(answer)) == answer


def test_v1_alignments_sit_beside_the_translations_in_their_shape():
    asked = api.v1_request({"text": ["a b", ""], "alignment": True}, OPTIONS, ONE)
    assert asked.alignment
    outputs = [[(Hypothesis([7, 8], -0.5, -0.5), "B A")], output(("", 0.0))]
    seen = []

    def align(lines, tokens):  # Translator.align's contract, called once for every output
        seen.append((lines, tokens))
        return [[(0, 1), (1, 0)] if ids else [] for ids in tokens]

    alignments = api.output_alignments(asked.lines, outputs, align)
    assert seen == [(["a b", ""], [[7, 8], []])]
    answer = api.v1_answer("m", asked, outputs, 1, alignments)
    assert answer["translations"] == ["B A", ""]
    assert answer["alignments"] == [[[0, 1], [1, 0]], []]
    nbest = [outputs[0] + [(NOT_FOUND, "")]]  # a K-th not found: its text stays "", no pairs
    answer = api.v1_answer("m", dataclasses.replace(asked, single=True), nbest, 2,
                           api.output_alignments(["a b"], nbest, align))
    assert answer["translations"] == ["B A", ""]
    assert answer["alignments"] == [[[0, 1], [1, 0]], []]
    assert refused(api.v1_request, {"text": "a", "split": True, "alignment": True}, OPTIONS,
                   ONE) == (422, "alignment is of lines searched whole: send one sentence per "
                                 "line without split")
    assert refused(api.v1_request, {"text": "a", "raw": True, "alignment": True}, OPTIONS,
                   ONE)[1].endswith("drop raw")


# ------------------------------------------------------------------------------- sentences


def test_split_sentences_within_the_limits():
    split = api.split_sentences(["A dog runs. A cat sleeps.", "  ", "Zwei Hunde.\nJa."],
                                ["en", None, "x y"], OPTIONS, "q", False)  # "x y": English's
    assert [paragraph.sentences for paragraph in split.paragraphs] == [
        ("A dog runs.", "A cat sleeps."), (), ("Zwei Hunde.", "Ja.")]
    assert split.paragraphs[1].spacing == ("  ",)
    assert refused(api.split_sentences, ["Go. Run. Eat.", "Sit. Stay."], [None] * 2, OPTIONS, "q",
                   False) == (422, "q holds 5 sentences; this server searches at most 4 in "
                                   "one request (--max-lines)")
    assert refused(api.split_sentences, ["Ok.", "A dog runs on the green grass."], [None] * 2,
                   OPTIONS, "q", False) == (
        422, "q[1] holds a sentence of 30 characters; this server takes at most 20 "
             "(--max-line-chars)")
    assert refused(api.split_sentences, ["A dog runs on the green grass."], [None], OPTIONS,
                   "text", True)[1].startswith("text holds a sentence of 30 characters")


def test_joined_outputs_keep_every_sentence_and_the_spacing():
    """Output k joins each sentence's k-th best, or its best where fewer were found; the score
    is the sum; a text of whitespace alone is itself."""
    split = api.split_sentences(["One.  Two.\n", " "], ["en"] * 2, OPTIONS, "q", False)
    outputs = [output(("Eins.", -1.0), ("Ein.", -2.0)) + [(NOT_FOUND, "")],
               output(("Zwei.", -0.5)) + [(NOT_FOUND, "")] * 2]
    joined = api.joined_outputs(split, outputs, 3)
    assert [[(hypothesis.score, text) for hypothesis, text in texts] for texts in joined] == [
        [(-1.5, "Eins.  Zwei.\n"), (-2.5, "Ein.  Zwei.\n"), (-1.5, "Eins.  Zwei.\n")],
        [(0.0, " ")] * 3]
    v1 = api.V1Request(["One.  Two.\n", " "], {}, single=False, scores=True, model=ONE[0],
                       split=True)
    assert api.v1_answer("m", v1, joined, 3)["scores"] == [[-1.5, -2.5, -1.5], [0.0] * 3]


def test_sentences_of_several_models_are_grouped_and_put_back_in_order():
    split = api.split_sentences(["Go. Run.", "Eat.", "Sit. Stay."], [None] * 3,
                                ServeOptions(max_lines=10), "q", False)
    en_de, de_en = PAIRS[:2]
    groups = api.grouped([api.Route(en_de, "en"), api.Route(de_en, "de"),
                          api.Route(en_de, "en")])
    assert groups == [(en_de, [0, 2]), (de_en, [1])]
    lines = [api.group_sentences(split, texts) for _, texts in groups]
    assert lines == [["Go.", "Run.", "Sit.", "Stay."], ["Eat."]]
    outputs = [[output((line.upper(), -1.0)) for line in group] for group in lines]
    assert [found[0][1] for found in api.regrouped(split, groups, outputs)] == [
        "GO.", "RUN.", "EAT.", "SIT.", "STAY."]


# ----------------------------------------------------------------- POST /translate (LibreTranslate)


def test_libre_request():
    fields = {"q": "one\r\ntwo", "source": "auto", "target": "de"}
    assert api.libre_request(fields, OPTIONS, 4) == api.LibreRequest(
        ["one\r\ntwo"], "auto", "de", {}, 0, single=True)
    asked = api.libre_request({**fields, "q": ["a", "b"], "alternatives": "2"}, OPTIONS, 1)
    assert not asked.single and asked.texts == ["a", "b"]
    assert asked.settings == {"nbest": 3, "beam": 3}  # a beam at least as wide as the outputs
    asked = api.libre_request({**fields, "alternatives": 2}, OPTIONS, 4)
    assert asked.settings == {"nbest": 3, "beam": 4}
    unlimited = dataclasses.replace(OPTIONS, char_limit=-1)
    assert api.libre_request({**fields, "q": "a" * 1000}, unlimited, 4).texts == ["a" * 1000]
    assert api.libre_request({**fields, "format": "html"}, OPTIONS, 4).html
    assert not api.libre_request({**fields, "format": "text"}, OPTIONS, 4).html


@pytest.mark.parametrize("fields, message", [
    ({"source": "en", "target": "de"}, "Invalid request: missing q parameter"),
    ({"q": "a", "target": "de"}, "Invalid request: missing source parameter"),
    ({"q": "a", "source": "en", "target": ""}, "Invalid request: missing target parameter"),
    ({"q": "a", "source": "en", "target": "de", "format": "xml"},
     "Invalid request: format 'xml' is not supported: send format 'text' or 'html'"),
    ({"q": "a", "source": "en", "target": "de", "format": ["html"]},
     "Invalid request: format ['html'] is not supported: send format 'text' or 'html'"),
    ({"q": ["a", 1], "source": "en", "target": "de"},
     "Invalid request: q must be a string or a list of strings"),
    ({"q": "a" * 61, "source": "en", "target": "de"},
     "Invalid request: request (61 characters) exceeds text limit (60, this server's "
     "--char-limit)"),
    ({"q": ["a" * 30, "b" * 31], "source": "en", "target": "de"},
     "Invalid request: request (61 characters) exceeds text limit (60, this server's "
     "--char-limit)"),
    ({"q": ["a", "b\ud800"], "source": "en", "target": "de"},
     "q[1] is not valid Unicode (an unpaired surrogate at character 1)"),
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
    assert refused(api.libre_request, fields, OPTIONS, 4) == (400, message)


def test_libre_routes_by_pair_or_by_the_language_detected_among_those_served():
    calls = []

    def detect(text, candidates):
        calls.append((text, candidates))
        french = "le " in text
        return [("fr", 80.0), ("en", 20.0)] if french else [("en", 90.0), ("fr", 10.0)]

    en_de, de_en, fr_de = PAIRS
    assert api.libre_routes(["a", "b"], "de", "en", PAIRS, detect) == [api.Route(de_en, "de")] * 2
    # auto: detected among the sources into the target; short texts get all texts' detection
    long = "le chien court dans le parc avec un ballon"  # > SHORT_TEXT characters
    english = "the dog runs in the park with a red ball today"
    routes = api.libre_routes([long, "a dog", english], "auto", "de", PAIRS, detect)
    assert [(route.model.id, route.detected) for route in routes] == [
        ("fr-de", {"confidence": 80.0, "language": "fr"}),
        ("fr-de", {"confidence": 80.0, "language": "fr"}),  # as the three together
        ("en-de", {"confidence": 90.0, "language": "en"})]
    assert calls == [(long, ["en", "fr"]), (f"{long}\na dog\n{english}", ["en", "fr"]),
                     (english, ["en", "fr"])]
    calls.clear()
    assert api.libre_routes(["Hallo"], "auto", "en", PAIRS, detect) == [
        api.Route(de_en, "de", {"confidence": 100.0, "language": "de"})]  # the one source
    assert calls == []
    assert api.libre_routes(["x"], "auto", "de", ANY, detect) == [api.Route(ANY[0], None)]
    assert api.libre_routes(["x"], "xx", "yy", ANY, detect) == [api.Route(ANY[0], "xx")]


@pytest.mark.parametrize("source, target, served, message", [
    ("fr", "de", ONE, "this server translates en to de only, not fr to de"),
    ("en", "fr", ONE, "this server translates en to de only, not en to fr"),
    ("en", "fr", PAIRS, "this server translates en to de, de to en, fr to de only, not en to "
                        "fr"),
    ("auto", "fr", PAIRS, "this server translates en to de, de to en, fr to de only: no source "
                          "language into fr"),
])
def test_libre_routes_refusals(source, target, served, message):
    assert refused(api.libre_routes, ["a"], source, target, served, None) == (400, message)


def test_libre_answer():
    split = api.split_sentences(["One. Two.", "Three."], ["en"] * 2, OPTIONS, "q", False)
    outputs = [output(("Eins.", -1.0), ("Ein.", -2.0)), output(("Zwei.", -1.0)) +
               [(NOT_FOUND, "")], output(("Drei.", -1.0), ("Drei!", -3.0))]
    joined = api.joined_outputs(split, outputs, 2)
    asked = api.LibreRequest(["One. Two.", "Three."], "en", "de", {"nbest": 2, "beam": 4}, 1,
                             single=False)
    routes = [api.Route(ONE[0], "en")] * 2
    assert api.libre_answer(asked, joined, routes) == {
        "translatedText": ["Eins. Zwei.", "Drei."], "alternatives": [["Ein. Zwei."], ["Drei!"]]}
    detected = {"confidence": 99.5, "language": "en"}
    auto = dataclasses.replace(asked, source="auto", alternatives=0, texts=["One. Two."],
                               single=True)
    assert api.libre_answer(auto, joined[:1], [api.Route(ONE[0], "en", detected)]) == {
        "translatedText": "Eins. Zwei.", "detectedLanguage": detected}
    # a server that takes any pair detects nothing, and says nothing of it
    assert api.libre_answer(auto, joined[:1], [api.Route(ANY[0], None)]) == {
        "translatedText": "Eins. Zwei."}


def test_detect_request_and_detections():
    assert api.detect_request({"q": "Hallo Welt"}, OPTIONS) == "Hallo Welt"
    assert api.detect_request({"q": ["Hallo", "Welt"]}, OPTIONS) == "Hallo\nWelt"
    for fields in ({}, {"q": ""}):
        assert refused(api.detect_request, fields, OPTIONS) == (
            400, "Invalid request: missing q parameter")
    assert refused(api.detect_request, {"q": 7}, OPTIONS)[0] == 400
    assert refused(api.detect_request, {"q": "a" * 61}, OPTIONS)[1].endswith("--char-limit)")
    assert api.detections([("de", 99.9512), ("en", 0.0488)]) == [
        {"confidence": 99.95, "language": "de"}, {"confidence": 0.05, "language": "en"}]


def test_languages_and_frontend_settings():
    assert api.languages(ANY) == []
    assert api.languages([api.Served("m", ("en", "xx"))]) == [
        {"code": "en", "name": "English", "targets": ["xx"]},
        {"code": "xx", "name": "xx", "targets": []}]
    assert api.languages(PAIRS) == [{"code": "en", "name": "English", "targets": ["de"]},
                                    {"code": "de", "name": "German", "targets": ["en"]},
                                    {"code": "fr", "name": "French", "targets": ["de"]}]
    settings = api.frontend_settings(ServeOptions(api_key="k"), ANY)
    assert settings["charLimit"] == 10_000 and settings["keyRequired"] is True
    assert settings["filesTranslation"] is True
    assert settings["supportedFilesFormat"] == [".txt", ".html", ".htm", ".docx", ".srt",
                                                ".vtt"]
    assert settings["language"] == {"source": {"code": "auto", "name": "auto"},
                                    "target": {"code": "", "name": ""}}
    settings = api.frontend_settings(OPTIONS, PAIRS)
    assert settings["charLimit"] == 60
    assert settings["language"]["target"] == {"code": "de", "name": "German"}


HTML = '<p>A <b>dog</b> runs. It <a href="/x">is</a> fast.</p><script>no()</script><p> </p>'


def test_html_texts_are_read_as_documents_their_text_detected():
    """Detection reads a document's text, not its markup (which would make a short text long);
    each document's sentences are its runs', within the limits."""
    calls = []

    def detect(text, candidates):
        calls.append(text)
        return [("en", 90.0), ("fr", 10.0)]

    long = f'<div class="{"x" * 60}">Le <i>chien</i>.</div>'  # long markup, short text
    prepared = api.libre_texts([HTML, long], "auto", "de", True, PAIRS, detect, OPTIONS, "q",
                               False)
    assert calls == ["A dog runs. It is fast.\nLe chien."]  # both short: detected together
    assert [route.model.id for route in prepared.routes] == ["en-de", "en-de"]
    assert [document.sentences for document in prepared.documents] == [
        ["A dog runs.", "It is fast."], ["Le chien."]]
    assert [paragraph.sentences for paragraph in prepared.split.paragraphs] == [
        ("A dog runs.", "It is fast."), ("Le chien.",)]
    assert api.html_text("<p>a</p><!-- b --><style>c</style>\n<p>d &amp; e</p>") == "a\nd & e"
    text = api.libre_texts(["A dog runs. It is fast."], "en", "de", False, PAIRS, None, OPTIONS,
                           "q", True)
    assert text.documents is None and text.split.sentences == ["A dog runs.", "It is fast."]
    assert refused(api.libre_texts, ["<p>Go. Run.</p><p>Eat. Sit. Stay.</p>"], "en", "de", True,
                   PAIRS, None, OPTIONS, "q", True) == (
        422, "q holds 5 sentences; this server searches at most 4 in one request (--max-lines)")
    assert refused(api.libre_texts, ["<p>A dog runs on the <b>green</b> grass.</p>"], "en",
                   "de", True, PAIRS, None, OPTIONS, "file", True)[1].startswith(
        "file holds a sentence of 30 characters")


def test_html_outputs_render_each_sentences_kth_best_with_its_own_alignment():
    documents, split = api.read_html([HTML, "<p></p>"], ["en", "xx-not a code"])
    outputs = [[(Hypothesis([1, 2, 3], -1.0, -1.0), "Ein Hund rennt."),
                (Hypothesis([4, 5], -2.0, -2.0), "Hund rennt.")],
               [(Hypothesis([6, 7, 8], -0.5, -0.5), "Er ist schnell."), (NOT_FOUND, "")]]
    asked = []

    def align(lines, ids):  # word i with word i, each output's ids recorded
        asked.append((lines, ids))
        return [[(i, i) for i in range(3)] for _ in lines]

    aligned = api.aligned_outputs(split.sentences, outputs, 2, align)
    assert asked == [(["A dog runs.", "A dog runs.", "It is fast.", "It is fast."],
                      [[1, 2, 3], [4, 5], [6, 7, 8], [6, 7, 8]])]  # not found: the best
    rendered = api.html_outputs(documents, aligned, 2)
    assert [(joined.score, text) for joined, text in rendered[0]] == [
        (-1.5, '<p>Ein <b>Hund</b> rennt. Er <a href="/x">ist</a> schnell.</p>'
               "<script>no()</script><p> </p>"),
        (-2.5, '<p>Hund <b>rennt.</b> Er <a href="/x">ist</a> schnell.</p>'
               "<script>no()</script><p> </p>")]
    assert [(joined.score, text) for joined, text in rendered[1]] == [(0, "<p></p>")] * 2


# ------------------------------------------------- POST /translate_file, GET /download_file


def test_multipart_fields_keep_the_files_bytes_exactly():
    data = b"One.\r\nTwo.\n\n\xff\xfe binary\r\n--not a boundary\r\n"
    for sent in (data, b"", b"no line break at the end"):
        content_type, body = multipart({"source": "en", "target": "dé"},
                                       {"file": ("Grüße.txt", sent)})
        assert api.multipart_fields(content_type, body) == (
            {"source": "en", "target": "dé"}, {"file": ("Grüße.txt", sent)})


@pytest.mark.parametrize("content_type, body, fragment", [
    ("multipart/form-data", b"--b\r\n\r\nx\r\n--b--\r\n", "NoBoundaryInMultipartDefect"),
    ("multipart/form-data; boundary=c", b"--b\r\n\r\nx\r\n--b--\r\n", "StartBoundaryNotFound"),
    ("multipart/form-data; boundary=b", b'--b\r\nContent-Disposition: form-data; name="q"\r\n'
                                        b"\r\nx", "CloseBoundaryNotFoundDefect"),
    ("multipart/form-data; boundary=b\r\nX: 1", b"", "holds a line break"),
    ("multipart/form-data; boundary=b", b'--b\r\nContent-Disposition: form-data; name="q"\r\n'
                                        b"\r\n\xff\r\n--b--\r\n",
     "the form field 'q' is not valid UTF-8 (byte 0)"),
])
def test_multipart_fields_refusals(content_type, body, fragment):
    status, message = refused(api.multipart_fields, content_type, body)
    assert status == 400 and fragment in message


def test_file_request():
    fields = {"source": "en", "target": "de"}
    asked = api.file_request(fields, {"file": ("notes.TXT", "\ufeffOne.\nTwo.".encode())})
    assert asked == api.FileRequest("notes.TXT", "One.\nTwo.", True, "en", "de")
    assert api.file_request(fields, {"file": ("Page.HTM", b"<p>Hi.</p>")}).html
    assert api.media_type("a.html") == "text/html; charset=utf-8"
    assert api.media_type("a.txt") == "text/plain; charset=utf-8"
    for files, extra, message in [
        ({}, {}, "Invalid request: missing file parameter"),
        ({"file": ("a.txt", b"")}, {"target": ""}, "Invalid request: missing target parameter"),
        ({"file": ("", b"x")}, {}, "Invalid request: empty file (the file field has no "
                                   "filename)"),
        ({"file": ("a.pdf", b"x")}, {}, "Invalid request: file format not supported: file "
                                        "'a.pdf'; this server translates .txt, .html, .htm, "
                                        ".docx, .srt, .vtt files"),
        ({"file": ("a.txt", b"\xe9t\xe9")}, {}, "file 'a.txt' is not valid UTF-8 (byte 0)"),
    ]:
        assert refused(api.file_request, {**fields, **extra}, files) == (400, message)


def test_download_names_are_plain():
    assert api.download_name("../../etc/passwd.txt") == "passwd.txt"
    assert api.download_name("C:\\Users\\me\\Grüße Bericht.TXT") == "Gr_e_Bericht.txt"
    assert api.download_name(".hidden.txt") == "hidden.txt"
    assert api.download_name("") == "file"


def test_downloads_are_bounded_by_age_and_count(tmp_path):
    now = [0.0]
    downloads = Downloads(seconds=10, count=2, clock=lambda: now[0])
    first = downloads.add("a.txt", b"one")
    assert re.fullmatch(r"[0-9a-f]{32}\.a\.txt", first)
    assert downloads.get(first) == (b"one", "a.txt")
    assert downloads.get("../" + first) is None and downloads.get("x") is None
    now[0] = 5.0
    second, third = downloads.add("b.txt", b"two"), downloads.add("c.txt", b"three")
    assert downloads.get(first) is None  # the oldest, past the count
    assert sorted(path.name for path in downloads.directory.iterdir()) == sorted(
        [second, third])
    now[0] = 14.9
    assert downloads.get(second) == (b"two", "b.txt")
    now[0] = 15.0
    assert downloads.get(second) is None and len(downloads) == 0  # past its 10 s
    directory = downloads.directory
    downloads.close()
    assert not directory.exists()


# ---------------------------------------------------------------------- the models of a server


def test_model_groups_pairs_and_ensembles():
    plain = ServeOptions()
    assert model_groups(["a.st"], plain) == [(None, [Path("a.st")])]
    assert model_groups(["a.st", "b.st"], plain) == [(None, [Path("a.st"), Path("b.st")])]
    assert model_groups(["en-de=a.st", "de-en=b.st", "en-de=c.st"], plain) == [
        (("en", "de"), [Path("a.st"), Path("c.st")]), (("de", "en"), [Path("b.st")])]
    assert model_groups(["./en-de=x.st"], plain) == [(None, [Path("en-de=x.st")])]
    for values, options, message in [
        (["en-de=a.st", "b.st"], plain, "-m b.st names no language pair, but other -m do"),
        (["en-de=a.st"], ServeOptions(langs=("en", "de")), "--langs is the pair of a model "
                                                            "given without one"),
        (["en-de=a.st"], ServeOptions(name="x"), "--name is the id of a server's one model"),
    ]:
        with pytest.raises(AttnError, match=re.escape(message)):
            model_groups(values, options)


def test_the_api_and_the_server_module_import_neither_torch_nor_starlette():
    """The server sets the environment torch reads at its start before anything imports torch
    (server.tune_process); and the request shapes need no web framework."""
    code = ("import sys; import attn_cli.serve.server; "
            "print(sorted(m for m in ('torch', 'starlette', 'uvicorn') if m in sys.modules))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)
    assert found.stdout == "[]\n"


def test_v1_prefixes_one_per_line_and_their_ids():
    """`prefix` (`attn decode --prefix`): a string per line (null: none), or one string for one
    text; refused with split, in another shape, or with a piece outside the vocabulary."""
    lines = api.V1Request(["a", "b", "c"], {}, single=False, scores=False, model=ONE[0])
    assert api.v1_prefixes({}, lines) is None
    assert api.v1_prefixes({"prefix": ["x y", None, ""]}, lines) == ["x y", "", ""]
    one = api.V1Request(["a"], {}, single=True, scores=False, model=ONE[0])
    assert api.v1_prefixes({"prefix": "x"}, one) == ["x"]
    for value in (["x"], "x", ["x", 1, "y"]):
        status, message = refused(api.v1_prefixes, {"prefix": value}, lines)
        assert status == 422 and "prefix must be a list of strings, one per line" in message
    split = dataclasses.replace(lines, split=True)
    assert refused(api.v1_prefixes, {"prefix": ["x"] * 3}, split)[0] == 422

    class Vocab:  # a toy vocabulary: "?" is outside it (<unk> is 1)
        def encode(self, texts):
            return [[1 if char == "?" else ord(char) for char in text] for text in texts]

    class Translator:
        tgt_vocab, config = Vocab(), dataclasses.make_dataclass(
            "Config", [("unk_id", int, 1)])()
        options = dataclasses.make_dataclass("Options", [("sample", bool, False)])()

        def controls_of(self, line, controls):
            return controls

    asked = api.RequestControls(prefixes=["ab", "", "c"])
    controls = asked.line_controls(Translator(), ["x", "y", "z"])
    assert [control.prefix for control in controls] == [(97, 98), (), (99,)]
    assert api.RequestControls(prefixes=["", "", ""]).line_controls(
        Translator(), ["x", "y", "z"]) is None
    assert refused(api.RequestControls(prefixes=["ab", "a?"]).line_controls, Translator(),
                   ["x", "y"]) == (
        422, "prefix[1] 'a?' has characters outside the model's target vocabulary: remove them")
