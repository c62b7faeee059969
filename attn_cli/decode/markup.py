"""HTML translated with its markup kept (LibreTranslate's `format: "html"`).

A document is read with the standard library's `html.parser`, every piece of it kept as written
(its position in the document: `read_markup`), and cut into runs of text: a block-level tag (p,
div, li, td, h1, br, ...) or any tag not known to be inline ends a run; inline tags (b, i, em, a,
span, code, ...), inline void elements (img, wbr) and comments stay inside one. A run's text, its
entities decoded, is cut into sentences (`sentences.split`) and each sentence is translated. The
translation is put back escaped, and each inline element around the output words aligned with the
source words it wrapped (`alignment.py`): from the first to the last of them, kept inside its
parent and after its earlier siblings, so that the answer holds the same tags in the same order.

Never translated, and given back byte for byte: everything outside the runs (tags, attributes,
whitespace between blocks), `<script>`, `<style>`, `<textarea>`, `<template>`, `<svg>` and
`<math>` elements, comments, the doctype, and elements marked `translate="no"` or
`class="notranslate"` (whole, whatever they hold; inside a sentence such an element is left out
of the text the model reads and placed like an image).

What the placement decides (the answer's tags are always the request's, in order):
- An element none of whose words the output aligns with (or whose output words an earlier
  sibling already took), or one that wraps no word (a link around an image), comes back where
  its source position maps to (before the output word aligned with the source word after it),
  around no word: its tags are kept, never doubled, and no word is moved into it.
- Tags inside a word wrap the whole output word.
- The whitespace of a gap between words that the translation kept as it was, holding the same
  markup, comes back as it was; elsewhere closing tags stay glued to the word before them and
  opening tags to the word after.
- Text comes back with only `&`, `<`, `>` and the no-break space escaped (`&amp;`, `&lt;`, `&gt;`,
  `&nbsp;`): other entities become the characters they stand for.
- Malformed markup never fails: what the parser reads as a tag is a tag; a stray or overlapping
  closing tag, or an element left open at the run's end, is kept in place as a mark of its own;
  what it cannot read as anything (`<` without a tag, an unclosed comment) it reads as text
  (`<` alone) or keeps as it was.
"""

from __future__ import annotations

import bisect
import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser

from ..alignment import Alignment, word_spans
from . import sentences

# Elements that stay inside a run of text (HTML's phrasing content that holds text).
INLINE = frozenset("a abbr acronym b bdi bdo big cite code data del dfn em font i ins kbd "
                   "label mark nobr q rp rt ruby s samp small span strike strong sub sup time "
                   "tt u var".split())
# Void elements (no end tag) that stay inside a run: marks between words.
INLINE_VOID = frozenset("img wbr input".split())
# HTML's void elements: never wait for an end tag.
VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())
# Elements whose content is not text to translate: kept whole, as written.
KEPT = frozenset("script style textarea template svg math".split())


@dataclass(frozen=True)
class Token:
    """One piece of the document as written (`raw`), read as `kind`: "text" (`text` its
    decoded characters), "start", "end" or "empty" (`<br/>`) tags with their `tag` and `attrs`,
    or "other" (comments, declarations, what the parser skips)."""

    kind: str
    raw: str
    tag: str = ""
    attrs: tuple = ()
    text: str = ""


class _Reader(HTMLParser):
    """HTMLParser reporting where each thing it reads lies: each callback comes before the
    parser steps past what it read (`updatepos`), so the step's span is that thing's text."""

    def __init__(self, document: str):
        super().__init__(convert_charrefs=True)
        self.document, self.consumed = document, 0
        self.tokens: list[Token] = []
        self.pending: list[Token] = []

    def updatepos(self, i: int, j: int) -> int:
        if i < j:
            raw = self.document[self.consumed:self.consumed + j - i]
            read = self.pending[0] if len(self.pending) == 1 else None
            self.tokens.append(Token("other", raw) if read is None else
                               Token(read.kind, raw, read.tag, read.attrs, read.text))
            self.consumed += j - i
            self.pending = []
        return super().updatepos(i, j)

    def handle_starttag(self, tag, attrs):
        self.pending.append(Token("start", "", tag, tuple(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.pending.append(Token("empty", "", tag, tuple(attrs)))

    def handle_endtag(self, tag):
        self.pending.append(Token("end", "", tag))

    def handle_data(self, data):
        self.pending.append(Token("text", "", text=data))


def read_markup(document: str) -> list[Token]:
    """The document as tokens whose `raw` texts, joined, are the document."""
    reader = _Reader(document)
    reader.feed(document)
    reader.close()
    tokens = reader.tokens
    if reader.consumed < len(document):  # what the parser left unread (an unclosed <script>)
        tokens.append(Token("other", document[reader.consumed:]))
    return tokens


def _kept_whole(token: Token) -> bool:
    """An element translated never: its content is not text, or it is marked so."""
    if token.tag in KEPT:
        return True
    attrs = dict(token.attrs)
    return (attrs.get("translate") or "").strip().lower() == "no" or \
        "notranslate" in (attrs.get("class") or "").split()


# ------------------------------------------------------------------------------ runs of text


@dataclass(eq=False)
class Mark:
    """Markup inside a run, given back as written: a tag, a comment, an element kept whole.
    `offset`: where it lies in the run's text; `glued`: right after a word's last character
    there, no space between."""

    raw: str
    offset: int
    closing: bool = False
    glued: bool = False


@dataclass(eq=False)
class Element:
    """An inline element of a run (the root: the run itself), its content from `begin` to `end`
    in the run's text."""

    start: Mark | None
    begin: int
    children: list = field(default_factory=list)  # Element | Mark, in order
    stop: Mark | None = None
    end: int = 0
    tag: str = ""


@dataclass
class Run:
    """Text between two block boundaries, as tokens."""

    tokens: list[Token]

    @property
    def raw(self) -> str:
        return "".join(token.raw for token in self.tokens)

    def tree(self) -> tuple[str, Element, list[Mark]]:
        """(the run's text, its inline elements as a tree, its marks in order). A closing tag
        closes the innermost open element if it names it; any other (stray, overlapping) is a
        mark. An element still open at the end gives its children to its parent, its start tag
        a mark."""
        text, root = [], Element(None, 0)
        stack, length, marks = [root], 0, []
        for token in self.tokens:
            if token.kind == "text":
                text += [token.text] if token.text else []
                length += len(token.text)
                continue
            mark = Mark(token.raw, length, closing=token.kind == "end")
            marks.append(mark)
            if token.kind == "start" and token.tag in INLINE:
                element = Element(mark, length, tag=token.tag)
                stack[-1].children.append(element)
                stack.append(element)
            elif token.kind == "end" and len(stack) > 1 and stack[-1].tag == token.tag:
                element = stack.pop()
                element.stop, element.end = mark, length
            else:
                stack[-1].children.append(mark)
        root.end, text = length, "".join(text)
        for mark in marks:  # glued to a word's end (not inside a word, nor before one)
            mark.glued = 0 < mark.offset and not text[mark.offset - 1].isspace() and (
                mark.offset == length or text[mark.offset].isspace())
        while len(stack) > 1:
            unclosed = stack.pop()
            siblings = stack[-1].children
            at = siblings.index(unclosed)
            siblings[at:at + 1] = [unclosed.start, *unclosed.children]
        return text, root, marks


def split_runs(tokens: list[Token]) -> list[str | Run]:
    """The document as markup given back as written (str) and runs of text to translate."""
    pieces: list[str | Run] = []
    current: list[Token] = []
    index = 0

    def flush():
        if current:
            pieces.append(Run(list(current)))
            current.clear()

    while index < len(tokens):
        token = tokens[index]
        index += 1
        if token.kind == "text" and len(token.raw) > 1 and token.raw.startswith("<"):
            current.append(Token("other", token.raw))  # markup the parser could not read
        elif token.kind in ("text", "other"):
            current.append(token)
        elif token.kind == "start" and token.tag not in VOID and _kept_whole(token):
            index, raw = _whole_element(tokens, index - 1)
            if token.tag in INLINE:
                current.append(Token("other", raw))
            else:
                flush()
                pieces.append(raw)
        elif token.tag in INLINE or token.tag in INLINE_VOID:
            current.append(token)
        else:  # a block boundary
            flush()
            pieces.append(token.raw)
    flush()
    return pieces


def _whole_element(tokens: list[Token], first: int) -> tuple[int, str]:
    """(the index after the element starting at tokens[first], its text as written): up to its
    end tag, or the document's end if it has none."""
    tag, depth, index = tokens[first].tag, 0, first
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if token.tag == tag and token.kind == "start":
            depth += 1
        elif token.tag == tag and token.kind == "end":
            depth -= 1
            if depth == 0:
                break
    return index, "".join(token.raw for token in tokens[first:index])


# --------------------------------------------------------------------- putting markup back


def escape(text: str) -> str:
    return html.escape(text, quote=False).replace("\xa0", "&nbsp;")


@dataclass
class _Side:
    """A run's text on one side (source or output): the text, its words' spans, and the first
    word of each sentence."""

    text: str
    words: list[tuple[int, int]]
    firsts: list[int]

    @classmethod
    def of(cls, paragraph: sentences.Paragraph, texts: Sequence[str]) -> "_Side":
        words, firsts, position = [], [], len(paragraph.spacing[0])
        for text, after in zip(texts, paragraph.spacing[1:]):
            firsts.append(len(words))
            words += [(position + start, position + end) for start, end in word_spans(text)]
            position += len(text) + len(after)
        return cls(paragraph.join(texts), words, firsts)

    def __post_init__(self):
        self.starts = [start for start, _ in self.words]
        self.ends = [end for _, end in self.words]

    def count(self, sentence: int) -> int:
        """The words of sentence `sentence`."""
        following = self.firsts[sentence + 1:sentence + 2] or [len(self.words)]
        return following[0] - self.firsts[sentence]

    def word_at(self, offset: int) -> int:
        """The first word ending after `offset`: the one it lies in, or the next."""
        return bisect.bisect_right(self.ends, offset)

    def words_in(self, begin: int, end: int) -> range:
        """The words text[begin:end] holds a part of."""
        return range(self.word_at(begin), bisect.bisect_left(self.starts, end)) \
            if begin < end else range(0)

    def gap(self, index: int) -> str:
        """The text between word index-1 and word index (before the first, after the last)."""
        start = self.words[index - 1][1] if index else 0
        end = self.words[index][0] if index < len(self.words) else len(self.text)
        return self.text[start:end]


class _Placement:
    """Where a run's marks go in its translation: `items()` lists the output words (their
    indices) and the marks in the order they are written."""

    def __init__(self, source: _Side, output: _Side, alignments: Sequence[Alignment]):
        self.source, self.output = source, output
        self.images: list[list[int]] = [[] for _ in source.words]  # output words of each
        for sentence, pairs in enumerate(alignments):
            for src, out in pairs:  # pairs out of the sentence's words are ignored
                if 0 <= src < source.count(sentence) and 0 <= out < output.count(sentence):
                    self.images[source.firsts[sentence] + src].append(
                        output.firsts[sentence] + out)

    def position(self, gap: int) -> int:
        """The output gap a source gap maps to: before the first output word aligned with the
        first aligned source word after it, else after those of the last before it."""
        words = self.source.words
        if gap == 0 or gap >= len(words):
            return 0 if gap == 0 else len(self.output.words)
        after = next((self.images[i] for i in range(gap, len(words)) if self.images[i]), None)
        if after:
            return min(after)
        before = next((self.images[i] for i in range(gap - 1, -1, -1) if self.images[i]), None)
        return max(before) + 1 if before else 0

    def wanted(self, child) -> tuple[int, int]:
        """The output words [first, last] a child would wrap; last < first: none, at first."""
        if isinstance(child, Mark):
            at = self.position(self.source.word_at(child.offset))
            return at, at - 1
        inside = self.source.words_in(child.begin, child.end)
        image = [out for i in inside for out in self.images[i]]
        if image:
            return min(image), max(image)
        at = self.position(inside[0] if inside else self.source.word_at(child.begin))
        return at, at - 1

    def items(self, element: Element, first: int, last: int, out: list) -> list:
        """Into `out`, the output words first..last and the element's children placed among
        them: each child within [first, last], after the siblings before it, and short of
        where a later sibling wants to begin."""
        wanted = [self.wanted(child) for child in element.children]
        cursor = first
        for index, child in enumerate(element.children):
            begin, end = wanted[index]
            begin = min(max(begin, cursor), last + 1)
            later = [start for start, _ in wanted[index + 1:] if start > begin]
            end = min(end, last, min(later, default=last + 1) - 1)
            out.extend(range(cursor, begin))
            if isinstance(child, Mark):
                out.append(child)
                cursor = begin
                continue
            end = max(end, begin - 1)
            out.append(child.start)
            self.items(child, begin, end, out)
            out.append(child.stop)
            cursor = end + 1
        out.extend(range(cursor, last + 1))
        return out


def _gaps_as_written(marks: list[Mark], source: _Side) -> dict[tuple[int, ...], list]:
    """The source's gaps between words that hold marks, each as written (whitespace and marks
    in turn), keyed by the ids of its marks; a mark inside a word is in no gap."""
    held: dict[int, list[Mark]] = {}
    for mark in marks:
        index = source.word_at(mark.offset)
        if index == len(source.words) or source.starts[index] >= mark.offset:
            held.setdefault(index, []).append(mark)
    written = {}
    for index, gap_marks in held.items():
        parts, position = [], source.ends[index - 1] if index else 0
        for mark in gap_marks:
            parts += [source.text[position:mark.offset], mark]
            position = mark.offset
        end = source.starts[index] if index < len(source.words) else len(source.text)
        written[tuple(map(id, gap_marks))] = parts + [source.text[position:end]]
    return written


def _render(items: list, output: _Side, as_written: dict[tuple[int, ...], list]) -> str:
    """The translated run: output words, escaped, with the marks `items` places among them."""
    gaps: list[list[Mark]] = [[] for _ in range(len(output.words) + 1)]
    word = 0
    for item in items:
        if isinstance(item, int):
            word = item + 1
        else:
            gaps[word].append(item)
    parts = []
    for index, marks in enumerate(gaps):
        space = output.gap(index)
        written = as_written.get(tuple(map(id, marks)))
        if written and "".join(p for p in written if isinstance(p, str)) == space:
            parts += [part.raw if isinstance(part, Mark) else escape(part) for part in written]
        else:  # closing tags (and marks glued to the word before) first, then the space
            glued = 0
            while index and glued < len(marks) and (marks[glued].closing or marks[glued].glued):
                glued += 1
            parts += [mark.raw for mark in marks[:glued]] + [escape(space)] + \
                [mark.raw for mark in marks[glued:]]
        if index < len(output.words):
            start, end = output.words[index]
            parts.append(escape(output.text[start:end]))
    return "".join(parts)


@dataclass
class _Translated:
    """A run to translate: its inline elements, its marks in order, its sentences."""

    root: Element
    marks: list[Mark]
    paragraph: sentences.Paragraph

    def render(self, translations: Sequence[str], alignments: Sequence[Alignment]) -> str:
        source = _Side.of(self.paragraph, self.paragraph.sentences)
        output = _Side.of(self.paragraph, translations)
        items = _Placement(source, output, alignments).items(self.root, 0,
                                                             len(output.words) - 1, [])
        return _render(items, output, _gaps_as_written(self.marks, source))


# ----------------------------------------------------------------------------------- the API


Translate = Callable[[list[str]], tuple[list[str], list[Alignment]]]


@dataclass
class HtmlDocument:
    """A document made ready to translate: `sentences` to translate (all of them, in order),
    then `render(translations, alignments)` gives the translated document. A server awaits its
    queue between the two; `translate_html` does both at once."""

    pieces: list[str | _Translated]  # markup and text kept as written, runs to translate
    sentences: list[str]

    @classmethod
    def read(cls, document: str, lang: str | None = None) -> "HtmlDocument":
        """`document` cut into runs and their runs into sentences by `lang`'s rules (None:
        English's)."""
        pieces, todo = [], []
        for piece in split_runs(read_markup(document)):
            if isinstance(piece, Run):
                text, root, marks = piece.tree()
                paragraph = sentences.split(text, lang)
                # Whitespace alone; or (never seen) sentences that do not join back into the
                # text exactly: kept as written rather than put back wrong.
                if not paragraph.sentences or paragraph.text != text:
                    pieces.append(piece.raw)
                    continue
                pieces.append(_Translated(root, marks, paragraph))
                todo += paragraph.sentences
            else:
                pieces.append(piece)
        return cls(pieces, todo)

    def render(self, translations: Sequence[str], alignments: Sequence[Alignment]) -> str:
        """The document with each sentence replaced by its translation (in the order of
        `sentences`), `alignments[i]` the (source word, output word) pairs of sentence i."""
        if len(translations) != len(self.sentences) or len(alignments) != len(self.sentences):
            raise ValueError(f"{len(translations)} translations and {len(alignments)} "
                             f"alignments for {len(self.sentences)} sentences")
        parts, done = [], 0
        for piece in self.pieces:
            if isinstance(piece, str):
                parts.append(piece)
                continue
            count = len(piece.paragraph.sentences)
            parts.append(piece.render(translations[done:done + count],
                                      alignments[done:done + count]))
            done += count
        return "".join(parts)


def translate_html(document: str, translate: Translate, lang: str | None = None) -> str:
    """`document` translated, its markup kept: `translate(sentences)` gives each sentence's
    translation and its alignment (`Translator.align`'s pairs); `lang` the source language,
    for cutting sentences."""
    prepared = HtmlDocument.read(document, lang)
    if not prepared.sentences:
        return document
    translations, alignments = translate(prepared.sentences)
    return prepared.render(translations, alignments)
