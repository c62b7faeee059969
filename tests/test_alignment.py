"""Word alignments as words and pieces (alignment.py): pieces mapped to the words they spell, pairs
read off the piece each output piece attends to most, decoder layers clamped, Pharaoh's format."""

from __future__ import annotations

from attn_cli.alignment import layer_index, pharaoh, piece_words, word_pairs


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
