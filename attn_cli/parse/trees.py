"""Constituency trees for `attn parse` (§6.3): reading the Penn Treebank, the clean-up every
parsing paper applies, the linearization the sequence-to-sequence setup of Vinyals & Kaiser et
al. (2015) uses, and the repair that turns any model output into a well-formed tree (EVALB, which
scores trees, is evalb.py).

Pure Python, no torch. A tree is `Tree(label, children)`; a child is a Tree or a word (str).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ..errors import AttnError
from ..formats import TERMINALS

PLACEHOLDER = "XX"  # every POS tag in linearized trees (EVALB does not score tags)
ROOT = "TOP"  # the outer bracket; Penn Treebank files leave it unlabelled
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
    from ..files import check_readable

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
