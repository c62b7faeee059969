"""What a user controls in a translation besides its source: a target prefix, phrases the output
must hold (`--constraints`, a glossary's terms) and phrases it must not (`--ban`), read from
decode's input lines and files and cut into the target vocabulary's pieces; constraints.py makes
them the search's constraint for each batch. A line's own controls are a `Controls`; what a
translator holds every line to (its glossary, its bans, its vocabulary shortlist) is a
`DecodeControls`, made with the translator. Torch-free: a server reads its files before torch
starts.

Input stays plain text unless an option says otherwise: with `--prefix` a line is
`source<TAB>prefix`, with `--constraints` `source<TAB>c1<TAB>c2…`, with both
`source<TAB>prefix<TAB>c1…` (an empty prefix: none). Texts are cut into the target vocabulary's
pieces as SentencePiece cuts them alone, so a phrase is matched as the words it spells ("Haus" is
"▁Haus": "Krankenhaus" does not hold it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import AttnError
from ..files import check_readable, read_lines
from .glossary import Glossary

if TYPE_CHECKING:
    from .shortlist import Shortlist


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


class BanList:
    """Phrases no output may hold, as texts, each with where it came from (a file's line):
    read before a model loads, cut into a model's target pieces when a translator is made
    (`ids`)."""

    def __init__(self, texts: list[str], wheres: list[str], name: str):
        if not texts:
            raise AttnError(f"{name}: no phrases to ban (one phrase per line)")
        self.texts, self.wheres = texts, wheres

    @classmethod
    def read(cls, path) -> "BanList":
        """`--ban FILE`: one phrase per line (target text; blank lines and `#` lines
        skipped)."""
        texts, wheres = [], []
        check_readable(path, "ban file")
        for number, line in enumerate(read_lines(path), 1):
            text = " ".join(line.split())
            if text and not text.startswith("#"):
                texts.append(text)
                wheres.append(f"{path}:{number}")
        return cls(texts, wheres, str(path))

    @classmethod
    def of(cls, phrases: Sequence[str], name: str = "bans") -> "BanList":
        """Phrases given from Python (blank ones skipped), named `name[i]` in errors."""
        kept = [(" ".join(text.split()), f"{name}[{place}]")
                for place, text in enumerate(phrases) if text.strip()]
        return cls([text for text, _ in kept], [where for _, where in kept], name)

    def ids(self, vocab, unk_id: int) -> list[list[int]]:
        """Each phrase's target ids; a phrase outside the vocabulary is an error naming its
        line."""
        return encode_checked(vocab, unk_id, self.texts, "banned phrase", self.wheres)


@dataclass(frozen=True)
class DecodeControls:
    """What a translator holds every line to, besides the line's own controls: the glossary's
    terms found in a line become phrases its outputs must hold (`GlossaryPhrases`), no output
    holds a banned phrase (target ids), and each batch writes only the pieces of its vocabulary
    shortlist (`shortlist.Shortlist`). Each None where not asked for."""

    glossary: GlossaryPhrases | None = None
    bans: list[list[int]] | None = None
    shortlist: "Shortlist | None" = None

    @classmethod
    def made_for(cls, loaded, glossary: Glossary | None, bans: BanList | None,
                 shortlist: "Shortlist | None") -> "DecodeControls":
        """The controls read before a model loaded, checked against its vocabularies: a
        target term or banned phrase outside its target vocabulary, or a shortlist of other
        vocabularies, is an error naming its file and line."""
        unk = loaded.config.unk_id
        if shortlist is not None:
            shortlist.check_vocabularies(loaded.src_vocab, loaded.tgt_vocab, "the model")
        return cls(None if glossary is None else GlossaryPhrases(glossary, loaded.tgt_vocab, unk),
                   None if bans is None else bans.ids(loaded.tgt_vocab, unk), shortlist)


def read_controls(glossary=None, bans=None, shortlist=None
                  ) -> tuple[Glossary | None, BanList | None, "Shortlist | None"]:
    """What a translator is asked to hold every line to, read (and each file checked) before
    any model loads: `glossary` a TSV's path, a `Glossary`, or source-to-target pairs (a
    mapping or a list of pairs); `bans` a file's path, a `BanList` or a list of phrases;
    `shortlist` a path or a `shortlist.Shortlist`. None: not asked for."""
    if glossary is not None and not isinstance(glossary, Glossary):
        glossary = Glossary.read(glossary) if isinstance(glossary, (str, os.PathLike)) else \
            Glossary.from_pairs(glossary, "glossary")
    if bans is not None and not isinstance(bans, BanList):
        bans = BanList.read(bans) if isinstance(bans, (str, os.PathLike)) else BanList.of(bans)
    if shortlist is not None and isinstance(shortlist, (str, os.PathLike)):
        from .shortlist import Shortlist

        shortlist = Shortlist.load(shortlist)
    return glossary, bans, shortlist
