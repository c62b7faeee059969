"""Word alignments from the model's encoder-decoder attention: which source word each output
word translates, as Pharaoh's pairs `i-j` (source word i, output word j, from 0) over the
whitespace-separated words of a line and of its translation.

The paper's Figures 3-5 show heads whose attention follows the words. Garg et al. (2019,
"Jointly Learning to Align and Translate with Transformer Models"), whose recipe fairseq's
alignment models follow, read alignments off the average of the heads of the penultimate decoder
layer: each output piece is aligned with the source piece it attends to most (the source's </s>
left out), and pieces are mapped to words. Alignment error rate against eflomal chose the layer
by the decoder's depth (`default_layer`: the penultimate of six layers, the last of three), its
heads averaged; `layer` and `heads` choose others. A model trained with
guided alignment (`attn train --guided-alignment`, Garg et al.'s other half: one head supervised
with external alignments) names its supervised layer and head in its config: that one head is
then the default.

The attention comes from a second, teacher-forced pass of the model over the source and the
finished output: the weights the search computed as it went (the same model over the same
prefixes), without touching the search, which stays as fast for callers that do not ask for
alignments. Its cost is one forward pass, that of scoring the output (`attn score -m`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..alignment import Alignment, clamped, layer_index, piece_words, word_pairs, word_spans
from ..batching import collate_pairs
from ..model import AttentionWeights


def default_layer(layers: int) -> int:
    """The decoder layer alignments are read off by default, chosen by alignment error rate
    against eflomal on Multi30k test2016 (benchmarks/README.md, `alignment_aer.py`): the last of
    a decoder of three layers or fewer (0.43 and 0.49 against the penultimate's 0.54 and 0.60),
    the penultimate of a deeper one (Garg et al.'s choice for six layers; 0.824 against the
    last's 0.836 for `base`). Heads averaged: a single head beat the average by 0.011 at most,
    and which head that is belongs to one trained model."""
    return -1 if layers <= 3 else -2


def chosen_heads(config, layer: int | None = None, heads: Sequence[int] | None = None
                 ) -> tuple[int, Sequence[int] | None]:
    """The decoder layer (from 0) and heads (None: all) alignments are read off: those asked,
    where `layer` is None the supervised layer of a model trained with guided alignment (its
    config's `alignment_layer`), else `default_layer`'s; of the supervised layer, where `heads`
    is None, the supervised head alone (`alignment_head`), the one trained to align."""
    supervised = getattr(config, "alignment_layer", None)
    if layer is None:
        layer = default_layer(config.decoder_layers) if supervised is None else supervised
    index = layer_index(layer, config.decoder_layers)
    if heads is None and supervised is not None and index == supervised:
        heads = [config.alignment_head]
    return index, heads


def alignment_attention(model, src_tokens: Tensor, tgt_input: Tensor,
                        layer: int | None = None, heads: Sequence[int] | None = None) -> Tensor:
    """The map alignments are read off, (B, T, S) in float32: the encoder-decoder attention of
    decoder layer `layer` averaged over `heads` (`chosen_heads`: by default a guided model's
    supervised head, else the penultimate layer's heads), in a teacher-forced pass over the
    padded batch src_tokens (B, S), tgt_input (B, T) (BOS + output). Row t is the query that
    predicts output piece t; the columns of the source's </s> and padding are -inf."""
    layer, heads = chosen_heads(model.config, layer, heads)
    memory, src_mask = model.encode(src_tokens)
    # Only the encoder-decoder attention written out (`decoder=None`: the self-attention keeps
    # its fused kernel).
    weights = AttentionWeights(decoder=None)
    model.decode(tgt_input, memory, src_mask, weights)
    chosen = weights.cross[layer]  # (B, H, T, S)
    if heads is not None:
        chosen = chosen[:, list(heads)]
    attention = chosen.float().mean(dim=1)
    config = model.config
    not_a_piece = (src_tokens == config.eos_id) | (src_tokens == config.pad_id)
    return attention.masked_fill_(not_a_piece[:, None, :], -math.inf)


def align(model, sources: list[list[int]], outputs: list[list[int]],
          source_words: list[list[int]], output_words: list[list[int]],
          layer: int | None = None, heads: Sequence[int] | None = None,
          sentences_per_pass: int = 32, tags: int = 0, starts: int = 0) -> list[Alignment]:
    """Each pair's alignment: `sources` and `outputs` the ids (no BOS, no EOS, neither empty),
    `source_words` and `output_words` the word of each id (`piece_words`). `tags`: how many
    ids every source starts with that are no word of it (tags.py's target-language tags, which
    `source_words` counts as -1): never aligned. `starts`: how many ids every output starts
    with that its words leave out (a target language's code, forced: `Translator.target_start`):
    attended from, never aligned."""
    config = model.config
    device = next(model.parameters()).device
    found = []
    for start in range(0, len(sources), sentences_per_pass):
        pairs = list(zip(sources[start:start + sentences_per_pass],
                         outputs[start:start + sentences_per_pass]))
        batch = collate_pairs(pairs, config.bos_id, config.eos_id, config.pad_id).to(device)
        with torch.inference_mode():
            attention = alignment_attention(model, batch.src_tokens, batch.tgt_input, layer,
                                            heads)
            attention[:, :, :tags] = -math.inf
            nearest = attention.argmax(dim=-1).tolist()  # (B, T): the one read of the batch
        for offset, row in enumerate(nearest):
            found.append(word_pairs(row[starts:], source_words[start + offset],
                                    output_words[start + offset]))
    return found


def source_pieces(vocab, line: str) -> list[str]:
    """The pieces SentencePiece cuts `line` into, as text (an unknown one keeps its surface,
    and its "▁", which its id would lose)."""
    return vocab.processor.encode(line, out_type=str)


def align_lines(model, src_vocab, tgt_vocab, lines: list[str], outputs: list[list[int]],
                max_source: int, layer: int | None = None,
                heads: Sequence[int] | None = None,
                source_tags: Sequence[int] = (),
                target_start: Sequence[int] = ()) -> list[Alignment]:
    """The alignment of each line with its output `outputs[i]` (output ids, as a search's
    `Hypothesis.tokens`): pairs over the words of the line and of the output's text (what
    `tgt_vocab.decode` makes of it). An empty line or output aligns nothing. `source_tags`:
    the ids the search put before each line (`--target-lang`'s tag), attended to, aligned with
    nothing; `target_start`: the ids the search forced before each output, the same."""
    found: list[Alignment] = [[] for _ in lines]
    texts = tgt_vocab.decode(outputs)
    encoded = src_vocab.encode(lines)
    todo = [i for i, line in enumerate(lines)
            if encoded[i] and word_spans(line) and word_spans(texts[i])]
    if not todo:
        return found
    sources, source_words, output_words = [], [], []
    for i in todo:
        ids, pieces = encoded[i], source_pieces(src_vocab, lines[i])
        if len(pieces) != len(ids):  # a vocabulary whose pieces are not spm's own: by id
            pieces = [src_vocab.piece(token) for token in ids]
        kept = max_source - len(source_tags)
        sources.append([*source_tags, *ids[:kept]])  # as the search saw it
        source_words.append([-1] * len(source_tags) + clamped(piece_words(pieces[:kept]),
                                                              len(word_spans(lines[i]))))
        out_words = piece_words([tgt_vocab.piece(token) for token in outputs[i]])
        output_words.append(clamped(out_words, len(word_spans(texts[i]))))
    aligned = align(model, sources, [[*target_start, *outputs[i]] for i in todo], source_words,
                    output_words, layer, heads, tags=len(source_tags), starts=len(target_start))
    for i, alignment in zip(todo, aligned):
        found[i] = alignment
    return found
