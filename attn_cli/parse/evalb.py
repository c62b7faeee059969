"""EVALB (Sekine & Collins, 1997) with COLLINS.prm, the parameter file parsing papers report
with, rule for rule, on both trees alike: what `attn score --trees` and `attn train
--valid-metric f1` report.

- terminals tagged with a DELETE_LABEL (-NONE-, the punctuation tags) are not words;
- a bracket's label is cut at its first '-' or '=' (NP-SBJ-1 → NP, PP=2 → PP);
- brackets labelled TOP, or over no remaining word, are not counted; ADVP equals PRT;
- gold and test must have the same words, else the sentence is an "error sentence": reported,
  not scored, and more than MAX_ERROR of them end the run; a test tree without words (an
  empty line) is a "skip sentence", not scored either;
- sentences of at most CUTOFF_LEN words, -NONE- not counted, are also scored apart.
One addition: a test terminal tagged with the placeholder XX (what `attn parse` writes, as
every tagless parser does) takes the gold tag of its position, which is what one does before
giving such output to EVALB (else every sentence with punctuation is an error sentence).

Below the rules: the per-line driver over a gold treebank and a file of test trees, the
summaries (all, len<=40, and length buckets), and their text (EVALB's) and JSON reports.
Pure Python, no torch.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, fields

from ..errors import AttnError
from ..files import STRICT, Utf8Policy, display_name, read_raw_lines
from .trees import PLACEHOLDER, Tree, delinearize, merge_unary_repeats, read_treebank, read_trees

EQUIVALENT_LABELS = {"PRT": "ADVP"}  # EQ_LABEL ADVP PRT
DELETED_LABELS = frozenset({"TOP", "-NONE-", ",", ":", "``", "''", "."})  # DELETE_LABEL
NOT_COUNTED_FOR_LENGTH = frozenset({"-NONE-"})  # DELETE_LABEL_FOR_LENGTH
CUTOFF_LENGTH = 40  # CUTOFF_LEN
MAX_ERRORS = 10  # MAX_ERROR


def evalb_label(label: str) -> str:
    """EVALB's label of a bracket: cut at the first '-' or '=' (so NP-SBJ-1 → NP), then
    ADVP = PRT. Unlike `base_label`, '|' is kept (EVALB keeps ADVP|PRT whole)."""
    cut = re.split(r"[-=]", label, maxsplit=1)[0]
    return EQUIVALENT_LABELS.get(cut, cut)


class EvalbMismatch(Exception):
    """A test tree EVALB cannot compare with its gold tree: an error sentence."""


@dataclass
class EvalbTree:
    """What EVALB sees of a tree: its words, its counted brackets, its terminals' tags."""

    words: list[str]  # without the deleted terminals (traces, punctuation)
    brackets: Counter  # (label, start, end) over `words`, a multiset
    tags: list[str]  # of every terminal but -NONE- (punctuation included)

    @property
    def length(self) -> int:
        """Words for the length cut-off: every terminal but -NONE-."""
        return len(self.tags)


def evalb_tree(tree: Tree, gold_tags: list[str] | None = None) -> EvalbTree:
    """A tree as EVALB reads it. `gold_tags` (the gold tree's, -NONE- left out) stand in for the
    test tree's placeholder tags. Raises EvalbMismatch for a word outside a preterminal."""
    words: list[str] = []
    brackets: Counter = Counter()
    tags: list[str] = []

    def walk(node: Tree) -> None:
        if node.is_preterminal:
            tag = node.label
            if tag not in NOT_COUNTED_FOR_LENGTH:
                if tag == PLACEHOLDER and gold_tags is not None and len(tags) < len(gold_tags):
                    tag = gold_tags[len(tags)]
                tags.append(tag)
            if tag not in DELETED_LABELS:
                words.append(node.children[0])
            return
        start = len(words)
        for child in node.children:
            if isinstance(child, str):
                raise EvalbMismatch(f"the word {child!r} has no tag of its own")
            walk(child)
        label = evalb_label(node.label)
        if len(words) > start and label not in DELETED_LABELS:
            brackets[(label, start, len(words))] += 1

    walk(tree)
    return EvalbTree(words, brackets, tags)


@dataclass
class BracketCounts:
    """EVALB's totals over sentences; the bracket counts sum over the valid ones only."""

    matched: int = 0
    gold: int = 0
    test: int = 0
    sentences: int = 0  # all of them, error and skip sentences included
    exact: int = 0
    crossing: int = 0
    errors: int = 0
    skipped: int = 0

    def add(self, other: "BracketCounts") -> None:
        for name in (counted.name for counted in fields(self)):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def valid(self) -> int:
        return self.sentences - self.errors - self.skipped

    @property
    def precision(self) -> float:
        return 100.0 * self.matched / self.test if self.test else 0.0

    @property
    def recall(self) -> float:
        return 100.0 * self.matched / self.gold if self.gold else 0.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0

    @property
    def exact_match(self) -> float:
        """Complete match: the share of valid sentences whose brackets all match."""
        return 100.0 * self.exact / self.valid if self.valid else 0.0

    @property
    def average_crossing(self) -> float:
        return self.crossing / self.valid if self.valid else 0.0


def _crosses(a: tuple[str, int, int], b: tuple[str, int, int]) -> bool:
    (_, a_start, a_end), (_, b_start, b_end) = a, b
    return a_start < b_start < a_end < b_end or b_start < a_start < b_end < a_end


def evalb_sentence(gold: Tree | EvalbTree, test: Tree | None) -> BracketCounts:
    """One sentence's counts (`gold` as read, or already as EVALB sees it). A test tree with no
    words (or None: nothing on its line) is a skip sentence; EvalbMismatch says why it is an
    error sentence."""
    gold_view = gold if isinstance(gold, EvalbTree) else evalb_tree(gold)
    if test is None:
        return BracketCounts(sentences=1, skipped=1)
    test_view = evalb_tree(test, gold_view.tags)
    if not test_view.words:
        return BracketCounts(sentences=1, skipped=1)
    if len(test_view.words) != len(gold_view.words):
        raise EvalbMismatch(f"{len(test_view.words)} words against the gold tree's "
                            f"{len(gold_view.words)} (traces and punctuation not counted)")
    for position, (gold_word, test_word) in enumerate(zip(gold_view.words, test_view.words)):
        if gold_word != test_word:
            raise EvalbMismatch(f"word {position + 1} is {test_word!r}, the gold tree's is "
                                f"{gold_word!r}")
    matched = sum((gold_view.brackets & test_view.brackets).values())
    gold_count, test_count = sum(gold_view.brackets.values()), sum(test_view.brackets.values())
    # Crossing is counted over the test brackets (EVALB's, by Mike Collins): each test bracket
    # that crosses any gold bracket, once per occurrence.
    crossing = sum(count for bracket, count in test_view.brackets.items()
                   if any(_crosses(bracket, other) for other in gold_view.brackets))
    return BracketCounts(matched, gold_count, test_count, sentences=1,
                         exact=int(matched == gold_count == test_count), crossing=crossing)



@dataclass(frozen=True)
class TreeSentence:
    """One test line scored against its gold tree."""

    number: int  # the line, from 1
    counts: BracketCounts  # an error or skip sentence counts as such, with no brackets
    gold_length: int  # words for the length cut-off (traces not counted)
    error: str | None = None  # why it is an error sentence

    @property
    def status(self) -> str:
        return "error" if self.counts.errors else "skip" if self.counts.skipped else "valid"


def tree_scores(gold_path: str, test_path: str, max_errors: int = MAX_ERRORS,
                policy: Utf8Policy = STRICT, warn=None) -> Iterator[TreeSentence]:
    """EVALB (COLLINS.prm) over a gold treebank and one test tree per line, line by line (sum
    them with `tree_totals`). Error sentences are reported through `warn`; more than
    `max_errors` of them is an error (EVALB's MAX_ERROR, which EVALB itself checks against its
    count of error messages, stopping one sentence later)."""
    warn = warn or (lambda message: None)
    gold = list(read_treebank([gold_path]))
    raw_lines = read_raw_lines(test_path)
    name = display_name(test_path)
    if len(gold) != len(raw_lines):
        raise AttnError(f"tree counts differ: {display_name(gold_path)} has {len(gold)} trees, "
                        f"{name} has {len(raw_lines)} lines")
    skipped = 0
    error_lines: list[int] = []
    try:
        for number, (gold_tree, raw) in enumerate(zip(gold, raw_lines), start=1):
            line = policy.decode(raw, test_path, number)
            try:
                gold_view = evalb_tree(gold_tree)  # once per gold tree
            except EvalbMismatch as error:
                raise AttnError(f"{display_name(gold_path)}: tree {number}: {error}") from None
            counts, reason = score_tree_line(gold_view, line, f"{name}:{number}")
            if reason is not None:
                error_lines.append(number)
                if len(error_lines) > max_errors:
                    raise AttnError(f"{name}:{number}: {reason}; that is {len(error_lines)} "
                                    f"error sentences, more than --max-errors {max_errors}"
                                    ) from None
                warn(f"score: {name}:{number}: error sentence, not scored: {reason}")
            skipped += counts.skipped
            yield TreeSentence(number, counts, gold_view.length, reason)
    finally:
        policy.finish()
    if error_lines or skipped:
        warn(f"score: {len(error_lines)} error and {skipped} skip sentence(s) not scored (as "
             f"EVALB counts them){': errors at lines ' if error_lines else ''}"
             f"{', '.join(map(str, error_lines))}")


def tree_totals(sentences: list[TreeSentence],
                length_edges: tuple[int, ...] = ()) -> dict[str, BracketCounts]:
    """EVALB's two summaries: every sentence, and those of at most 40 words; then, for
    `length_edges` (10, 20, 40, say), one per length bucket: len1-10, len11-20, len21-40 and
    len>40 (gold words, traces not counted, as EVALB's cut-off counts them)."""
    totals = {"all": BracketCounts(), f"len<={CUTOFF_LENGTH}": BracketCounts()}
    buckets = length_buckets(length_edges)
    totals.update((label, BracketCounts()) for label, _, _ in buckets)
    for sentence in sentences:
        totals["all"].add(sentence.counts)
        if sentence.gold_length <= CUTOFF_LENGTH:
            totals[f"len<={CUTOFF_LENGTH}"].add(sentence.counts)
        for label, low, high in buckets:
            if low <= sentence.gold_length <= high:
                totals[label].add(sentence.counts)
    return totals


def length_buckets(edges: tuple[int, ...]) -> list[tuple[str, int, float]]:
    """(label, fewest words, most words) of the buckets that `edges` (ascending upper bounds)
    cut sentence lengths into, the last one open: (10, 20) → len1-10, len11-20, len>20."""
    if not edges:
        return []
    if any(edge < 1 for edge in edges) or list(edges) != sorted(set(edges)):
        raise AttnError(f"length buckets need ascending positive edges, not "
                        f"{','.join(map(str, edges))}")
    buckets, low = [], 0
    for edge in edges:
        buckets.append((f"len{low + 1}-{edge}", low + 1, edge))
        low = edge
    buckets.append((f"len>{low}", low + 1, math.inf))
    return buckets


def score_tree_line(gold, line: str, where: str):
    """(counts, None) for one test line against its gold tree (a Tree or its EvalbTree), or (an
    error sentence's counts, why) when the line is not one tree over the gold's words."""
    try:
        trees = list(read_trees(line, where))
        if len(trees) > 1:
            raise EvalbMismatch(f"{len(trees)} trees on one line")
        return evalb_sentence(gold, trees[0] if trees else None), None
    except (AttnError, EvalbMismatch) as error:
        return BracketCounts(sentences=1, errors=1), str(error).removeprefix(f"{where}: ")


# -------------------------------------------------------------------------------- reports


def tree_summary_line(label: str, counts: BracketCounts) -> str:
    return (f"EVALB|COLLINS.prm|{label}|sentences:{counts.sentences}|valid:{counts.valid}"
            f"|errors:{counts.errors}|skipped:{counts.skipped} = F1 {counts.f1:.2f} "
            f"P {counts.precision:.2f} R {counts.recall:.2f} "
            f"EX {counts.exact_match:.2f} CB {counts.average_crossing:.2f}")


def tree_sentence_line(sentence: TreeSentence) -> str:
    counts = sentence.counts
    if counts.valid:
        return f"{counts.precision:.2f}\t{counts.recall:.2f}\t{counts.f1:.2f}"
    return "nan\tnan\tnan"


def tree_counts_json(counts: BracketCounts) -> dict:
    return {"sentences": counts.sentences, "valid": counts.valid, "errors": counts.errors,
            "skipped": counts.skipped, "f1": round(counts.f1, 4),
            "precision": round(counts.precision, 4), "recall": round(counts.recall, 4),
            "exact_match": round(counts.exact_match, 4),
            "average_crossing": round(counts.average_crossing, 4), "matched": counts.matched,
            "gold_brackets": counts.gold, "test_brackets": counts.test}


def tree_sentence_json(sentence: TreeSentence) -> dict:
    valid = sentence.counts.valid > 0
    return {"line": sentence.number, "status": sentence.status,
            **{key: (round(getattr(sentence.counts, key), 4) if valid else None)
               for key in ("precision", "recall", "f1")},
            **({"error": sentence.error} if sentence.error else {})}


def trees_f1(sequences: list[str], words: list[list[str]], gold: list) -> float:
    """EVALB's labelled-bracket F1 over linearized trees (repaired into trees over the words,
    as `attn parse` does) against gold trees."""
    total = BracketCounts()
    for sequence, sentence, gold_tree in zip(sequences, words, gold):
        total.add(evalb_sentence(gold_tree, merge_unary_repeats(delinearize(sequence, sentence))))
    return total.f1


def report_lines(gold_path: str, test_path: str, sentence_level: bool = False,
                 max_errors: int = MAX_ERRORS, policy: Utf8Policy = STRICT, warn=None,
                 as_json: bool = False, length_edges: tuple[int, ...] = ()) -> Iterator[str]:
    """`attn score --trees`'s output, line by line as the test lines are scored: one line per
    test line (`sentence_level`), else the summaries (`tree_totals`), as EVALB's text or JSON."""
    sentences = []
    for sentence in tree_scores(gold_path, test_path, max_errors, policy, warn):
        sentences.append(sentence)
        if sentence_level:
            yield (_json_line(tree_sentence_json(sentence)) if as_json
                   else tree_sentence_line(sentence))
    if not sentence_level:
        totals = tree_totals(sentences, length_edges)
        if as_json:
            yield _json_line({label: tree_counts_json(counts) for label, counts in totals.items()})
        else:
            yield from (tree_summary_line(label, counts) for label, counts in totals.items())


def parse_length_edges(text: str | None) -> tuple[int, ...]:
    """--by-length 10,20,40 as (10, 20, 40), checked."""
    if text is None:
        return ()
    try:
        edges = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise AttnError(f"--by-length takes word counts such as 10,20,40, not {text!r}") from None
    length_buckets(edges)
    return edges


def _json_line(value) -> str:
    return json.dumps(value, ensure_ascii=False)
