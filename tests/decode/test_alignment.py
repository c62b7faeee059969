"""Word alignments read off the cross-attention (decode/alignment.py, `Translator.align`, `attn
decode --alignment`): the chosen layer and heads, a model trained to reverse sequences (the
committed fixture, tests/fixtures/run/checkpoint-600.st) aligning word i with output word n-1-i,
and through the real entry point each output followed by a TAB and its Pharaoh pairs, read in the
search's windows."""

from __future__ import annotations

import pytest
import torch

from attn_cli import load_translator
from attn_cli.alignment import pharaoh
from attn_cli.decode.alignment import align, alignment_attention

from ..conftest import REPO, assert_clean_error, run_attn
from ..toys import random_model, reversal_pairs

REVERSER = REPO / "tests" / "fixtures" / "run" / "checkpoint-600.st"


@pytest.fixture(scope="module")
def reverser():
    return load_translator(REVERSER, 4, device="cpu", threads=1, workers=1)


def test_attention_skips_the_source_end_and_padding_and_averages_the_chosen_heads():
    model = random_model(vocab=9)
    src = torch.tensor([[4, 5, 3, 0], [6, 7, 8, 3]])  # padded, each ending in </s> (3)
    tgt_in = torch.tensor([[2, 5, 6], [2, 4, 0]])
    with torch.inference_mode():
        attention = alignment_attention(model, src, tgt_in)
        first_head = alignment_attention(model, src, tgt_in, layer=0, heads=[0])
    assert attention.shape == (2, 3, 4)
    assert torch.isinf(attention[0, :, 2:]).all() and torch.isinf(attention[1, :, 3]).all()
    assert torch.isfinite(attention[1, :, :3]).all()
    # layer -2 of a two-layer decoder is layer 0; its first head differs from the average
    assert not torch.equal(attention, first_head)
    assert align(model, [[4, 5]], [[5, 6]], [[0, 1]], [[0, 0]]) == [
        sorted({(int(s), 0) for s in attention[0, :2, :2].argmax(-1)})]


def test_a_model_trained_to_reverse_aligns_the_anti_diagonal(reverser):
    """Of held-out sequences of distinct letters that the model reverses exactly, word i aligns
    with output word n-1-i and nothing else (67 of 68 measured; the bound leaves room)."""
    lines, expected = reversal_pairs(200, seed=99, letters="abcdefghij")
    texts, alignments = reverser.translate_aligned(lines)
    checked = [(line, alignment) for line, text, target, alignment
               in zip(lines, texts, expected, alignments)
               if text == target and len(set(line.split())) == len(line.split())]
    assert len(checked) >= 40
    diagonal = sum(alignment == [(i, len(line.split()) - 1 - i)
                                 for i in range(len(line.split()))]
                   for line, alignment in checked)
    assert diagonal >= 0.9 * len(checked), checked


def test_translator_align_takes_any_outputs_and_empty_lines(reverser):
    vocab = reverser.tgt_vocab
    outputs = vocab.encode(["c b a", "", "x"])
    aligned = reverser.align(["a b c", "a b", ""], outputs)
    assert aligned[0] == [(0, 2), (1, 1), (2, 0)]
    assert aligned[1] == [] and aligned[2] == []  # an empty output, an empty line


# -------------------------------------------------------------------------- attn decode --alignment


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
    (as the library's bound above: nearly all of them)."""
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
    from attn_cli.decode.pipe import split_alignments
    from attn_cli.decode.sentences import Paragraph, SplitTexts

    split = SplitTexts((Paragraph(("a b", "c"), ("", "", "")), Paragraph((), (" ",))))
    aligned = [[(0, 0), (1, 0)], [(0, 1)]]
    assert split_alignments(split, ["x", "y z"], aligned) == ["0-0 1-0 1-1", ""]
