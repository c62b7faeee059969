"""HTML translated with its markup kept (markup.py): the answer holds the request's tags, in
order, with their attributes; what is not text to translate comes back byte for byte; an
identity translation gives the document back; malformed markup never fails."""

from __future__ import annotations

import random

import pytest

from attn_cli import load_translator
from attn_cli.decode.markup import HtmlDocument, read_markup, translate_html

from ..conftest import REPO
from ..toys import tag_tree


def diagonal(sentence: str) -> list[tuple[int, int]]:
    return [(i, i) for i in range(len(sentence.split()))]


def identity(sentences):
    return list(sentences), [diagonal(s) for s in sentences]


def upper(sentences):
    return [s.upper() for s in sentences], [diagonal(s) for s in sentences]


def reverse(sentences):
    words = [s.split() for s in sentences]
    return [" ".join(w[::-1]) for w in words], \
        [[(i, len(w) - 1 - i) for i in range(len(w))] for w in words]


def random_translation(seed: int):
    """Outputs of another length, each word aligned with a random source word, some left
    unaligned."""
    rng = random.Random(seed)

    def translate(sentences):
        outputs, alignments = [], []
        for sentence in sentences:
            count, length = len(sentence.split()), rng.randint(0, 8)
            pairs = sorted({(rng.randrange(count), t) for t in range(length) if rng.random() < 0.8})
            outputs.append(" ".join(f"w{t}" for t in range(length)))
            alignments.append(pairs)
        return outputs, alignments

    return translate


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>A page title</title>
<style>p > b { color: red }</style>
<script>if (a < b && c > d) { document.write("<p>not text</p>") }</script></head>
<body class="main">
<!-- a comment, kept -->
<h1 id="top">Hello <b>big <i>bright</i></b> world &amp; friends.</h1>
<p>See <a href="/x?a=1&amp;b=2" title="a > b">the <em>linked</em> page</a> here. Another
sentence follows &lt;here&gt;.</p>
<ul><li>one item<li>two <code>items</code></ul>
<p>An image <img src="a.png" alt="x > y"> between words, a<br>break, 10&nbsp;km.</p>
<div translate="no">Keep <b>this</b> as it is.</div>
<p>Press <span class="notranslate">Save</span> now.</p>
<table><tr><td>Cell one</td><td> Cell <strong>two</strong> </td></tr></table>
<p>Hello<b> spaced </b>world</p>
</body></html>
"""


@pytest.mark.parametrize("document", [
    PAGE,
    "<p>text outside any <i>block",
    "plain text, no tags at all. Two sentences.",
    "<p>unclosed <b>bold <i>both</b> text</i> end",
    "<div>stray </em> close and <span>open span",
    "<p>a comment <!-- inside --> a sentence</p>",
])
def test_an_identity_translation_gives_the_document_back(document):
    assert translate_html(document, identity, "en") == document


@pytest.mark.parametrize("translate", [upper, reverse, random_translation(1),
                                       random_translation(2)])
def test_the_answer_holds_the_requests_tags_in_order(translate):
    answer = translate_html(PAGE, translate, "en")
    assert tag_tree(answer) == tag_tree(PAGE)
    assert answer != PAGE


def test_random_documents_keep_their_tags_whatever_the_alignment():
    """Generated documents (nested inline tags, tags inside words, voids, comments, blocks,
    stray and unclosed tags, elements kept whole) under random outputs and alignments."""
    rng = random.Random(0)
    inline = ["b", "i", "a href='x'", "span class='y'", "em"]

    def content(depth: int) -> str:
        parts = []
        for _ in range(rng.randint(1, 5)):
            roll = rng.random()
            if roll < 0.45:
                parts.append(rng.choice(["word", " two words ", "Hi. There", "&amp;", "\n"]))
            elif roll < 0.65 and depth < 3:
                tag = rng.choice(inline)
                parts.append(f"<{tag}>{content(depth + 1)}</{tag.split()[0]}>")
            else:
                parts.append(rng.choice(["<img src=a>", "<!-- c -->", "<br>", "<p>", "</b>",
                                         "<i>", "<span translate=no>k <b>x</b></span>"]))
        return "".join(parts)

    for seed in range(150):
        document = f"<div>{content(0)}</div>{content(0)}"
        for translate in (reverse, random_translation(seed)):
            assert tag_tree(translate_html(document, translate, "en")) == tag_tree(document), \
                document


def test_what_is_not_text_comes_back_byte_for_byte():
    answer = translate_html(PAGE, upper, "en")
    for kept in ['<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
                 "<style>p > b { color: red }</style>",
                 '<script>if (a < b && c > d) { document.write("<p>not text</p>") }</script>',
                 "<!-- a comment, kept -->", '<a href="/x?a=1&amp;b=2" title="a > b">',
                 '<div translate="no">Keep <b>this</b> as it is.</div>',
                 '<span class="notranslate">Save</span>', '<img src="a.png" alt="x > y">',
                 "</td></tr></table>"]:
        assert kept in answer
    assert "<title>A PAGE TITLE</title>" in answer
    assert '<h1 id="top">HELLO <b>BIG <i>BRIGHT</i></b> WORLD &amp; FRIENDS.</h1>' in answer
    assert "ANOTHER\nSENTENCE FOLLOWS &lt;HERE&gt;." in answer  # entities decoded, re-escaped
    assert "10&nbsp;KM." in answer
    assert "<p>PRESS <span" in answer and "</span> NOW.</p>" in answer  # read without "Save"
    assert "<li>TWO <code>ITEMS</code></ul>" in answer


def test_reordered_words_take_their_tags_along():
    assert translate_html("<p><b>one</b> two three</p>", reverse) == \
        "<p>three two <b>one</b></p>"
    assert translate_html("<p>one <b>two <i>three</i></b> four</p>", reverse) == \
        "<p>four <b><i>three</i> two</b> one</p>"
    # Siblings keep their order: the later one, whose words went first, comes back empty.
    assert translate_html("<p><b>one</b> <i>two</i></p>", reverse) == \
        "<p>two <b>one</b><i></i></p>"


def test_an_element_aligned_with_nothing_comes_back_empty_where_its_words_were():
    def unaligned(sentences):
        return ["Hallo große Welt"], [[(0, 0), (2, 2)]]

    assert translate_html("<p>Hello <b>big</b> world</p>", unaligned) == \
        "<p>Hallo große <b></b>Welt</p>"


def test_a_tag_spanning_sentences_wraps_their_translations():
    asked = []

    def recorded(sentences):
        asked.extend(sentences)
        return upper(sentences)

    answer = translate_html("<p><b>First one. Second one.</b> Third.</p>", recorded, "en")
    assert asked == ["First one.", "Second one.", "Third."]
    assert answer == "<p><b>FIRST ONE. SECOND ONE.</b> THIRD.</p>"


def test_translations_are_text_never_markup():
    def hostile(sentences):
        return ["<script>alert(1)</script> & co"], [[(0, 0)]]

    answer = translate_html("<p>Hello</p>", hostile)
    assert answer == "<p>&lt;script&gt;alert(1)&lt;/script&gt; &amp; co</p>"
    assert tag_tree(answer) == tag_tree("<p>Hello</p>")


@pytest.mark.parametrize("document", [
    "<p>unclosed comment <!-- to the end",
    "<p>unclosed script <script>if (a < b) {",
    "<p>a < b and c <> d &unknown; &#x110000; </p>",
    '<p class="never closed>text</p>',
    "<p>tag <b",
    "</p></div>only closing</b></i>",
    "<![CDATA[ x ]]><?php echo 1 ?><p>text</p>",
])
def test_malformed_markup_never_fails_and_keeps_its_tags(document):
    """Every piece the parser reads is kept: joined, they are the document."""
    assert "".join(token.raw for token in read_markup(document)) == document
    for translate in (upper, reverse, random_translation(3)):
        assert tag_tree(translate_html(document, translate, "en")) == tag_tree(document)


def test_a_document_without_text_is_not_translated():
    def refuse(sentences):
        raise AssertionError(f"asked to translate {sentences}")

    document = "<div><img src=a> <!-- c --> <script>x()</script></div>\n"
    assert translate_html(document, refuse) == document
    assert HtmlDocument.read(document).sentences == []


def test_a_reversing_model_moves_the_bold_word_with_its_translation():
    """End to end: the fixture model trained to reverse letter sequences, its alignments read
    from its cross-attention (`Translator.translate_aligned`)."""
    translator = load_translator(REPO / "tests" / "fixtures" / "run" / "checkpoint-600.st", 4,
                                 device="cpu", threads=1, workers=1)
    assert translate_html("<p><b>a</b> b c d</p><p>e f <i>g h</i></p>",
                          translator.translate_aligned, "en") == \
        "<p>d c b <b>a</b></p><p><i>h g</i> f e</p>"
    # Two siblings whose words swap places: the second comes back empty, after the first.
    assert translate_html('<p><b>a</b> b c <a href="#">d</a></p>',
                          translator.translate_aligned, "en") == \
        '<p>d c b <b>a</b><a href="#"></a></p>'
