"""LibreTranslate's `format: "html"` over HTTP (server.py's `_translate_html`, markup.py): one
server of the committed model trained to reverse letter sequences, whose alignments are known
(word i with output word n-1-i). A page's answer holds the request's tag tree, gives back what
lies outside its runs of text byte for byte, and translates each run as `format: "text"`
translates that run's text (the same search); inline tags follow their words; an .html file
goes through /translate_file and /download_file. libretranslatepy's `translate` sends no
`format`: the requests here are its form, or JSON, written out."""

from __future__ import annotations

import re
import sys
import urllib.parse
import urllib.request
from html.parser import HTMLParser

import pytest

from attn_cli.decode.markup import HtmlDocument

from ..conftest import REPO
from ..toys import tag_tree
from .client import Server, call, multipart, raw_call

pytest.importorskip("uvicorn", reason="attn[serve] is not installed")

pytestmark = pytest.mark.slow

REVERSER = REPO / "tests" / "fixtures" / "run" / "checkpoint-600.st"

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>a b c</title>
<style>p > b { content: "a b" }</style>
<script>if (a < b && c > d) { document.write("<p>e f</p>") }</script></head>
<body class="main">
<!-- a comment, kept: g h -->
<h1 id="top">a <b>b <i>c</i> d</b> e &amp; f.</h1>
<p>g <a href="/x?a=1&amp;b=2" title="a &gt; b">h <em>i</em> j</a> a. <!-- k -->b&nbsp;c &lt;d&gt; e.
f <img src="g.png" alt="h"> g h</p>
<ul><li>i j<li><code>a</code> b c</ul>
</body></html>
"""


@pytest.fixture(scope="module")
def server():
    """Its pair not known (the fixture names none): it takes any pair, "en" cutting sentences
    by English's rules. --max-len-b: what the model never saw (punctuation) ends soon."""
    process = Server([sys.executable, "-m", "attn_cli", "serve", "-m", str(REVERSER), "--port",
                      "0", "--threads", "2", "--cache-lines", "0", "--max-len-b", "12"])
    process.wait_ready()
    yield process
    assert process.stop() == 0


class _Text(HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts = []

    def handle_data(self, data):
        self.parts.append(data)


def text_of(fragment: str) -> str:
    """The text of an HTML fragment, its entities decoded."""
    parser = _Text()
    parser.feed(fragment)
    parser.close()
    return "".join(parser.parts)


def translate(server, q, **fields) -> str | list:
    status, answer = call(server, "POST", "/translate",
                          {"q": q, "source": "en", "target": "de", **fields})
    assert status == 200, answer
    return answer


def test_a_page_keeps_its_tags_and_each_run_is_translated_as_its_text(server):
    answer = translate(server, PAGE, format="html")["translatedText"]
    assert tag_tree(answer) == tag_tree(PAGE)
    # Outside the runs, byte for byte: the answer is the request's kept pieces, in order, with
    # each run's translation between them.
    pieces = HtmlDocument.read(PAGE, "en").pieces
    runs = [piece for piece in pieces if not isinstance(piece, str)]
    pattern = "".join(re.escape(piece) if isinstance(piece, str) else "(.*?)" for piece in pieces)
    found = re.fullmatch(pattern, answer, re.DOTALL)
    assert found is not None and len(runs) == 5
    texts = [run.paragraph.text for run in runs]
    assert texts[1] == "a b c d e & f." and texts[2].endswith("b\xa0c <d> e.\nf  g h")
    as_text = translate(server, texts)["translatedText"]
    assert [text_of(run) for run in found.groups()] == as_text
    assert found.group(1, 4, 5) == ("c b a", "j i", "c b <code>a</code>")  # reversed


def test_inline_tags_follow_the_words_they_wrapped(server):
    """The reverser's outputs and alignments: each tag around the reversed word; alternative
    k renders each sentence's k-th best. Sent as libretranslatepy's form, with `format`."""
    page = "<p><b>a</b> b c d</p><p>e f <i>g h</i></p>"
    body = urllib.parse.urlencode({"q": page, "source": "en", "target": "de",
                                   "format": "html", "alternatives": 1}).encode()
    status, _, answer = raw_call(server, "POST", "/translate", body,
                                 {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200, answer
    assert answer["translatedText"] == "<p>d c b <b>a</b></p><p><i>h g</i> f e</p>"
    (alternative,) = answer["alternatives"]
    assert tag_tree(alternative) == tag_tree(page) and alternative != answer["translatedText"]
    assert translate(server, [page, "", "<br>"], format="html")["translatedText"] == [
        answer["translatedText"], "", "<br>"]


def test_an_html_file_round_trip(server):
    """A .htm file (a byte order mark, CRLF line breaks) through /translate_file: its
    download is /translate's answer for the page, the mark put back, served as HTML."""
    page = PAGE.replace("\n", "\r\n")
    expected = "\ufeff" + translate(server, page, format="html")["translatedText"]
    content_type, body = multipart({"source": "en", "target": "de"},
                                   {"file": ("Page.HTM", ("\ufeff" + page).encode())})
    status, _, answer = raw_call(server, "POST", "/translate_file", body,
                                 {"Content-Type": content_type})
    assert status == 200, answer
    assert answer["translatedFileUrl"].endswith(".Page.htm")
    with urllib.request.urlopen(answer["translatedFileUrl"]) as download:
        assert download.read().decode("utf-8") == expected
        assert download.headers["Content-Type"] == "text/html; charset=utf-8"
    status, settings = call(server, "GET", "/frontend/settings")
    assert settings["supportedFilesFormat"] == [".txt", ".html", ".htm", ".docx", ".srt",
                                                ".vtt"]


@pytest.mark.parametrize("value", ["xml", "HTML", 1])
def test_a_format_other_than_text_or_html_is_a_400_naming_format(server, value):
    status, answer = call(server, "POST", "/translate",
                          {"q": "a b", "source": "en", "target": "de", "format": value})
    assert status == 400
    assert answer["error"] == (f"Invalid request: format {value!r} is not supported: send "
                               "format 'text' or 'html'")
