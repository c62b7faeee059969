"""Glossaries (`attn decode --glossary FILE`, `attn serve`'s per server or per request): pairs of
a source term and its target term. Each source term found in a source line makes its target term
a lexical constraint of that line (lexical.py): the output must hold it. Not in the paper: how a
company's terminology reaches a translation (DeepL's and ModernMT's glossaries, fairseq's
`--constraints` fed by a term list).

A glossary file is UTF-8 text, one `source<TAB>target` a line; blank lines and lines starting
with `#` are skipped (so no source term starts with `#`), and a byte-order mark at the start is
tolerated. Each term's whitespace is
squeezed (stripped, inner runs one space), so "credit  card" is "credit card".

What finds a term in a text:
- Word boundaries: a term is found only as whole words ("art" is not in "party"). A text is read
  as tokens: maximal runs of word characters (letters, digits, `_`, and the combining marks
  that Python's `\\w` leaves out, so that "हिन्दी" is one word), and every other character that is
  not whitespace, alone. A term is a run of whole tokens, so a boundary is needed only where the
  term's own edge is a word character: "C++" is found in "I like C++.", ".NET" in "ASP.NET".
- Whitespace: a term's space matches any run of whitespace ("credit\\u00a0card",
  "credit   card"), and only whitespace ("e-mail" is not "e - mail").
- Case: a term written all in lower case is found in any casing ("bank": "Bank", "BANK");
  a term with a capital ("Apple", "AWS") only as written. The target is forced as written:
  a sentence-initial "Credit card" does not make "carte de crédit" "Carte de crédit", since the
  translation seldom starts with it ("Les paiements par carte de crédit").
- Overlaps: the longest match first (in characters), then the leftmost; a match never overlaps
  one chosen before it ("New York City" over "New York" over "York"). Where a capitalised term
  and a lower-case one both match the same text ("Bank", "bank"), the capitalised one is taken.

    glossary = Glossary.read("terms.tsv")          # or Glossary.from_pairs({"bank": "Bank"})
    glossary.matches("The bank's credit card.")    # [Match(4, 8, ...), Match(11, 22, ...)]
    glossary.targets("The bank's credit card.")    # ["Bank", "Kreditkarte"]
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..errors import AttnError
from ..files import STDIO, check_readable, display_name, read_lines

BYTE_ORDER_MARK = "\ufeff"
# The planes that hold combining marks (as of Unicode 15: the BMP, the SMP's scripts, plane 14's
# variation selectors; a test checks the running Python's): scanning only these, not all 17,
# builds the token pattern in ~15 ms rather than ~100.
MARK_PLANES = (range(0x0, 0x20000), range(0xE0000, 0xE1000))


@dataclass(frozen=True)
class Term:
    """One glossary entry, its whitespace squeezed; `line` its line in the file (1-based), 0
    when it came from pairs."""

    source: str
    target: str
    line: int


@dataclass(frozen=True)
class Match:
    """One occurrence of a term in a text: the characters `text[start:end]`, and `target`, the
    text to force (the term's target, as written)."""

    start: int
    end: int
    term: Term
    target: str


@functools.cache
def token_pattern() -> re.Pattern:
    """A token: a maximal run of word characters (`\\w` and the combining marks, which `\\w`
    lacks: the vowel signs and viramas of Indic scripts, accents written apart), or any other
    character but whitespace, alone. Built at first use from the running Python's Unicode data,
    so that it agrees with its `\\w` and `str.casefold`."""
    marks = [code for plane in MARK_PLANES for code in plane
             if unicodedata.category(chr(code)).startswith("M")]
    return re.compile(rf"[\w{character_ranges(marks)}]+|[^\w\s]")


def character_ranges(codes: list[int]) -> str:
    """Sorted code points → the inside of a regex character class (`\\U00000300-\\U0000036f...`)."""
    ranges: list[list[int]] = []
    for code in codes:
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])
    return "".join(f"\\U{first:08x}-\\U{last:08x}" for first, last in ranges)


def first_token_and_count(term: str) -> tuple[str, int]:
    """A squeezed term's first token and its count of tokens."""
    if term.replace(" ", "").isalnum():  # words alone (most terms): 3x faster than the regex
        return term.split(" ", 1)[0], term.count(" ") + 1
    tokens = token_pattern().findall(term)
    return tokens[0], len(tokens)


def squeeze(text: str) -> str:
    """Stripped, each inner run of whitespace one space: how terms and texts are compared."""
    return " ".join(text.split())


class Glossary:
    """Source terms and their targets, indexed for matching (`matches`, `targets`).

    The index: capitalised terms by their squeezed text, lower-case ones by its casefold, and
    each first token (casefolded) → the token counts of the terms it starts. A text of n
    characters and T tokens is matched in O(n + T·D·L), D the distinct token counts of the terms
    sharing a first token, L their length in characters: independent of the glossary's size
    (10^5 terms match as fast as 10), and built in O(total characters of the terms)."""

    def __init__(self, terms: Iterable[Term], name: str = "glossary"):
        """An index of `terms` (each source term once: `read` and `from_pairs` check them)."""
        self.name = name
        self.terms: tuple[Term, ...] = tuple(terms)
        self.capitalised: dict[str, Term] = {}
        self.lower_case: dict[str, Term] = {}
        token_counts: dict[str, set[int]] = {}
        for term in self.terms:
            if term.source == term.source.lower():  # written in lower case: found in any
                self.lower_case[term.source.casefold()] = term
            else:
                self.capitalised[term.source] = term
            first, count = first_token_and_count(term.source)
            first = first.casefold()
            if first in token_counts:
                token_counts[first].add(count)
            else:
                token_counts[first] = {count}
        self.token_counts = {first: tuple(sorted(counts)) for first, counts
                             in token_counts.items()}

    @classmethod
    def read(cls, path) -> "Glossary":
        """The glossary of a TSV file (UTF-8, `-`: stdin); a bad line is an error naming the file
        and the line."""
        name = display_name(path)
        if str(path) != STDIO:
            check_readable(path, "glossary")
        entries = []
        for line_number, line in enumerate(read_lines(path), start=1):
            if line_number == 1:
                line = line.removeprefix(BYTE_ORDER_MARK)
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                count = "1 field (no tab)" if len(fields) == 1 else f"{len(fields)} fields"
                raise AttnError(f"{name}:{line_number}: a glossary line is source<TAB>target, "
                                f"this one has {count}")
            entries.append((line_number, line_number, *fields))
        return cls(checked_terms(entries, name, lambda line_number: f"{name}:{line_number}"),
                   name)

    @classmethod
    def from_pairs(cls, pairs, name: str = "glossary") -> "Glossary":
        """The glossary of `[(source, target), ...]` or `{source: target}` (a request's JSON);
        an error names the pair as `name[index]` (0-based, as in the JSON) or `name["key"]`."""
        if isinstance(pairs, Mapping):
            entries = [(source, 0, source, target) for source, target in pairs.items()]
            where = functools.partial(key_where, name)
        elif isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
            raise AttnError(f"{name}: a glossary is a list of [source, target] pairs or an "
                            f"object of source: target, not {type(pairs).__name__}")
        else:
            entries = [(index, 0, *pair_terms(pair, f"{name}[{index}]"))
                       for index, pair in enumerate(pairs)]
            where = functools.partial(index_where, name)
        return cls(checked_terms(entries, name, where), name)

    def __len__(self) -> int:
        return len(self.terms)

    def matches(self, text: str) -> list[Match]:
        """The terms found in `text`, in text order, none overlapping another (longest first,
        then leftmost)."""
        spans = [token.span() for token in token_pattern().finditer(text)]
        candidates = []  # (start, end, first token, last token, term)
        for first, (start, first_end) in enumerate(spans):
            for count in self.token_counts.get(text[start:first_end].casefold(), ()):
                last = first + count - 1
                if last >= len(spans):
                    break  # the counts are sorted: longer ones run past the text too
                term = self.term_of(text[start:spans[last][1]])
                if term is not None:
                    candidates.append((start, spans[last][1], first, last, term))
        candidates.sort(key=lambda candidate: (candidate[0] - candidate[1], candidate[0]))
        taken = bytearray(len(spans))  # 1: a token inside a chosen match
        chosen = []
        for start, end, first, last, term in candidates:
            if not any(taken[first:last + 1]):
                taken[first:last + 1] = b"\x01" * (last + 1 - first)
                chosen.append(Match(start, end, term, term.target))
        return sorted(chosen, key=lambda match: match.start)

    def targets(self, text: str) -> list[str]:
        """The constraints of a source line: the target of each term found in it, in the order
        first found, each once."""
        return list(dict.fromkeys(match.target for match in self.matches(text)))

    def term_of(self, found: str) -> Term | None:
        """The term that is this run of whole tokens, if any: a capitalised term as written
        before a lower-case one in any casing."""
        found = squeeze(found)
        term = self.capitalised.get(found)
        return term if term is not None else self.lower_case.get(found.casefold())


def index_where(name: str, index: int) -> str:
    """Where a pair of a list is, for errors: `glossary[2]` (0-based, as in the JSON)."""
    return f"{name}[{index}]"


def key_where(name: str, key) -> str:
    """Where a pair of an object is, for errors: its key as JSON writes it, `glossary["bank"]`."""
    key = json.dumps(key, ensure_ascii=False) if isinstance(key, str) else repr(key)
    return f"{name}[{key}]"


def pair_terms(pair, where: str) -> tuple:
    """A pair of a list → its (source, target); anything but two items is an error."""
    if isinstance(pair, (str, bytes, Mapping)) or not isinstance(pair, Iterable):
        raise AttnError(f"{where}: a glossary pair is [source, target], not "
                        f"{type(pair).__name__}")
    items = tuple(pair)
    if len(items) != 2:
        raise AttnError(f"{where}: a glossary pair is [source, target], this one has "
                        f"{len(items)} item{'' if len(items) == 1 else 's'}")
    return items


def checked_terms(entries: list[tuple], name: str, where: Callable[[object], str]) -> list[Term]:
    """(place, line, source, target) entries → their terms, squeezed, each once; `where(place)`
    names an entry in an error. A term that is not a string or is empty, a source term given
    twice with different targets, or no term at all, is an error."""
    terms: list[Term] = []
    first_place: dict[str, object] = {}  # a source term's key → the place it was first given
    by_key: dict[str, Term] = {}
    for place, line, source, target in entries:
        term = Term(checked_term(source, "source", where, place),
                    checked_term(target, "target", where, place), line)
        # A lower-case term is found in any casing, so "strasse" and "straße" are one term.
        key = term.source.casefold() if term.source == term.source.lower() else term.source
        earlier = by_key.get(key)
        if earlier is None:
            by_key[key], first_place[key] = term, place
            terms.append(term)
        elif earlier.target != term.target:
            spelt = "" if earlier.source == term.source else f' ("{earlier.source}")'
            raise AttnError(f'{where(place)}: "{term.source}" is already '
                            f"{where(first_place[key])}'s term{spelt}, with another target "
                            f'("{earlier.target}" there, "{term.target}" here): keep one')
    if not terms:
        raise AttnError(f"{name}: no terms (a glossary line is source<TAB>target)")
    return terms


def checked_term(term, side: str, where: Callable[[object], str], place) -> str:
    """A term squeezed; an error naming its place if it is not a string or is empty."""
    if not isinstance(term, str):
        raise AttnError(f"{where(place)}: the {side} term is {type(term).__name__}, not a "
                        f"string")
    term = " ".join(term.split())  # squeeze, inline: 10^5 terms
    if not term:
        raise AttnError(f"{where(place)}: the {side} term is empty")
    return term
