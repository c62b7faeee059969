"""`attn serve` of several language pairs (issue 41): one server, started once, serving the
tiny trained model as en-de and a random model as de-en and fr-de — a request reaches the model
of its pair (each pair's answers are `attn decode`'s with that pair's model), with source "auto"
the pair of the language detected, /detect tells held-out English from German, a .txt file goes
through /translate_file and comes back from /download_file, and --char-limit holds. Also: the
lines of two models never share a batch in the one queue they all use."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.error
import urllib.request

import pytest

from attn_cli.decode.translator import load_translator
from attn_cli.serve.request_queue import Job, RequestQueue
from attn_cli.vocab import Vocabulary

from ..conftest import bundled_lines, decode
from ..toys import save_random_model
from .client import Connection, Server, call, multipart, raw_call, wait_for

pytest.importorskip("uvicorn", reason="attn[serve] is not installed")

pytestmark = pytest.mark.slow

LIMITS = ("--max-len-b", 20)  # the random model's outputs run to the limit: kept short
FRENCH = ["Un homme fait du vélo dans la rue.", "Deux chiens jouent dans le parc."]


@pytest.fixture(scope="module")
def random_model(spm_model, tmp_path_factory):
    """A model of random weights whose metadata says de-en (served as de-en and fr-de)."""
    path = tmp_path_factory.mktemp("pairs") / "random.st"
    return save_random_model(path, Vocabulary.from_file(spm_model), langs="de-en")


@pytest.fixture(scope="module")
def server(trained, random_model):
    model, _ = trained
    process = Server([sys.executable, "-m", "attn_cli", "serve", "-m", f"en-de={model}",
                      "-m", f"de-en={random_model}", "-m", f"fr-de={random_model}", "--port", "0",
                      "--threads", "2", "--char-limit", "2000", *map(str, LIMITS)])
    process.wait_ready()
    yield process
    assert process.stop() == 0


def sentences(lang: str, places) -> list[str]:
    lines = bundled_lines(f"val.{lang}", 50)
    return [lines[place] for place in places]  # each one sentence, ending with a period


def test_each_pair_reaches_its_model(server, trained, random_model):
    """libretranslatepy and JSON bodies, by pair and with source "auto" (English and French
    into German: detected); /v1/translate by pair or by model id."""
    libretranslatepy = pytest.importorskip("libretranslatepy")
    model, _ = trained
    english, german = sentences("en", (4, 5, 6, 7)), sentences("de", (4, 5, 6, 7))
    from_english = decode(model, english, *LIMITS)
    from_german = decode(random_model, german + FRENCH, *LIMITS)
    assert from_german[:4] != decode(model, german, *LIMITS)  # the models tell apart
    layout = "{} {}\n\n{}  {}"
    client = libretranslatepy.LibreTranslateAPI(f"http://{server.host}:{server.port}")
    assert client.translate(layout.format(*english), "en", "de") == layout.format(*from_english)
    assert client.translate(layout.format(*german), "de", "en") == layout.format(*from_german)
    status, answer = call(server, "POST", "/translate",
                          {"q": [" ".join(english[:2]), " ".join(FRENCH)], "source": "auto",
                           "target": "de"})
    assert status == 200
    assert answer["translatedText"] == [" ".join(from_english[:2]), " ".join(from_german[4:])]
    assert [found["language"] for found in answer["detectedLanguage"]] == ["en", "fr"]
    assert min(found["confidence"] for found in answer["detectedLanguage"]) > 90
    # into English only German is served: "auto" is German, with nothing to detect
    status, answer = call(server, "POST", "/translate",
                          {"q": german[0], "source": "auto", "target": "en"})
    assert answer == {"translatedText": from_german[0],
                      "detectedLanguage": {"confidence": 100.0, "language": "de"}}
    for fields, model_id, expected in [({"source": "en", "target": "de"}, "en-de", from_english),
                                       ({"model": "de-en"}, "de-en", from_german[:4])]:
        text = english if model_id == "en-de" else german
        assert call(server, "POST", "/v1/translate", {"text": text, **fields}) == (
            200, {"model": model_id, "translations": expected})
    status, answer = call(server, "POST", "/v1/translate", {"text": english})
    assert status == 422 and "several models ('en-de', 'de-en', 'fr-de')" in answer["error"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        client.translate(english[0], "en", "fr")
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"] == (
        "this server translates en to de, de to en, fr to de only, not en to fr")


def test_languages_models_health_and_settings_list_every_pair(server, random_model):
    assert call(server, "GET", "/languages") == (200, [
        {"code": "en", "name": "English", "targets": ["de"]},
        {"code": "de", "name": "German", "targets": ["en"]},
        {"code": "fr", "name": "French", "targets": ["de"]}])
    status, models = call(server, "GET", "/v1/models")
    assert [(model["id"], model["source"], model["target"], model["ready"])
            for model in models["data"]] == [("en-de", "en", "de", True),
                                             ("de-en", "de", "en", True),
                                             ("fr-de", "fr", "de", True)]
    status, health = call(server, "GET", "/health")
    assert status == 200 and health["models"] == {"en-de": "ok", "de-en": "ok", "fr-de": "ok"}
    status, settings = call(server, "GET", "/frontend/settings")
    assert settings["charLimit"] == 2000
    assert settings["supportedFilesFormat"] == [".txt", ".html", ".htm", ".docx", ".srt",
                                                ".vtt"]
    assert settings["language"]["source"] == {"code": "en", "name": "English"}
    assert any(f"{random_model} says it translates de-en; serving it as fr-de" in line
               for line in server.log)


def test_detect_tells_held_out_english_from_german(server):
    """Multi30k's test_2016_flickr lines (no test or setting was tuned on them), 100 of each
    language, through /detect among the served sources (en, de, fr): at least 95% right."""
    libretranslatepy = pytest.importorskip("libretranslatepy")
    held_out = {lang: bundled_lines(f"test_2016_flickr.{lang}", 100) for lang in ("en", "de")}

    async def detect_all():
        connection = Connection(server.host, server.port)
        try:
            return {lang: [await connection.send("POST", "/detect",
                                                 json.dumps({"q": line}).encode())
                           for line in lines] for lang, lines in held_out.items()}
        finally:
            await connection.close()

    for lang, answers in asyncio.run(detect_all()).items():
        detected = [json.loads(body) for status, _, body in answers if status == 200]
        assert len(detected) == 100
        right = sum(1 for candidates in detected if candidates[0]["language"] == lang)
        assert right >= 95, (lang, right)
        assert all(sorted(found["language"] for found in candidates) == ["de", "en", "fr"]
                   and abs(sum(found["confidence"] for found in candidates) - 100) < 0.1
                   for candidates in detected)
    client = libretranslatepy.LibreTranslateAPI(f"http://{server.host}:{server.port}")
    assert client.detect(held_out["de"][0])[0]["language"] == "de"
    for body, fragment in [({}, "Invalid request: missing q parameter"),
                           ({"q": "a" * 2001}, "exceeds text limit (2000, this server's "
                                               "--char-limit)"),
                           ({"q": [1]}, "q must be a string or a list of strings")]:
        status, answer = call(server, "POST", "/detect", body)
        assert status == 400 and fragment in answer["error"]


def test_a_text_file_round_trip(server, trained):
    """A .txt file (a byte order mark, CRLF line breaks, a paragraph of two sentences) through
    POST /translate_file, its translation fetched from the URL answered: the file's layout
    with each sentence as `attn decode` translates it."""
    model, _ = trained
    english = sentences("en", (10, 11, 12))
    layout = "\ufeff{} {}\r\n\r\n{}\r\n"
    expected = layout.format(*decode(model, english, *LIMITS)).encode()
    content_type, body = multipart({"source": "en", "target": "de"},
                                   {"file": ("../Notes 1.txt", layout.format(*english).encode())})
    status, _, answer = raw_call(server, "POST", "/translate_file", body,
                                 {"Content-Type": content_type})
    assert status == 200, answer
    url = answer["translatedFileUrl"]
    assert url.startswith(f"http://{server.host}:{server.port}/download_file/")
    assert url.endswith(".Notes_1.txt")
    with urllib.request.urlopen(url) as download:
        assert download.read() == expected
        assert download.headers["Content-Disposition"] == 'attachment; filename="Notes_1.txt"'
    wait_for(lambda: any(" POST /translate_file 200 3 lines " in line for line in server.log))
    for form, files, fragment in [
        ({"source": "en", "target": "de"}, {"file": ("page.pdf", b"%PDF")},
         "file format not supported: file 'page.pdf'; this server translates .txt, .html, .htm, "
         ".docx, .srt, .vtt files"),
        ({"source": "en", "target": "de"}, {}, "missing file parameter"),
        ({"target": "de"}, {"file": ("a.txt", b"Hi.")}, "missing source parameter"),
        ({"source": "en", "target": "fr"}, {"file": ("a.txt", b"Hi.")},
         "not en to fr"),
    ]:
        content_type, body = multipart(form, files)
        status, _, answer = raw_call(server, "POST", "/translate_file", body,
                                     {"Content-Type": content_type})
        assert status == 400 and fragment in answer["error"], answer
    status, _, answer = raw_call(server, "POST", "/translate_file", b"file=a.txt",
                                 {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 400 and "multipart/form-data" in answer["error"]
    assert call(server, "GET", "/download_file/" + "0" * 32 + ".x.txt")[0] == 404


def test_the_character_limit(server):
    libretranslatepy = pytest.importorskip("libretranslatepy")
    client = libretranslatepy.LibreTranslateAPI(f"http://{server.host}:{server.port}")
    with pytest.raises(urllib.error.HTTPError) as refused:
        client.translate("a " * 1000 + "b", "en", "de")  # 2,001 characters
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"] == (
        "Invalid request: request (2001 characters) exceeds text limit (2000, this server's "
        "--char-limit)")
    status, answer = call(server, "POST", "/translate", {"q": ["a" * 1000, "b" * 1001],
                                                         "source": "en", "target": "de"})
    assert status == 400 and "request (2001 characters)" in answer["error"]


def test_the_lines_of_two_models_never_share_a_batch(trained):
    """Two translators of the same file (two pairs' models: equal settings, other weights
    for all the queue knows) queued together: each batch holds one model's lines."""
    model, _ = trained
    first, second = (load_translator(model, 4, threads=1) for _ in range(2))
    lines = bundled_lines("val.en", 9)
    queue = RequestQueue(workers=0, capacity=100)  # no worker: the test takes the batches
    jobs = [Job(lines[0:3], first, None), Job(lines[3:6], second, None),
            Job(lines[6:9], first, None)]
    for job in jobs:
        queue.submit(job)
    batches = [queue._take(0, 0.0), queue._take(0, 0.0)]
    assert [{line.job for line in batch} for batch in batches] == [{jobs[0], jobs[2]},
                                                                   {jobs[1]}]
