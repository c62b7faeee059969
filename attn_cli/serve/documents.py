"""Documents /translate_file takes besides .txt and .html: Word files (.docx) and subtitles
(.srt, .vtt). Each is read into the texts to translate and a way to write the translated file
back (`Document`); the server translates the texts as HTML, so that markup is carried onto the
translated words by the word alignments, as an HTML page's is (decode/markup.py).

- .docx (python-docx): each paragraph of the body, of its tables (nested ones too), headers and
  footers is one text, its runs as `<span class="rN">` around their text; the translation's
  spans give each translated word the formatting of the run its source word was in (bold,
  italic, font, size, colour: the run's properties are copied whole). Paragraph styles, tables,
  images and everything that is not a run's text are kept as they were.
- .srt and .vtt: each cue's lines are translated together (a cue is one utterance, often cut
  in two lines by length alone) and the translation is cut again into as many lines, at the
  spaces nearest to even lengths; cue numbers, timings and their settings, WebVTT's header,
  NOTE, STYLE and REGION blocks are kept byte for byte. The <i>, <b>, <u> tags of subtitles
  stay on the translated words; any other text is escaped, not read as HTML.

A file that does not read (a damaged .docx, a cue without its timing) is a DocumentError
naming what is wrong, which /translate_file answers 400. No torch here.
"""

from __future__ import annotations

import copy
import html
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from html.parser import HTMLParser

WORD_FILES = (".docx",)
SUBTITLE_FILES = (".srt", ".vtt")
MEDIA_TYPES = {
    ".docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    ".srt": "application/x-subrip; charset=utf-8", ".vtt": "text/vtt; charset=utf-8"}


class DocumentError(ValueError):
    """A document that cannot be read: the message names the file (and the line)."""


@dataclass
class Document:
    """What a file asks to translate: `texts`, each an HTML fragment, and `rebuild(outputs)`,
    the translated file's bytes from each text's translation (in order)."""

    texts: list[str]
    rebuild: Callable[[list[str]], bytes]


def read_document(name: str, extension: str, data: bytes) -> Document:
    if extension in WORD_FILES:
        return read_docx(name, data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DocumentError(f"file {name!r} is not valid UTF-8 (byte {error.start})") from None
    return read_subtitles(name, text, vtt=extension == ".vtt")


# ------------------------------------------------------------------------------------- Word


def read_docx(name: str, data: bytes) -> Document:
    try:
        import docx
    except ImportError:
        raise DocumentError(f"file {name!r}: this server cannot read Word files (python-docx "
                      "is not installed: pip install 'attn[serve]')") from None
    try:
        document = docx.Document(io.BytesIO(data))
    except Exception as error:  # noqa: BLE001 (zipfile, lxml, python-docx: all "damaged")
        raise DocumentError(f"file {name!r} is not a Word document that can be read "
                      f"({type(error).__name__}: {str(error)[:120]})") from None
    paragraphs = [paragraph for paragraph in word_paragraphs(document)
                  if any(run.text.strip() for run in paragraph.runs)]
    texts = [paragraph_markup(paragraph) for paragraph in paragraphs]

    def rebuild(outputs: list[str]) -> bytes:
        for paragraph, output in zip(paragraphs, outputs):
            write_runs(paragraph, marked_runs(output))
        written = io.BytesIO()
        document.save(written)
        return written.getvalue()

    return Document(texts, rebuild)


def word_paragraphs(document):
    """Every paragraph with text: the body's, its tables' (nested too), each section's header
    and footer, in document order."""
    def of(container):
        for paragraph in container.paragraphs:
            yield paragraph
        for table in getattr(container, "tables", ()):
            for row in table.rows:
                seen = set()
                for cell in row.cells:
                    if id(cell._tc) in seen:  # a merged cell is listed once per column
                        continue
                    seen.add(id(cell._tc))
                    yield from of(cell)

    yield from of(document)
    for section in document.sections:
        for part in (section.header, section.footer):
            if not part.is_linked_to_previous:
                yield from of(part)


def paragraph_markup(paragraph) -> str:
    """A paragraph's runs as `<span class="rN">text</span>`, N the run's place."""
    return "".join(f'<span class="r{index}">{html.escape(run.text, quote=False)}</span>'
                   for index, run in enumerate(paragraph.runs) if run.text)


class _Spans(HTMLParser):
    """(run index, text) of a translated paragraph's spans; text outside every span goes with
    the span before it (the first one's, at the start)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[list] = []
        self.open: list[int] = []

    def handle_starttag(self, tag, attrs):
        found = re.fullmatch(r"r(\d+)", dict(attrs).get("class") or "")
        self.open.append(int(found[1]) if tag == "span" and found else
                         (self.open[-1] if self.open else -1))

    def handle_endtag(self, tag):
        if self.open:
            self.open.pop()

    def handle_data(self, data):
        run = self.open[-1] if self.open else -1
        if self.parts and self.parts[-1][0] == run:
            self.parts[-1][1] += data
        else:
            self.parts.append([run, data])


def marked_runs(output: str) -> list[tuple[int, str]]:
    parser = _Spans()
    parser.feed(output)
    parser.close()
    parts = parser.parts
    first = next((run for run, _ in parts if run >= 0), 0)
    found, last = [], first
    for run, text in parts:
        run = last if run < 0 else run
        found.append((run, text))
        last = run
    return found


def write_runs(paragraph, parts: list[tuple[int, str]]) -> None:
    """The paragraph's runs replaced by one run per translated part, each a copy of the run
    its words came from (its properties: bold, italic, font, ...), where the first run was."""
    runs = paragraph.runs
    if not runs:
        return
    from docx.text.run import Run

    anchor = runs[0]._r
    made = []
    for index, text in parts:
        source = runs[min(max(index, 0), len(runs) - 1)]._r
        element = copy.deepcopy(source)
        run = Run(element, paragraph)
        run.text = text
        made.append(element)
    for element in made:
        anchor.addprevious(element)
    for run in runs:
        run._r.getparent().remove(run._r)


# -------------------------------------------------------------------------------- subtitles

SRT_TIMING = re.compile(r"\d{1,2}:\d{2}:\d{2}[,.]\d{1,3}\s*-->\s*\d{1,2}:\d{2}:\d{2}[,.]\d{1,3}")
VTT_TIMING = re.compile(r"(\d{1,2}:)?\d{2}:\d{2}\.\d{3}\s+-->\s+(\d{1,2}:)?\d{2}:\d{2}\.\d{3}")
SUBTITLE_TAG = re.compile(r"&lt;(/?)([ibu])&gt;")


def read_subtitles(name: str, text: str, vtt: bool) -> Document:
    """The cues of an .srt or .vtt file: each cue's text lines one text to translate; the rest
    of the file kept as it is."""
    bom = text.startswith("\ufeff")
    body = text[1:] if bom else text
    newline = "\r\n" if "\r\n" in body else "\n"
    lines = body.replace("\r\n", "\n").split("\n")
    timing = VTT_TIMING if vtt else SRT_TIMING
    if vtt and not lines[0].startswith("WEBVTT"):
        raise DocumentError(f"file {name!r} is not WebVTT: its first line must be WEBVTT")
    cues: list[tuple[int, int]] = []  # (first text line, lines) of each cue
    block_start = 0
    for number, line in enumerate(lines + [""]):
        if line.strip():
            continue
        block = lines[block_start:number]
        if block:
            found = next((place for place, row in enumerate(block[:2]) if timing.match(row)),
                         None)
            header = vtt and (block_start == 0 or block[0].startswith(("NOTE", "STYLE",
                                                                       "REGION")))
            if found is None and not header:
                raise DocumentError(f"file {name!r}, line {block_start + 1}: a cue without its "
                              "timing (" + ("00:00:01.000 --> 00:00:02.000" if vtt else
                                            "00:00:01,000 --> 00:00:02,000") + ")")
            if found is not None and not header and len(block) > found + 1:
                cues.append((block_start + found + 1, len(block) - found - 1))
        block_start = number + 1
    texts = [subtitle_markup(" ".join(line.strip() for line in lines[first:first + count]))
             for first, count in cues]

    def rebuild(outputs: list[str]) -> bytes:
        rows = list(lines)
        for (first, count), output in reversed(list(zip(cues, outputs))):
            rows[first:first + count] = cut_lines(plain_subtitle(output), count)
        return (("\ufeff" if bom else "") + newline.join(rows)).encode("utf-8")

    return Document(texts, rebuild)


def subtitle_markup(text: str) -> str:
    """A cue's text as HTML: escaped, but for its <i>, <b> and <u> tags."""
    return SUBTITLE_TAG.sub(r"<\1\2>", html.escape(text, quote=False))


def plain_subtitle(output: str) -> str:
    """A translated cue back from HTML: its <i>, <b>, <u> tags kept, the rest unescaped."""
    kept = re.sub(r"<(/?)([ibu])>", "\x00\\1\\2\x01", output)
    kept = re.sub(r"<[^>]*>", "", kept)
    return html.unescape(kept).replace("\x00", "<").replace("\x01", ">")


def cut_lines(text: str, count: int) -> list[str]:
    """`text` in `count` lines (as the cue had), cut at the spaces nearest to even lengths;
    an empty translation in none (the cue keeps its number and timing)."""
    words = text.split()
    if not words:  # no line at all: an empty one would end the cue
        return []
    if count <= 1 or len(words) <= 1:
        return [" ".join(words)]
    lines, rest = [], words
    for remaining in range(count, 1, -1):
        if len(rest) <= 1:
            break
        target = len(" ".join(rest)) / remaining
        best, length = 1, len(rest[0])
        for place in range(1, len(rest)):
            if abs(length - target) <= abs(length + 1 + len(rest[place]) - target):
                break
            length += 1 + len(rest[place])
            best = place + 1
        best = min(best, len(rest) - 1)
        lines.append(" ".join(rest[:best]))
        rest = rest[best:]
    lines.append(" ".join(rest))
    return lines
