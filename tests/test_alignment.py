"""Word alignments from the cross-attention (alignment.py, `Translator.align`): pieces mapped to
words, pairs read off the chosen layer, and a model trained to reverse sequences (the committed
fixture) aligning word i with output word n-1-i."""

from __future__ import annotations

import pytest
import torch

from attn_cli import load_translator
from attn_cli.alignment import (
    align,
    alignment_attention,
    layer_index,
    pharaoh,
    piece_words,
    word_pairs,
)

from .conftest import REPO
from .toys import random_model, reversal_pairs

REVERSER = REPO / "tests" / "fixtures" / "run" / "checkpoint-600.st"


@pytest.fixture(scope="module")
def reverser():
    return load_translator(REVERSER, 4, device="cpu", threads=1, workers=1)


def test_pieces_map_to_the_words_they_spell():
    assert piece_words(["▁The", "▁cat", "s", "▁sat"]) == [0, 1, 1, 2]
    assert piece_words(["▁", "j", "▁i"]) == [0, 0, 1]  # a lone ▁: the word after it
    assert piece_words(["no", "▁mark", "ed"]) == [0, 1, 1]  # the first piece begins a word
    # "<unk>" is decoded " ⁇ ": a word of its own, even between pieces of one word
    assert piece_words(["▁a", "<unk>", "b", "▁c"]) == [0, 1, 2, 3]


def test_each_output_piece_takes_the_word_it_attends_to_most():
    # output pieces 0-1 are one word, 2 another; the source has words 0 (pieces 0-1) and 1
    assert word_pairs([2, 2, 0], [0, 0, 1], [0, 0, 1]) == [(0, 1), (1, 0)]
    assert pharaoh([(0, 1), (1, 0)]) == "0-1 1-0"
    assert word_pairs([], [0], []) == []


def test_the_penultimate_layer_by_default_clamped_to_the_layers_there_are():
    assert layer_index(-2, 6) == 4
    assert layer_index(-2, 1) == 0 and layer_index(5, 2) == 1 and layer_index(-9, 3) == 0


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
