"""Beam search as the paper used it (§6.1): beam 4, the GNMT length penalty ((5+|Y|)/6)^α with
α 0.6, outputs of at most a·|x| + b tokens, and early termination as soon as no live hypothesis
can beat the finished ones. Greedy search is beam 1.

Batched over sentences and beams at once on the model's incremental interface (`encode`,
`start_decoding`, `decode_step`, `DecoderCache.reorder`); the cross-attention keys/values are
computed once per batch and sentences that are done leave the batch. Small pure functions do the
arithmetic so that each can be tested against hand computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def length_penalty(length: int | Tensor, alpha: float):
    """GNMT (Wu et al. 2016): lp(Y) = ((5 + |Y|) / 6)^α; |Y| counts the EOS."""
    return ((5.0 + length) / 6.0) ** alpha


def max_output_length(src_length: int, a: float, b: int) -> int:
    """§6.1: "maximum output length to input length + 50" (a=1, b=50); |x| without the EOS."""
    return max(1, int(a * src_length + b))


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # without BOS and EOS
    score: float  # log-probability / length penalty (the ranking score)
    log_prob: float  # the sum of token log-probabilities, EOS included


def topk_over_beams(scores: Tensor, logits: Tensor, log_normalizer: Tensor,
                    k: int) -> tuple[Tensor, Tensor, Tensor]:
    """scores (B, K) of live beams + next-token logits (B, K, V) with their log-normalizers
    (B, K, 1) → the best k extensions of every sentence: (their scores (B, k), the beam each
    extends (B, k), the token (B, k)). The k best of a sentence are among the k best of each of
    its beams, so the full log-softmax over the vocabulary is never materialised."""
    batch, beams, vocab = logits.shape
    per_beam = min(k, vocab)
    top_logits, top_tokens = logits.topk(per_beam, dim=-1)  # (B, K, k)
    candidates = (scores.unsqueeze(-1) + (top_logits - log_normalizer)).view(batch, -1)
    best, flat = candidates.topk(min(k, beams * per_beam), dim=-1)
    return best, torch.div(flat, per_beam, rounding_mode="floor"), \
        top_tokens.view(batch, -1).gather(1, flat)


def can_stop(finished: list[Hypothesis], best_live_log_prob: float, beam: int,
             longest: int, alpha: float) -> bool:
    """Early termination: with `beam` hypotheses finished, stop when the best live one cannot
    catch up. Log-probabilities only fall as a hypothesis grows and the penalty only grows with
    length, so the best any live hypothesis can still reach is its log-prob over the penalty of
    the longest allowed output."""
    if len(finished) < beam:
        return False
    worst_kept = sorted(h.score for h in finished)[-beam]
    return best_live_log_prob / length_penalty(longest, alpha) <= worst_kept


@torch.inference_mode()
def beam_search(model, src_tokens: Tensor, beam: int = 4, alpha: float = 0.6,
                max_len_a: float = 1.0, max_len_b: int = 50, nbest: int = 1,
                banned: tuple[int, ...] | None = None, longest: int | None = None,
                constraint=None) -> list[list[Hypothesis]]:
    """src_tokens (B, S), padded with pad_id and ending in EOS → for each sentence, its `nbest`
    best hypotheses, best first. `beam=1` is greedy search. `longest` caps every output length
    (a model with learned positions has no position past its table). `constraint` (optional,
    e.g. `TreeConstraint`) says which tokens each hypothesis may take next."""
    config = model.config
    eos, pad = config.eos_id, config.pad_id
    banned = (pad, config.bos_id) if banned is None else banned
    device = src_tokens.device
    batch = src_tokens.shape[0]
    nbest = min(nbest, beam)
    src_lengths = (src_tokens != pad).sum(dim=1) - 1  # without EOS
    limits = [min(max_output_length(int(n), max_len_a, max_len_b), longest or math.inf)
              for n in src_lengths.tolist()]

    memory, src_mask = model.encode(src_tokens)
    cache = model.start_decoding(memory, src_mask)
    rows = torch.arange(batch, device=device).repeat_interleave(beam)
    cache = cache.reorder(rows)  # (B·K) rows: every sentence's beams
    scores = torch.full((batch, beam), -math.inf, device=device)
    scores[:, 0] = 0.0  # one live hypothesis at first: the K beams must not start as copies
    tokens = torch.full((batch * beam,), config.bos_id, dtype=torch.long, device=device)
    history = torch.empty((batch, beam, 0), dtype=torch.long, device=device)
    active = list(range(batch))  # sentence ids of the batch rows still searching
    state = constraint.start(batch, beam, device) if constraint is not None else None
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]

    for step in range(max(limits)):
        logits, cache = model.decode_step(tokens, cache)
        logits = logits.float().view(len(active), beam, -1)
        log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)  # the model's own p
        logits[..., list(banned)] = -math.inf  # never chosen, but not renormalised away
        at_limit = torch.tensor([step + 1 >= limits[s] for s in active], device=device)
        if constraint is not None:
            steps_left = torch.tensor([limits[s] - step - 1 for s in active], device=device)
            allowed = constraint.allowed(state, active, steps_left) | at_limit.view(-1, 1, 1)
            logits.masked_fill_(~allowed, -math.inf)
        if at_limit.any():  # the last allowed position: only EOS
            forced = torch.full_like(logits[at_limit], -math.inf)
            forced[..., eos] = logits[at_limit][..., eos]
            logits[at_limit] = forced
        best, origin, next_tokens = topk_over_beams(scores, logits, log_normalizer, 2 * beam)
        history = torch.cat([history.gather(1, origin.unsqueeze(-1).expand(
            -1, -1, history.shape[-1])), next_tokens.unsqueeze(-1)], dim=-1)
        if constraint is not None:
            state = constraint.advance(state, origin, next_tokens)

        ends = next_tokens == eos
        penalty = length_penalty(step + 1, alpha)
        keep_rows, keep_sentences, new_scores, new_tokens = [], [], [], []
        best_cpu, ends_cpu = best.tolist(), ends.tolist()
        for row, sentence in enumerate(active):
            live = []
            for rank in range(len(best_cpu[row])):
                if best_cpu[row][rank] == -math.inf:
                    break
                if ends_cpu[row][rank]:
                    if rank < beam:  # an EOS among the top `beam` candidates finishes one
                        finished[sentence].append(Hypothesis(
                            history[row, rank, :-1].tolist(), best_cpu[row][rank] / penalty,
                            best_cpu[row][rank]))
                elif len(live) < beam:
                    live.append(rank)
            best_live = best_cpu[row][live[0]] if live else -math.inf
            done = not live or can_stop(finished[sentence], best_live, beam,
                                        limits[sentence], alpha)
            if done:
                continue
            while len(live) < beam:  # keep the shape; padding beams can never be chosen
                live.append(live[-1])
            keep_sentences.append(sentence)
            keep_rows.append((row, live, len(set(live))))
        if not keep_sentences:
            break
        row_index = torch.tensor([row for row, _, _ in keep_rows], device=device)
        rank_index = torch.tensor([live for _, live, _ in keep_rows], device=device)
        new_scores = best[row_index.unsqueeze(-1), rank_index].clone()
        for position, (_, _, distinct) in enumerate(keep_rows):
            new_scores[position, distinct:] = -math.inf
        new_tokens = next_tokens[row_index.unsqueeze(-1), rank_index]
        parents = origin[row_index.unsqueeze(-1), rank_index]  # (B', K) beam in the old row
        cache_rows = (row_index.unsqueeze(-1) * beam + parents).view(-1)
        cache = cache.reorder(cache_rows, same_sources=len(keep_sentences) == len(active))
        history = history[row_index.unsqueeze(-1), rank_index]
        if constraint is not None:
            state = tuple(part[row_index.unsqueeze(-1), rank_index] for part in state)
        scores, tokens, active = new_scores, new_tokens.view(-1), keep_sentences

    return [sorted(hypotheses, key=lambda h: -h.score)[:nbest] or [Hypothesis([], -math.inf,
                                                                             -math.inf)]
            for hypotheses in finished]


class TreeConstraint:
    """Search constraint for linearized trees (an option of `attn parse`, not in the paper):
    exactly as many placeholders as the sentence has words, closing brackets only inside an open
    one, EOS only when every word is placed and every bracket closed, nothing but brackets and
    placeholders. The state per hypothesis is (placeholders emitted, open brackets)."""

    OTHER, PLACEHOLDER, OPEN, CLOSE, END = range(5)

    def __init__(self, piece_classes: Tensor, word_counts: list[int]):
        self.piece_classes = piece_classes  # (V,) long: the class of every vocabulary piece
        self.word_counts = word_counts  # per sentence of the batch

    @classmethod
    def for_pieces(cls, pieces: list[str], eos_id: int, word_counts: list[int],
                   placeholder: str = "XX") -> "TreeConstraint":
        classes = []
        for piece in pieces:
            text = piece.lstrip("\u2581")
            if text == placeholder:
                classes.append(cls.PLACEHOLDER)
            elif text.startswith("(") and len(text) > 1:
                classes.append(cls.OPEN)
            elif text.startswith(")"):
                classes.append(cls.CLOSE)
            else:
                classes.append(cls.OTHER)
        classes[eos_id] = cls.END
        return cls(torch.tensor(classes), word_counts)

    def start(self, batch: int, beam: int, device) -> tuple[Tensor, Tensor]:
        self.piece_classes = self.piece_classes.to(device)
        zeros = torch.zeros(batch, beam, dtype=torch.long, device=device)
        return zeros, zeros.clone()

    def allowed(self, state: tuple[Tensor, Tensor], active: list[int],
                steps_left: Tensor) -> Tensor:
        """(B', K, V) True where a token may come next. `steps_left` (B',): the tokens that may
        still follow this one; every choice must leave room to place the missing words, close
        the open brackets and end."""
        placed, depth = state  # (B', K)
        words = torch.tensor([self.word_counts[s] for s in active],
                             device=placed.device).unsqueeze(-1)
        missing = words - placed
        room = steps_left.unsqueeze(-1)
        by_class = torch.stack([
            torch.zeros_like(depth, dtype=torch.bool),  # anything else: never
            (missing > 0) & (missing + depth <= room),  # a placeholder
            (missing > 0) & (missing + depth + 2 <= room),  # an opening bracket
            (depth > 0) & (missing + depth <= room),  # a closing bracket
            (missing <= 0) & (depth == 0),  # the end
        ], dim=-1)  # (B', K, classes)
        stuck = ~by_class.any(dim=-1, keepdim=True)  # out of room: let the repair cope
        by_class = by_class | (stuck & torch.tensor([False, True, False, True, True],
                                                    device=depth.device))
        return by_class[..., self.piece_classes]  # (B', K, V)

    def advance(self, state: tuple[Tensor, Tensor], origin: Tensor,
                tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The state of every candidate: its parent beam's, plus the token it adds."""
        placed, depth = (part.gather(1, origin) for part in state)
        kind = self.piece_classes[tokens]
        return (placed + (kind == self.PLACEHOLDER).long(),
                depth + (kind == self.OPEN).long() - (kind == self.CLOSE).long())
