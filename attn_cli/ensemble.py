"""Models loaded for inference, one or several searched and scored as one (`-m A -m B`).

An ensemble's next-token distribution is the average of its models' log-probabilities (a
product of experts), renormalised: what `attn decode` searches and `attn score -m` scores. The
models must share their vocabularies; their architectures may differ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .devices import choose_cudnn_attention, pick_device
from .errors import AttnError
from .modelfile import LoadedModel, load_model


def set_threads(threads: int) -> int:
    """Torch threads of this (the calling) thread: `threads`, or every core for 0."""
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    return threads


def load_models(paths: list, device: str = "auto", threads: int = 0
                ) -> tuple[list[LoadedModel], torch.device, int]:
    """Model files loaded for inference: on `device` (auto: a GPU when torch sees one), with
    this thread's torch threads set (0: every core), checked to share their vocabularies.
    Returns (models, device, threads)."""
    threads = set_threads(threads)
    chosen = pick_device(device)
    choose_cudnn_attention("off", chosen)  # why: its docstring (decoding 8% faster without)
    models = [load_model(path, device=chosen) for path in paths]
    check_same_vocabularies(models, [str(path) for path in paths])
    return models, chosen, threads


def check_same_vocabularies(models: list[LoadedModel], names: list[str]) -> None:
    """An ensemble's models must read and write the same pieces."""
    first = models[0]
    for other, name in zip(models[1:], names[1:]):
        if not first.same_vocabularies(other):
            raise AttnError(f"{name} has another vocabulary than {names[0]}: the models of an "
                            "ensemble must share their vocabularies")


class Ensemble:
    """Several models searched as one: each step's next-token log-probabilities are the
    average of the models' (which the search's log-softmax renormalises). Implements what the
    search needs of a model (`search.SearchModel`), and teacher-forced scoring (`log_probs`)."""

    def __init__(self, models: list[torch.nn.Module]):
        self.models = models
        self.config = models[0].config  # the special ids, the same in every model

    def encode(self, src_tokens: torch.Tensor):
        encoded = [model.encode(src_tokens) for model in self.models]
        return encoded, encoded[0][1]

    def start_decoding(self, memory, src_mask, output_ids=None) -> "EnsembleCache":
        return EnsembleCache(tuple(model.start_decoding(*encoded, output_ids)
                                   for model, encoded in zip(self.models, memory)))

    def decode_step(self, tokens: torch.Tensor, cache: "EnsembleCache"):
        steps = [model.decode_step(tokens, part) for model, part in zip(self.models,
                                                                       cache.parts)]
        return _mean_log_probs([logits for logits, _ in steps]), \
            EnsembleCache(tuple(part for _, part in steps))

    def gold_log_probs(self, src_tokens: torch.Tensor, tgt_input: torch.Tensor,
                       tgt_output: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: (B, T) log-probabilities of the gold next tokens `tgt_output`, the
        one model's, or the models' averaged and renormalised. The output projection and its
        log-softmax run a block of positions at a time (as training's loss does): a batch's
        whole (B, T, V) logits would be ~1.2 GB per model at 8,000 tokens and V = 37,000,
        in float32, and more with a GPU's 64,000."""
        hidden = [model.decode(tgt_input, *model.encode(src_tokens)).flatten(0, 1)
                  for model in self.models]
        gold = tgt_output.reshape(-1, 1)
        # Blocks of equal size: no few-row remainder, whose matmul may take another kernel
        # and round otherwise than the whole batch's would.
        blocks = -(-gold.shape[0] * self.config.tgt_vocab_size // GOLD_BLOCK_ELEMENTS)
        rows = -(-gold.shape[0] // max(1, blocks))
        picked = []
        for start in range(0, gold.shape[0], rows):
            each = [torch.log_softmax(model.output_logits(states[start:start + rows]).float(),
                                      dim=-1) for model, states in zip(self.models, hidden)]
            log_probs = each[0] if len(each) == 1 else torch.log_softmax(
                torch.stack(each).mean(dim=0), dim=-1)
            picked.append(log_probs.gather(-1, gold[start:start + rows]).squeeze(-1))
        return torch.cat(picked).view_as(tgt_output)


# Logits scored at once per model: 64 MB of float32.
GOLD_BLOCK_ELEMENTS = 1 << 24


def _mean_log_probs(logits: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.log_softmax(part.float(), dim=-1) for part in logits]).mean(dim=0)


@dataclass(frozen=True)
class EnsembleCache:
    """The decoder caches of an ensemble's models, reordered together."""

    parts: tuple

    def reorder(self, rows: torch.Tensor, sources: torch.Tensor | None = None):
        return EnsembleCache(tuple(part.reorder(rows, sources) for part in self.parts))
