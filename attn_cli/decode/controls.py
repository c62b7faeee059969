"""What a user controls in a translation besides its source: a target prefix (`prefix.py`),
phrases the output must hold (`--constraints`, a glossary's terms) and phrases it must not
(`--ban`), read from decode's input lines and files and made into the search's constraint
(`lexical.py`) for each batch.

Input stays plain text unless an option says otherwise: with `--prefix` a line is
`source<TAB>prefix`, with `--constraints` `source<TAB>c1<TAB>c2…`, with both
`source<TAB>prefix<TAB>c1…` (an empty prefix: none). Texts are cut into the target vocabulary's
pieces as SentencePiece cuts them alone, so a phrase is matched as the words it spells ("Haus" is
"▁Haus": "Krankenhaus" does not hold it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import AttnError
from ..files import check_readable, read_lines
from .glossary import Glossary
from .lexical import BannedPhrases, Chained, LexicalConstraint, WordPieces, holds
from .prefix import PrefixConstraint


@dataclass(frozen=True)
class Controls:
    """One line's controls, as target ids: its output starts with `prefix` and holds every
    phrase of `phrases`. Hashable: a server's cache keys on it."""

    prefix: tuple[int, ...] = ()
    phrases: tuple[tuple[int, ...], ...] = field(default=())

    def with_phrases(self, phrases) -> "Controls":
        """These controls and `phrases` too (those already here are not repeated)."""
        added = tuple(phrase for phrase in dict.fromkeys(map(tuple, phrases))
                      if phrase not in self.phrases)
        return self if not added else Controls(self.prefix, self.phrases + added)


NONE = Controls()


def split_fields(line: str, prefix: bool, constraints: bool, name: str,
                 line_number: int) -> tuple[str, str, list[str]]:
    """A line of decode's input → (source, prefix text, constraint texts), as the options say
    it is laid out (module doc). A line without a tab has no controls. An empty constraint is
    an error naming the line; with `--constraints` alone, `source<TAB>` has none."""
    if not (prefix or constraints):
        return line, "", []
    source, *fields = line.split("\t")
    if prefix and not constraints:
        if len(fields) > 1:
            raise AttnError(f"{name}:{line_number}: --prefix reads one tab per line "
                            f"(source<TAB>prefix; add --constraints for phrases after it), "
                            f"this line has {len(fields)}")
        return source, fields[0] if fields else "", []
    prefix_text = fields.pop(0) if prefix and fields else ""
    if fields == [""] and not prefix:
        fields = []
    for place, text in enumerate(fields, 1):
        if not text.strip():
            raise AttnError(f"{name}:{line_number}: constraint {place} is empty (a line is "
                            f"source{'<TAB>prefix' if prefix else ''}<TAB>c1<TAB>c2…)")
    return source, prefix_text, fields


def outside_vocabulary(what: str, text: str, where: str) -> AttnError:
    """The error of a text SentencePiece cuts into a piece outside the target vocabulary
    (`<unk>`): forcing it would force a token the model cannot mean."""
    return AttnError(f"{where}: the {what} {text!r} has characters outside the model's target "
                     f"vocabulary (they would be <unk>): remove them, or use a model whose "
                     f"vocabulary has them")


def encode_checked(vocab, unk_id: int, texts: list[str], what: str, wheres: list[str]
                   ) -> list[list[int]]:
    """Each text's target ids, or the error naming the first that has an unknown piece."""
    ids = vocab.encode(texts) if texts else []
    for text, pieces, where in zip(texts, ids, wheres):
        if unk_id in pieces:
            raise outside_vocabulary(what, text, where)
    return ids


class GlossaryPhrases:
    """A glossary (`glossary.Glossary`) with each target term cut into the model's target
    pieces once: the phrases the terms found in a source line force. Every target is checked
    when the glossary is loaded, so a term outside the vocabulary is an error naming its line
    before anything is translated."""

    def __init__(self, glossary: Glossary, vocab, unk_id: int):
        self.glossary = glossary
        targets = list(dict.fromkeys(term.target for term in glossary.terms))
        lines = {term.target: term.line for term in glossary.terms}
        wheres = [f"{glossary.name}:{lines[target]}" if lines[target] else glossary.name
                  for target in targets]
        ids = encode_checked(vocab, unk_id, targets, "target term", wheres)
        self.ids = {target: tuple(pieces) for target, pieces in zip(targets, ids)}

    def phrases(self, source: str) -> list[tuple[int, ...]]:
        """The target ids of every term found in `source`, in order of first occurrence."""
        return [self.ids[target] for target in self.glossary.targets(source)]


def read_bans(path, vocab, unk_id: int) -> list[list[int]]:
    """`--ban FILE`: one phrase per line (target text; blank lines and `#` lines skipped) →
    each phrase's target ids. A phrase outside the vocabulary is an error naming its line."""
    texts, wheres = [], []
    check_readable(path, "ban file")
    for number, line in enumerate(read_lines(path), 1):
        text = " ".join(line.split())
        if text and not text.startswith("#"):
            texts.append(text)
            wheres.append(f"{path}:{number}")
    if not texts:
        raise AttnError(f"{path}: no phrases to ban (one phrase per line)")
    return encode_checked(vocab, unk_id, texts, "banned phrase", wheres)


def search_constraint(controls: list[Controls], bans: list[list[int]] | None, eos_id: int,
                      words: WordPieces | None = None):
    """The search constraint of a batch whose lines have `controls` (and every line `bans`;
    `words`: the target vocabulary's, for phrases' word ends): None where nothing is
    controlled, so that such a batch is searched as a free one, at no extra cost; one
    constraint, or several chained (`lexical.Chained`)."""
    parts = []
    if any(line.prefix for line in controls):
        parts.append(PrefixConstraint.for_batch([list(line.prefix) for line in controls],
                                                eos_id))
    if any(line.phrases for line in controls):
        parts.append(LexicalConstraint.for_batch(
            [[list(phrase) for phrase in line.phrases] for line in controls], eos_id, words))
    if bans:
        parts.append(BannedPhrases.from_phrases(bans, eos_id))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else Chained(parts)


def holds_phrases(tokens: list[int], controls: Controls, words: WordPieces | None) -> bool:
    """Whether an output holds every phrase of its line's controls, as the search counts it."""
    return all(holds(tokens, phrase, words) for phrase in controls.phrases)


def free_controls(controls: list[Controls]) -> list[Controls]:
    """The controls without their phrases: the prefixes only."""
    return [Controls(line.prefix) if line.phrases else line for line in controls]
