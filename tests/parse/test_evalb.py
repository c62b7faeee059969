"""EVALB (evalb.py), rule for rule, and `attn score --trees`, on trees of our own."""

from __future__ import annotations

import json

import pytest

from attn_cli.parse.evalb import (
    BracketCounts,
    EvalbMismatch,
    evalb_label,
    evalb_sentence,
    parse_length_edges,
    report_lines,
)
from attn_cli.parse.trees import PLACEHOLDER, Tree, clean, normalize_tags, read_trees

from ..conftest import assert_clean_error, run_attn
from ..toys import TREEBANK

# ------------------------------------------------------------------------------------ the rules


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


# --------------------------------------------------------------------------- attn score --trees


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
    assert "sentences:3|" in rows["all"]  # each of the 3 in one bucket
    for bad in ("4,2", "0,3", "2,x"):
        assert_clean_error(run_attn("score", "--trees", "--ref", gold, "--by-length", bad,
                                    stdin=test), "--by-length" if bad == "2,x" else "edges")
    assert_clean_error(run_attn("score", "--ref", gold, "--by-length", "2", stdin=test),
                       "--trees")


def test_report_by_length_buckets_add_up_to_all(tmp_path):
    """`report_lines` with length buckets: every sentence (error and skip ones included) in
    exactly one bucket, so the buckets' counts add up to the `all` row's."""
    gold, test = [], []
    for length in range(1, 13):  # sentences of 1 to 12 words, a '.' on every third
        words = [f"w{i}" for i in range(length)]
        stop = " (. .)" if length % 3 == 0 else ""
        gold.append(f"(TOP (S (NP {' '.join(f'(NN {w})' for w in words)}){stop}))")
        tests = f"(TOP (S {' '.join(f'(XX {w})' for w in words)}{' (XX .)' if stop else ''}))"
        test.append("" if length == 5 else tests.replace("w0", "v0") if length == 7 else tests)
    (tmp_path / "gold.mrg").write_text("\n".join(gold) + "\n", encoding="utf-8")
    (tmp_path / "test.txt").write_text("\n".join(test) + "\n", encoding="utf-8")
    edges = parse_length_edges("3,6,9")
    (line,) = report_lines(str(tmp_path / "gold.mrg"), str(tmp_path / "test.txt"), as_json=True,
                           length_edges=edges)
    totals = json.loads(line)
    buckets = ["len1-3", "len4-6", "len7-9", "len>9"]
    assert list(totals) == ["all", "len<=40", *buckets]
    # gold lengths 1, 2, 4, 4, 5, 7, 7, 8, 10, 10, 11, 13 (a '.' counts as a word)
    assert [totals[label]["sentences"] for label in buckets] == [2, 3, 3, 4]
    for key in ("sentences", "valid", "errors", "skipped", "matched", "gold_brackets",
                "test_brackets"):
        assert sum(totals[label][key] for label in buckets) == totals["all"][key], key
    assert (totals["all"]["errors"], totals["all"]["skipped"]) == (1, 1)
    text = list(report_lines(str(tmp_path / "gold.mrg"), str(tmp_path / "test.txt"),
                             length_edges=edges))
    assert [row.split("|")[2] for row in text] == list(totals)


def tags_to_placeholders(tree: Tree) -> Tree:
    """The tree with each POS tag but -NONE- replaced by the placeholder."""
    if tree.is_preterminal:
        return tree if tree.label == "-NONE-" else Tree(PLACEHOLDER, list(tree.children))
    return Tree(tree.label, [tags_to_placeholders(child) for child in tree.children])


def test_score_trees_of_the_treebank_itself(tmp_path):
    treebank = tmp_path / "tiny.mrg"
    treebank.write_text(TREEBANK, encoding="utf-8")
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
