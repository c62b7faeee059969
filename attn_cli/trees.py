"""Constituency trees for `attn parse` (§6.3): reading the Penn Treebank, the clean-up every
parsing paper applies, the linearization the sequence-to-sequence setup of Vinyals & Kaiser et
al. (2015) uses, the repair that turns any model output into a well-formed tree, and EVALB.

Pure Python, no torch. A tree is `Tree(label, children)`; a child is a Tree or a word (str).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields

from .files import AttnError

PLACEHOLDER = "XX"  # every POS tag in linearized trees (EVALB does not score tags)
ROOT = "TOP"  # the outer bracket; Penn Treebank files leave it unlabelled
EQUIVALENT_LABELS = {"PRT": "ADVP"}  # COLLINS.prm's EQ_LABEL ADVP PRT
BRACKET_ESCAPES = {"(": "-LRB-", ")": "-RRB-"}
# Deepest nesting `delinearize` builds. Gold trees of the Penn Treebank sample nest at most ~30
# deep; an untrained parser can open hundreds of brackets in a row, and the tree functions
# here recurse once per level.
MAX_TREE_DEPTH = 100


@dataclass
class Tree:
    label: str
    children: list = field(default_factory=list)  # Tree or str (a word)

    @property
    def is_preterminal(self) -> bool:
        return len(self.children) == 1 and isinstance(self.children[0], str)

    def words(self) -> list[str]:
        out = []
        for child in self.children:
            out.extend([child] if isinstance(child, str) else child.words())
        return out

    def preterminals(self) -> list["Tree"]:
        if self.is_preterminal:
            return [self]
        return [p for child in self.children if isinstance(child, Tree)
                for p in child.preterminals()]

    def __str__(self) -> str:
        inner = " ".join(escape_word(c) if isinstance(c, str) else str(c) for c in self.children)
        return f"({self.label} {inner})" if inner else f"({self.label})"


def escape_word(word: str) -> str:
    return BRACKET_ESCAPES.get(word, word)


# ------------------------------------------------------------------------------------ reading

_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def read_trees(text: str, source: str = "<text>") -> Iterator[Tree]:
    """Every tree in a string of bracketed trees (one per line or spread over many lines, with or
    without the treebank's unlabelled outer bracket, which becomes TOP)."""
    tokens = _TOKEN.findall(text)
    position = 0

    def parse() -> Tree | str:
        nonlocal position
        token = tokens[position]
        if token == ")":
            raise AttnError(f"{source}: unbalanced ')' in a tree")
        if token != "(":
            position += 1
            return token
        position += 1
        label = ""
        if position < len(tokens) and tokens[position] not in ("(", ")"):
            label = tokens[position]
            position += 1
        children = []
        while True:
            if position >= len(tokens):
                raise AttnError(f"{source}: a tree is not closed (missing ')')")
            if tokens[position] == ")":
                position += 1
                return Tree(label or ROOT, children)
            children.append(parse())

    while position < len(tokens):
        tree = parse()
        if isinstance(tree, str):
            raise AttnError(f"{source}: text outside brackets: {tree!r}")
        if tree.label != ROOT:
            tree = Tree(ROOT, [tree])
        yield tree


def read_treebank(paths: Iterable[str]) -> Iterator[Tree]:
    from .files import check_readable

    for path in paths:
        try:
            text = check_readable(path, "treebank file").read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise AttnError(f"{path}: not UTF-8 text") from None
        yield from read_trees(text, str(path))


# ----------------------------------------------------------------------------------- clean-up


def base_label(label: str) -> str:
    """NP-SBJ-1 → NP, PP-LOC=2 → PP, ADVP|PRT → ADVP; -NONE-, -LRB- stay as they are."""
    if label.startswith("-") or label == ROOT:
        return label
    return re.split(r"[-=|]", label, maxsplit=1)[0] or label


def clean(tree: Tree) -> Tree | None:
    """Drop -NONE- elements and the constituents left empty, strip function tags and indices;
    words are kept as they are. None if nothing is left."""
    if tree.is_preterminal:
        return None if tree.label == "-NONE-" else Tree(base_label(tree.label),
                                                       list(tree.children))
    children = [c for c in (clean(child) for child in tree.children
                            if isinstance(child, Tree)) if c is not None]
    return Tree(base_label(tree.label), children) if children else None


def normalize_tags(tree: Tree) -> Tree:
    """The same tree with every POS tag replaced by the placeholder."""
    if tree.is_preterminal:
        return Tree(PLACEHOLDER, list(tree.children))
    return Tree(tree.label, [normalize_tags(c) for c in tree.children])


# ------------------------------------------------------------------------------ linearization


TERMINALS = ("placeholders", "words")


def linearize(tree: Tree, terminals: str = "placeholders") -> str:
    """Depth-first brackets with labelled closings, the root TOP left out. Terminals are
    placeholders, as in the paper's setup: (S (NP XX XX )NP (VP XX )VP XX )S; or, with
    terminals="words" (an option, not the paper's), the words themselves (brackets in them
    escaped): (S (NP The cat )NP (VP sat )VP . )S, which tells the decoder where it is in the
    sentence instead of leaving it to count placeholders."""
    if terminals not in TERMINALS:
        raise ValueError(f"terminals must be one of {TERMINALS}, not {terminals!r}")

    def walk(node: Tree) -> Iterator[str]:
        if node.is_preterminal:
            yield PLACEHOLDER if terminals == "placeholders" else terminal_word(node.children[0])
            return
        yield f"({node.label}"
        for child in node.children:
            yield from walk(child)
        yield f"){node.label}"

    top = tree.children if tree.label == ROOT else [tree]
    return " ".join(token for node in top for token in walk(node))


def terminal_word(word: str) -> str:
    """A word as a terminal of a linearized tree: never mistaken for a bracket."""
    return word.replace("(", "-LRB-").replace(")", "-RRB-")


def is_terminal(token: str) -> bool:
    """Anything but a bracket is a terminal of a linearized tree (a placeholder, a word, or
    whatever else a model emits where a word goes)."""
    return not token.startswith(("(", ")"))


def delinearize(sequence: str, words: list[str]) -> Tree:
    """A well-formed tree with exactly `words` as leaves, whatever `sequence` holds: each
    terminal token (placeholder or word) takes the next input word, unmatched closings and bare
    brackets are dropped, open brackets are closed, missing terminals are added at the end and
    surplus ones dropped, empty constituents removed; brackets nested deeper than
    MAX_TREE_DEPTH are dropped with their closings."""
    root = Tree(ROOT, [])
    stack = [root]
    used = 0
    too_deep = 0  # brackets opened past MAX_TREE_DEPTH and not yet closed: dropped
    for token in sequence.split():
        if is_terminal(token):
            if used < len(words):
                stack[-1].children.append(Tree(PLACEHOLDER, [words[used]]))
                used += 1
        elif token.startswith("(") and len(token) > 1:
            if len(stack) > MAX_TREE_DEPTH:
                too_deep += 1
                continue
            node = Tree(token[1:], [])
            stack[-1].children.append(node)
            stack.append(node)
        elif token.startswith(")") and too_deep:
            too_deep -= 1
        elif token.startswith(")") and len(stack) > 1:
            stack.pop()
    for word in words[used:]:  # the model stopped early: attach what is missing to the root
        root.children.append(Tree(PLACEHOLDER, [word]))
    pruned = _prune_empty(root) or Tree(ROOT, [])
    if not pruned.children:  # no words at all
        return Tree(ROOT, [])
    return pruned


def _prune_empty(tree: Tree) -> Tree | None:
    if tree.is_preterminal:
        return tree
    children = [c for c in (_prune_empty(child) for child in tree.children) if c is not None]
    return Tree(tree.label, children) if children else None


def merge_unary_repeats(tree: Tree) -> Tree:
    """(X (X ...)) → (X ...): a constituent whose only child is a constituent of the same label
    over the same words is one bracket. A parser that loses its place repeats such brackets (each
    a false positive for EVALB); cleaned gold trees almost never hold one (160 of 67,285
    constituents in the sample's training part)."""
    if tree.is_preterminal:
        return tree
    children = [merge_unary_repeats(c) if isinstance(c, Tree) else c for c in tree.children]
    while (len(children) == 1 and isinstance(children[0], Tree)
           and not children[0].is_preterminal and children[0].label == tree.label):
        children = children[0].children
    return Tree(tree.label, children)


# ------------------------------------------------------------------------------------- EVALB
#
# EVALB (Sekine & Collins, 1997) with COLLINS.prm, the parameter file parsing papers report
# with, rule for rule, on both trees alike:
# - terminals tagged with a DELETE_LABEL (-NONE-, the punctuation tags) are not words;
# - a bracket's label is cut at its first '-' or '=' (NP-SBJ-1 → NP, PP=2 → PP);
# - brackets labelled TOP, or over no remaining word, are not counted; ADVP equals PRT;
# - gold and test must have the same words, else the sentence is an "error sentence": reported,
#   not scored, and more than MAX_ERROR of them end the run; a test tree without words (an
#   empty line) is a "skip sentence", not scored either;
# - sentences of at most CUTOFF_LEN words, -NONE- not counted, are also scored apart.
# One addition: a test terminal tagged with the placeholder XX (what `attn parse` writes, as
# every tagless parser does) takes the gold tag of its position, which is what one does before
# giving such output to EVALB (else every sentence with punctuation is an error sentence).

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

