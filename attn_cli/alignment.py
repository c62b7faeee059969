"""Word alignments as Pharaoh's pairs `i-j` (source word i, target word j, from 0) over the
whitespace-separated words of a line and of its translation, and the bookkeeping between words and
SentencePiece's pieces: what binarize's reference alignments (`--alignments`), guided-alignment
training, HTML markup and decode's alignments (`decode/alignment.py`, which reads them off the
model's attention) share. Torch-free: the markup that counts words needs no torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .errors import AttnError

# Pairs (source word, output word), sorted: one line's alignment.
Alignment = list[tuple[int, int]]

WORD_START = "\u2581"  # SentencePiece's mark of a piece that begins a word ("▁")
UNKNOWN_PIECE = "<unk>"  # decoded as " ⁇ ": a word of its own
WORD = re.compile(r"\S+")


def word_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each whitespace-separated word of `text`: the words alignments count."""
    return [match.span() for match in WORD.finditer(text)]


def piece_words(pieces: Sequence[str]) -> list[int]:
    """The word (from 0) each SentencePiece piece belongs to: a piece beginning with "▁" begins a
    word, a lone "▁" belongs to the word after it, an unknown piece is a word of its own."""
    words, index, boundary = [], -1, True
    for piece in pieces:
        if piece == UNKNOWN_PIECE:
            index += 1
            words.append(index)
            boundary = True
            continue
        boundary = boundary or piece.startswith(WORD_START)
        if not piece.lstrip(WORD_START):  # "▁" alone: the space before the next word
            words.append(index + 1)
            continue
        if boundary:
            index, boundary = index + 1, False
        words.append(index)
    return words


def layer_index(layer: int, layers: int) -> int:
    """Decoder layer `layer` (a Python index, -1 the last) among `layers`, clamped to those
    there are: the penultimate of a one-layer decoder is its only layer."""
    return min(max(layer, -layers), layers - 1) % layers


def word_pairs(nearest: Sequence[int], source_words: Sequence[int],
               output_words: Sequence[int]) -> Alignment:
    """Output piece t aligned with source piece nearest[t] (the one it attends to most), as
    pairs of their words, sorted, each once."""
    return sorted({(source_words[s], output_words[t])
                   for t, s in zip(range(len(output_words)), nearest)})


def clamped(words: list[int], count: int) -> list[int]:
    """Piece-to-word indices kept within the `count` words of the text (pieces and words can
    disagree on text SentencePiece normalises, say full-width forms)."""
    return [min(word, count - 1) for word in words]


def pharaoh(alignment: Alignment) -> str:
    """"0-0 1-2 2-1": the format of fast_align, GIZA++ and the alignment test sets."""
    return " ".join(f"{source}-{output}" for source, output in alignment)


# ------------------------------------------------- reference alignments, for guided training


def read_pharaoh(line: str, where: str, source_words: int, target_words: int,
                 source_line: str = "the source line",
                 target_line: str = "the target line") -> Alignment:
    """The pairs (source word, target word) of one line of a Pharaoh alignment file ("0-0 1-2
    2-1", words from 0, as fast_align and eflomal write them), each checked against the word
    counts of its pair's lines (`source_line`, `target_line`: how the error names them). A bad
    pair is an AttnError starting with `where` (the file and line)."""
    pairs = set()
    for token in line.split():
        source, dash, target = token.partition("-")
        if not (dash and source.isdigit() and target.isdigit() and source.isascii()
                and target.isascii()):
            raise AttnError(f"{where}: {token!r} is not a pair i-j of word numbers (Pharaoh "
                            "format, words from 0: 0-0 1-2 2-1)")
        for side, index, count, name in (("source", int(source), source_words, source_line),
                                         ("target", int(target), target_words, target_line)):
            if index >= count:
                raise AttnError(f"{where}: pair {token} names {side} word {index}, but {name} "
                                f"has {count} word{'s' * (count != 1)}"
                                f"{f' (0-{count - 1})' if count > 1 else ''}")
        pairs.add((int(source), int(target)))
    return sorted(pairs)


def piece_pairs(word_alignment: Alignment, source_words: Sequence[int],
                target_words: Sequence[int]) -> list[tuple[int, int]]:
    """Word pairs to piece pairs (source piece, target piece), sorted by target piece, then
    source piece: every piece of source word i with every piece of target word j, for each
    pair (i, j). `source_words` and `target_words` are the word of each piece
    (`piece_words`)."""
    def pieces_of(words: Sequence[int]) -> dict[int, list[int]]:
        found: dict[int, list[int]] = {}
        for piece, word in enumerate(words):
            found.setdefault(word, []).append(piece)
        return found

    source_pieces_of, target_pieces_of = pieces_of(source_words), pieces_of(target_words)
    return sorted({(s, t) for i, j in word_alignment
                   for s in source_pieces_of.get(i, ()) for t in target_pieces_of.get(j, ())},
                  key=lambda pair: (pair[1], pair[0]))
