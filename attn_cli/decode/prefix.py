"""Target prefixes (`attn decode --prefix`, CTranslate2's `target_prefix`): each output starts
with its sentence's given pieces, and the search continues from there. Not in the paper: a
translator's half-typed sentence, completed by the model.

The prefix is forced piece by piece through `search.beam_search`'s `Constraint` protocol: at step
t a hypothesis of a sentence whose prefix has more than t pieces may take only piece t (every
other token, EOS too, -inf), then anything. Every hypothesis of a step has t tokens, so the
state is the (B', K) count of tokens so far, on the search's device: no read per step. The
forced piece keeps the model's own log-probability, so a forced output scores as it would have
unforced (`attn score` gives it the same log-probability), and with --nbest the N best are the
beam's N best finished hypotheses, every one of them through the prefix. A beam search in the
C++ stream (float32 on a CPU, `stream.Stream.add(prefixes=)`) forces them by the same rule.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor

from ..search import Unconstrained


class PrefixConstraint(Unconstrained):
    """Each sentence's output starts with its prefix: `prefixes` (B, P) padded token ids,
    `lengths` (B,) each one's count of pieces (0: no prefix, a free search)."""

    def __init__(self, prefixes: Tensor, lengths: Tensor, eos_id: int):
        self.prefixes, self.lengths, self.eos_column = prefixes, lengths, eos_id

    @classmethod
    def for_batch(cls, prefixes: list[list[int]], eos_id: int) -> "PrefixConstraint":
        """The constraint of a batch of sentences, each with its prefix's ids (maybe none)."""
        # One column at least: `candidates` gathers a (clamped) column even where none is forced.
        width = max(1, max(map(len, prefixes), default=0))
        padded = torch.zeros(len(prefixes), width, dtype=torch.long)
        for row, ids in enumerate(prefixes):
            padded[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        return cls(padded, torch.tensor([len(ids) for ids in prefixes], dtype=torch.long),
                   eos_id)

    def to(self, device) -> "PrefixConstraint":
        moved = copy.copy(self)
        moved.prefixes, moved.lengths = self.prefixes.to(device), self.lengths.to(device)
        return moved

    def start(self, batch: int, beam: int, device) -> Tensor:
        """(B, K) no token yet."""
        return torch.zeros(batch, beam, dtype=torch.long, device=device)

    def candidates(self, log_probs: Tensor, state: Tensor, active: Tensor, steps_left: Tensor,
                   at_limit: Tensor) -> tuple[Tensor, None]:
        """The vocabulary's (B', K, V) log-probabilities, every token but the prefix's next
        piece at -inf in a row still inside its prefix. A row at its length limit is left free
        (the search then takes its EOS): a prefix longer than the output's limit is cut there
        rather than leaving the sentence without an output."""
        width = self.prefixes.shape[1]
        forced = (state < self.lengths[active].unsqueeze(-1)) & ~at_limit.unsqueeze(-1)  # (B', K)
        piece = self.prefixes[active].gather(1, state.clamp(max=width - 1)).unsqueeze(-1)
        piece_score = log_probs.gather(-1, piece)  # (B', K, 1)
        scores = log_probs.masked_fill(forced.unsqueeze(-1), -math.inf)
        # A free row gets its own score back at `piece`; a forced one its piece's score alone.
        return scores.scatter_(-1, piece, piece_score), None

    def advance(self, state: Tensor, origin: Tensor, tokens: Tensor) -> Tensor:
        return state.gather(1, origin) + 1

    def select(self, state: Tensor, chosen: Tensor, kept: Tensor | None) -> Tensor:
        state = state.gather(1, chosen)
        return state if kept is None else state[kept]
