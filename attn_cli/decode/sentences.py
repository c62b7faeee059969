"""Paragraphs cut into sentences, and put back together around their translations.

A model trained on sentences must be given sentences: a paragraph searched as one line comes back
with sentences missing (the model ends it after the first). `split` cuts a text at its line
breaks and, within each line, at the sentence boundaries of Wikimedia's `sentencex` (chosen over
pysbd, NLTK's Punkt and syntok: ~300 languages through fallback chains, each language's
abbreviations and numbering ("Dr.", "z.B.", "1."), no model to download, about a microsecond a
sentence; its segments concatenate back to the input exactly, which is what lets the spacing
survive). `Paragraph.join` puts translations back with the original spaces and line breaks.

`split_texts` does it for many texts at once, so that all their sentences are searched in the
same batches (`attn decode --split-sentences`, `Translator.translate_paragraphs`, a server):

    split = split_texts(texts, "en")
    translations = translate(split.sentences)  # any function: one translation per sentence
    split.join(translations)                   # one string per text, its spacing kept
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# Line breaks are boundaries whatever the segmenter says: a line holds no sentence's end in the
# middle of a word, and a model reads one line at a time. These are the breaks of Python's
# str.splitlines (CRLF, LF, CR, VT, FF, the file/group/record separators, NEL, U+2028, U+2029).
LINE_BREAK = re.compile(r"(\r\n|[\n\r\v\f\x1c-\x1e\x85\u2028\u2029])")
# A language code as BCP 47 and locales write it: its primary subtag ("pt" of "pt-BR", "pt_BR").
LANGUAGE_CODE = re.compile(r"([A-Za-z]{2,3})(?:[-_][A-Za-z0-9]{1,8})*")


@dataclass(frozen=True)
class Paragraph:
    """A text as its sentences, each without the whitespace around it, and `spacing`: what lies
    before the first sentence, between each two, and after the last (one more than the
    sentences: spaces, tabs, line breaks, kept byte for byte)."""

    sentences: tuple[str, ...]
    spacing: tuple[str, ...]

    def join(self, translations: Sequence[str]) -> str:
        """The text with each sentence replaced by its translation, in order, the spacing kept.
        A sentence whose translation is empty leaves its spacing (no doubled space is made
        up, none is lost)."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"{len(translations)} translations for {len(self.sentences)} "
                             "sentences")
        parts = [self.spacing[0]]
        for translation, after in zip(translations, self.spacing[1:]):
            parts += [translation, after]
        return "".join(parts)

    @property
    def text(self) -> str:
        """The text split (`join` of the sentences themselves)."""
        return self.join(self.sentences)


def segmenter_language(code: str | None) -> str:
    """The code sentencex knows a language by: the primary subtag, lower case ("de" of "de-DE",
    "pt_BR" → "pt"); None: "en". sentencex takes any code (one it has no rules for falls back,
    in the end to English's), but only its own spelling: "de-DE" would get English's rules."""
    if code is None:
        return "en"
    match = LANGUAGE_CODE.fullmatch(code.strip())
    if match is None:
        raise ValueError(f"not a language code: {code!r} (e.g. en, de, pt-BR)")
    return match.group(1).lower()


def split(text: str, lang: str | None = None) -> Paragraph:
    """`text` cut into sentences by the rules of `lang` (an ISO 639 code, a region or script
    after it ignored; None: English's, which also cut most languages written with Latin letters
    right)."""
    import sentencex

    lang = segmenter_language(lang)
    sentences, spacing, pending = [], [], ""
    for part in LINE_BREAK.split(text):
        if LINE_BREAK.fullmatch(part):
            pending += part
            continue
        segments = list(sentencex.segment(lang, part))
        if "".join(segments) != part:  # never expected; the text must not change if it does
            segments = [part]
        for segment in segments:
            sentence = segment.strip()
            if not sentence:  # whitespace alone
                pending += segment
                continue
            start = len(segment) - len(segment.lstrip())
            spacing.append(pending + segment[:start])
            sentences.append(sentence)
            pending = segment[start + len(sentence):]
    spacing.append(pending)
    return Paragraph(tuple(sentences), tuple(spacing))


@dataclass(frozen=True)
class SplitTexts:
    """Texts each cut into sentences (`split`): `sentences` lists them all, text after text,
    to be translated together; `join` puts the translations back, one string per text."""

    paragraphs: tuple[Paragraph, ...]

    @property
    def sentences(self) -> list[str]:
        return [sentence for paragraph in self.paragraphs for sentence in paragraph.sentences]

    def join(self, translations: Sequence[str]) -> list[str]:
        """Each text with its sentences replaced by their translations (`translations[i]` that
        of `sentences[i]`), its spacing kept; a text of whitespace alone comes back as it was."""
        if len(translations) != sum(len(paragraph.sentences) for paragraph in self.paragraphs):
            raise ValueError(f"{len(translations)} translations for "
                             f"{len(self.sentences)} sentences")
        texts, start = [], 0
        for paragraph in self.paragraphs:
            end = start + len(paragraph.sentences)
            texts.append(paragraph.join(translations[start:end]))
            start = end
        return texts


def split_texts(texts: Sequence[str], lang: str | None = None) -> SplitTexts:
    """Each text `split` by the rules of `lang`."""
    return SplitTexts(tuple(split(text, lang) for text in texts))
