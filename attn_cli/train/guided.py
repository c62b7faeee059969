"""Guided alignment: one encoder-decoder attention head learns to follow word alignments.

Not in the paper: an option (`attn train --guided-alignment`), after Garg et al. (2019, "Jointly
Learning to Align and Translate with Transformer Models", §4.2), as OpenNMT-py's
`guided_alignment` and Marian's `--guided-alignment` have it. External alignments (fast_align,
eflomal: Pharaoh `i-j` lines, kept in the data file in pieces by `attn binarize --alignments`)
give, for each target piece t aligned with k source pieces, a reference distribution G_t uniform
over those k (target pieces aligned with nothing give none). The loss adds
λ · Σ_t CE(G_t, A_t), A_t the attention of one head of one decoder layer at the query that
predicts piece t, to the §5.4 loss sum; both are divided by the step's target tokens. Garg et
al. supervise one head of the penultimate layer with λ = 0.05: the defaults.

Only that head's log attention is written out (model.HeadAttention); every attention keeps its
fused kernel, and a run without guidance computes exactly what it did before.

How the alignments follow their pairs: a micro-batch is a list of pair indices (batching.py),
the same whatever the process count, and a resumed run takes the same ones; each process
builds the reference of its own micro-batches from those indices (`alignment_targets`), on the
host, as flat indices into the head's (B, T, S) attention: nothing to shuffle or save besides
the data position.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..alignment import layer_index
from ..config import ModelConfig, TrainOptions
from ..data import ParallelData
from ..errors import AttnError

OPTIONS = ("alignment_lambda", "alignment_layer", "alignment_head")  # --guided-alignment's


def check_options(options: TrainOptions) -> None:
    """The guidance options changed from their defaults go with --guided-alignment."""
    from ..config import TRAIN_DEFAULTS

    changed = [name for name in OPTIONS if getattr(options, name) != TRAIN_DEFAULTS[name]]
    if changed and not options.guided_alignment:
        names = ", ".join("--" + name.replace("_", "-") for name in changed)
        raise AttnError(f"{names} set how --guided-alignment supervises a head: add "
                        "--guided-alignment (and data binarized with --alignments)")
    if not options.alignment_lambda >= 0:  # NaN too
        raise AttnError(f"--alignment-lambda must be 0 or more, not {options.alignment_lambda}")


def guided_config(config: ModelConfig, options: TrainOptions,
                  data: ParallelData) -> ModelConfig:
    """The network to train: `config` naming the head --guided-alignment supervises (the file
    then records it, and `attn decode --alignment` reads that head), where the run is guided;
    else `config` as it is (a model that was guided before keeps saying which head was)."""
    if not options.guided_alignment:
        return config
    if not data.has_alignments:
        raise AttnError(f"{data.path} holds no word alignments: binarize it with --alignments "
                        "FILE (a Pharaoh line per pair) for --guided-alignment")
    layers, layer = config.decoder_layers, options.alignment_layer
    # The default, the penultimate layer, is a one-layer decoder's only one (as alignment.py
    # reads it); a layer asked for by number must be there.
    if not -layers <= layer < layers and not (layer == -2 and layers == 1):
        raise AttnError(f"--alignment-layer {layer}: the decoder has {layers} layers (0 to "
                        f"{layers - 1}, or -1 to -{layers} from the last)")
    if not 0 <= options.alignment_head < config.heads:
        raise AttnError(f"--alignment-head {options.alignment_head}: the layers have "
                        f"{config.heads} heads (0 to {config.heads - 1})")
    return dataclasses.replace(config, alignment_layer=layer_index(layer, layers),
                               alignment_head=options.alignment_head)


def alignment_targets(data: ParallelData, indices: np.ndarray, tgt_width: int,
                      src_width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The reference alignment of the micro-batch of pairs `indices` (rows in that order, as
    batching.collate makes them) padded to tgt_width (T) × src_width (S): (positions (M,) int64,
    flat indices into the supervised head's (B, T, S) attention; weights (M,) float32, the
    reference probability there, 1/k for a target piece aligned with k source pieces; the
    number of target pieces aligned). Row t of the attention is the query that predicts target
    piece t; source column s is source piece s."""
    starts = data.alignment_offsets[indices]
    ends = data.alignment_offsets[indices + 1]
    counts = (ends - starts).astype(np.int64)
    if not counts.any():
        return np.zeros(0, np.int64), np.zeros(0, np.float32), 0
    pairs = np.concatenate([data.alignment_pairs[start:end] for start, end in zip(starts, ends)])
    rows = np.repeat(np.arange(len(indices), dtype=np.int64), counts)
    src, tgt = pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)
    if ((src < 0) | (tgt < 0) | (src >= np.repeat(data.src_lengths[indices], counts))
            | (tgt >= np.repeat(data.tgt_lengths[indices], counts))).any():
        raise AttnError(f"data file {data.path} is corrupt (an alignment names a piece past the "
                        "end of its line)")
    queries = rows * tgt_width + tgt  # nondecreasing: each pair's sorted by target piece
    _, query_of_pair, per_query = np.unique(queries, return_inverse=True, return_counts=True)
    weights = (1.0 / per_query)[query_of_pair].astype(np.float32)
    return queries * src_width + src, weights, len(per_query)
