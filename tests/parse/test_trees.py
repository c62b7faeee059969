"""Trees for `attn parse` (trees.py): reading, clean-up, linearization, repair, on trees of our
own."""

from __future__ import annotations

import random

import pytest

from attn_cli.errors import AttnError
from attn_cli.parse.evalb import evalb_sentence
from attn_cli.parse.trees import (
    MAX_TREE_DEPTH,
    PLACEHOLDER,
    Tree,
    clean,
    delinearize,
    linearize,
    merge_unary_repeats,
    normalize_tags,
    read_trees,
)

from ..toys import TREEBANK, toy_treebank

CLEANED = [
    "(TOP (S (NP (DT The) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat))) "
    "(S (VP (TO to) (VP (VB rest))))) (. .)))",
    "(TOP (S (NP (NNP Alice) (-LRB- -LRB-) (NNP Al) (-RRB- -RRB-)) (VP (VBZ says)) (, ,) "
    "(ADVP (RB up)) (. .)))",
]


def test_reader_and_cleanup_on_tricky_trees():
    trees = list(read_trees(TREEBANK))
    assert len(trees) == 2
    assert [str(clean(tree)) for tree in trees] == CLEANED
    # The words the treebank gives, traces removed: the gold tokens are kept as they are.
    assert clean(trees[1]).words() == ["Alice", "-LRB-", "Al", "-RRB-", "says", ",", "up", "."]


def test_reader_errors():
    with pytest.raises(AttnError, match="not closed"):
        list(read_trees("(S (NP (DT a)"))
    with pytest.raises(AttnError, match="unbalanced"):
        list(read_trees(")"))


def test_linearization_round_trip():
    for tree in read_trees(TREEBANK):
        cleaned = clean(tree)
        sequence = linearize(cleaned)
        assert "TOP" not in sequence and sequence.count(PLACEHOLDER) == len(cleaned.words())
        assert str(delinearize(sequence, cleaned.words())) == str(normalize_tags(cleaned))
    first = clean(next(read_trees(TREEBANK)))
    assert linearize(first) == ("(S (NP XX XX )NP (VP XX (PP XX (NP XX XX )NP )PP (S (VP XX "
                                "(VP XX )VP )VP )S )VP XX )S")


def test_word_terminals_round_trip_and_escape_brackets():
    for tree in read_trees(toy_treebank(50, seed=3)):
        sequence = linearize(tree, terminals="words")
        assert [t for t in sequence.split() if not t.startswith(("(", ")"))] == tree.words()
        assert str(delinearize(sequence, tree.words())) == str(
            delinearize(linearize(tree), tree.words()))
    odd = Tree("S", [Tree("NP", [Tree("NN", ["(a)"])]), Tree("VP", [Tree("VBZ", [")"])])])
    assert linearize(odd, terminals="words") == "(S (NP -LRB-a-RRB- )NP (VP -RRB- )VP )S"


def test_a_runaway_parser_output_still_gives_a_tree():
    """An untrained parser can open brackets until its length limit: the repair drops those
    nested past MAX_TREE_DEPTH (with their closings) instead of recursing past Python's limit,
    and the tree is still over exactly the words and scores."""
    words = ["the", "dog", "barks"]
    sequence = "(S " * 3000 + "(NP XX XX )NP " + ")S " * 2999 + "XX )S )S"
    tree = merge_unary_repeats(delinearize(sequence, words))
    assert tree.words() == words
    depth, node = 0, tree
    while not node.is_preterminal:
        node, depth = node.children[0], depth + 1
    assert depth <= MAX_TREE_DEPTH + 1
    assert str(tree).startswith("(TOP (S")
    gold = next(read_trees("(TOP (S (NP (DT the) (NN dog)) (VP (VBZ barks))))"))
    assert evalb_sentence(gold, tree).test > 0


@pytest.mark.parametrize("sequence,expected", [
    ("(S (NP XX XX )NP (VP XX )VP", "(TOP (S (NP (XX a) (XX b)) (VP (XX c))))"),  # unclosed
    (")S )NP (S XX XX XX )S )S", "(TOP (S (XX a) (XX b) (XX c)))"),  # stray closings
    ("(S XX )S", "(TOP (S (XX a)) (XX b) (XX c))"),  # too few placeholders
    ("(S XX XX XX XX XX )S", "(TOP (S (XX a) (XX b) (XX c)))"),  # too many
    ("(S (NP )NP XX (VP (PP )PP )VP XX XX )S", "(TOP (S (XX a) (XX b) (XX c)))"),  # empties
    ("", "(TOP (XX a) (XX b) (XX c))"),
    ("garbage tokens ( ) XX", "(TOP (XX a) (XX b) (XX c))"),
])
def test_repair(sequence, expected):
    assert str(delinearize(sequence, ["a", "b", "c"])) == expected


@pytest.mark.parametrize("tree,expected", [
    ("(TOP (S (NP (NP (NP (XX a)))) (VP (XX b))))", "(TOP (S (NP (XX a)) (VP (XX b))))"),
    ("(TOP (NP (NP (XX a) (XX b)) (PP (XX c))))", "(TOP (NP (NP (XX a) (XX b)) (PP (XX c))))"),
    ("(TOP (S (VP (VP (S (S (XX a) (XX b)))))))", "(TOP (S (VP (S (XX a) (XX b)))))"),
    ("(TOP (NP (XX a)))", "(TOP (NP (XX a)))"),
])
def test_merge_unary_repeats_keeps_one_bracket_per_label_and_span(tree, expected):
    assert str(merge_unary_repeats(next(read_trees(tree)))) == expected


def test_random_bracket_soup_always_gives_a_valid_tree():
    rng = random.Random(0)
    vocabulary = ["(S", "(NP", "(VP", ")S", ")NP", ")VP", ")", "(", "XX", "XX", "XX", "junk"]
    for _ in range(500):
        words = [f"w{i}" for i in range(rng.randint(1, 12))]
        words[0] = "(" if rng.random() < 0.2 else words[0]  # words that need escaping
        sequence = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(0, 40)))
        tree = delinearize(sequence, words)
        text = str(tree)
        reread = list(read_trees(text))
        assert len(reread) == 1 and text.count("(") == text.count(")")
        assert [w if w != "-LRB-" else "(" for w in reread[0].words()] == words
