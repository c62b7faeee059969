"""`attn serve` (attn_cli/serve/server.py): the real server started on a free port and talked to
over HTTP — its answers against `attn decode`'s, LibreTranslate's client library, bad requests
(every field fed each wrong kind and edge), the limits, the API key, a full queue, clients that go
away and requests past their deadline (the server idle again within a second), SIGTERM, and a
load of 10,000 requests. The server process and the clients are tests/serve/client.py's
(benchmarks/serve_load.py measures with them too); what each request is answered, field by
field, is test_api.py's."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest

from attn_cli.serve.api import V1_FIELDS

from ..conftest import assert_clean_error, decode, run_attn
from .client import (
    Connection,
    Server,
    call,
    multipart,
    raw_call,
    run_clients,
    wait_for,
)

pytest.importorskip("uvicorn", reason="attn[serve] is not installed")

pytestmark = pytest.mark.slow


def serve_command(model, *options) -> list[str]:
    """The server under test, its translation cache off (test_operations.py tests the cache):
    every answer here comes from a search."""
    return [sys.executable, "-m", "attn_cli", "serve", "-m", str(model), "--port", "0",
            "--threads", "2", "--cache-lines", "0", *map(str, options)]


@pytest.fixture(scope="module")
def lines(corpus) -> list[str]:
    return corpus["val.en"].read_text(encoding="utf-8").splitlines()[:40]


@pytest.fixture(scope="module")
def server(trained):
    """One server for the tests that do not need special settings."""
    model, _ = trained
    process = Server(serve_command(model, "--langs", "en-de", "--max-lines", 64,
                                  "--max-line-chars", 300, "--max-body", 20000,
                                  "--max-request-tokens", 100_000))
    process.wait_ready()
    yield process
    assert process.stop() == 0


def test_answers_are_attn_decode_s_byte_for_byte(server, trained, lines):
    """Line by line from 8 clients at once (so lines of different requests share batches) and
    as one request, at beam 4 and greedy: exactly `attn decode`'s lines."""
    model, _ = trained
    for beam in (4, 1):
        expected = decode(model, lines, "--beam", beam)
        run = asyncio.run(run_clients(server.host, server.port, lines, 8, {"beam": beam}))
        assert run["statuses"] == {200: len(lines)}
        assert run["outputs"] == expected
        status, answer = call(server, "POST", "/v1/translate", {"text": lines, "beam": beam})
        assert status == 200 and answer["translations"] == expected


def test_nbest_scores_and_sampling_match_decode(server, trained, lines):
    model, _ = trained
    status, answer = call(server, "POST", "/v1/translate", {"text": lines[:6], "nbest": 3})
    assert status == 200
    printed = [f"{index}\t{'-inf' if score is None else f'{score:.4f}'}\t{text}"
               for index, (texts, scores) in enumerate(zip(answer["translations"],
                                                           answer["scores"]))
               for text, score in zip(texts, scores)]
    assert printed == decode(model, lines[:6], "--nbest", 3)
    status, answer = call(server, "POST", "/v1/translate",
                          {"text": lines[:6], "sample": True, "seed": 7, "topk": 5})
    assert status == 200
    assert answer["translations"] == decode(model, lines[:6], "--sample", "--seed", 7,
                                            "--topk", 5)
    status, answer = call(server, "POST", "/v1/translate", {"text": lines[0], "scores": True})
    assert status == 200 and isinstance(answer["translations"], str)
    assert isinstance(answer["scores"], float)


def test_alignments_are_decode_alignment_s(server, trained, lines):
    """"alignment": true answers `attn decode --alignment`'s pairs beside the translations."""
    model, _ = trained
    expected = [row.split("\t") for row in decode(model, lines[:6], "--alignment")]
    status, answer = call(server, "POST", "/v1/translate", {"text": lines[:6], "alignment": True})
    assert status == 200
    assert answer["translations"] == [text for text, _ in expected]
    assert [" ".join(f"{i}-{j}" for i, j in pairs) for pairs in answer["alignments"]] == [
        column for _, column in expected]


def test_constraints_and_a_glossary_are_decode_s(server, trained, lines, tmp_path):
    """"constraints" (a list of phrases per line) and "glossary" (source: target terms) answer
    `attn decode --constraints` and `--glossary`'s lines; an empty glossary is none; a phrase
    outside the vocabulary, or constraints with sample, is a 422 naming it."""
    model, _ = trained
    words = [line.split()[-1].strip(".") for line in lines[:4]]
    phrases = [[word] for word in reversed(words)]
    expected = decode(model, [f"{line}\t{row[0]}" for line, row in zip(lines[:4], phrases)],
                      "--constraints")
    status, answer = call(server, "POST", "/v1/translate",
                          {"text": lines[:4], "constraints": phrases, "glossary": {}})
    assert status == 200 and answer["translations"] == expected
    term = lines[0].split()[1]
    glossary = tmp_path / "terms.tsv"
    glossary.write_text(f"{term}\t{words[3]}\n", encoding="utf-8")
    status, answer = call(server, "POST", "/v1/translate",
                          {"text": lines[:4], "glossary": {term: words[3]}})
    assert status == 200
    assert answer["translations"] == decode(model, lines[:4], "--glossary", glossary)
    status, answer = call(server, "POST", "/v1/translate",
                          {"text": lines[0], "constraints": ["\u2603\u2603"]})
    assert status == 422 and "constraints '\u2603\u2603' has characters outside" in \
        answer["error"]
    status, answer = call(server, "POST", "/v1/translate",
                          {"text": lines[0], "constraints": [term], "sample": True})
    assert status == 422 and "need beam search" in answer["error"]


@pytest.mark.long  # a server of its own and four decodes: ~17 s on 2 busy cores
def test_a_server_glossary_and_bans_hold_for_both_apis(trained, lines, tmp_path):
    """`attn serve --glossary FILE --ban FILE`: LibreTranslate's /translate (sentences cut)
    answers `attn decode --split-sentences --glossary --ban`'s lines, /v1/translate `attn
    decode --glossary --ban`'s, and a request's own glossary adds to the server's."""
    model, _ = trained
    first, second = lines[0].split()[1], lines[1].split()[1]
    glossary, ban = tmp_path / "terms.tsv", tmp_path / "ban.txt"
    glossary.write_text(f"{first}\t{lines[2].split()[-1].strip('.')}\n", encoding="utf-8")
    banned = next(output.split()[0] for output in decode(model, lines[:8]) if output.strip())
    ban.write_text(banned + "\n", encoding="utf-8")
    controls = ["--glossary", glossary, "--ban", ban]
    process = Server(serve_command(model, "--langs", "en-de", *controls))
    try:
        process.wait_ready()
        paragraph = f"{lines[0]} {lines[1]}"
        status, answer = call(process, "POST", "/translate",
                              {"q": paragraph, "source": "en", "target": "de"})
        assert status == 200
        assert answer["translatedText"] == decode(model, [paragraph], "--split-sentences",
                                                  *controls)[0]
        status, answer = call(process, "POST", "/v1/translate", {"text": lines[:3]})
        assert status == 200 and answer["translations"] == decode(model, lines[:3], *controls)
        both = tmp_path / "both.tsv"
        both.write_text(glossary.read_text(encoding="utf-8") +
                        f"{second}\t{lines[3].split()[-1].strip('.')}\n", encoding="utf-8")
        status, answer = call(process, "POST", "/v1/translate", {
            "text": lines[:3], "glossary": [[second, lines[3].split()[-1].strip(".")]]})
        assert status == 200
        assert answer["translations"] == decode(model, lines[:3], "--glossary", both, "--ban",
                                                ban)
    finally:
        assert process.stop() == 0


def test_empty_lines_stay_in_place(server, trained, lines):
    model, _ = trained
    text = ["", lines[0], "   ", lines[1], ""]
    status, answer = call(server, "POST", "/v1/translate", {"text": text})
    assert status == 200 and answer["translations"] == decode(model, text)
    assert answer["translations"][0] == answer["translations"][2] == ""
    assert call(server, "POST", "/v1/translate", {"text": []}) == (
        200, {"model": answer["model"], "translations": []})


def test_health_models_and_languages(server, trained):
    model, _ = trained
    status, health = call(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == model.stem
    status, models = call(server, "GET", "/v1/models")
    (described,) = models["data"]
    assert status == 200 and described["id"] == model.stem and described["ready"]
    assert described["source"] == "en" and described["target"] == "de"
    assert described["defaults"]["beam"] == 4
    status, languages = call(server, "GET", "/languages")
    assert status == 200
    assert languages[0] == {"code": "en", "name": "English", "targets": ["de"]}


def test_libretranslate_client_library_works_unchanged(server, trained, lines):
    """libretranslatepy, LibreTranslate's own Python client (form-encoded bodies)."""
    libretranslatepy = pytest.importorskip("libretranslatepy")
    model, _ = trained
    client = libretranslatepy.LibreTranslateAPI(f"http://{server.host}:{server.port}")
    expected = decode(model, lines[:3])
    assert [client.translate(line, "en", "de") for line in lines[:3]] == expected
    assert client.translate(f"{lines[0]}\n{lines[1]}", "auto", "de") == "\n".join(expected[:2])
    assert {language["code"] for language in client.languages()} == {"en", "de"}
    with pytest.raises(urllib.error.HTTPError) as refused:
        client.translate(lines[0], "fr", "de")
    assert refused.value.code == 400
    assert "translates en to de only" in json.loads(refused.value.read())["error"]
    # JSON, as the browser extensions send it: a list of texts, alternatives
    status, answer = call(server, "POST", "/translate",
                          {"q": lines[:2], "source": "en", "target": "de", "format": "text",
                           "alternatives": 2})
    assert status == 200 and answer["translatedText"] == expected[:2]
    assert [len(others) for others in answer["alternatives"]] == [2, 2]


def test_a_paragraph_keeps_every_sentence_in_order_and_its_spacing(server, trained, lines):
    """LibreTranslate's /translate cuts a text into sentences, searches them as the request's
    lines and joins them again: each sentence translated once (the log counts 6 lines), in
    order, as `attn decode` translates it on a line of its own, the spaces, tabs and line
    breaks kept; each alternative too (the k-th best of each sentence, or its best).
    /v1/translate does the same with split: true, and stays decode's byte for byte without."""
    libretranslatepy = pytest.importorskip("libretranslatepy")
    model, _ = trained
    chosen = [lines[i] for i in (1, 2, 4, 6, 7, 10)]  # a sentence each, ending with a period
    layout = "  {} {}\n\n{}\t{}\r\n{}  {}\n"
    paragraph = layout.format(*chosen)
    two = f"{chosen[0]}  {chosen[1]}"
    expected = decode(model, [*chosen, two])
    client = libretranslatepy.LibreTranslateAPI(f"http://{server.host}:{server.port}")
    assert client.translate(paragraph, "en", "de") == layout.format(*expected[:6])
    wait_for(lambda: any(" POST /translate 200 6 lines " in line for line in server.log))
    status, answer = call(server, "POST", "/translate", {"q": [paragraph, "", " "],
                                                         "source": "en", "target": "de",
                                                         "alternatives": 2})
    assert status == 200
    assert answer["translatedText"] == [layout.format(*expected[:6]), "", " "]
    _, nbest = call(server, "POST", "/v1/translate", {"text": chosen, "nbest": 3, "beam": 4})
    assert answer["alternatives"][0] == [
        layout.format(*(texts[k] if scores[k] is not None else texts[0]
                        for texts, scores in zip(nbest["translations"], nbest["scores"])))
        for k in (1, 2)]
    assert answer["alternatives"][1:] == [["", ""], [" ", " "]]
    assert call(server, "POST", "/v1/translate", {"text": [two, ""], "split": True})[1][
        "translations"] == [f"{expected[0]}  {expected[1]}", ""]
    assert call(server, "POST", "/v1/translate", {"text": [two]})[1]["translations"] == [
        expected[6]]


@pytest.mark.parametrize("path, body, headers, status, fragment", [
    ("/v1/translate", b'{"text": [', None, 400, "not valid JSON"),
    ("/v1/translate", b'{"text": ["\xff\xfe"]}', None, 400, "not valid UTF-8"),
    ("/v1/translate", b'{"text": ["\\ud800"]}', None, 400, "unpaired surrogate"),
    ("/v1/translate", b'["a"]', None, 422, "must be a JSON object"),
    ("/v1/translate", b'{"txt": ["a"]}', None, 422, "unknown field 'txt'"),
    ("/v1/translate", b'{"beam": 2}', None, 422, "needs a 'text' field"),
    ("/v1/translate", b'{"text": [1]}', None, 422, "text[0] must be a string"),
    ("/v1/translate", b'{"text": {"a": 1}}', None, 422, "must be a list of strings"),
    ("/v1/translate", b'{"text": ["a\\nb"]}', None, 422, "line break"),
    ("/v1/translate", b'{"text": ["a"], "beam": "4"}', None, 422, "beam must be an integer"),
    ("/v1/translate", b'{"text": ["a"], "beam": true}', None, 422, "beam must be an integer"),
    ("/v1/translate", b'{"text": ["a"], "beam": 0}', None, 422, "beam must be at least 1"),
    ("/v1/translate", b'{"text": ["a"], "beam": 999}', None, 422, "--max-beam"),
    ("/v1/translate", b'{"text": ["a"], "alpha": NaN}', None, 400, "NaN, which is not JSON"),
    ("/v1/translate", b'{"text": ["a"], "alpha": 1e308, "scores": true}', None, 422,
     "alpha must be at most 10.0"),
    ("/v1/translate", b'{"text": ["a"], "beam": 2, "stop": "limit", "max_len_a": 100000}', None,
     422, "max_len_a must be at most 10.0"),
    ("/v1/translate", b'{"text": ["a"], "sample": true, "temperature": 5e-324}', None, 422,
     "temperature must be at least 0.001"),
    ("/v1/translate", b'{"text": ["a"], "beam": 32, "max_len_b": 4096}', None, 422,
     "above this server's limit of 100,000 (--max-request-tokens"),
    ("/translate", json.dumps({"q": "\n".join(["a b c"] * 64), "source": "en", "target": "de",
                               "alternatives": 31}).encode(), None, 400, "--max-request-tokens"),
    ("/translate", b'{"q": "a", "source": "en", "target": "de", "alternatives": Infinity}', None,
     400, "Infinity, which is not JSON"),
    ("/translate", b"q=a&source=en&target=de&alternatives=1e400",
     {"Content-Type": "application/x-www-form-urlencoded"}, 400, "alternatives must be an"),
    ("/v1/translate", b'{"text": ["a"], "stop": "soon"}', None, 422, "stop must be one of"),
    ("/v1/translate", b'{"text": ["a"], "sample": true, "nbest": 2}', None, 422, "--nbest"),
    ("/v1/translate", b'{"text": ["a"], "model": "other"}', None, 404, "unknown model 'other'"),
    ("/v1/translate", json.dumps({"text": ["a"] * 65}).encode(), None, 422, "--max-lines"),
    ("/v1/translate", json.dumps({"text": ["a" * 301]}).encode(), None, 422,
     "--max-line-chars"),
    ("/v1/translate", json.dumps({"text": ["a " * 11000]}).encode(), None, 413, "--max-body"),
    ("/translate", b"source=en&target=de", {"Content-Type": "application/x-www-form-urlencoded"},
     400, "missing q"),
    ("/translate", b"q=%FF&source=en&target=de",
     {"Content-Type": "application/x-www-form-urlencoded"}, 400, "not valid UTF-8"),
    ("/translate", b'{"q": "a", "source": "en", "target": "de", "format": "xml"}', None, 400,
     "format 'xml' is not supported"),
    ("/nowhere", b"", None, 404, "no such endpoint"),
])
def test_bad_requests_get_a_4xx_with_a_clear_message(server, path, body, headers, status,
                                                     fragment):
    got, _, answer = raw_call(server, "POST", path, body, headers)
    assert got == status, answer
    assert fragment in answer["error"]


def test_a_client_that_goes_away_disturbs_no_one(server, trained, lines):
    """A client sends 64 lines and hangs up at once; the others are answered as ever, and the
    log says the request was dropped (499)."""
    model, _ = trained
    body = json.dumps({"text": [lines[0]] * 64, "beam": 8}).encode()
    with socket.create_connection((server.host, server.port)) as gone:
        gone.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    run = asyncio.run(run_clients(server.host, server.port, lines[:8], 4))
    assert run["outputs"] == decode(model, lines[:8])
    deadline = time.monotonic() + 30
    while not any(" 499 64 lines" in line for line in server.log):
        assert time.monotonic() < deadline, server.log[-10:]
        time.sleep(0.05)
    assert call(server, "GET", "/health")[0] == 200


# ---------------------------------------------------------------- what a hostile client sends

# A value of each wrong kind and edge, as the bytes of a JSON value.
EDGES = {"NaN": b"NaN", "Infinity": b"Infinity", "-Infinity": b"-Infinity", "1e308": b"1e308",
         "-1e308": b"-1e308", "5e-324": b"5e-324", "1e400": b"1e400", "1e20": b"1e20",
         "5,000 digits": b"9" * 5000, "2**63": b"9223372036854775808", "-1": b"-1",
         "string": b'"x"', "true": b"true", "null": b"null", "array": b"[1]",
         "object": b'{"a": 1}', "nested 9,000 deep": b"[" * 9000 + b"]" * 9000}
# What no field can take: refused as the body is read (400), whatever the field.
UNREADABLE = {"NaN", "Infinity", "-Infinity", "1e400", "5,000 digits"}
# A field's companions in the body: the settings that make its value count.
COMPANIONS = {"alpha": b', "scores": true', **{name: b', "sample": true' for name in
                                                ("topk", "topp", "temperature", "seed")}}
# The (field, edge) pairs that are valid requests (200); every other pair is a 4xx.
V1_ACCEPTED = {("text", "string"), ("model", "null"), ("source", "null"), ("target", "null"),
               ("split", "true"), ("scores", "true"), ("sample", "true"), ("alignment", "true"),
               ("raw", "true"), ("prefix", "null"), ("constraints", "null"),
               ("glossary", "null"), ("alpha", "5e-324"), ("max_len_a", "5e-324"),
               ("topp", "5e-324"), ("topk", "2**63"), ("seed", "-1"), ("seed", "2**63")}
LIBRE_ACCEPTED = {("q", "string"), ("alternatives", "true"), ("alternatives", "5e-324")}


def test_every_field_s_wrong_kinds_and_edges_get_a_4xx_json_error_never_a_500(server):
    """Every field of /v1/translate and of LibreTranslate's /translate and /detect fed each
    edge: a valid value is answered, anything else is a 4xx with a JSON error (400 for what is
    not JSON a float or a 64-bit integer holds, or nests too deep; LibreTranslate's endpoints
    400 for all), each within seconds, on one connection. (`api_key` is read only by a server
    with a key: test_api_key.)"""
    v1_fields = sorted(V1_FIELDS - {"api_key"})
    cases = [("/v1/translate", field, name, b'{"text": ["A dog runs."]' + COMPANIONS.get(
        field, b"") + b', "' + field.encode() + b'": ' + value + b"}")
             for field in v1_fields for name, value in EDGES.items()]
    libre = {"q": b'"A dog runs."', "source": b'"en"', "target": b'"de"', "format": b'"text"',
             "alternatives": b"1"}
    cases += [("/translate", field, name, b"{" + b", ".join(
        b'"%s": %s' % (other.encode(), value if other == field else given)
        for other, given in libre.items()) + b"}")
              for field in libre for name, value in EDGES.items()]
    cases += [("/detect", "q", name, b'{"q": ' + value + b"}") for name, value in EDGES.items()]

    async def ask_all():
        connection = Connection(server.host, server.port)
        try:
            return [await asyncio.wait_for(connection.send("POST", path, body), 20)
                    for path, _, _, body in cases]
        finally:
            await connection.close()

    wrong = []
    for (path, field, name, _), (status, _, body) in zip(cases, asyncio.run(ask_all())):
        accepted = (V1_ACCEPTED if path == "/v1/translate" else LIBRE_ACCEPTED)
        expected = {200} if (field, name) in accepted else \
            {400} if name in UNREADABLE or path != "/v1/translate" else set(range(400, 500))
        answer = json.loads(body)
        if status not in expected or (status != 200 and not isinstance(answer["error"], str)):
            wrong.append(f"{path} {field}={name}: {status} {answer}")
    assert not wrong, "\n".join(wrong)


# ----------------------------------------------------------- work that stops when no one waits


@pytest.fixture(scope="module")
def patient(trained):
    """A server whose requests may be long (400 lines, and a budget that lets one line search
    to 4,096 positions at beam 32) and take 3 s: what a client that leaves, or a search past
    its deadline, is tested on (well before the deadline, or at it)."""
    model, _ = trained
    process = Server(serve_command(model, "--max-lines", 400, "--request-timeout", 3,
                                   "--max-request-tokens", 10 ** 9))
    process.wait_ready()
    yield process
    assert process.stop() == 0


def cpu_seconds(server: Server) -> float:
    """The server process's CPU time so far, all threads (Linux /proc: utime + stime)."""
    fields = Path(f"/proc/{server.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def seconds_until_idle(server: Server, within: float) -> float:
    """How long until /health counts no line queued or searched and the server then uses
    under a tenth of a core (over 0.3 s); fails past `within` seconds."""
    started = time.monotonic()
    while True:
        status, health = call(server, "GET", "/health")
        idle_since = time.monotonic() - started
        before = cpu_seconds(server)
        time.sleep(0.3)
        used = cpu_seconds(server) - before
        if status == 200 and health["queued_lines"] == health["searching_lines"] == 0 \
                and used < 0.03:
            return idle_since
        assert time.monotonic() - started < within, (health, used)


# One long line searched as long as a request may ask: 32 beams, each to 10 × its tokens +
# 4096 (stop: limit), thousands of steps (the issue's `beam 32, max_len_b 4096` took over 30 s
# on the demo model).
LONGEST = {"text": [" ".join(["A man rides a bike down the street."] * 8)], "beam": 32,
           "max_len_a": 10, "max_len_b": 4096, "stop": "limit"}


def searching(server: Server) -> bool:
    return call(server, "GET", "/health")[1]["searching_lines"] > 0


def test_a_client_that_hangs_up_stops_its_search_within_a_step(patient):
    """The long search running, its client hangs up: within a second the server is idle,
    well before the request's deadline (3 s); it logs 499."""
    body = json.dumps(LONGEST).encode()
    with socket.create_connection((patient.host, patient.port)) as client:
        client.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: searching(patient))
    assert seconds_until_idle(patient, within=2.5) < 1.0
    wait_for(lambda: any(" 499 1 line " in line for line in patient.log))


def test_a_request_past_its_deadline_gets_504_and_its_search_stops(patient):
    started = time.monotonic()
    status, answer = call(patient, "POST", "/v1/translate", LONGEST)
    assert status == 504, answer
    assert 3.0 <= time.monotonic() - started < 5.0
    assert answer["error"] == ("no answer within 3 s, this server's limit for a request "
                               "(--request-timeout): send fewer lines, or ask for a smaller beam "
                               "or max_len_b")
    assert seconds_until_idle(patient, within=2.5) < 1.0


def test_the_queue_forgets_clients_that_left_at_once(patient, lines):
    """30 clients queue 10,000 sampled lines and hang up: within a second the queue is empty
    and the server idle, and a request is answered as before the flood."""
    status, before = call(patient, "POST", "/v1/translate", {"text": lines[:2]})
    assert status == 200
    flood = [f"{lines[n % len(lines)]} {n}" for n in range(10_000)]
    clients = []
    for part in range(30):
        body = json.dumps({"text": flood[part::30], "sample": True}).encode()
        client = socket.create_connection((patient.host, patient.port))
        client.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        clients.append(client)
    wait_for(lambda: call(patient, "GET", "/health")[1]["queued_lines"] > 5000)
    for client in clients:
        client.close()
    assert seconds_until_idle(patient, within=2.5) < 1.0
    assert call(patient, "POST", "/v1/translate", {"text": lines[:2]}) == (200, before)


def test_api_key(trained, lines):
    """With ATTN_API_KEY set: 401 without it, 200 with it in any of the three places."""
    libretranslatepy = pytest.importorskip("libretranslatepy")
    model, _ = trained
    with_key = {**os.environ, "ATTN_API_KEY": "s3cret"}
    process = Server(serve_command(model, "--langs", "en-de"), env=with_key)
    try:
        process.wait_ready()
        body = {"text": lines[:1]}
        assert call(process, "POST", "/v1/translate", body)[0] == 401
        assert call(process, "POST", "/v1/translate", body,
                    {"Authorization": "Bearer wrong"})[0] == 401
        assert call(process, "GET", "/v1/models")[0] == 401
        assert call(process, "POST", "/v1/translate", body,
                    {"Authorization": "Bearer s3cret"})[0] == 200
        assert call(process, "POST", "/v1/translate", body, {"X-API-Key": "s3cret"})[0] == 200
        assert call(process, "POST", "/v1/translate", {**body, "api_key": "s3cret"})[0] == 200
        assert call(process, "GET", "/health")[0] == 200  # open: for load balancers
        # LibreTranslate's api_key field in a JSON body and in a multipart form
        assert call(process, "POST", "/detect", {"q": lines[0], "api_key": "s3cret"}) == (
            200, [{"confidence": 100.0, "language": "en"}])  # one source language: it
        assert call(process, "POST", "/detect", {"q": lines[0]})[0] == 401
        for key, status in (({"api_key": "s3cret"}, 200), ({}, 401)):
            content_type, form = multipart({"source": "en", "target": "de", **key},
                                           {"file": ("a.txt", lines[0].encode())})
            assert raw_call(process, "POST", "/translate_file", form,
                            {"Content-Type": content_type})[0] == status
        url = f"http://{process.host}:{process.port}"
        expected = decode(model, lines[:1])[0]
        assert libretranslatepy.LibreTranslateAPI(url, "s3cret").translate(
            lines[0], "en", "de") == expected
        with pytest.raises(urllib.error.HTTPError) as refused:
            libretranslatepy.LibreTranslateAPI(url).translate(lines[0], "en", "de")
        assert refused.value.code == 401
    finally:
        assert process.stop() == 0


def test_full_queue_answers_503_and_sigterm_finishes_open_requests(trained, lines):
    """A queue of 4 lines and one slow worker: of 10 requests of 4 lines sent at once, those
    that do not fit get 503 with Retry-After, the others their right answers. Then SIGTERM
    while a request is being searched: it is answered in full, new connections are refused,
    and the server exits 0 with nothing on stdout."""
    model, _ = trained
    slow = ["--beam", 12, "--max-len-b", 120]
    process = Server(serve_command(model, "--queue-lines", 4, "--max-lines", 4, "--workers", 1,
                                   "--threads", 1, *slow))
    process.wait_ready()
    text = lines[4:8]
    expected = decode(model, text, *slow)

    async def at_once(count):
        connections = [Connection(process.host, process.port) for _ in range(count)]
        body = json.dumps({"text": text}).encode()
        try:
            return await asyncio.gather(*(c.send("POST", "/v1/translate", body)
                                          for c in connections))
        finally:
            for connection in connections:
                await connection.close()

    answers = asyncio.run(at_once(10))
    statuses = [status for status, _, _ in answers]
    assert 503 in statuses and 200 in statuses, statuses
    for status, headers, answer in answers:
        if status == 200:
            assert json.loads(answer)["translations"] == expected
        else:
            assert headers["retry-after"] == "1"
            assert "busy" in json.loads(answer)["error"]

    async def stopped_midway():
        connection = Connection(process.host, process.port)
        answer = asyncio.ensure_future(connection.send(
            "POST", "/v1/translate", json.dumps({"text": text}).encode()))
        await asyncio.sleep(0.3)  # in the worker's hands by now
        process.process.send_signal(signal.SIGTERM)
        try:
            return await answer
        finally:
            await connection.close()

    status, _, answer = asyncio.run(stopped_midway())
    assert status == 200 and json.loads(answer)["translations"] == expected
    assert process.process.wait(60) == 0
    assert process.process.stdout.read() == b""
    with pytest.raises(OSError):
        socket.create_connection((process.host, process.port), timeout=2).close()
    time.sleep(0.2)  # the log reader's last lines
    assert any("serve: stopped" in line for line in process.log), process.log[-5:]
    assert not any("Traceback" in line for line in process.log)


@pytest.mark.long
def test_ten_thousand_requests_from_64_clients_lose_none_and_memory_stays_flat(trained,
                                                                                  lines):
    model, _ = trained
    process = Server(serve_command(model, "--beam", 1, "--max-len-b", 5))
    try:
        process.wait_ready()
        short = [" ".join(line.split()[:4]) for line in lines]
        warm = asyncio.run(run_clients(process.host, process.port, short * 50, 64))
        assert warm["statuses"] == {200: len(short) * 50}
        before = process.resident_mib()
        requests = [short[i % len(short)] for i in range(10_000)]
        run = asyncio.run(run_clients(process.host, process.port, requests, 64))
        after = process.resident_mib()
        assert run["statuses"] == {200: 10_000}
        assert None not in run["outputs"]
        assert after - before < 25, (before, after)  # MiB: no growth with the requests
    finally:
        assert process.stop() == 0


# ------------------------------------------------------------------------- refusals at start


def test_refuses_cleanly_without_the_extra(trained, monkeypatch):
    model, _ = trained
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` raises ImportError
    assert_clean_error(run_attn("serve", "-m", model), "pip install 'attn[serve]'")


def test_refuses_bad_models_options_and_a_taken_port(trained, tmp_path):
    model, _ = trained
    assert_clean_error(run_attn("serve", "-m", tmp_path / "missing.st"), "missing.st")
    empty = tmp_path / "empty.st"
    empty.write_bytes(b"")
    assert_clean_error(run_attn("serve", "-m", empty), "empty.st")
    assert_clean_error(run_attn("serve", "-m", model, "--langs", "english"), "--langs")
    assert_clean_error(run_attn("serve", "-m", model, "--max-lines", 10, "--queue-lines", 5),
                       "--queue-lines")
    assert_clean_error(run_attn("serve", "-m", model, "--beam", 8, "--max-beam", 4),
                       "--beam (8) is above --max-beam (4)")
    assert_clean_error(run_attn("serve", "-m", model, "--max-len-b", 5000),
                       "--max-len-b must be at most 4096")
    assert_clean_error(run_attn("serve", "-m", model, "--request-timeout", 0),
                       "--request-timeout must be a finite number of seconds above 0")
    assert_clean_error(run_attn("serve", "-m", model, "--char-limit", 0),
                       "--char-limit must be at least 1, or -1 for no limit, not 0")
    assert_clean_error(run_attn("serve", "-m", f"en-de={model}", "-m", model),
                       f"-m {model} names no language pair, but other -m do")
    assert_clean_error(run_attn("serve", "-m", f"en-de={tmp_path / 'missing.st'}"),
                       "missing.st")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_clean_error(run_attn("serve", "-m", model, "--port", port),
                           f"cannot listen on 127.0.0.1:{port}")


def test_nothing_imports_torch_before_the_server_tunes_the_process(trained):
    """server.tune_process sets the kernel caches' sizes in the environment, which torch reads
    once, when it starts: `attn serve` must not have imported torch by then."""
    model, _ = trained
    code = ("import sys\nfrom attn_cli.serve import server\n"
            "def tune():\n    print('torch' in sys.modules)\n    sys.exit(0)\n"
            "server.tune_process = tune\nfrom attn_cli.cli import main\n"
            f"main(['serve', '-m', {str(model)!r}, '--port', '0'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout == "False\n", result.stderr


@pytest.mark.parametrize("ending", ["the client hangs up", "the deadline passes",
                                    "the request is cancelled"])
def test_a_request_called_off_leaves_no_unread_exception_behind(ending):
    """However a request's wait ends before its answers (Service._answered), no future is left
    with an exception nobody read: asyncio would log it with a traceback when it is collected
    ("_GatheringFuture exception was never retrieved", seen in a server's log after a client
    hung up on a long search)."""
    import gc
    import types

    from attn_cli.serve.api import Problem
    from attn_cli.serve.server import Service

    cancelled = []
    service = types.SimpleNamespace(
        options=types.SimpleNamespace(request_timeout=0.05 if "deadline" in ending else 30),
        queue=types.SimpleNamespace(cancel=cancelled.append))
    logged = []

    async def request():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: logged.append(context["message"]))
        answers = [loop.create_future(), loop.create_future()]

        async def client_gone():
            if "hangs up" in ending:
                return
            await asyncio.sleep(60)

        waiting = asyncio.ensure_future(Service._answered(service, ["job 1", "job 2"], answers,
                                                          client_gone))
        if "cancelled" in ending:
            await asyncio.sleep(0.05)
            waiting.cancel()
        try:
            await waiting
        except (Problem, asyncio.CancelledError) as error:
            status = getattr(error, "status", "cancelled")
        await asyncio.sleep(0.05)  # the callbacks of what was cancelled
        del waiting
        gc.collect()
        await asyncio.sleep(0)
        return status

    status = asyncio.run(request())
    assert status == {"the client hangs up": 499, "the deadline passes": 504,
                      "the request is cancelled": "cancelled"}[ending]
    assert cancelled == ["job 1", "job 2"]
    gc.collect()
    assert logged == []


@pytest.mark.slow
def test_the_default_budget_refuses_at_once_a_line_that_would_search_for_minutes(trained,
                                                                                  lines):
    """At the defaults a request's search may cost what one search worker does in 5 s here
    (--max-request-seconds, timed when the model loads; the ready line says how much): one
    4-byte line at beam 32 to 4,096 positions (minutes on one thread) is refused at once with
    422, while a request of --char-limit's characters at beam 4 is answered."""
    model, _ = trained
    process = Server(serve_command(model))
    try:
        process.wait_ready()
        ready = next(line for line in process.log if " ready (" in line)
        budget = int(re.search(r"a request may cost ([\d,]+) hypothesis steps", ready)
                     .group(1).replace(",", ""))
        assert "(--max-request-seconds 5 of one worker here)" in ready and budget > 0
        started = time.monotonic()
        status, answer = call(process, "POST", "/v1/translate", {
            "text": ["Hi."], "beam": 32, "max_len_b": 4096, "stop": "limit"})
        assert status == 422 and time.monotonic() - started < 1.0
        assert f"above this server's limit of {budget:,}" in answer["error"]
        text = " ".join(lines)[:10_000]
        status, answer = call(process, "POST", "/translate", {"q": text, "source": "en",
                                                             "target": "de"})
        assert status == 200, answer
        status, described = call(process, "GET", "/v1/models")
        assert described["data"][0]["limits"]["max_request_tokens"] == budget
    finally:
        assert process.stop() == 0
