"""Trees for `attn parse`: reading, clean-up, linearization, repair, EVALB (on trees of our own)."""

from __future__ import annotations

import random

import pytest

from attn_cli.files import AttnError
from attn_cli.trees import (
    PLACEHOLDER,
    clean,
    delinearize,
    evalb_sentence,
    linearize,
    merge_unary_repeats,
    normalize_tags,
    read_trees,
)

from .conftest import assert_clean_error, run_attn

# Our own trees, in the treebank's style: outer empty brackets, several lines per tree, traces,
# nested empty elements, function tags and indices, -LRB-/-RRB-.
TREEBANK = """\
( (S
    (NP-SBJ-1 (DT The) (NN cat) )
    (VP (VBD sat)
      (PP-LOC (IN on) (NP (DT the) (NN mat) ))
      (S (NP-SBJ (-NONE- *-1) ) (VP (TO to) (VP (VB rest) ))))
    (. .) ))
( (S
    (NP-SBJ (NNP Alice) (-LRB- -LRB-) (NNP Al) (-RRB- -RRB-) )
    (VP (VBZ says)
      (SBAR (-NONE- 0)
        (S (NP-SBJ (-NONE- *T*-2) ) (VP (-NONE- *?*) ))))
    (, ,)
    (ADVP|PRT (RB up) )
    (. .) ))
"""

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


def evalb(gold: str, test: str):
    return evalb_sentence(next(read_trees(gold)), next(read_trees(test)))


def test_evalb_hand_worked_example():
    """Gold has S(0,4), NP(0,2), VP(2,4), NP(3,4)... over 'the cat ate fish' + '.' (ignored).
    The test tree gets NP(0,2) and S right, VP wrong (2,3), NP(3,4) right, and adds an ADJP."""
    gold = "(S (NP (DT the) (NN cat)) (VP (VBD ate) (NP (NN fish))) (. .))"
    test = "(S (NP (XX the) (XX cat)) (VP (XX ate)) (NP (ADJP (XX fish))) (XX .))"
    counts = evalb(gold, test)
    assert (counts.matched, counts.gold, counts.test) == (3, 4, 5)
    assert counts.precision == pytest.approx(60.0)
    assert counts.recall == pytest.approx(75.0)
    assert counts.f1 == pytest.approx(2 * 60 * 75 / 135)
    assert counts.exact == 0


def test_evalb_ignores_punctuation_root_and_tags_and_equates_advp_prt():
    gold = "(TOP (S (NP (PRP He)) (, ,) (VP (VBD gave) (PRT (RP up))) (. .)))"
    test = "(TOP (S (NP (XX He)) (XX ,) (VP (XX gave) (ADVP (XX up)) (XX .))))"
    counts = evalb(gold, test)  # VP spans (1,3) in both once '.' and ',' are gone
    assert (counts.matched, counts.gold, counts.test, counts.exact) == (4, 4, 4, 1)


def test_evalb_words_must_match():
    with pytest.raises(AttnError, match="words differ"):
        evalb("(S (NN a) (NN b))", "(S (XX a))")


def test_linearize_command_and_tree_scoring(tmp_path):
    treebank = tmp_path / "tiny.mrg"
    treebank.write_text(TREEBANK, encoding="utf-8")
    result = run_attn("parse", "linearize", treebank, "-o", tmp_path / "pairs")
    assert result.returncode == 0, result.stderr
    src = (tmp_path / "pairs.src").read_text(encoding="utf-8").splitlines()
    tgt = (tmp_path / "pairs.tgt").read_text(encoding="utf-8").splitlines()
    assert src[0] == "The cat sat on the mat to rest ." and len(tgt) == 2
    symbols = (tmp_path / "pairs.symbols").read_text(encoding="utf-8").split()
    assert {"(S", ")S", "(NP", ")NP", "(ADVP", "XX"} <= set(symbols)
    # A vocabulary told about the symbols keeps every bracket token whole.
    vocab = run_attn("vocab", tmp_path / "pairs.src", tmp_path / "pairs.tgt", "-o",
                     tmp_path / "v.model", "--size", "60", "--symbols", tmp_path / "pairs.symbols")
    assert vocab.returncode == 0, vocab.stderr
    from attn_cli.vocab import Vocabulary

    pieces = Vocabulary.from_file(tmp_path / "v.model").processor.encode(tgt[0], out_type=str)
    assert len(pieces) == len(tgt[0].split())
    perfect = "\n".join(str(normalize_tags(clean(t))) for t in read_trees(TREEBANK)) + "\n"
    scored = run_attn("score", "--trees", "--ref", treebank, stdin=perfect)
    assert scored.returncode == 0, scored.stderr
    assert "F1 100.00" in scored.stdout and "EX 100.00" in scored.stdout
    flat = ("(TOP (S (XX The) (XX cat) (XX sat) (XX on) (XX the) (XX mat) (XX to) (XX rest) "
            "(XX .)))\n")
    one = run_attn("score", "--trees", "--ref", treebank, stdin=flat + perfect.splitlines()[1]
                   + "\n", )
    assert one.returncode == 0 and "F1 100.00" not in one.stdout
    assert_clean_error(run_attn("score", "--trees", "--ref", treebank, stdin=flat),
                       "tree counts differ")


def test_parse_without_model_is_a_clean_error():
    assert_clean_error(run_attn("parse", stdin="a b\n"), "-m")
