"""Paragraphs cut into sentences, and put back together around their translations.

A model trained on sentences must be given sentences: a paragraph searched as one line comes back
with sentences missing (the model ends it after the first). `split` cuts a text at its line
breaks and, within each line, at the sentence boundaries of Wikimedia's `sentencex` (chosen over
pysbd, NLTK's Punkt and syntok: ~300 languages through fallback chains, each language's
abbreviations and numbering ("Dr.", "z.B.", "1."), no model to download, about a microsecond a
sentence; its segments concatenate back to the input exactly, which is what lets the spacing
survive). `Paragraph.join` puts translations back with the original spaces and line breaks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# Line breaks are boundaries whatever the segmenter says: a line holds no sentence's end in the
# middle of a word, and a model reads one line at a time.
LINE_BREAK = re.compile(r"(\r\n|\r|\n|\u2028|\u2029)")
EDGE_SPACE = re.compile(r"^(\s*)(.*?)(\s*)$", re.DOTALL)


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


def split(text: str, lang: str | None = None) -> Paragraph:
    """`text` cut into sentences by the rules of `lang` (an ISO 639 code; None: English's,
    which also cut most languages written with Latin letters right)."""
    import sentencex

    sentences, spacing, pending = [], [], ""
    for part in LINE_BREAK.split(text):
        if LINE_BREAK.fullmatch(part):
            pending += part
            continue
        for segment in sentencex.segment(lang or "en", part):
            before, sentence, after = EDGE_SPACE.match(segment).groups()
            if not sentence:  # whitespace alone
                pending += segment
                continue
            spacing.append(pending + before)
            sentences.append(sentence)
            pending = after
    spacing.append(pending)
    return Paragraph(tuple(sentences), tuple(spacing))
