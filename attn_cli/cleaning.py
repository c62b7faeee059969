"""Cleaning for `attn binarize`: the filters users know from OpusCleaner, eole's filter transforms
and Marian's or fairseq's preprocessing, each on by its own option, each counted.

A pair is dropped by the first filter that finds fault with it, in this order (the first two
were always on; `--clean` turns on all the others but --langid, with --max-ratio 3):

- `empty`      a side is empty (after SentencePiece: nothing but whitespace counts as empty);
- `too-long`   a side has more than --max-len subword pieces;
- `ratio`      `--max-ratio R`: the longer side has more than R times the pieces of the shorter
               (pieces, not words: what --max-len counts and what the model sees, and the same
               for languages written without spaces);
- `control`    `--drop-control`: a character of Unicode category Cc (control; TAB excepted, as
               whitespace), Cf (format: zero-width spaces, bidi marks, soft hyphens, BOMs; ZWNJ
               and ZWJ excepted, which Persian, Indic scripts and emoji sequences spell with), Co
               (private use) or Cn (unassigned), by Python's Unicode database;
- `copy`       `--drop-copies`: the source is the target, whitespace and case aside (casefold);
- `digits`     `--drop-digit-mismatch`: the digit sequences of the two sides differ as multisets
               (`3,5` and `3.5` agree: both are 3 and 5; any script's digits, as their values);
- `langid`     `--langid`: py3langid (serve's identifier; `attn[clean]`) over all its languages
               finds a side not in its expected language (`--langs`); a side without letters
               is not judged;
- `duplicate`  `--dedup`: the pair came before. Pairs are compared as training sees them, by
               their subword ids (SentencePiece's normalisation has collapsed whitespace and
               applied NFKC), and by their text too where a side holds an unknown piece, so
               that two texts whose differences the vocabulary cannot spell stay apart. Runs
               last, so only kept pairs are remembered.

Memory stays bounded per chunk except for --dedup, which must remember every kept pair:
`PairSet` holds a 32-bit fingerprint of each in a flat table sized from the source file's line
count (5 bytes a line: 21.5 MiB for WMT14 en-de's 4.5M pairs, where a Python set of their
8-byte blake2b digests measured 335 MiB).
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import os
import re
import stat
import sys
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .errors import AttnError
from .files import STDIO, atomic_output, display_name
from .formats import SIDES, UNK_ID

# A drop's reason: its index here (0 keeps the pair), in the order the filters run. `empty` and
# `too-long` are binarize's own, always on.
REASONS = ("kept", "empty", "too-long", "ratio", "control", "copy", "digits", "langid",
           "duplicate")
EMPTY, TOO_LONG, RATIO, CONTROL, COPY, DIGITS, LANGID, DUPLICATE = range(1, len(REASONS))
CLEAN_RATIO = 3.0  # --clean's --max-ratio
LANGID_EXTRA = "pip install 'attn[clean]'"


@dataclass(frozen=True)
class CleanOptions:
    """Which filters run (module docstring). `langid`: the expected (source, target) codes."""

    max_ratio: float | None = None
    drop_control: bool = False
    drop_copies: bool = False
    drop_digit_mismatch: bool = False
    langid: tuple[str, str] | None = None
    dedup: bool = False

    def __post_init__(self):
        if self.max_ratio is not None and not self.max_ratio >= 1:
            raise AttnError(f"--max-ratio must be at least 1, not {self.max_ratio}")

    @property
    def reasons(self) -> list[int]:
        """The reasons of the filters that are on, in the order they run."""
        on = {RATIO: self.max_ratio is not None, CONTROL: self.drop_control,
              COPY: self.drop_copies, DIGITS: self.drop_digit_mismatch,
              LANGID: self.langid is not None, DUPLICATE: self.dedup}
        return [reason for reason, active in on.items() if active]

    def describe(self) -> str:
        """The filters as the data file's metadata records them: `ratio=3,control,duplicate`."""
        names = []
        for reason in self.reasons:
            value = {RATIO: f"={self.max_ratio:g}" if self.max_ratio else "",
                     LANGID: "=" + "-".join(self.langid or ())}.get(reason, "")
            names.append(REASONS[reason] + value)
        return ",".join(names)


def clean_options(clean: bool = False, max_ratio: float | None = None, dedup: bool = False,
                  drop_copies: bool = False, drop_control: bool = False,
                  drop_digit_mismatch: bool = False, langid: bool = False,
                  langs: tuple[str, str] | None = None) -> CleanOptions | None:
    """binarize's options as CleanOptions (`clean`: every filter but --langid), None for none."""
    if langid and langs is None:
        raise AttnError("--langid needs the expected languages: --langs SRC-TGT (e.g. en-de)")
    if clean and max_ratio is None:
        max_ratio = CLEAN_RATIO
    options = CleanOptions(max_ratio=max_ratio, drop_control=drop_control or clean,
                           drop_copies=drop_copies or clean,
                           drop_digit_mismatch=drop_digit_mismatch or clean,
                           langid=langs if langid else None, dedup=dedup or clean)
    return options if options.reasons else None


class Cleaner:
    """The filters of `options` over a corpus, a chunk at a time (`judge`); `counts` holds what
    each dropped, by name."""

    def __init__(self, options: CleanOptions, expected_pairs: int | None = None):
        self.options = options
        self.counts = {REASONS[reason]: 0 for reason in options.reasons}
        self.languages = LanguageCheck(options.langid) if options.langid else None
        self.seen = PairSet(expected_pairs) if options.dedup else None

    def judge(self, reasons: np.ndarray, texts: dict[str, list[str]],
              encoded: dict[str, tuple]) -> None:
        """Set the reason of each pair of a chunk still kept (`reasons` 0) that a filter drops.
        `encoded[side]`: (flat ids, lengths) of the chunk's lines."""
        lengths = {side: encoded[side][1] for side in SIDES}
        if self.options.max_ratio is not None:
            longer = np.maximum(lengths["src"], lengths["tgt"])
            shorter = np.minimum(lengths["src"], lengths["tgt"])
            self._drop(reasons, RATIO, np.flatnonzero(
                (reasons == 0) & (longer > self.options.max_ratio * shorter)))
        sources, targets = texts["src"], texts["tgt"]
        printable = None  # str.isprintable of each line, which two filters use
        if self.options.drop_control or self.options.drop_copies:
            printable = (_printable(sources), _printable(targets))
        checks = ((CONTROL, self.options.drop_control and has_control),
                  (COPY, self.options.drop_copies and is_copy),
                  (DIGITS, self.options.drop_digit_mismatch and digits_differ))
        for reason, check in checks:  # on every pair: cheaper than picking the kept ones
            if check:  # a block of lines at a time: the temporaries stay small
                faulty = np.concatenate([
                    check(sources[first:last], targets[first:last],
                          printable and (printable[0][first:last], printable[1][first:last]))
                    for first, last in _blocks(len(sources), TEXT_BLOCK)]
                    or [np.zeros(0, dtype=bool)])
                self._drop(reasons, reason, np.flatnonzero((reasons == 0) & faulty))
        if self.languages is not None:  # the costly one: only the pairs still kept
            kept = np.flatnonzero(reasons == 0)
            wrong = self.languages.wrong([sources[i] for i in kept], [targets[i] for i in kept])
            self._drop(reasons, LANGID, kept[np.asarray(wrong, dtype=bool)])
        if self.seen is not None:
            kept = np.flatnonzero(reasons == 0)
            hashes = pair_hashes(texts, encoded)[kept]
            self._drop(reasons, DUPLICATE, kept[~self.seen.add(hashes)])

    def _drop(self, reasons: np.ndarray, reason: int, where: np.ndarray) -> None:
        """The pairs at indices `where` dropped for `reason`."""
        reasons[where] = reason
        self.counts[REASONS[reason]] += len(where)


# ------------------------------------------------------------------------------- text filters

TEXT_BLOCK = 2048  # lines a text filter looks at at once
# Cc (TAB aside), Cf (ZWNJ, ZWJ aside), Co, Cn; Cs cannot come out of UTF-8 decoding.
CONTROL_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cn"})
CONTROL_ALLOWED = frozenset("\t\u200c\u200d")

# The text filters look at a chunk's lines all at once where they can: a Python step per line
# costs about a microsecond, and all the filters but --langid may add no more than 30% to
# binarize's time, some 3 µs a pair of one core's time, where SentencePiece encodes on all of
# them (benchmarks/binarize_clean.py). Each returns a bool per pair.


def _printable(lines: list[str]) -> np.ndarray:
    return np.fromiter(map(str.isprintable, lines), dtype=bool, count=len(lines))


def has_control(sources: list[str], targets: list[str],
                printable: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Whether either side holds a character `--drop-control` drops. str.isprintable is false for
    each of them (and for other spaces than " "), so only the rare lines it fails are looked at
    character by character. `printable`: that of each line of each side, if known."""
    faulty = np.zeros(len(sources), dtype=bool)
    for lines, fine in zip((sources, targets), printable or map(_printable, (sources, targets))):
        for index in np.flatnonzero(~fine).tolist():
            faulty[index] |= any(unicodedata.category(char) in CONTROL_CATEGORIES
                                 for char in set(lines[index]) - CONTROL_ALLOWED)
    return faulty


def is_copy(sources: list[str], targets: list[str],
            printable: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Whether the target repeats the source, whitespace and case aside (their casefolded words
    are the same). Only the pairs whose casefolded sides have as many characters besides spaces
    are split into words, and those with a side not printable (which may hold other spaces)."""
    count = len(sources)
    folded = [list(map(str.casefold, lines)) for lines in (sources, targets)]
    spaces = operator.methodcaller("count", " ")
    sizes = [np.fromiter(map(len, lines), dtype=np.int64, count=count)
             - np.fromiter(map(spaces, lines), dtype=np.int64, count=count) for lines in folded]
    printable = printable or (_printable(sources), _printable(targets))
    copies = np.zeros(count, dtype=bool)
    maybe = (sizes[0] == sizes[1]) | ~printable[0] | ~printable[1]
    for index in np.flatnonzero(maybe).tolist():
        copies[index] = folded[0][index].split() == folded[1][index].split()
    return copies


DIGIT_RUN = re.compile(r"\d+")  # any script's decimal digits (Unicode category Nd)
# Bytes to themselves if ASCII digits or the line break, else to a space
DIGITS_AND_BREAKS = bytes(byte if byte in b"0123456789\n" else 32 for byte in range(256))
FIRST_OTHER_DIGIT = 0xD9  # UTF-8's first byte of U+0640-067F; the first digit not ASCII: U+0660


def digits_differ(sources: list[str], targets: list[str],
                  printable: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Whether the multisets of digit sequences of the two sides differ. The digit runs of a
    chunk's lines are read from its UTF-8 bytes, all lines at once, in order: that sees every
    digit of a line whose characters are all below U+0640 (where the first digits not ASCII's
    are); the other lines, and those whose runs differ at first sight (in another order, say),
    go through a regular expression."""
    if not sources:
        return np.zeros(0, dtype=bool)
    runs, plain = [], np.ones(len(sources), dtype=bool)
    for lines in (sources, targets):
        data = "\n".join(lines).encode("utf-8")
        tokens = data.translate(DIGITS_AND_BREAKS).replace(b"\n", b" | ").split()
        runs.append(b" ".join(tokens).split(b"|"))  # a line's runs, one space apart
        array = np.frombuffer(data, dtype=np.uint8)
        plain[np.searchsorted(np.flatnonzero(array == 10), np.flatnonzero(
            array >= FIRST_OTHER_DIGIT))] = False  # (the line of each such byte)
    differ = np.fromiter(map(operator.ne, *runs), dtype=bool, count=len(sources)) | ~plain
    for index in np.flatnonzero(differ).tolist():
        differ[index] = _digits_differ(sources[index], targets[index])
    return differ


def _digits_differ(source: str, target: str) -> bool:
    return _digit_values(DIGIT_RUN.findall(source)) != _digit_values(DIGIT_RUN.findall(target))


def _digit_values(runs: list[str]) -> list[str]:
    """The runs in ASCII digits (leading zeros kept), sorted: ٣ and 3 are one number."""
    return sorted(run if run.isascii() else str(int(run)).zfill(len(run)) for run in runs)


# ---------------------------------------------------------------------------------- languages


class LanguageCheck:
    """`--langid`: py3langid over all its languages; a side is wrong when the language it finds
    is not the expected one. Not narrowed to the pair (as serve's detection is, which chooses
    between the languages it serves): narrowed, it runs 1.7x faster, but a third language can
    only be called one of the two, and on Multi30k it let through 18% of French and 56% of Czech
    sentences where German was expected (and 82% of French where English was). Over all its
    languages it calls 99.9% of Multi30k's English and all its German right, and none of its
    French or Czech German (benchmarks/binarize_clean.py), at some 33,000 sentences/s on a
    core (two a pair; only the pairs the other filters kept are looked at)."""

    def __init__(self, langs: tuple[str, str]):
        try:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
        except ImportError:
            raise AttnError(f"--langid needs py3langid: {LANGID_EXTRA}") from None
        self.identifier = LanguageIdentifier.from_model_file(MODEL_FILE)
        known = set(self.identifier.labels)
        unknown = [code for code in langs if code not in known]
        if unknown:
            raise AttnError(f"--langid: py3langid does not know {', '.join(unknown)} (--langs "
                            f"{'-'.join(langs)}); it knows {', '.join(sorted(known))}")
        self.langs = langs

    def wrong(self, sources: list[str], targets: list[str]) -> list[bool]:
        classify = self.identifier.classify
        expected_source, expected_target = self.langs
        return [(_has_letters(source) and classify(source)[0] != expected_source)
                or (_has_letters(target) and classify(target)[0] != expected_target)
                for source, target in zip(sources, targets)]


def _has_letters(text: str) -> bool:
    return any(map(str.isalpha, text))


# ------------------------------------------------------------------------------------- dedup

_MIX_1, _MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SALTS = {"src": np.uint64(0x9E3779B97F4A7C15), "tgt": np.uint64(0xD1B54A32D192ED03)}


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 `values`, in place (wrapping): a cheap, well-spread
    hash. In place because a chunk's ids are a few MB and every temporary counts toward the
    peak memory binarize keeps bounded."""
    values ^= values >> np.uint64(30)
    values *= _MIX_1
    values ^= values >> np.uint64(27)
    values *= _MIX_2
    values ^= values >> np.uint64(31)
    return values


def line_hashes(flat_ids: np.ndarray, lengths: np.ndarray, side: str) -> np.ndarray:
    """A 64-bit hash of each line's ids: the sum of a hash of each (id, position), by prefix
    sums, so that a whole chunk is a few vector operations."""
    ends = np.cumsum(lengths)
    keys = np.arange(len(flat_ids), dtype=np.uint64)  # (position in the line) | id << 32
    keys -= np.repeat((ends - lengths).astype(np.uint64), lengths)
    keys |= flat_ids.astype(np.uint64) << np.uint64(32)
    keys ^= _SALTS[side]
    if not len(keys):
        return np.zeros(len(lengths), dtype=np.uint64)
    sums = np.cumsum(_mix(keys), out=keys)

    def through(end: np.ndarray) -> np.ndarray:  # sums[end - 1], 0 before the first id
        return np.where(end > 0, sums[np.maximum(end - 1, 0)], np.uint64(0))

    return through(ends) - through(ends - lengths)


HASH_BLOCK = 1024  # lines


def _blocks(count: int, size: int) -> list[tuple[int, int]]:
    return [(first, min(first + size, count)) for first in range(0, count, size)]


def pair_hashes(texts: dict[str, list[str]], encoded: dict[str, tuple]) -> np.ndarray:
    """A 64-bit hash of each pair of a chunk: of both sides' ids, and where a side holds the
    unknown piece, of its text too (whitespace runs made one space)."""
    sides = []
    for side in SIDES:
        flat_ids, lengths = encoded[side][:2]
        ends = np.cumsum(lengths)
        hashes = np.concatenate([  # a block of lines at a time: the temporaries stay small
            line_hashes(flat_ids[ends[first] - lengths[first]:ends[last - 1]],
                        lengths[first:last], side)
            for first, last in _blocks(len(lengths), HASH_BLOCK)]) if len(lengths) else \
            np.zeros(0, dtype=np.uint64)
        unknown = np.flatnonzero(flat_ids == UNK_ID)
        for line in np.unique(np.searchsorted(ends, unknown, side="right")):
            text = " ".join(texts[side][line].split()).encode("utf-8")
            hashes[line] ^= np.uint64(int.from_bytes(
                hashlib.blake2b(text, digest_size=8).digest(), "little"))
        sides.append(hashes)
    return _mix(sides[0] + _mix(sides[1] ^ _SALTS["tgt"]))


class PairSet:
    """The pairs seen so far, as 32-bit fingerprints in open-addressing tables (linear probing;
    0 marks an empty slot). A pair's 64-bit hash gives its home slot (its low 32 bits, modulo
    the table's size) and its fingerprint (its high 32 bits); a pair is taken for one seen
    before when a slot it probes, from its home to the first empty one, holds its fingerprint:
    falsely, once in 2^32 slots compared, a few slots a pair (some 0.005 false duplicates
    expected in 4.5M pairs). Where the number of pairs is known, one table of `expected` / LOAD
    slots, 4 bytes each; otherwise tables added as they fill, each twice the last, all looked
    up (a fingerprint cannot move to a larger table: its home slot is not stored)."""

    LOAD = 0.8  # the most a table is filled (0.7 is no faster: 0.2 µs a pair either way)
    UNSIZED = 1 << 20  # slots of the first table, when the number of pairs is not known

    def __init__(self, expected: int | None = None):
        size = int(expected / self.LOAD) + 1 if expected else self.UNSIZED
        self.tables = [np.zeros(max(size, 1 << 10), dtype=np.uint32)]
        self.filled = 0  # of the last table

    @property
    def nbytes(self) -> int:
        return sum(table.nbytes for table in self.tables)

    def add(self, hashes: np.ndarray) -> np.ndarray:
        """Record each of `hashes` (uint64); True where it is new, neither seen before nor
        earlier in `hashes`."""
        unique, first = np.unique(hashes, return_index=True)
        fresh = np.ones(len(unique), dtype=bool)
        for table in self.tables[:-1]:
            fresh[fresh] = ~_probe(table, unique[fresh], insert=False)
        room = self.LOAD * len(self.tables[-1]) - self.filled
        if np.count_nonzero(fresh) > room:  # may not fit: first leave out what it holds
            fresh[fresh] = ~_probe(self.tables[-1], unique[fresh], insert=False)
            if np.count_nonzero(fresh) > room:
                self.tables.append(np.zeros(2 * len(self.tables[-1]), dtype=np.uint32))
                self.filled = 0
        inserted = ~_probe(self.tables[-1], unique[fresh], insert=True)
        self.filled += int(np.count_nonzero(inserted))
        fresh[fresh] = inserted
        new = np.zeros(len(hashes), dtype=bool)
        new[first[fresh]] = True
        return new


def _probe(table: np.ndarray, keys: np.ndarray, insert: bool) -> np.ndarray:
    """Which of `keys` (distinct uint64) `table` holds; with `insert`, the others are added. All
    keys probe at once, a slot a round: a key stops at its fingerprint (found) or at an empty
    slot (absent; inserting, the first key of the round to reach that slot takes it, and the
    others reaching it look at it again next round)."""
    size = np.uint64(len(table))
    fingerprints = (keys >> np.uint64(32)).astype(np.uint32)
    fingerprints[fingerprints == 0] = 1
    slots = (keys & np.uint64(0xFFFFFFFF)) % size
    found = np.zeros(len(keys), dtype=bool)
    pending = np.arange(len(keys))
    while len(pending):
        here = table[slots]
        wanted = fingerprints[pending]
        match = here == wanted
        empty = here == 0
        found[pending[match]] = True
        done = match | empty
        if insert:
            claims = np.flatnonzero(empty)
            _, first = np.unique(slots[claims], return_index=True)
            winners = claims[first]
            table[slots[winners]] = wanted[winners]
            done = match.copy()
            done[winners] = True
        move = ~(match | empty)
        slots[move] += np.uint64(1)
        slots[slots == size] = 0
        pending, slots = pending[~done], slots[~done]
    return found


def count_lines(path) -> int | None:
    """Lines in a regular file (a fast pass over its bytes), None for stdin or a pipe, which
    cannot be read twice."""
    if str(path) == STDIO:
        return None
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        count = 0
        with open(path, "rb") as handle:
            while block := handle.read(1 << 20):
                count += block.count(b"\n")
        return count + 1
    except OSError:
        return None


# --------------------------------------------------------------------------------- --dropped


class DroppedWriter:
    """`--dropped FILE`: a line per dropped pair, `reason<TAB>line<TAB>source<TAB>target` (a TAB
    inside a sentence written as a space, so that every line has four fields)."""

    def __init__(self, handle):
        self.handle = handle

    def write(self, reasons: np.ndarray, texts: dict[str, list[str]], first_line: int) -> None:
        write = self.handle.write
        for index in np.flatnonzero(reasons).tolist():
            source, target = (texts[side][index].replace("\t", " ") for side in SIDES)
            write(f"{REASONS[reasons[index]]}\t{first_line + index}\t{source}\t{target}\n")


@contextlib.contextmanager
def dropped_output(path) -> Iterator[DroppedWriter | None]:
    """A DroppedWriter to `path` (atomic: the whole file when binarize succeeds, none
    otherwise; `-`: stdout), or None for no path."""
    if path is None:
        yield None
    elif str(path) == STDIO:
        yield DroppedWriter(sys.stdout)
        sys.stdout.flush()
    else:
        if os.path.isdir(path):
            raise AttnError(f"--dropped {display_name(path)} is a directory, not a file")
        with atomic_output(path, "w") as handle:
            yield DroppedWriter(handle)
