"""Documents /translate_file takes (serve/documents.py): Word files and subtitles read into the
texts to translate and written back, on files generated here; then the round trip through a
real server."""

from __future__ import annotations

import html
import io
import re
import sys
import urllib.request

import pytest

from attn_cli.serve.api import Problem, file_request
from attn_cli.serve.documents import cut_lines, marked_runs, read_docx, read_subtitles

from .client import Server, call, multipart, raw_call

docx = pytest.importorskip("docx", reason="pip install 'attn[serve]' (python-docx)")

SRT = """1
00:00:01,000 --> 00:00:03,500
A man is riding
a bike down the street.

2
00:00:04,000 --> 00:00:06,000
<i>Two dogs</i> play & run.

"""

VTT = """WEBVTT - a header

NOTE a note that is not a cue

STYLE
::cue { color: yellow }

intro
00:01.000 --> 00:03.500 align:start position:10%
A man is riding
a bike.

00:00:04.000 --> 00:00:06.000
Two dogs play.
"""


def word_file() -> bytes:
    document = docx.Document()
    document.sections[0].header.is_linked_to_previous = False
    document.sections[0].header.paragraphs[0].text = "A header line."
    paragraph = document.add_paragraph("A man ")
    paragraph.add_run("is riding").bold = True
    paragraph.add_run(" a ")
    paragraph.add_run("bike").italic = True
    paragraph.add_run(".")
    document.add_paragraph("")  # empty: not sent
    table = document.add_table(rows=1, cols=2)
    table.cell(0, 0).paragraphs[0].text = "Two dogs play."
    table.cell(0, 1).paragraphs[0].text = "In the snow."
    written = io.BytesIO()
    document.save(written)
    return written.getvalue()


# ------------------------------------------------------------------------------------ Word


def test_a_word_file_s_runs_go_out_as_spans_and_come_back_with_their_formatting():
    document = read_docx("a.docx", word_file())
    assert document.texts == [
        '<span class="r0">A man </span><span class="r1">is riding</span><span class="r2"> a '
        '</span><span class="r3">bike</span><span class="r4">.</span>',
        '<span class="r0">Two dogs play.</span>', '<span class="r0">In the snow.</span>',
        '<span class="r0">A header line.</span>']
    # a translation whose words moved: the italic word first, the bold one last
    outputs = ['<span class="r3">Fahrrad</span><span class="r0"> ein Mann </span>'
               '<span class="r1">fährt</span><span class="r4">.</span>', "Zwei Hunde.",
               '<span class="r0">Im Schnee &amp; Eis.</span>', '<span class="r0">Kopf.</span>']
    written = docx.Document(io.BytesIO(document.rebuild(outputs)))
    first = written.paragraphs[0]
    assert first.text == "Fahrrad ein Mann fährt."
    assert [(run.text, bool(run.bold), bool(run.italic)) for run in first.runs] == [
        ("Fahrrad", False, True), (" ein Mann ", False, False), ("fährt", True, False),
        (".", False, False)]
    assert written.paragraphs[1].text == ""  # the empty paragraph kept, untouched
    cells = written.tables[0].rows[0].cells
    assert [cells[0].text, cells[1].text] == ["Zwei Hunde.", "Im Schnee & Eis."]
    assert written.sections[0].header.paragraphs[0].text == "Kopf."


def test_text_outside_every_span_goes_with_the_span_before_it():
    assert marked_runs('x <span class="r2">a</span> b <span class="r1">c</span>') == [
        (2, "x "), (2, "a"), (2, " b "), (1, "c")]


@pytest.mark.parametrize("data", [b"PK\x03\x04 not really a zip", b"", b"plain text"])
def test_a_damaged_word_file_is_a_400_naming_it(data):
    with pytest.raises(Problem) as problem:
        file_request({"source": "en", "target": "de"}, {"file": ("report.docx", data)})
    assert problem.value.status == 400
    assert "'report.docx' is not a Word document that can be read" in problem.value.message


# ------------------------------------------------------------------------------- subtitles


def test_srt_cues_are_translated_whole_and_keep_their_numbers_timings_and_line_count():
    document = read_subtitles("a.srt", SRT, vtt=False)
    assert document.texts == ["A man is riding a bike down the street.",
                              "<i>Two dogs</i> play &amp; run."]
    written = document.rebuild(["Ein Mann fährt mit dem Rad die Straße entlang.",
                                "<i>Zwei Hunde</i> spielen &amp; rennen."]).decode()
    assert written == ("1\n00:00:01,000 --> 00:00:03,500\nEin Mann fährt mit dem\nRad die "
                       "Straße entlang.\n\n2\n00:00:04,000 --> 00:00:06,000\n<i>Zwei Hunde</i> "
                       "spielen & rennen.\n\n")


def test_vtt_keeps_its_header_notes_styles_cue_ids_and_settings():
    document = read_subtitles("a.vtt", VTT.replace("\n", "\r\n"), vtt=True)
    assert document.texts == ["A man is riding a bike.", "Two dogs play."]
    written = document.rebuild(["Ein Mann fährt Rad.", "Zwei Hunde spielen."]).decode()
    assert written == VTT.replace("A man is riding\na bike.", "Ein Mann\nfährt Rad.").replace(
        "Two dogs play.", "Zwei Hunde spielen.").replace("\n", "\r\n")


@pytest.mark.parametrize("name, text, message", [
    ("a.srt", "1\nnot a timing\nHello.\n", "'a.srt', line 1: a cue without its timing"),
    ("a.vtt", "1\n00:01.000 --> 00:02.000\nHi.\n", "is not WebVTT"),
    ("a.vtt", "WEBVTT\n\nHello without timing.\n", "'a.vtt', line 3: a cue without"),
])
def test_a_subtitle_file_that_does_not_read_is_a_400_naming_the_line(name, text, message):
    with pytest.raises(Problem) as problem:
        file_request({"source": "en", "target": "de"}, {"file": (name, text.encode())})
    assert problem.value.status == 400 and message in problem.value.message


@pytest.mark.parametrize("text, count, lines", [
    ("one two three four", 2, ["one two", "three four"]),
    ("a bb ccc dddd eeeee", 2, ["a bb ccc", "dddd eeeee"]),
    ("word", 2, ["word"]),
    ("one two three", 1, ["one two three"]),
    ("a b c d e f", 3, ["a b", "c d", "e f"]),
    ("  ", 2, []),
])
def test_a_translated_cue_is_cut_into_as_many_lines_at_even_lengths(text, count, lines):
    assert cut_lines(text, count) == lines


# ------------------------------------------------------------------- through a real server


@pytest.fixture(scope="module")
def server(trained):
    model, _ = trained
    process = Server([sys.executable, "-m", "attn_cli", "serve", "-m", str(model), "--port",
                      "0", "--threads", "2", "--langs", "en-de"])
    process.wait_ready()
    yield process
    assert process.stop() == 0


def round_trip(server, name: str, data: bytes) -> tuple[bytes, str]:
    content_type, body = multipart({"source": "en", "target": "de"}, {"file": (name, data)})
    status, _, answer = raw_call(server, "POST", "/translate_file", body,
                                 {"Content-Type": content_type})
    assert status == 200, answer
    with urllib.request.urlopen(answer["translatedFileUrl"]) as response:
        return response.read(), response.headers["Content-Type"]


@pytest.mark.slow
def test_word_and_subtitle_files_round_trip_through_the_server(server):
    data, media = round_trip(server, "report.docx", word_file())
    assert media.startswith("application/vnd.openxmlformats-officedocument")
    written = docx.Document(io.BytesIO(data))
    assert len(written.paragraphs) == 2 and written.paragraphs[1].text == ""
    first = written.paragraphs[0]
    # what /translate answers for the paragraph's markup, and its bold words where they went
    status, expected = call(server, "POST", "/translate", {
        "q": read_docx("a.docx", word_file()).texts[0], "source": "en", "target": "de",
        "format": "html"})
    assert status == 200
    spans = re.findall(r'<span class="r(\d)">([^<]*)</span>', expected["translatedText"])
    assert first.text == html.unescape(re.sub(r"<[^>]*>", "", expected["translatedText"]))
    bold = "".join(html.unescape(text) for index, text in spans if index == "1")
    assert "".join(run.text for run in first.runs if run.bold) == bold  # on the right words
    data, media = round_trip(server, "film.srt", SRT.encode())
    assert media.startswith("application/x-subrip")
    cues = data.decode().split("\n\n")
    assert cues[0].split("\n")[:2] == ["1", "00:00:01,000 --> 00:00:03,500"]
    assert cues[1].split("\n")[:2] == ["2", "00:00:04,000 --> 00:00:06,000"]
    data, _ = round_trip(server, "film.vtt", VTT.encode())
    assert data.decode().startswith("WEBVTT - a header\n\nNOTE a note that is not a cue\n\n"
                                    "STYLE\n::cue { color: yellow }\n\nintro\n00:01.000 --> "
                                    "00:03.500 align:start position:10%\n")
