"""Check attn's EVALB (`attn score --trees`) against a real EVALB binary, figure for figure.

attn_cli scores constituency trees with its own pure-Python EVALB (COLLINS.prm rules). This
script runs both scorers on the same files and compares what they report. Gold: the dev split of
the Penn Treebank sample (wsj_0160.mrg ... wsj_0179.mrg), one tree per line, root TOP. Test sets,
each made from the gold trees with a seeded random generator, each a row of the report:

1. identical      the gold trees themselves (every figure 100, nothing crossing);
2. perturbed      random brackets relabelled, deleted (children spliced into the parent) and
                  added (over a run of >= 2 adjacent children, some of them over part of a
                  deleted bracket's children and a neighbour, so that they cross it);
3. function-tags  the same, plus function tags and indices on labels (NP-SBJ, PP-LOC-2, S=3),
                  which EVALB cuts off;
4. parser-like    what a parser writes: -NONE- elements and empty constituents removed, every
                  POS tag the placeholder XX, brackets perturbed as in 2. attn reads the XX trees
                  (an XX tag takes the gold tag of its position); EVALB reads the same trees with
                  the gold tags put back, which is what users do before running it;
5. errors         set 2 with error and skip sentences mixed in: a word changed, a word dropped,
                  a word turned into punctuation (error sentences), a punctuation token changed
                  (not an error: EVALB drops punctuation before comparing words), an empty line
                  and a `(TOP)` line (skip sentences).

For each set it compares, for all sentences and for those of <= 40 words: the sentence, error,
skip and valid counts, bracketing recall, precision and F1, complete match and average crossing
(at the two decimals both print), and, sentence by sentence, EVALB's status and per-sentence
recall and precision against attn's sentence-level output (`--sentence-level`).

    python -m checks.evalb_parity --evalb /path/to/evalb --prm /path/to/COLLINS.prm
    python -m checks.evalb_parity --evalb ./evalb --prm COLLINS.prm \\
        --treebank ../shared/data/ptb --seed 1

Getting EVALB: download the NYU EVALB distribution (https://nlp.cs.nyu.edu/evalb/, EVALB.tgz),
which holds evalb.c and COLLINS.prm, and compile it with `gcc -O2 -o evalb evalb.c`.

The default treebank is the NLTK 5% sample of the Penn Treebank next to the repository
(REPO/../shared/data/ptb); it is read where it is, never copied into the repository. Every file
is written to a temporary directory that is removed at the end (`--keep DIR` keeps them in DIR).

Known differences on input these sets do not hold (read in evalb.c, confirmed on small files):
- error limit: EVALB's Error() exits when its count of error messages, before this one, is
  already above -e, so `-e 10` scores 11 error sentences and stops at the 12th (and one
  malformed line can give several messages); attn stops at the 11th (`max_errors` + 1);
- F1 with no matched bracket: EVALB computes 0/0 and prints `-nan`; attn prints 0.00;
- an unlabelled bracket inside a tree, `( (DT the) (NN cat))`, or the Penn Treebank's unlabelled
  outer bracket in a one-tree-per-line gold file: EVALB counts a bracket labelled "" (not TOP, so
  not deleted); attn reads "" as TOP and does not count it;
- a line cut short with no word, `(TOP (S`: EVALB calls it a skip sentence (no word read wins
  over its read errors); attn an error sentence.

The report goes to stderr, one JSON object with every figure to stdout. Exit status: 0 if attn
and EVALB agree on every figure, 1 if any differs, 2 on bad input. Sentences beyond EVALB's fixed
limits (the constants of evalb.c: line length, words, brackets, label and word length) are left
out of every file and listed, since EVALB would crash on them or misread the files.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from attn_cli.errors import AttnError
from attn_cli.parse.evalb import tree_scores, tree_sentence_line, tree_summary_line, tree_totals
from attn_cli.parse.trees import PLACEHOLDER, ROOT, Tree, clean, read_treebank
from benchmarks._harness import SHARED, log  # this checkout's attn_cli, whatever is installed

DEFAULT_TREEBANK = SHARED / "data" / "ptb"
DEV_FILES = [f"wsj_{number:04d}.mrg" for number in range(160, 180)]
# Passed to both: attn's max_errors and EVALB's -e (COLLINS.prm's MAX_ERROR). The error set has
# 5 error sentences, well within it: the two do not stop at the same count (see the docstring).
MAX_ERRORS = 10
CUTOFF = 40  # COLLINS.prm's CUTOFF_LEN: the second summary block
SUBSETS = ("all", f"len<={CUTOFF}")

# COLLINS.prm, as far as this script needs it to build its test sets (not to score: that is
# what is being compared). Terminals with these tags are not words to EVALB.
DELETED_TAGS = frozenset({"TOP", "-NONE-", ",", ":", "``", "''", "."})
TRACE = "-NONE-"

# evalb.c's fixed limits. Beyond them EVALB overruns a fixed array or, for a line longer than its
# fgets buffer, reads the rest of the line as the next sentence and pairs every later gold line
# with the wrong test line.
EVALB_MAX_LINE_CHARS = 5000 - 2  # MAX_LINE_LEN 5000: fgets keeps 4999 chars, newline included
EVALB_MAX_WORDS = 2000  # MAX_WORD_IN_SENT
EVALB_MAX_BRACKETS = 2000  # MAX_BRACKET_IN_SENT (and the bracket stack)
EVALB_MAX_TEST_BRACKETS = 200  # calc_result's `char match_j[200]`, indexed by test bracket
EVALB_MAX_LABEL_CHARS = 300 - 1  # MAX_LABEL_LEN, NUL included
EVALB_MAX_WORD_CHARS = 1000 - 1  # MAX_WORD_LEN, NUL included

# How much each test set is perturbed: the chance that a bracket is relabelled, deleted, that
# a deleted bracket's children are regrouped with a neighbour (which crosses the gold bracket),
# that a new bracket is added among a bracket's children. F1 comes out at about 75.
RELABEL_RATE = 0.10
DELETE_RATE = 0.15
MISATTACH_RATE = 0.5
ADD_RATE = 0.15
FUNCTION_TAG_RATE = 0.5
FUNCTION_TAGS = ("-SBJ", "-LOC", "-TMP", "-PRD", "-CLR", "-ADV", "-DIR", "-1", "-2", "=3",
                 "-LOC-2", "-SBJ-1", "=2", "-TMP=1", "-NOM-SBJ")
CHANGED_WORD = "EVALB-PARITY-CHANGED"

# EVALB's output: the per-sentence table and the two summary blocks (print_total in evalb.c).
SENTENCE_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([012])\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)"
                          r"\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s*$")
SUMMARY_FIELDS = {
    "Number of sentence": "sentences",
    "Number of Error sentence": "errors",
    "Number of Skip  sentence": "skipped",
    "Number of Valid sentence": "valid",
    "Bracketing Recall": "recall",
    "Bracketing Precision": "precision",
    "Bracketing FMeasure": "f1",
    "Complete match": "exact",
    "Average crossing": "crossing",
}
COUNT_FIELDS = ("sentences", "errors", "skipped", "valid")
SCORE_FIELDS = ("recall", "precision", "f1", "exact", "crossing")
ATTN_SUMMARY = re.compile(
    r"^EVALB\|COLLINS\.prm\|(?P<subset>[^|]+)\|sentences:(?P<sentences>\d+)\|valid:(?P<valid>\d+)"
    r"\|errors:(?P<errors>\d+)\|skipped:(?P<skipped>\d+) = F1 (?P<f1>\S+) P (?P<precision>\S+) "
    r"R (?P<recall>\S+) EX (?P<exact>\S+) CB (?P<crossing>\S+)$")


# ------------------------------------------------------------------------------- tree helpers


def nonterminals(tree: Tree) -> list[Tree]:
    """Every bracket that is not a POS tag, the root included, in preorder."""
    if tree.is_preterminal:
        return []
    found = [tree]
    for child in tree.children:
        if isinstance(child, Tree):
            found.extend(nonterminals(child))
    return found


def is_scored_word(preterminal: Tree) -> bool:
    """A terminal EVALB compares between gold and test (traces and punctuation it drops)."""
    return preterminal.label not in DELETED_TAGS


def gold_tag_sequence(gold: Tree) -> list[str]:
    """The gold tags in order, traces left out: position i is the i-th word of a parser's tree."""
    return [p.label for p in gold.preterminals() if p.label != TRACE]


def restore_gold_tags(test: Tree, tags: list[str]) -> Tree:
    """The test tree with each placeholder tag replaced by the gold tag of its position (what a
    user does before giving tagless parser output to EVALB). Positions past the gold tree's end
    keep the placeholder."""
    restored = copy.deepcopy(test)
    position = 0
    for preterminal in restored.preterminals():
        if preterminal.label == TRACE:
            continue
        if preterminal.label == PLACEHOLDER and position < len(tags):
            preterminal.label = tags[position]
        position += 1
    return restored


def with_placeholder_tags(tree: Tree) -> Tree:
    if tree.is_preterminal:
        return Tree(PLACEHOLDER, list(tree.children))
    return Tree(tree.label, [with_placeholder_tags(c) for c in tree.children])


def label_pool(trees: list[Tree]) -> list[str]:
    """The bracket labels of the gold trees without function tags (NP, VP, PRT, ...), sorted so
    that a seed always draws the same ones."""
    labels = {re.split(r"[-=]", node.label, maxsplit=1)[0]
              for tree in trees for node in nonterminals(tree)}
    return sorted(label for label in labels if label and label != ROOT)


# ------------------------------------------------------------------------------ perturbations


def perturb_brackets(tree: Tree, rng: random.Random, labels: list[str]) -> Tree:
    """A copy of `tree` with random brackets relabelled, deleted (their children spliced into the
    parent) and added over runs of >= 2 adjacent children. POS tags and words are left alone, so
    the sentence stays valid for both scorers; the root is never touched."""

    def rebuild(node: Tree, is_root: bool) -> Tree:
        children: list = []
        spliced: list[tuple[int, int]] = []  # where deleted brackets' children now lie
        for child in node.children:
            if isinstance(child, str) or child.is_preterminal:
                children.append(copy.deepcopy(child))
                continue
            rebuilt = rebuild(child, is_root=False)
            if rng.random() < DELETE_RATE:
                spliced.append((len(children), len(children) + len(rebuilt.children)))
                children.extend(rebuilt.children)
            else:
                children.append(rebuilt)
        if spliced and rng.random() < MISATTACH_RATE:
            add_crossing_bracket(children, rng.choice(spliced), rng, labels)
        if len(children) >= 2 and rng.random() < ADD_RATE:
            start = rng.randrange(len(children) - 1)
            end = rng.randrange(start + 2, len(children) + 1)
            children[start:end] = [Tree(rng.choice(labels), children[start:end])]
        label = node.label
        if not is_root and rng.random() < RELABEL_RATE:
            label = rng.choice(labels)
        return Tree(label, children)

    return rebuild(tree, is_root=True)


def add_crossing_bracket(children: list, spliced: tuple[int, int], rng: random.Random,
                         labels: list[str]) -> None:
    """Add a bracket over a run of adjacent children that takes part of a deleted bracket's
    children and a neighbour of it: a parser's attachment error, and the only way brackets added
    among siblings cross a gold bracket (the deleted one). Deletion and addition alone rarely
    cross, and the crossing count would go untested."""
    start, end = spliced
    if end - start < 2:
        return
    sides = [side for side, possible in (("left", start > 0), ("right", end < len(children)))
             if possible]
    if not sides:
        return
    if rng.choice(sides) == "right":
        run_start, run_end = rng.randrange(start + 1, end), rng.randrange(end + 1,
                                                                          len(children) + 1)
    else:
        run_start, run_end = rng.randrange(0, start), rng.randrange(start + 1, end)
    children[run_start:run_end] = [Tree(rng.choice(labels), children[run_start:run_end])]


def add_function_tags(tree: Tree, rng: random.Random) -> Tree:
    """A copy with function tags and indices added to some bracket labels (not POS tags: EVALB
    compares a POS tag whole, so NN-1 would not be NN)."""
    tagged = copy.deepcopy(tree)
    for node in nonterminals(tagged)[1:]:  # the root TOP stays TOP
        if rng.random() < FUNCTION_TAG_RATE:
            node.label += rng.choice(FUNCTION_TAGS)
    return tagged


def scored_preterminals(tree: Tree) -> list[tuple[Tree, int]]:
    """(parent, index) of every terminal EVALB compares, for the word-level damage of set 5."""
    found = []
    for node in nonterminals(tree):
        for index, child in enumerate(node.children):
            if isinstance(child, Tree) and child.is_preterminal and is_scored_word(child):
                found.append((node, index))
    return found


def punctuation_preterminals(tree: Tree) -> list[tuple[Tree, int]]:
    found = []
    for node in nonterminals(tree):
        for index, child in enumerate(node.children):
            if (isinstance(child, Tree) and child.is_preterminal
                    and child.label in DELETED_TAGS - {TRACE, ROOT}):
                found.append((node, index))
    return found


def change_word(tree: Tree, rng: random.Random) -> Tree:
    damaged = copy.deepcopy(tree)
    parent, index = rng.choice(scored_preterminals(damaged))
    parent.children[index].children = [CHANGED_WORD]
    return damaged


def drop_word(tree: Tree, rng: random.Random) -> Tree:
    """Drop a scored word with its tag; its parent may be left empty, as `(NP)`, which both
    scorers must ignore (a bracket over no word)."""
    damaged = copy.deepcopy(tree)
    parent, index = rng.choice(scored_preterminals(damaged))
    del parent.children[index]
    return damaged


def tag_word_as_punctuation(tree: Tree, rng: random.Random) -> Tree:
    """Give a word a punctuation tag: EVALB then drops it from the test words only."""
    damaged = copy.deepcopy(tree)
    parent, index = rng.choice(scored_preterminals(damaged))
    parent.children[index].label = "."
    return damaged


def change_punctuation(tree: Tree, rng: random.Random) -> Tree | None:
    """Change a punctuation token (not an error: EVALB drops punctuation before comparing
    words). None if the tree has no punctuation."""
    damaged = copy.deepcopy(tree)
    candidates = punctuation_preterminals(damaged)
    if not candidates:
        return None
    parent, index = rng.choice(candidates)
    parent.children[index].children = ["EVALB-PARITY-PUNCT"]
    return damaged


# --------------------------------------------------------------------------------- test sets


@dataclass
class SetUnderTest:
    """One comparison: for each gold tree, the line attn reads and the line EVALB reads (the
    same, except in the parser-like set, where EVALB's has the gold tags back)."""

    name: str
    description: str
    attn_lines: list[str]
    evalb_lines: list[str]
    notes: dict = field(default_factory=dict)


def make_sets(gold: list[Tree], seed: int) -> list[SetUnderTest]:
    labels = label_pool(gold)

    def rng_for(name: str) -> random.Random:
        # one generator per set, so that changing one set leaves the others as they were
        return random.Random(f"{seed}:{name}")

    sets = []
    identical = [str(tree) for tree in gold]
    sets.append(SetUnderTest("identical", "the gold trees", identical, identical))

    rng = rng_for("perturbed")
    perturbed = [str(perturb_brackets(tree, rng, labels)) for tree in gold]
    sets.append(SetUnderTest("perturbed", "brackets relabelled, deleted, added", perturbed,
                             perturbed))

    rng = rng_for("function-tags")
    tagged = [str(add_function_tags(perturb_brackets(tree, rng, labels), rng)) for tree in gold]
    sets.append(SetUnderTest("function-tags", "as perturbed, plus NP-SBJ, PP-LOC-2, S=3 labels",
                             tagged, tagged))

    sets.append(parser_like_set(gold, rng_for("parser-like"), labels))
    sets.append(error_set(gold, rng_for("errors"), labels))
    return sets


def parser_like_set(gold: list[Tree], rng: random.Random, labels: list[str]) -> SetUnderTest:
    attn_lines, evalb_lines = [], []
    for tree in gold:
        cleaned = clean(tree)
        if cleaned is None:  # nothing but traces: a parser writes an empty line
            attn_lines.append("")
            evalb_lines.append("")
            continue
        test = perturb_brackets(with_placeholder_tags(cleaned), rng, labels)
        attn_lines.append(str(test))
        evalb_lines.append(str(restore_gold_tags(test, gold_tag_sequence(tree))))
    return SetUnderTest("parser-like", "no -NONE-, XX tags (gold tags back for EVALB), perturbed",
                        attn_lines, evalb_lines)


def error_set(gold: list[Tree], rng: random.Random, labels: list[str]) -> SetUnderTest:
    """Set 2 with a few damaged lines. 5 error sentences, within MAX_ERRORS for both scorers."""
    trees = [perturb_brackets(tree, rng, labels) for tree in gold]
    lines = [str(tree) for tree in trees]
    damage = (["word changed"] * 2 + ["word dropped"] * 2 + ["word tagged '.'"]
              + ["punctuation changed"] * 2 + ["empty line"] * 2 + ["(TOP)"] * 2)
    with_words = [i for i, tree in enumerate(trees) if scored_preterminals(tree)]
    with_punctuation = [i for i, tree in enumerate(trees) if punctuation_preterminals(tree)]
    chosen: dict[int, str] = {}
    for kind in damage:
        pool = with_punctuation if kind == "punctuation changed" else with_words
        index = rng.choice([i for i in pool if i not in chosen])
        chosen[index] = kind
        tree = trees[index]
        if kind == "word changed":
            lines[index] = str(change_word(tree, rng))
        elif kind == "word dropped":
            lines[index] = str(drop_word(tree, rng))
        elif kind == "word tagged '.'":
            lines[index] = str(tag_word_as_punctuation(tree, rng))
        elif kind == "punctuation changed":
            lines[index] = str(change_punctuation(tree, rng))
        elif kind == "empty line":
            lines[index] = ""
        else:
            lines[index] = "(TOP)"
    notes = {"damaged_lines": {str(i + 1): kind for i, kind in sorted(chosen.items())}}
    return SetUnderTest("errors", "perturbed + changed/dropped words, empty and (TOP) lines",
                        lines, lines, notes)


# ----------------------------------------------------------------------------- EVALB's limits


def evalb_limit_problems(line: str, is_test: bool) -> list[str]:
    """What in one line is beyond evalb.c's fixed limits (empty if nothing)."""
    problems = []
    if len(line) > EVALB_MAX_LINE_CHARS:
        problems.append(f"{len(line)} characters > {EVALB_MAX_LINE_CHARS}")
    tokens = re.findall(r"\(|\)|[^\s()]+", line)
    brackets = 0
    words = 0
    for position, token in enumerate(tokens):
        if token != "(":
            continue
        # as read_line reads it: "(" label word ")" is a terminal, any other "(" a bracket
        label, word, close = (tokens[position + 1:position + 4] + [")", ")", ")"])[:3]
        label = "" if label in ("(", ")") else label
        if len(label) > EVALB_MAX_LABEL_CHARS:
            problems.append(f"a label of {len(label)} characters")
        if label and word not in ("(", ")") and close == ")":
            if len(word) > EVALB_MAX_WORD_CHARS:
                problems.append(f"a word of {len(word)} characters")
            words += label not in DELETED_TAGS
        else:
            brackets += 1
    if words > EVALB_MAX_WORDS:
        problems.append(f"{words} words > {EVALB_MAX_WORDS}")
    if brackets > EVALB_MAX_BRACKETS:
        problems.append(f"{brackets} brackets > {EVALB_MAX_BRACKETS}")
    if is_test and brackets > EVALB_MAX_TEST_BRACKETS:
        problems.append(f"{brackets} test brackets > {EVALB_MAX_TEST_BRACKETS} (match_j)")
    return problems


def within_evalb_limits(gold_lines: list[str], set_under_test: SetUnderTest
                        ) -> tuple[list[int], list[dict]]:
    """The sentence indices both scorers get, and the ones left out with why."""
    kept, left_out = [], []
    for index, gold_line in enumerate(gold_lines):
        problems = (evalb_limit_problems(gold_line, is_test=False)
                    + evalb_limit_problems(set_under_test.evalb_lines[index], is_test=True)
                    + evalb_limit_problems(set_under_test.attn_lines[index], is_test=True))
        if problems:
            left_out.append({"sentence": index + 1, "why": sorted(set(problems))})
        else:
            kept.append(index)
    return kept, left_out


# --------------------------------------------------------------------------------- the scorers


def run_evalb(evalb: Path, prm: Path, gold_path: Path, test_path: Path) -> dict:
    """EVALB's summary blocks and per-sentence rows, or why it failed."""
    process = subprocess.run(
        [str(evalb), "-p", str(prm), "-e", str(MAX_ERRORS), str(gold_path), str(test_path)],
        capture_output=True, text=True, errors="replace")
    result = {"returncode": process.returncode, "messages": process.stderr.splitlines(),
              "summary": parse_evalb_summary(process.stdout),
              "sentences": parse_evalb_rows(process.stdout)}
    if process.returncode != 0 or set(result["summary"]) != set(SUBSETS):
        result["failure"] = (f"evalb exited with status {process.returncode}; "
                             f"last messages: {result['messages'][-3:]}")
    return result


def parse_evalb_rows(stdout: str) -> list[dict]:
    """The per-sentence table between the header and the first rule of '='."""
    rows = []
    for line in stdout.split("=== Summary ===")[0].splitlines():
        match = SENTENCE_ROW.match(line)
        if match:
            rows.append({"id": int(match[1]), "length": int(match[2]), "status": int(match[3]),
                         "recall": match[4], "precision": match[5]})
    return rows


def parse_evalb_summary(stdout: str) -> dict:
    """{"all": {...}, "len<=40": {...}}, counts as int, scores as EVALB printed them (%6.2f)."""
    blocks = re.split(r"^-- (All|len<=\d+) --$", stdout, flags=re.MULTILINE)
    summary = {}
    for heading, body in zip(blocks[1::2], blocks[2::2]):
        subset = "all" if heading == "All" else heading
        figures = {}
        for line in body.splitlines():
            name, _, value = line.partition("=")
            key = SUMMARY_FIELDS.get(name.strip())
            if key:
                figures[key] = int(value) if key in COUNT_FIELDS else value.strip()
        summary[subset] = figures
    return summary


def run_attn(gold_path: Path, test_path: Path) -> dict:
    """attn's two summary lines and its sentence-level lines, in this process."""
    warnings: list[str] = []
    result: dict = {"warnings": warnings}
    sentences = []
    try:
        for sentence in tree_scores(str(gold_path), str(test_path), max_errors=MAX_ERRORS,
                                    warn=warnings.append):
            sentences.append(sentence)
        lines = [tree_summary_line(label, counts)
                 for label, counts in tree_totals(sentences).items()]  # what attn prints
        result["summary"] = parse_attn_summary(lines)
        result["lines"] = lines
        result["sentences"] = [tree_sentence_line(sentence).split("\t")
                               for sentence in sentences]
    except AttnError as error:
        result["failure"] = f"attn stopped: {error}"
        result.setdefault("summary", {})
        result.setdefault("sentences", [])
    result["error_lines"] = [sentence.number for sentence in sentences
                             if sentence.status == "error"]
    return result


def parse_attn_summary(lines: list[str]) -> dict:
    summary = {}
    for line in lines:
        match = ATTN_SUMMARY.match(line)
        if match:
            figures = match.groupdict()
            subset = figures.pop("subset")
            summary[subset] = {key: int(value) if key in COUNT_FIELDS else value
                               for key, value in figures.items()}
    return summary


# -------------------------------------------------------------------------------- comparison


def same_score(evalb_text: str, attn_text: str) -> bool:
    """Two figures printed with two decimals. EVALB prints 'nan' or '-nan' where it divides 0 by
    0 (F1 with no matched bracket); that is a difference unless attn prints nan too."""
    try:
        evalb_value, attn_value = float(evalb_text), float(attn_text)
    except ValueError:
        return evalb_text == attn_text
    if math.isnan(evalb_value) or math.isnan(attn_value):
        return math.isnan(evalb_value) and math.isnan(attn_value)
    return f"{evalb_value:.2f}" == f"{attn_value:.2f}"


def compare_summaries(evalb: dict, attn: dict) -> dict[str, list[str]]:
    """For each summary block ("all", "len<=40"), the figures that differ."""
    differences: dict[str, list[str]] = {subset: [] for subset in SUBSETS}
    for subset in SUBSETS:
        ours, theirs = attn.get(subset), evalb.get(subset)
        if ours is None or theirs is None:
            differences[subset].append(f"{subset}: no summary from "
                                       f"{'attn' if ours is None else 'EVALB'}")
            continue
        for key in COUNT_FIELDS + SCORE_FIELDS:
            a, e = ours.get(key), theirs.get(key)
            equal = a == e if key in COUNT_FIELDS else (a is not None and e is not None
                                                        and same_score(e, a))
            if not equal:
                differences[subset].append(f"{subset} {key}: EVALB {e}, attn {a}")
    return differences


def compare_sentences(evalb_rows: list[dict], attn_rows: list[list[str]],
                      attn_error_lines: list[int]) -> tuple[int, list[str]]:
    """Sentence by sentence: the status (valid, error, skip), and recall and precision of the
    valid ones. attn's sentence-level line is `precision recall f1`, nan for error and skip
    sentences; its warnings say which were errors."""
    differences = []
    if len(evalb_rows) != len(attn_rows):
        differences.append(f"EVALB printed {len(evalb_rows)} sentence rows, attn "
                           f"{len(attn_rows)} lines")
    errors = set(attn_error_lines)
    compared = 0
    for row, attn_row in zip(evalb_rows, attn_rows):
        number = row["id"]
        attn_precision, attn_recall = attn_row[0], attn_row[1]
        attn_status = 1 if number in errors else 2 if attn_precision == "nan" else 0
        if attn_status != row["status"]:
            differences.append(f"sentence {number}: EVALB status {row['status']}, attn "
                               f"{attn_status} (0 valid, 1 error, 2 skip)")
            continue
        if row["status"] != 0:
            continue
        compared += 1
        if not (same_score(row["recall"], attn_recall)
                and same_score(row["precision"], attn_precision)):
            differences.append(f"sentence {number}: EVALB R {row['recall']} P "
                               f"{row['precision']}, attn R {attn_recall} P {attn_precision}")
    return compared, differences


# ------------------------------------------------------------------------------------ running


def read_gold(treebank: Path) -> list[Tree]:
    paths = [treebank / name for name in DEV_FILES]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise AttnError(f"{len(missing)} of the dev files {DEV_FILES[0]} ... {DEV_FILES[-1]} "
                        f"are not in {treebank} (first missing: {missing[0]})")
    return list(read_treebank([str(path) for path in paths]))


def write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def compare_set(set_under_test: SetUnderTest, gold_lines: list[str], work: Path, evalb: Path,
                prm: Path) -> dict:
    kept, left_out = within_evalb_limits(gold_lines, set_under_test)
    folder = work / set_under_test.name
    folder.mkdir()
    gold_path = folder / "gold.txt"
    evalb_test_path, attn_test_path = folder / "test.evalb.txt", folder / "test.attn.txt"
    write_lines(gold_path, [gold_lines[i] for i in kept])
    write_lines(evalb_test_path, [set_under_test.evalb_lines[i] for i in kept])
    write_lines(attn_test_path, [set_under_test.attn_lines[i] for i in kept])

    evalb_result = run_evalb(evalb, prm, gold_path, evalb_test_path)
    attn_result = run_attn(gold_path, attn_test_path)
    failures = [r["failure"] for r in (evalb_result, attn_result) if "failure" in r]
    summary_differences = compare_summaries(evalb_result["summary"], attn_result["summary"])
    compared, sentence_differences = compare_sentences(
        evalb_result["sentences"], attn_result["sentences"], attn_result["error_lines"])
    same = not failures and not any(summary_differences.values()) and not sentence_differences
    return {
        "name": set_under_test.name,
        "description": set_under_test.description,
        "sentences": len(kept),
        "left_out_for_evalb_limits": left_out,
        **set_under_test.notes,
        "evalb": {"summary": evalb_result["summary"], "returncode": evalb_result["returncode"],
                  "messages": evalb_result["messages"]},
        "attn": {"summary": attn_result["summary"], "lines": attn_result.get("lines", []),
                 "warnings": attn_result["warnings"], "error_lines": attn_result["error_lines"]},
        "failures": failures,
        "summary_differences": summary_differences,
        "sentences_compared": compared,
        "sentence_differences": sentence_differences,
        "same": same,
    }


def report_table(results: list[dict]) -> None:
    def pair(result: dict, subset: str, key: str) -> str:
        e = result["evalb"]["summary"].get(subset, {}).get(key, "-")
        a = result["attn"]["summary"].get(subset, {}).get(key, "-")
        return f"{str(e).strip()}/{str(a).strip()}"

    header = (f"{'set':<14}{'subset':<10}{'sent/err/skip/valid (EVALB|attn)':<36}"
              f"{'F1 EVALB/attn':<16}{'P EVALB/attn':<16}{'R EVALB/attn':<16}"
              f"{'EX EVALB/attn':<16}{'CB EVALB/attn':<14}{'per-sentence':<14}verdict")
    log(header)
    log("-" * len(header))
    for result in results:
        for subset in SUBSETS:
            counts = "|".join(
                "/".join(str(result[side]["summary"].get(subset, {}).get(k, "-"))
                         for k in COUNT_FIELDS) for side in ("evalb", "attn"))
            per_sentence = (f"{result['sentences_compared'] - len(result['sentence_differences'])}"
                            f"/{result['sentences_compared']} ok" if subset == "all" else "")
            # the per-sentence comparison is reported on the "all" row
            same = (not result["failures"] and not result["summary_differences"][subset]
                    and (subset != "all" or not result["sentence_differences"]))
            verdict = "same" if same else "DIFFERENT"
            log(f"{result['name'] if subset == 'all' else '':<14}{subset:<10}{counts:<36}"
                f"{pair(result, subset, 'f1'):<16}{pair(result, subset, 'precision'):<16}"
                f"{pair(result, subset, 'recall'):<16}{pair(result, subset, 'exact'):<16}"
                f"{pair(result, subset, 'crossing'):<14}{per_sentence:<14}{verdict}")
    for result in results:
        for difference in (result["failures"] + sum(result["summary_differences"].values(), [])
                           + result["sentence_differences"][:10]):
            log(f"  {result['name']}: {difference}")
        if len(result["sentence_differences"]) > 10:
            log(f"  {result['name']}: ... {len(result['sentence_differences']) - 10} more")
        for left in result["left_out_for_evalb_limits"]:
            log(f"  {result['name']}: sentence {left['sentence']} left out (beyond EVALB's "
                f"limits: {'; '.join(left['why'])})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--evalb", type=Path, required=True,
                        help="the EVALB binary (gcc -O2 -o evalb evalb.c)")
    parser.add_argument("--prm", type=Path, required=True, help="COLLINS.prm")
    parser.add_argument("--treebank", type=Path, default=DEFAULT_TREEBANK,
                        help="folder with wsj_0160.mrg ... wsj_0179.mrg (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the perturbations")
    parser.add_argument("--keep", type=Path, default=None,
                        help="write the gold and test files to this new folder and keep them")
    args = parser.parse_args(argv)

    for path, what in ((args.evalb, "EVALB binary"), (args.prm, "parameter file")):
        if not path.is_file():
            log(f"evalb_parity: no {what} at {path}")
            return 2
    try:
        gold = read_gold(args.treebank)
    except AttnError as error:
        log(f"evalb_parity: {error}")
        return 2
    gold_lines = [str(tree) for tree in gold]
    sets = make_sets(gold, args.seed)
    log(f"gold: {len(gold)} trees from {args.treebank} ({DEV_FILES[0]} ... {DEV_FILES[-1]}); "
        f"seed {args.seed}; EVALB {args.evalb} -p {args.prm} -e {MAX_ERRORS}")

    with tempfile.TemporaryDirectory(prefix="evalb_parity_") as temporary:
        work = args.keep or Path(temporary)
        if args.keep:
            args.keep.mkdir(parents=True)
        results = [compare_set(set_under_test, gold_lines, work, args.evalb, args.prm)
                   for set_under_test in sets]

    report_table(results)
    same = all(result["same"] for result in results)
    log("attn and EVALB agree on every figure" if same else "attn and EVALB DIFFER")
    print(json.dumps({"evalb": str(args.evalb), "prm": str(args.prm),
                      "treebank": str(args.treebank), "dev_files": DEV_FILES,
                      "gold_trees": len(gold), "seed": args.seed, "max_errors": MAX_ERRORS,
                      "sets": results, "same": same}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
