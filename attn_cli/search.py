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


def topk_blocked(values: Tensor, k: int, width: int = 64) -> tuple[Tensor, Tensor]:
    """values.topk(k, dim=-1) (sorted), faster over a long last dimension (a vocabulary) on a
    CPU: the k largest values lie in the k blocks of `width` whose maxima are largest (a block
    left out has k blocks above it, each holding a larger value), so one cheap block-max pass
    leaves a full top-k over k·width values instead of all of them."""
    size = values.shape[-1]
    blocks = size // width
    if blocks <= 2 * k:
        return values.topk(k, dim=-1)
    body = values[..., :blocks * width].unflatten(-1, (blocks, width))
    chosen = body.amax(dim=-1).topk(k, dim=-1).indices  # (..., k)
    offsets = torch.arange(width, device=values.device)
    columns = (chosen.unsqueeze(-1) * width + offsets).flatten(-2)  # (..., k·width)
    if blocks * width < size:  # the ragged last block is always a candidate
        tail = torch.arange(blocks * width, size, device=values.device)
        columns = torch.cat([columns, tail.expand(*columns.shape[:-1], -1)], dim=-1)
    top, position = values.gather(-1, columns).topk(k, dim=-1)
    return top, columns.gather(-1, position)


def topk_over_beams(scores: Tensor, log_probs: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """scores (B, K) of live beams + next-token log-probabilities (B, K, V) → the best k
    extensions of every sentence: (their scores (B, k), the beam each extends (B, k), the
    token (B, k)). The k best of a sentence are among the k best of each of its beams, so the
    (B, K·V) sum is never formed."""
    batch, beams, vocab = log_probs.shape
    per_beam = min(k, vocab)
    top_log_probs, top_tokens = topk_blocked(log_probs, per_beam)  # (B, K, per_beam)
    candidates = (scores.unsqueeze(-1) + top_log_probs).view(batch, -1)
    best, flat = candidates.topk(min(k, beams * per_beam), dim=-1)
    return best, torch.div(flat, per_beam, rounding_mode="floor"), \
        top_tokens.view(batch, -1).gather(1, flat)


def can_stop(kth_best_finished: Tensor, best_live_log_prob: Tensor, longest: Tensor,
             alpha: float) -> Tensor:
    """Early termination, per sentence: stop when no live hypothesis can still beat the n-th
    best finished one (n = the hypotheses asked for; -inf until there are n), since then the
    answer is settled. Log-probabilities only fall as a hypothesis grows and the penalty only
    grows with length, so the best any live hypothesis can still reach is its log-prob over the
    penalty of the longest allowed output. Exact: the search returns what it would have
    returned had it run every sentence to its length limit."""
    return best_live_log_prob / length_penalty(longest, alpha) <= kth_best_finished


@torch.inference_mode()
def beam_search(model, src_tokens: Tensor, beam: int = 4, alpha: float = 0.6,
                max_len_a: float = 1.0, max_len_b: int = 50, nbest: int = 1,
                banned: tuple[int, ...] | None = None, longest: int | None = None,
                constraint=None, stop_early: bool = True) -> list[list[Hypothesis]]:
    """src_tokens (B, S), padded with pad_id and ending in EOS → for each sentence, its `nbest`
    best hypotheses, best first. `longest` caps every output length
    (a model with learned positions has no position past its table). `constraint` (optional,
    e.g. `TreeConstraint`) says which tokens each hypothesis may take next. `stop_early=False`
    runs every sentence to its length limit (for tests: the answer must not change).
    `beam=1` is greedy decoding, as tensor2tensor does for a beam of one: the most probable
    token at each step until EOS (the length penalty then only scales the reported score).

    Each step, the 2K best extensions of a sentence's K beams are ranked: an EOS among the first
    K finishes a hypothesis, and the first K that are not EOS live on (one EOS at most per beam,
    so there are always K of them). Everything but the few finished hypotheses stays in tensors;
    rows are grouped K per sentence, which the model uses to share each source's memory."""
    config = model.config
    eos, pad = config.eos_id, config.pad_id
    banned = list((pad, config.bos_id) if banned is None else banned)
    device = src_tokens.device
    batch = src_tokens.shape[0]
    nbest = min(nbest, beam)
    src_lengths = (src_tokens != pad).sum(dim=1) - 1  # without EOS
    limits = [min(max_output_length(int(n), max_len_a, max_len_b), longest or math.inf)
              for n in src_lengths.tolist()]
    limit_of = torch.tensor(limits, device=device)  # (B,)
    kth_best_finished = torch.full((batch,), -math.inf, device=device)

    memory, src_mask = model.encode(src_tokens)
    cache = model.start_decoding(memory, src_mask)
    cache = cache.reorder(torch.arange(batch, device=device).repeat_interleave(beam))
    scores = torch.full((batch, beam), -math.inf, device=device)
    scores[:, 0] = 0.0  # one live hypothesis at first: the K beams must not start as copies
    tokens = torch.full((batch * beam,), config.bos_id, dtype=torch.long, device=device)
    history = torch.empty((batch, beam, 0), dtype=torch.long, device=device)
    active = torch.arange(batch, device=device)  # the sentence of each batch row still searching
    state = constraint.start(batch, beam, device) if constraint is not None else None
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]

    for step in range(max(limits)):
        logits, cache = model.decode_step(tokens, cache)
        log_probs = torch.log_softmax(logits.float(), dim=-1).view(len(active), beam, -1)
        log_probs[..., banned] = -math.inf  # never chosen, but not renormalised away
        at_limit = limit_of[active] <= step + 1  # (B',): the last allowed position
        if constraint is not None:
            log_probs = constraint.rescore(log_probs, state, active)
            allowed = constraint.allowed(state, active, limit_of[active] - step - 1)
            log_probs.masked_fill_(~(allowed | at_limit.view(-1, 1, 1)), -math.inf)
        if at_limit.any():  # only EOS
            rows = at_limit.nonzero().squeeze(1)
            eos_log_probs = log_probs[rows, :, eos]
            log_probs[rows] = -math.inf
            log_probs[rows, :, eos] = eos_log_probs
        best, origin, next_tokens = topk_over_beams(scores, log_probs, 2 * beam)
        if constraint is not None:
            state = constraint.advance(state, origin, next_tokens)

        ends = next_tokens == eos  # (B', 2K)
        finishing = (ends[:, :beam] & (best[:, :beam] > -math.inf)).nonzero().tolist()
        if finishing:
            penalty = length_penalty(step + 1, alpha)  # |Y| counts the EOS
            changed = set()
            for row, rank in finishing:
                sentence = int(active[row])
                log_prob = float(best[row, rank])
                finished[sentence].append(Hypothesis(
                    history[row, origin[row, rank]].tolist(), log_prob / penalty, log_prob))
                changed.add(sentence)
            for sentence in changed:
                if len(finished[sentence]) >= nbest:
                    kth_best_finished[sentence] = sorted(
                        (h.score for h in finished[sentence]), reverse=True)[nbest - 1]
        live = torch.sort(ends.to(torch.uint8), dim=1, stable=True).indices[:, :beam]  # (B', K)
        scores = best.gather(1, live)  # best first: ranks ascend
        done = scores[:, 0] == -math.inf
        if beam == 1:  # greedy: done at the first EOS
            done |= kth_best_finished[active] > -math.inf
        elif stop_early:
            done |= can_stop(kth_best_finished[active], scores[:, 0], limit_of[active], alpha)
        parents = origin.gather(1, live)  # (B', K): the beam each live hypothesis extends
        tokens = next_tokens.gather(1, live)
        if constraint is not None:
            state = tuple(part.gather(1, live) for part in state)
        kept = None
        if done.any():
            kept = (~done).nonzero().squeeze(1)
            if len(kept) == 0:
                break
            scores, parents, tokens, active = scores[kept], parents[kept], tokens[kept], \
                active[kept]
            if constraint is not None:
                state = tuple(part[kept] for part in state)
        old_rows = torch.arange(len(done), device=device) if kept is None else kept
        history = torch.cat([history[old_rows.unsqueeze(-1), parents], tokens.unsqueeze(-1)],
                            dim=-1)
        cache = cache.reorder((old_rows.unsqueeze(-1) * beam + parents).view(-1), kept)
        tokens = tokens.view(-1)

    return [sorted(hypotheses, key=lambda h: -h.score)[:nbest] or [Hypothesis([], -math.inf,
                                                                             -math.inf)]
            for hypotheses in finished]


class TreeConstraint:
    """Search constraint for linearized trees (an option of `attn parse`, not in the paper):
    exactly one terminal per word (per piece of the sentence, in order, when the terminals are
    the words themselves, and brackets only between words, never inside one), closing brackets
    only inside an open one and never right after it (no empty constituent), EOS only when
    every terminal is placed and every bracket closed, nothing but brackets and terminals. The
    state per hypothesis is (terminals emitted, open brackets, opening brackets in a row)."""

    NEVER, TERMINAL, OPEN, CLOSE, END = range(5)
    WORD_SCORES = ("given", "joint")
    # Opening brackets in a row (a unary chain and the phrases it starts): at most 6 in the
    # Penn Treebank sample; the bound keeps a search from stalling on brackets alone.
    MAX_OPEN_RUN = 8

    def __init__(self, piece_classes: Tensor, word_counts: list[int],
                 required: list[list[int]] | None = None,
                 piece_starts_word: Tensor | None = None, score_words: str = "given"):
        self.piece_classes = piece_classes  # (V,) long: the class of every vocabulary piece
        self.piece_starts_word = piece_starts_word  # (V,) bool: the piece begins a word
        # With word terminals the input fixes the words; only the brackets are to be found.
        # "given" scores a word by the model's probability of *a* word at that point (a word's
        # first piece: the mass of every word-starting piece; its other pieces: 1), so a model
        # unsure *which* word comes next is not pushed into brackets it does not believe in.
        # "joint" scores the input's own pieces, p(tree and words).
        self.score_words = score_words
        self.word_counts = word_counts  # terminals per sentence of the batch
        self.required = None  # (B, longest + 1): each sentence's terminal pieces, padded
        self.boundary = None  # (B, longest + 1): a bracket may come before that piece
        if required is not None:
            width = max(map(len, required), default=0) + 1
            self.required = torch.zeros(len(required), width, dtype=torch.long)
            self.boundary = torch.ones(len(required), width, dtype=torch.bool)
            for row, ids in enumerate(required):
                pieces = torch.tensor(ids, dtype=torch.long)
                self.required[row, :len(ids)] = pieces
                if piece_starts_word is not None:
                    self.boundary[row, :len(ids)] = piece_starts_word[pieces]

    @classmethod
    def for_pieces(cls, pieces: list[str], eos_id: int, word_counts: list[int],
                   placeholder: str | None = "XX", required: list[list[int]] | None = None,
                   score_words: str = "given") -> "TreeConstraint":
        """Classes from the pieces' spelling. `placeholder` None: the terminals are words, and
        every piece that is not a bracket may be one."""
        classes = []
        for piece in pieces:
            text = piece.lstrip("\u2581")
            if text.startswith("(") and len(text) > 1:
                classes.append(cls.OPEN)
            elif text.startswith(")"):
                classes.append(cls.CLOSE)
            elif placeholder is None or text == placeholder:
                classes.append(cls.TERMINAL)
            else:
                classes.append(cls.NEVER)
        classes[eos_id] = cls.END
        starts_word = torch.tensor([piece.startswith("\u2581") for piece in pieces])
        return cls(torch.tensor(classes), word_counts, required, starts_word, score_words)

    def for_batch(self, word_counts: list[int],
                  required: list[list[int]] | None = None) -> "TreeConstraint":
        """The same vocabulary's constraint for another batch of sentences."""
        return TreeConstraint(self.piece_classes, word_counts, required, self.piece_starts_word,
                              self.score_words)

    def start(self, batch: int, beam: int, device) -> tuple[Tensor, Tensor, Tensor]:
        self.piece_classes = self.piece_classes.to(device)
        self.word_count_of = torch.tensor(self.word_counts, dtype=torch.long, device=device)
        if self.required is not None:
            self.required = self.required.to(device)
            self.boundary = self.boundary.to(device)
        if self.piece_starts_word is not None:  # the pieces `rescore` sums over
            self.word_starts = ((self.piece_classes == self.TERMINAL)
                                & self.piece_starts_word.to(device))
        zeros = torch.zeros(batch, beam, dtype=torch.long, device=device)
        return zeros, zeros.clone(), zeros.clone()

    def rescore(self, log_probs: Tensor, state: tuple[Tensor, Tensor, Tensor],
                active: Tensor) -> Tensor:
        """(B', K, V) log-probabilities with the next input piece scored as `score_words` says
        (in place; unchanged for placeholder terminals or "joint")."""
        if self.required is None or self.score_words == "joint":
            return log_probs
        placed = state[0].clamp(max=self.required.shape[1] - 1)  # (B', K)
        next_piece = self.required[active].gather(1, placed).unsqueeze(-1)
        starts = self.boundary[active].gather(1, placed)
        any_word = torch.logsumexp(log_probs[..., self.word_starts], dim=-1)  # (B', K)
        given = torch.where(starts, any_word, torch.zeros_like(any_word)).unsqueeze(-1)
        # Past the last word the "next piece" is padding: it keeps its own (banned) score.
        missing = (state[0] < self.word_count_of[active].unsqueeze(-1)).unsqueeze(-1)
        given = torch.where(missing, given, log_probs.gather(-1, next_piece))
        return log_probs.scatter_(-1, next_piece, given)

    def allowed(self, state: tuple[Tensor, Tensor, Tensor], active: Tensor,
                steps_left: Tensor) -> Tensor:
        """(B', K, V) True where a token may come next. `active` (B'): the sentence of each
        row; `steps_left` (B',): the tokens that may still follow this one; every choice must
        leave room to place the missing terminals, close the open brackets and end."""
        placed, depth, opened = state  # (B', K); opened: opening brackets since the last token
        words = self.word_count_of[active].unsqueeze(-1)
        missing = words - placed
        room = steps_left.unsqueeze(-1)
        between_words = True
        if self.required is not None:  # within a word of several pieces: no bracket
            between_words = self.boundary[active].gather(1, placed.clamp(
                max=self.boundary.shape[1] - 1))  # (B', K)
        by_class = torch.stack([
            torch.zeros_like(depth, dtype=torch.bool),  # anything else: never
            (missing > 0) & (missing + depth <= room),  # a terminal
            (missing > 0) & (missing + depth + 2 <= room) & between_words
            & (opened < self.MAX_OPEN_RUN),  # an opening bracket
            # a closing one, never right after an opening one: no empty constituent
            (depth > 0) & (missing + depth <= room) & between_words & (opened == 0),
            (missing <= 0) & (depth == 0),  # the end
        ], dim=-1)  # (B', K, classes)
        stuck = ~by_class.any(dim=-1, keepdim=True)  # out of room: let the repair cope
        by_class = by_class | (stuck & torch.tensor([False, True, False, True, True],
                                                    device=depth.device))
        allowed = by_class[..., self.piece_classes]  # (B', K, V)
        if self.required is not None:  # of the terminals, only the sentence's next piece
            next_piece = self.required[active].gather(1, placed.clamp(
                max=self.required.shape[1] - 1))  # (B', K)
            allowed &= self.piece_classes != self.TERMINAL
            allowed.scatter_(-1, next_piece.unsqueeze(-1),
                             by_class[..., self.TERMINAL].unsqueeze(-1))
        return allowed

    def advance(self, state: tuple[Tensor, Tensor, Tensor], origin: Tensor,
                tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The state of every candidate: its parent beam's, plus the token it adds."""
        placed, depth, opened = (part.gather(1, origin) for part in state)
        kind = self.piece_classes[tokens]
        opening = kind == self.OPEN
        return (placed + (kind == self.TERMINAL).long(),
                depth + opening.long() - (kind == self.CLOSE).long(),
                torch.where(opening, opened + 1, 0))
