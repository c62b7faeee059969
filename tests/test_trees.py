"""Trees for `attn parse`: reading, clean-up, linearization, repair, EVALB (on trees of our own)."""

from __future__ import annotations

import random

import pytest

from attn_cli.errors import AttnError
from attn_cli.evalb import BracketCounts, EvalbMismatch, evalb_label, evalb_sentence
from attn_cli.trees import (
    PLACEHOLDER,
    Tree,
    clean,
    delinearize,
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


def test_a_runaway_parser_output_still_gives_a_tree():
    """An untrained parser can open brackets until its length limit: the repair drops those
    nested past MAX_TREE_DEPTH (with their closings) instead of recursing past Python's limit,
    and the tree is still over exactly the words and scores."""
    from attn_cli.trees import MAX_TREE_DEPTH

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


def evalb(gold: str, test: str) -> BracketCounts:
    return evalb_sentence(next(read_trees(gold)), next(read_trees(test)))


def test_evalb_hand_worked_example():
    """Gold has S(0,4), NP(0,2), VP(2,4), NP(3,4) over 'the cat ate fish' ('.' is not counted).
    The test tree gets NP(0,2) and S right, VP wrong (2,3), NP(3,4) right, and adds an ADJP."""
    gold = "(S (NP (DT the) (NN cat)) (VP (VBD ate) (NP (NN fish))) (. .))"
    test = "(S (NP (XX the) (XX cat)) (VP (XX ate)) (NP (ADJP (XX fish))) (XX .))"
    counts = evalb(gold, test)
    assert (counts.matched, counts.gold, counts.test) == (3, 4, 5)
    assert counts.precision == pytest.approx(60.0)
    assert counts.recall == pytest.approx(75.0)
    assert counts.f1 == pytest.approx(2 * 60 * 75 / 135)
    assert counts.exact == 0
    # VP(2,3) crosses no gold bracket (it sits inside VP(2,4)): no crossing.
    assert counts.crossing == 0


def test_evalb_ignores_punctuation_root_and_tags_and_equates_advp_prt():
    gold = "(TOP (S (NP (PRP He)) (, ,) (VP (VBD gave) (PRT (RP up))) (. .)))"
    test = "(TOP (S (NP (XX He)) (XX ,) (VP (XX gave) (ADVP (XX up)) (XX .))))"
    counts = evalb(gold, test)  # VP spans (1,3) in both once '.' and ',' are gone
    assert (counts.matched, counts.gold, counts.test, counts.exact) == (4, 4, 4, 1)


def test_evalb_strips_function_tags_and_indices_on_both_sides():
    """COLLINS.prm cuts every label at its first '-' or '=', in the gold and the test tree."""
    gold = "(TOP (S (NP-SBJ-1 (DT the) (NN cat)) (VP (VBD sat) (PP-LOC (IN on) (NP (NN mats))))))"
    test = ("(TOP (S (NP-SBJ (XX the) (XX cat)) (VP=2 (XX sat) (PP-DIR-3 (XX on) "
            "(NP (XX mats))))))")
    counts = evalb(gold, test)
    assert (counts.matched, counts.gold, counts.test, counts.exact) == (5, 5, 5, 1)
    assert evalb_label("NP-SBJ-1") == "NP" and evalb_label("PP=2") == "PP"
    # ... and nothing else: '|' is not a separator for EVALB (ADVP|PRT stays whole).
    assert evalb_label("ADVP|PRT") == "ADVP|PRT" and evalb_label("PRT") == "ADVP"


def test_evalb_removes_traces_and_what_covers_only_traces_in_the_test_tree_too():
    gold = "(TOP (S (NP-SBJ (-NONE- *-1)) (NP (DT the) (NN cat)) (VP (VBD sat))))"
    test = ("(TOP (S (NP (-NONE- *T*)) (NP (XX the) (XX cat)) (VP (XX sat) "
            "(SBAR (-NONE- 0) (S (-NONE- *))))))")
    counts = evalb(gold, test)  # S(0,3), NP(0,2), VP(2,3) on each side; empty ones dropped
    assert (counts.matched, counts.gold, counts.test) == (3, 3, 3)


def test_evalb_counts_each_crossing_test_bracket_once():
    """Y(1,3) crosses both NP(0,2) and VP(2,4): one crossing bracket; X(0,1) crosses none."""
    gold = "(TOP (S (NP (DT a) (NN b)) (VP (VB c) (NN d))))"
    test = "(TOP (S (X (XX a)) (Y (XX b) (XX c)) (Z (XX d))))"
    counts = evalb(gold, test)
    assert (counts.matched, counts.gold, counts.test, counts.crossing) == (1, 3, 4, 1)


def test_evalb_error_and_skip_sentences():
    with pytest.raises(EvalbMismatch, match="1 words against the gold tree's 2"):
        evalb("(S (NN a) (NN b))", "(S (XX a))")
    with pytest.raises(EvalbMismatch, match="word 2 is 'c', the gold tree's is 'b'"):
        evalb("(S (NN a) (NN b) (. .))", "(S (XX a) (XX c) (XX .))")
    gold = next(read_trees("(S (NN a) (NN b))"))
    assert evalb_sentence(gold, None).skipped == 1
    assert evalb_sentence(gold, next(read_trees("(TOP)"))).skipped == 1
    # A test tag says what is punctuation unless it is the placeholder: a word the test tree
    # tags '.' where the gold has a noun leaves the test one word short, an error sentence.
    with pytest.raises(EvalbMismatch, match="1 words"):
        evalb("(S (NN a) (NN b))", "(S (XX a) (. b))")


GOLD_THREE = """\
( (S (NP (DT The) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .)) )
( (S (NP (PRP It)) (VP (VBD purred)) (. .)) )
( (S (NP (NNS Dogs)) (VP (VBP bark)) (. .)) )
"""


def test_score_trees_skips_error_sentences_as_evalb_does(tmp_path):
    """Line 1 misses the PP and its NP (5 gold brackets, 3 test, 3 matched); line 2's words
    differ (an error sentence, left out); line 3 is perfect (3 of 3). All: P 6/6, R 6/8."""
    gold = tmp_path / "gold.mrg"
    gold.write_text(GOLD_THREE, encoding="utf-8")
    test = tmp_path / "test.txt"
    test.write_text("(TOP (S (NP (XX The) (XX cat)) (VP (XX sat) (XX on) (XX the) (XX mat)) "
                    "(XX .)))\n"
                    "(TOP (S (NP (XX He)) (VP (XX purred)) (XX .)))\n"
                    "(TOP (S-1 (NP-SBJ (XX Dogs)) (VP (XX bark)) (XX .)))\n", encoding="utf-8")
    result = run_attn("score", "--trees", "--ref", gold, test)
    assert result.returncode == 0, result.stderr
    recall, precision = 100 * 6 / 8, 100.0
    f1 = 2 * precision * recall / (precision + recall)
    assert result.stdout.splitlines()[0] == (
        "EVALB|COLLINS.prm|all|sentences:3|valid:2|errors:1|skipped:0 = "
        f"F1 {f1:.2f} P 100.00 R 75.00 EX 50.00 CB 0.00")
    assert f"{test}:2: error sentence, not scored: word 1 is 'He', the gold tree's is 'It'" \
        in result.stderr
    per_line = run_attn("score", "--trees", "--ref", gold, test, "--sentence-level")
    assert per_line.stdout.splitlines() == ["100.00\t60.00\t75.00", "nan\tnan\tnan",
                                            "100.00\t100.00\t100.00"]
    too_many = run_attn("score", "--trees", "--ref", gold, test, "--max-errors", "0")
    assert_clean_error(too_many, f"{test}:2:", "more than --max-errors 0")


def test_score_trees_as_json(tmp_path):
    import json

    gold = tmp_path / "gold.mrg"
    gold.write_text(GOLD_THREE, encoding="utf-8")
    test = tmp_path / "test.txt"
    test.write_text("(TOP (S (NP (XX The) (XX cat)) (VP (XX sat) (XX on) (XX the) (XX mat)) "
                    "(XX .)))\n\n(TOP (S (NP (XX Dogs)) (VP (XX bark)) (XX .)))\n",
                    encoding="utf-8")
    totals = json.loads(run_attn("score", "--trees", "--ref", gold, test, "--format",
                                 "json").stdout)
    assert list(totals) == ["all", "len<=40"]
    assert {key: totals["all"][key] for key in ("sentences", "valid", "errors", "skipped",
                                                "matched", "gold_brackets", "test_brackets")} \
        == {"sentences": 3, "valid": 2, "errors": 0, "skipped": 1, "matched": 6,
            "gold_brackets": 8, "test_brackets": 6}
    assert totals["all"]["f1"] == pytest.approx(2 * 100 * 75 / 175, abs=1e-4)
    rows = run_attn("score", "--trees", "--ref", gold, test, "--format", "json",
                    "--sentence-level").stdout.splitlines()
    assert [json.loads(row) for row in rows] == [
        {"line": 1, "status": "valid", "precision": 100.0, "recall": 60.0, "f1": 75.0},
        {"line": 2, "status": "skip", "precision": None, "recall": None, "f1": None},
        {"line": 3, "status": "valid", "precision": 100.0, "recall": 100.0, "f1": 100.0}]


def test_score_trees_length_cutoff_counts_punctuation_not_traces(tmp_path):
    """EVALB's len<=40 row: 40 words and a '.' make 41 (out); 40 words and a trace make 40."""
    words = " ".join(f"(NN w{i})" for i in range(40))
    gold = tmp_path / "gold.mrg"
    gold.write_text(f"(TOP (S (NP {words}) (. .)))\n"
                    f"(TOP (S (NP {words}) (NP (-NONE- *))))\n"
                    f"(TOP (S (NP (NN a)) (VP (VB b))))\n", encoding="utf-8")
    xx = " ".join(f"(XX w{i})" for i in range(40))
    test = (f"(TOP (S (NP {xx}) (XX .)))\n(TOP (S (NP {xx})))\n\n")
    result = run_attn("score", "--trees", "--ref", gold, stdin=test)
    assert result.returncode == 0, result.stderr
    every, short = result.stdout.splitlines()
    assert every.startswith("EVALB|COLLINS.prm|all|sentences:3|valid:2|errors:0|skipped:1 = ")
    assert short.startswith("EVALB|COLLINS.prm|len<=40|sentences:2|valid:1|errors:0|skipped:1 = ")
    assert "F1 100.00" in every and "F1 100.00" in short


def test_score_trees_by_length_buckets_sum_to_the_whole(tmp_path):
    """--by-length 2,4: len1-2, len3-4, len>4 by gold words (punctuation counted, traces not),
    each bucket EVALB's sums over its sentences; bad edges are a clean error."""
    gold = tmp_path / "gold.mrg"
    gold.write_text("(TOP (S (NP (NN a)) (VP (VB b))))\n"
                    "(TOP (S (NP (NN a) (NN b)) (VP (VB c) (NP (-NONE- *))) (. .)))\n"
                    "(TOP (S (NP (NN a) (NN b)) (VP (VB c) (NP (NN d) (NN e)))))\n",
                    encoding="utf-8")
    test = ("(TOP (S (NP (XX a)) (VP (XX b))))\n"  # 2 words: all 3 brackets right
            "(TOP (S (XX a) (NP (XX b) (XX c)) (XX .)))\n"  # 4: S right, NP wrong, VP missed
            "(TOP (S (NP (XX a) (XX b)) (VP (XX c) (NP (XX d) (XX e)))))\n")  # 5: all right
    result = run_attn("score", "--trees", "--ref", gold, "--by-length", "2,4", stdin=test)
    assert result.returncode == 0, result.stderr
    rows = {line.split("|")[2]: line for line in result.stdout.splitlines()}
    assert list(rows) == ["all", "len<=40", "len1-2", "len3-4", "len>4"]
    assert "sentences:1|" in rows["len1-2"] and "F1 100.00" in rows["len1-2"]
    assert "sentences:1|" in rows["len3-4"] and "F1 40.00 P 50.00 R 33.33" in rows["len3-4"]
    assert "sentences:1|" in rows["len>4"] and "F1 100.00" in rows["len>4"]
    for bad in ("4,2", "0,3", "2,x"):
        assert_clean_error(run_attn("score", "--trees", "--ref", gold, "--by-length", bad,
                                    stdin=test), "--by-length" if bad == "2,x" else "edges")
    assert_clean_error(run_attn("score", "--ref", gold, "--by-length", "2", stdin=test),
                       "--trees")


def tags_to_placeholders(tree: Tree) -> Tree:
    """The tree with each POS tag but -NONE- replaced by the placeholder."""
    if tree.is_preterminal:
        return tree if tree.label == "-NONE-" else Tree(PLACEHOLDER, list(tree.children))
    return Tree(tree.label, [tags_to_placeholders(child) for child in tree.children])


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
    # The gold trees themselves, tags replaced by placeholders (traces, function tags and all):
    # EVALB's rules leave them perfect.
    perfect = "\n".join(str(tags_to_placeholders(t)) for t in read_trees(TREEBANK)) + "\n"
    scored = run_attn("score", "--trees", "--ref", treebank, stdin=perfect)
    assert scored.returncode == 0, scored.stderr
    assert "F1 100.00" in scored.stdout and "EX 100.00" in scored.stdout
    # After the training clean-up, the gold's ADVP|PRT is ADVP: EVALB keeps 'ADVP|PRT' whole,
    # so that is the one bracket of 12 (7 + 5) that no longer matches.
    cleaned = "\n".join(str(normalize_tags(clean(t))) for t in read_trees(TREEBANK)) + "\n"
    assert "F1 91.67 P 91.67 R 91.67 EX 50.00" in run_attn(
        "score", "--trees", "--ref", treebank, stdin=cleaned).stdout
    perfect = cleaned
    flat = ("(TOP (S (XX The) (XX cat) (XX sat) (XX on) (XX the) (XX mat) (XX to) (XX rest) "
            "(XX .)))\n")
    one = run_attn("score", "--trees", "--ref", treebank, stdin=flat + perfect.splitlines()[1]
                   + "\n", )
    assert one.returncode == 0 and "F1 100.00" not in one.stdout
    assert_clean_error(run_attn("score", "--trees", "--ref", treebank, stdin=flat),
                       "tree counts differ")


def test_parse_without_model_is_a_clean_error():
    assert_clean_error(run_attn("parse", stdin="a b\n"), "-m")


@pytest.mark.parametrize("argv", [["parse", "linearize", "{treebank}", "-o", "{prefix}"],
                                  ["score", "--trees", "--ref", "{treebank}", "{treebank}"]])
def test_tree_commands_do_not_import_torch(argv, tmp_path):
    """Linearizing a treebank and scoring trees are text work: instant, torch-free."""
    import subprocess
    import sys

    treebank = tmp_path / "tiny.mrg"
    treebank.write_text("(TOP (S (NP (DT a) (NN cat)) (VP (VBZ sleeps))))\n", encoding="utf-8")
    argv = [arg.format(treebank=treebank, prefix=tmp_path / "pairs") for arg in argv]
    code = ("import sys; from attn_cli.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit as exit_:\n    assert not exit_.code\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stderr.strip().splitlines()[-1] == "False", result.stderr
