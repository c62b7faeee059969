"""`attn decode --alignment` (issue 42, part 4): each output followed by a TAB and its Pharaoh
pairs, read off the cross-attention in the search's windows, through the real entry point.

On the committed reversal model (tests/fixtures/run/checkpoint-600.st), whose alignments
test_alignment.py shows to be the anti-diagonal."""

from __future__ import annotations

import pytest

from attn_cli.alignment import pharaoh

from .conftest import REPO, assert_clean_error, run_attn
from .toys import reversal_pairs

REVERSER = REPO / "tests" / "fixtures" / "run" / "checkpoint-600.st"
# One thread: a command's own threads wait on each other when another process holds a core.
DECODE = ["decode", "-m", REVERSER, "--device", "cpu", "--threads", "1", "--workers", "1"]
LINES, REVERSED = reversal_pairs(60, seed=99)
# Words the model has never seen (several pieces each, some unknown), an empty and a blank line.
ODD = ["hello world c b", "", "Ünïcode ok? a", "  ", "j"]


def decoded(*options, lines=LINES) -> list[list[str]]:
    result = run_attn(*DECODE, "--alignment", *options, stdin="".join(f"{x}\n" for x in lines))
    assert result.returncode == 0, result.stderr
    return [line.split("\t") for line in result.stdout.split("\n")[:-1]]


def pairs(column: str) -> list[tuple[int, int]]:
    return [tuple(map(int, pair.split("-"))) for pair in column.split()]


def test_the_reversal_models_lines_align_on_the_anti_diagonal():
    """Lines of distinct letters reversed exactly: word i with output word n-1-i, nothing else
    (as test_alignment.py's bound: nearly all of them)."""
    rows = decoded()
    assert len(rows) == len(LINES) and all(len(row) == 2 for row in rows)
    checked = [(line, column) for line, (text, column), target in zip(LINES, rows, REVERSED)
               if text == target and len(set(line.split())) == len(line.split())]
    assert len(checked) >= 15
    diagonal = sum(column == pharaoh([(i, len(line.split()) - 1 - i)
                                      for i in range(len(line.split()))])
                   for line, column in checked)
    assert diagonal >= 0.9 * len(checked), checked


@pytest.mark.parametrize("options", [["--beam", "1"], ["--sample", "--seed", "3"],
                                     ["-m", REVERSER], ["--int8"]],
                         ids=["greedy", "sample", "ensemble", "int8"])
def test_the_outputs_are_those_without_the_option_each_with_its_alignment(options):
    """The text column is decode's own output with the same options (the alignment is
    computed after the search, which it does not touch), and an output the beam search also
    found aligns as it does there (an ensemble aligns with its first model, here the same
    one; int8's pass, this model's attention being sharp, alike)."""
    plain = run_attn(*DECODE, *options, stdin="".join(f"{x}\n" for x in LINES[:12]))
    rows = decoded(*options, lines=LINES[:12])
    assert [text for text, _ in rows] == plain.stdout.split("\n")[:-1]
    same = [(row, beam) for row, beam in zip(rows, decoded(lines=LINES[:12]))
            if row[0] == beam[0]]
    assert len(same) >= 3 and all(row == beam for row, beam in same)


def test_pairs_index_words_that_exist_and_each_line_gets_one_line():
    rows = decoded(lines=ODD)
    assert len(rows) == len(ODD)  # one output line per input line, empty ones too
    assert rows[1] == ["", ""] and rows[3] == ["", ""]  # an empty line: a lone TAB
    for line, (text, column) in zip(ODD, rows):
        for source, output in pairs(column):
            assert 0 <= source < len(line.split()) and 0 <= output < len(text.split())
        assert bool(column) == bool(line.split() and text.split())


def test_batching_does_not_change_the_alignments():
    assert decoded("--buffer-size", "1", "--batch-tokens", "8") == decoded()


def test_each_nbest_output_has_its_own_alignment():
    rows = decoded("--nbest", "3", lines=LINES[:8])
    assert len(rows) == 3 * 8 and all(len(row) == 4 for row in rows)
    from attn_cli import load_translator

    translator = load_translator(REVERSER, device="cpu", threads=1, workers=1)
    for k, (index, _, text, column) in enumerate(rows):
        assert int(index) == k // 3
        # the reversal model's pieces are its letters: the text gives back the tokens
        tokens = translator.tgt_vocab.encode([text])[0]
        assert column == pharaoh(translator.align([LINES[k // 3]], [tokens])[0])
    assert len({column for *_, column in rows[:3]}) > 1  # not the best's alignment thrice


def test_a_split_line_aligns_as_its_sentences_do_renumbered_within_the_line():
    sentences = ["c h g?", "g b c!", "j h a f"]
    alone = decoded(lines=sentences)
    (text, column), = decoded("--split-sentences", lines=[" ".join(sentences)])
    assert text == " ".join(text for text, _ in alone)
    expected, source_offset, output_offset = [], 0, 0
    for sentence, (output, sentence_column) in zip(sentences, alone):
        expected += [(i + source_offset, j + output_offset) for i, j in pairs(sentence_column)]
        source_offset, output_offset = (source_offset + len(sentence.split()),
                                        output_offset + len(output.split()))
    assert pairs(column) == sorted(expected)


@pytest.mark.parametrize("options, fragment", [
    (["--alignment", "--raw"], "drop --raw"),
    (["--alignment-layer", "0"], "add --alignment"),
])
def test_options_that_do_not_go_together_get_one_line(options, fragment):
    assert_clean_error(run_attn(*DECODE, *options, stdin="a b\n"), fragment)


def test_words_that_joining_merges_share_their_number():
    """Sentences joined without spacing ("a b" + "c" → "a bc"): b and c are one word of the
    line, and so are x and y of the output "xy z"."""
    from attn_cli.sentences import Paragraph, SplitTexts
    from attn_cli.translate import split_alignments

    split = SplitTexts((Paragraph(("a b", "c"), ("", "", "")), Paragraph((), (" ",))))
    aligned = [[(0, 0), (1, 0)], [(0, 1)]]
    assert split_alignments(split, ["x", "y z"], aligned) == ["0-0 1-0 1-1", ""]
