"""sentences.py: texts cut into sentences and joined back around translations, the spacing
kept byte for byte."""

from __future__ import annotations

import pytest

from attn_cli.decode.sentences import Paragraph, segmenter_language, split, split_texts

TEXTS = [
    "",
    " ",
    "\t \t",
    "No punctuation at all",
    "One sentence.",
    "Two sentences. Here is the second!",
    "  Leading and trailing spaces.  Inside too.   ",
    "Tabs.\tBetween.\t",
    "Windows line ends.\r\nA second line.\r\n",
    "An old Mac's.\rAnd more.",
    "A line separator\u2028inside, and a paragraph one\u2029too.",
    "\n\nBlank lines first.\n\n\nThen three.\n",
    "Dr. Smith came, e.g. today. Then he left at 5 p.m. yesterday.",
    "Er kam z.B. heute. Dann ging er.",
    "今日は晴れ。明日は雨。",
    "Is it?  Yes!  No…   Maybe.",
    "A non-breaking space.\u00a0Then another sentence.",
    "Ends without a full stop? yes",
]


@pytest.mark.parametrize("lang", [None, "de", "ja"])
def test_joining_the_sentences_themselves_gives_the_text_back(lang):
    for text in TEXTS:
        paragraph = split(text, lang)
        assert paragraph.join(paragraph.sentences) == text, repr(text)
        assert len(paragraph.spacing) == len(paragraph.sentences) + 1
        assert all(sentence == sentence.strip() and sentence for sentence in paragraph.sentences)
        assert all(not space.strip() for space in paragraph.spacing)


def test_sentences_and_their_spacing():
    assert split(" Ab cd.  Ef gh!\tIj kl?  ") == Paragraph(("Ab cd.", "Ef gh!", "Ij kl?"),
                                                            (" ", "  ", "\t", "  "))
    assert split("") == Paragraph((), ("",))
    assert split(" \t ") == Paragraph((), (" \t ",))


def test_line_breaks_are_boundaries_without_punctuation():
    for text in ("first line\rsecond line", "first line\u2028second line",
                 "first line\r\nsecond line", "first line\nsecond line"):
        assert split(text).sentences == ("first line", "second line")


def test_abbreviations_and_numbers_stay_whole_by_their_language():
    assert split("Dr. Smith came, e.g. today. Then he left.").sentences == (
        "Dr. Smith came, e.g. today.", "Then he left.")
    assert split("Er kam z.B. heute. Dann ging er.", "de").sentences == (
        "Er kam z.B. heute.", "Dann ging er.")
    # German writes dates with an ordinal's full stop; English's rules cut there.
    assert split("Sie kam am 3. Mai. Er nicht.", "de").sentences == (
        "Sie kam am 3. Mai.", "Er nicht.")
    assert len(split("Sie kam am 3. Mai. Er nicht.", "en").sentences) == 3
    assert split("Sie kam am 3. Mai. Er nicht.", "de-DE") == split(
        "Sie kam am 3. Mai. Er nicht.", "de")
    assert split("今日は晴れ。明日は雨。", "ja").sentences == ("今日は晴れ。", "明日は雨。")


def test_translations_take_the_sentences_places():
    paragraph = split("  One.  Two!\tThree?\u2028Four ")
    assert paragraph.join(["Eins.", "Zwei!", "Drei?", "Vier"]) == \
        "  Eins.  Zwei!\tDrei?\u2028Vier "
    assert paragraph.join(["Eins.", "", "Drei?", "Vier"]) == "  Eins.  \tDrei?\u2028Vier "
    with pytest.raises(ValueError, match="3 translations for 4 sentences"):
        paragraph.join(["Eins.", "Zwei!", "Drei?"])


def test_many_texts_share_one_list_of_sentences():
    split_ = split_texts(["One. Two.", "", "  ", "Three."])
    assert split_.sentences == ["One.", "Two.", "Three."]
    assert split_.join(["1", "2", "3"]) == ["1 2", "", "  ", "3"]
    with pytest.raises(ValueError, match="2 translations for 3 sentences"):
        split_.join(["1", "2"])
    assert split_texts([]).join([]) == []


def test_language_codes_as_sentencex_knows_them():
    assert segmenter_language(None) == "en"
    assert [segmenter_language(code) for code in ("de", "DE", "de-DE", "pt_BR", "zh-Hant")] == \
        ["de", "de", "de", "pt", "zh"]
    for wrong in ("", "english language", "d", "de-", "12"):
        with pytest.raises(ValueError, match="not a language code"):
            segmenter_language(wrong)
