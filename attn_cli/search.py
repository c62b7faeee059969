"""Beam search as the paper used it (§6.1): beam 4, the GNMT length penalty ((5+|Y|)/6)^α with
α 0.6, outputs of at most a·|x| + b tokens, and early termination as soon as no live hypothesis
can beat the finished ones. Greedy search is beam 1.

Batched over sentences and beams at once on the model's incremental interface (`encode`,
`start_decoding`, `decode_step`, `DecoderCache.reorder`); the cross-attention keys/values are
computed once per batch and sentences that are done leave the batch. `beam_search` is the
orchestration; small pure functions below it do each part (the length limits, the step's
candidates, finishing hypotheses, keeping the live ones, dropping done sentences), so that each can
be tested against hand computation. The search knows nothing of what it decodes: it talks to the
model and to an optional constraint through the two protocols below (`SearchModel`, `Constraint`):
parsing's well-formed trees, decode's prefixes, phrases to hold and to ban (attn_cli/decode/), or
several of them chained. A vocabulary shortlist is one more thing a batch may have: `start_search`,
which both searches share, says how a step works over it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from .formats import TRANSLATION, Stop


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
    leaves a full top-k over k·width values instead of all of them. On a GPU, torch's top-k:
    one kernel there, where the blocks take ten."""
    size = values.shape[-1]
    blocks = size // width
    if blocks <= 2 * k or values.device.type != "cpu":
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
    if best.shape[1] < k:  # fewer extensions than k (one beam, a tiny vocabulary): -inf ones
        missing = k - best.shape[1]
        best = torch.cat([best, best.new_full((batch, missing), -math.inf)], dim=1)
        flat = torch.cat([flat, flat[:, :1].expand(batch, missing)], dim=1)
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


class SearchModel(Protocol):
    """What the search needs of a model: the special ids in `config` (pad_id, bos_id, eos_id)
    and the incremental interface of `attn_cli.model.Transformer`."""

    config: Any

    def encode(self, src_tokens: Tensor) -> tuple[Tensor, Tensor]: ...

    def start_decoding(self, memory: Tensor, src_mask: Tensor,
                       output_ids: Tensor | None = None) -> Any: ...

    def decode_step(self, tokens: Tensor, cache: Any) -> tuple[Tensor, Any]: ...


def start_decoding(model: SearchModel, memory: Tensor, src_mask: Tensor,
                   output_ids: Tensor | None) -> Any:
    """`model.start_decoding`, asked for a shortlist only when there is one (a model of
    another kind may take none)."""
    if output_ids is None:
        return model.start_decoding(memory, src_mask)
    return model.start_decoding(memory, src_mask, output_ids)


class Constraint(Protocol):
    """Which tokens each hypothesis may take next (`Unconstrained`, below, parsing's
    `attn_cli.parse.constraint.TreeConstraint`, or decode's
    `attn_cli.decode.prefix.PrefixConstraint`). Its state holds a (B', K) row per live
    hypothesis: B' sentences still searching, K beams. `Unconstrained` is every constraint's
    base: each of its methods does nothing, so that a constraint writes only what it changes."""

    eos_column: int  # where EOS is among the candidates' columns
    ranks: bool  # whether `rank` orders the candidates its own way (not the best 2K first)

    def to(self, device) -> "Constraint":
        """The constraint with its tensors on `device`."""

    def start(self, batch: int, beam: int, device) -> Any:
        """The state of `beam` hypotheses for each of `batch` sentences, before any token."""

    def candidates(self, log_probs: Tensor, state: Any, active: Tensor, steps_left: Tensor,
                   at_limit: Tensor) -> tuple[Tensor, Any]:
        """Of the (B', K, V) log-probabilities, what the search ranks (B', K, C): the scores of
        the only tokens that may ever come next, -inf where one may not come now (except in
        rows `at_limit`, where the search takes EOS), and what `token_ids` needs to name
        them. `active` (B'): each row's sentence; `steps_left` (B',): tokens that may still
        follow."""

    def token_ids(self, columns: Any, origin: Tensor, picked: Tensor) -> Tensor:
        """The token ids of the candidates `picked` (B', 2K) of the beams `origin` (B', 2K)."""

    def advance(self, state: Any, origin: Tensor, tokens: Tensor) -> Any:
        """The state of each candidate: beam `origin` (B', C) extended by `tokens` (B', C)."""

    def rank(self, scores: Tensor, log_probs: Tensor, columns: Any, state: Any,
             beam: int) -> tuple[Tensor, Tensor, Tensor]:
        """The 2K candidates of each sentence, in the order the search takes them (an EOS
        among the first K finishes a hypothesis, the first K others live on): (their scores
        (B', 2K), the beam each extends, its column). `topk_over_beams`, the best 2K, unless
        the constraint keeps others (`lexical.LexicalConstraint`: dynamic beam allocation)."""

    def bound(self, state: Any, chosen: Tensor, active: Tensor, length: int,
              limit: Tensor) -> Tensor:
        """(B',) the longest output, EOS included, that the candidates `chosen` (B', K), each
        `length` tokens so far, can still grow into, at most `limit`: the early stop's bound."""

    def select(self, state: Any, chosen: Tensor, kept: Tensor | None) -> Any:
        """The state of the candidates `chosen` (B', K) of each sentence, then of the sentences
        `kept` only (None: all)."""


class Unconstrained:
    """The constraint of a free search (translation): any token may come next, and the
    candidates are the vocabulary itself. Each method is the identity of its part: the base
    every constraint extends, writing only the parts it changes."""

    ranks = False

    def __init__(self, eos_id: int):
        self.eos_column = eos_id

    def to(self, device) -> "Unconstrained":
        return self

    def start(self, batch: int, beam: int, device) -> Any:
        return None

    def candidates(self, log_probs: Tensor, state: Any, active: Tensor, steps_left: Tensor,
                   at_limit: Tensor) -> tuple[Tensor, Any]:
        return log_probs, None

    def token_ids(self, columns: Any, origin: Tensor, picked: Tensor) -> Tensor:
        return picked

    def advance(self, state: Any, origin: Tensor, tokens: Tensor) -> Any:
        return state

    def rank(self, scores: Tensor, log_probs: Tensor, columns: Any, state: Any,
             beam: int) -> tuple[Tensor, Tensor, Tensor]:
        return topk_over_beams(scores, log_probs, 2 * beam)

    def bound(self, state: Any, chosen: Tensor, active: Tensor, length: int,
              limit: Tensor) -> Tensor:
        return limit

    def select(self, state: Any, chosen: Tensor, kept: Tensor | None) -> Any:
        return state


class Chained(Unconstrained):
    """Several constraints over the vocabulary's columns at once (decode's prefix, phrases to
    meet and phrases banned): each masks the candidates in turn and keeps its own state, each
    bounds the output in turn, and the one that ranks its own way, if one does, ranks."""

    def __init__(self, parts: list):
        super().__init__(parts[0].eos_column)
        self.parts = parts
        rankers = [place for place, part in enumerate(parts) if part.ranks]
        if len(rankers) > 1:
            raise ValueError("two constraints that each rank the candidates their own way "
                             "cannot be chained")
        self.ranker = rankers[0] if rankers else None
        self.ranks = self.ranker is not None

    def to(self, device) -> "Chained":
        return Chained([part.to(device) for part in self.parts])

    def start(self, batch: int, beam: int, device) -> tuple:
        return tuple(part.start(batch, beam, device) for part in self.parts)

    def candidates(self, log_probs: Tensor, state: tuple, active: Tensor, steps_left: Tensor,
                   at_limit: Tensor) -> tuple[Tensor, None]:
        for part, part_state in zip(self.parts, state):
            log_probs, _ = part.candidates(log_probs, part_state, active, steps_left, at_limit)
        return log_probs, None

    def advance(self, state: tuple, origin: Tensor, tokens: Tensor) -> tuple:
        return tuple(part.advance(part_state, origin, tokens)
                     for part, part_state in zip(self.parts, state))

    def rank(self, scores: Tensor, log_probs: Tensor, columns: None, state: tuple,
             beam: int) -> tuple[Tensor, Tensor, Tensor]:
        if self.ranker is None:
            return super().rank(scores, log_probs, columns, state, beam)
        return self.parts[self.ranker].rank(scores, log_probs, columns, state[self.ranker],
                                            beam)

    def bound(self, state: tuple, chosen: Tensor, active: Tensor, length: int,
              limit: Tensor) -> Tensor:
        for part, part_state in zip(self.parts, state):
            limit = part.bound(part_state, chosen, active, length, limit)
        return limit

    def select(self, state: tuple, chosen: Tensor, kept: Tensor | None) -> tuple:
        return tuple(part.select(part_state, chosen, kept)
                     for part, part_state in zip(self.parts, state))


class ShortlistColumns(Unconstrained):
    """The free search over a vocabulary shortlist: column c of a step's log-probabilities is
    target id `ids[c]` (sorted; EOS among them), the candidates those columns."""

    def __init__(self, ids: Tensor, eos_id: int):
        self.ids = ids
        self.eos_column = int(torch.searchsorted(ids, eos_id))  # a batch's one read

    def to(self, device) -> "ShortlistColumns":
        self.ids = self.ids.to(device)
        return self

    def token_ids(self, columns: None, origin: Tensor, picked: Tensor) -> Tensor:
        return self.ids[picked]


@dataclass
class Setup:
    """What a search of one batch works with, set up before its first step (`start_search`)."""

    limits: Tensor  # (B,) each sentence's longest output, EOS included
    limit_lengths: set[int]  # the lengths at which some sentence reaches its limit
    cache: Any  # the model's, after the encoder's pass
    constraint: Constraint  # over the columns of a step's log-probabilities, on the device
    banned: Tensor  # the columns never chosen
    # What spreads a step's logits over the whole vocabulary, or None where they are the
    # constraint's columns already.
    spread: Callable[[Tensor], Tensor] | None
    called_off: "CalledOff"

    def log_probs(self, logits: Tensor) -> Tensor:
        """A step's log-probabilities in the constraint's columns, the banned ones -inf (never
        chosen, but not renormalised away)."""
        if self.spread is not None:
            logits = self.spread(logits)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        return log_probs.index_fill_(-1, self.banned, -math.inf)


def start_search(model: SearchModel, src_tokens: Tensor, max_len_a: float, max_len_b: int,
                 longest: int | None, banned: tuple[int, ...] | None,
                 constraint: Constraint | None, output_ids: Tensor | None,
                 cancelled: Callable[[], Iterable[int]] | None) -> Setup:
    """Both searches' set-up: the length limits, the encoder's pass and the decoder's cache,
    and how a step works over the shortlist `output_ids` (None: none), the one place a search
    deals with it. Free, the search works in the shortlist's columns (`ShortlistColumns`: its
    softmax and top-k over those alone); under a constraint, which speaks of target ids, each
    step's logits are spread, -inf outside the shortlist."""
    config, device = model.config, src_tokens.device
    banned = banned_ids(config, banned, device)
    limits = output_limits(src_tokens, config.pad_id, max_len_a, max_len_b, longest)  # (B,)
    limit_lengths = set(limits.tolist())
    memory, src_mask = model.encode(src_tokens)
    cache = start_decoding(model, memory, src_mask, output_ids)
    spread = None
    if output_ids is None:
        constraint = constraint or Unconstrained(config.eos_id)
    elif constraint is not None:
        size = config.tgt_vocab_size

        def spread(logits: Tensor) -> Tensor:
            full = logits.new_full((logits.shape[0], size), -math.inf)
            return full.index_copy_(1, output_ids, logits)
    else:
        places = torch.searchsorted(output_ids, banned).clamp(max=len(output_ids) - 1)
        banned = places[output_ids[places] == banned]  # a batch's one read
        constraint = ShortlistColumns(output_ids, config.eos_id)
    return Setup(limits, limit_lengths, cache, constraint.to(device), banned, spread,
                 CalledOff(cancelled, len(src_tokens), device))


@torch.inference_mode()
def beam_search(model: SearchModel, src_tokens: Tensor, beam: int = TRANSLATION.beam,
                alpha: float = TRANSLATION.alpha, max_len_a: float = TRANSLATION.max_len_a,
                max_len_b: int = TRANSLATION.max_len_b, nbest: int = 1,
                banned: tuple[int, ...] | None = None, longest: int | None = None,
                constraint: Constraint | None = None, stop: Stop | str = Stop.bound,
                cancelled: Callable[[], Iterable[int]] | None = None,
                output_ids: Tensor | None = None) -> list[list[Hypothesis]]:
    """src_tokens (B, S), padded with pad_id and ending in EOS → for each sentence, its `nbest`
    best hypotheses, best first. `longest` caps every output length (a model with learned
    positions has no position past its table). `constraint` says which tokens each hypothesis
    may take next (None: any). `stop` says when a sentence's search ends (`Stop`). `beam=1` is
    greedy decoding, as tensor2tensor does for a beam of one: the most probable token at each
    step until EOS (the length penalty then only scales the reported score). `cancelled`: see
    `CalledOff` (what comes back for a sentence called off means nothing). `output_ids`: the
    target ids the batch may write (a vocabulary shortlist, sorted; None: all of them).

    Each step, the 2K best extensions of a sentence's K beams are ranked: an EOS among the first
    K finishes a hypothesis, and the first K that are not EOS live on (one EOS at most per beam,
    so there are always K of them). Everything stays on the device until the search ends, the
    finished hypotheses too: a step reads one thing, two counts (on a GPU, its one wait). Rows
    are grouped K per sentence, which the model uses to share each source's memory."""
    config, stop = model.config, Stop(stop)
    batch, device, nbest = src_tokens.shape[0], src_tokens.device, min(nbest, beam)
    setup = start_search(model, src_tokens, max_len_a, max_len_b, longest, banned, constraint,
                         output_ids, cancelled)
    if getattr(model, "free_search", None) is not None \
            and type(setup.constraint) in (Unconstrained, ShortlistColumns):
        # A free search the model runs whole, every step in one call (decode/native.py)
        penalties = length_penalties(max(setup.limit_lengths), alpha, device)
        return best_hypotheses(model.free_search(setup, penalties, beam, alpha, nbest, stop),
                               batch, nbest)
    # The lengths at which some sentence reaches its limit: only at those steps can a row be
    # at its limit, so only then is there anything to do about it.
    limits, limit_lengths, cache = setup.limits, setup.limit_lengths, setup.cache
    constraint, called_off = setup.constraint, setup.called_off
    finished = Finished(batch, nbest, length_penalties(max(limit_lengths), alpha, device))
    # One hypothesis per sentence to begin with (BOS): the first step ranks its 2K extensions,
    # and K rows per sentence only from the second step on (K copies of BOS would cost a
    # full step's work for nothing).
    live = Beams.start(batch, config.bos_id, device)
    state = constraint.start(batch, 1, device)

    for step in range(max(limit_lengths)):
        logits, cache = model.decode_step(live.tokens.view(-1), cache)
        log_probs = setup.log_probs(logits).view(*live.scores.shape, -1)
        limit = limits[live.active]  # (B',)
        at_limit = limit <= step + 1
        log_probs, columns = constraint.candidates(log_probs, state, live.active,
                                                   limit - step - 1, at_limit)
        if step + 1 in limit_lengths:
            only_eos_at_limit(log_probs, at_limit, constraint.eos_column)
        best, origin, picked = constraint.rank(live.scores, log_probs, columns, state, beam)
        tokens = constraint.token_ids(columns, origin, picked)
        state = constraint.advance(state, origin, tokens)
        ends = tokens == config.eos_id  # (B', 2K)
        finishing = finished.collect(best, ends, live, beam)  # (B', K)
        chosen = first_not_ending(ends, beam)  # (B', K)
        scores = best.gather(1, chosen)
        bound = constraint.bound(state, chosen, live.active, step + 1, limit)
        done = sentences_done(scores, finished.kth_best[live.active], bound, alpha, beam,
                              stop, finished.best_ended[live.active],
                              finished.ended[live.active])
        leaving = called_off.rows(live.active)
        if leaving is not None:  # they leave as done sentences do
            done = done | leaving
        # The step's one read (on a GPU, a wait): how many hypotheses finish, how many
        # sentences go on. Which ones, the device finds without the host.
        finishing_count, kept_count = read_counts(finishing, ~done)
        finished.keep(finishing, finishing_count, best, origin, live)
        if kept_count == 0:
            break
        kept = None if kept_count == len(done) else true_positions(~done, kept_count)
        state = constraint.select(state, chosen, kept)
        live, cache = live.advance(scores, origin.gather(1, chosen), tokens.gather(1, chosen),
                                   kept, cache)
    return finished.best()


class CalledOff:
    """The sentences of a batch whose search is called off midway (a server's requests whose
    client left or whose deadline passed). `cancelled()`, host-side state only, names them (their
    places in the batch, those named before included); it is asked before each step's one read,
    and the rows of a named sentence then leave the batch as a finished sentence's do: the
    others go on to the outputs they would have had (as when a neighbour finishes first).
    No read and no upload for it: a (B,) mask on the device, made at the first sentence called
    off and set one sentence at a time (a fill of a constant, no data sent)."""

    def __init__(self, cancelled: Callable[[], Iterable[int]] | None, batch: int, device):
        self.cancelled, self.batch, self.device = cancelled, batch, device
        self.named: set[int] = set()
        self.mask: Tensor | None = None

    def rows(self, active: Tensor) -> Tensor | None:
        """(B',) True for the rows of sentences `active` (B',) called off; None while none
        is (a search nobody cancels does nothing more)."""
        if self.cancelled is None:
            return None
        for sentence in set(self.cancelled()) - self.named:
            if self.mask is None:
                self.mask = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
            self.mask[sentence].fill_(True)  # `mask[i] = True` would upload the True
            self.named.add(sentence)
        return None if self.mask is None else self.mask[active]


def banned_ids(config, banned: tuple[int, ...] | None, device) -> Tensor:
    """The tokens a search never chooses (default: padding and BOS, unless BOS is EOS, as in
    fairseq's models, whose decoder starts from EOS), on the device once, not uploaded at every
    step."""
    if banned is None:
        banned = (config.pad_id,) + ((config.bos_id,) if config.bos_id != config.eos_id else ())
    return torch.tensor(banned, dtype=torch.long, device=device)


def length_penalties(longest: int, alpha: float, device) -> Tensor:
    """(longest + 1,) float64: `length_penalty` of each length 0..longest, computed on the
    host as the search always has (a device's pow may differ in the last bit), and put on the
    device once, not at every step."""
    return torch.tensor([length_penalty(length, alpha) for length in range(longest + 1)],
                        dtype=torch.float64, device=device)


def read_counts(*masks: Tensor) -> list[int]:
    """How many True values each mask holds, read to the host at once: on a GPU each read is a
    wait for the device."""
    return torch.stack([mask.sum() for mask in masks]).tolist()


def true_positions(mask: Tensor, count: int) -> Tensor:
    """`mask.nonzero()` of a 1-d mask holding `count` True values (a count already read), in
    order, without another wait to learn the count: a stable sort puts them first."""
    return torch.sort((~mask).to(torch.uint8), stable=True).indices[:count]


def finished_rows(sentences: Tensor, log_probs: Tensor, scores: Tensor,
                  histories: Tensor) -> Tensor:
    """(F, 3 + t) float64, one row per finished hypothesis: its sentence, log-probability,
    score and tokens (histories (F, t)), kept on the device for `read_hypotheses` (float64
    holds the token ids and a float32 or float64 score exactly)."""
    return torch.cat([sentences[:, None].double(), log_probs[:, None].double(),
                      scores[:, None].double(), histories.double()], dim=1)


def read_hypotheses(parts: list[Tensor]) -> list[tuple[int, Hypothesis]]:
    """(sentence, hypothesis) of every row of `parts` (`finished_rows`), in order, read to the
    host at once after the search: on a GPU each read in it would be a wait."""
    if not parts:
        return []
    values = torch.cat([part.flatten() for part in parts]).tolist()
    hypotheses, start = [], 0
    for part in parts:
        height, width = part.shape
        for row in range(start, start + height * width, width):
            sentence, log_prob, score, *tokens = values[row:row + width]
            hypotheses.append((int(sentence), Hypothesis([int(token) for token in tokens],
                                                         score, log_prob)))
        start += height * width
    return hypotheses


def output_limits(src_tokens: Tensor, pad_id: int, a: float, b: int,
                  longest: int | None) -> Tensor:
    """(B,) the longest output of each sentence, EOS included: a·|x| + b, at most `longest`."""
    src_lengths = (src_tokens != pad_id).sum(dim=1) - 1  # without EOS
    limits = [min(max_output_length(int(n), a, b), longest or math.inf)
              for n in src_lengths.tolist()]
    return torch.tensor(limits, device=src_tokens.device)


def only_eos_at_limit(log_probs: Tensor, at_limit: Tensor, eos: int) -> None:
    """In place: a hypothesis at its last allowed position (rows `at_limit` (B',) of
    log_probs (B', K, V)) can only end, with the log-probability the model gives EOS. By
    masks, not by reading which rows: on a GPU a read is a wait."""
    eos_log_probs = log_probs[:, :, eos].clone()
    log_probs.masked_fill_(at_limit[:, None, None], -math.inf)
    log_probs[:, :, eos] = eos_log_probs


def first_not_ending(ends: Tensor, beam: int) -> Tensor:
    """(B', K): the positions among each sentence's ranked candidates (B', 2K) of the first K
    that do not end in EOS: they live on, best first."""
    return torch.sort(ends.to(torch.uint8), dim=1, stable=True).indices[:, :beam]


def sentences_done(scores: Tensor, kth_best: Tensor, limits: Tensor, alpha: float, beam: int,
                   stop: Stop, best_ended: Tensor, ended: Tensor) -> Tensor:
    """(B',) True for a sentence whose search is over: no live hypothesis left, its first
    finished one for greedy search, or as `stop` says (`best_ended`: whether a step's best
    candidate of the sentence has ended; `ended`: how many of its hypotheses have)."""
    done = scores[:, 0] == -math.inf
    if beam == 1:
        return done | (kth_best > -math.inf)
    if stop is Stop.bound:
        return done | can_stop(kth_best, scores[:, 0], limits, alpha)
    if stop is Stop.patience:
        return done | (ended >= beam)
    if stop is Stop.best_ends:
        return done | (best_ended & (kth_best > -math.inf))
    return done


@dataclass
class Beams:
    """The live hypotheses: K per sentence still searching."""

    scores: Tensor  # (B', K) log-probabilities, best first
    tokens: Tensor  # (B', K) the last token of each
    history: Tensor  # (B', K, t) every token so far, BOS left out
    active: Tensor  # (B',) the sentence of each row

    @classmethod
    def start(cls, batch: int, bos: int, device) -> "Beams":
        """One hypothesis per sentence, BOS: the first step grows it to K."""
        return cls(torch.zeros((batch, 1), device=device),
                   torch.full((batch, 1), bos, dtype=torch.long, device=device),
                   torch.empty((batch, 1, 0), dtype=torch.long, device=device),
                   torch.arange(batch, device=device))

    def advance(self, scores: Tensor, parents: Tensor, tokens: Tensor, kept: Tensor | None,
                cache):
        """The next step's beams (each extends beam `parents` (B', K) by `tokens`), of the
        sentences `kept` only (None: all), and the decoder cache reordered to match."""
        rows = torch.arange(len(scores), device=scores.device) if kept is None else kept
        active = self.active
        if kept is not None:
            scores, parents, tokens, active = scores[kept], parents[kept], tokens[kept], \
                active[kept]
        history = torch.cat([self.history[rows.unsqueeze(-1), parents], tokens.unsqueeze(-1)],
                            dim=-1)
        rows_per_sentence = self.scores.shape[1]  # in the cache: 1 after BOS, then K
        cache = cache.reorder((rows.unsqueeze(-1) * rows_per_sentence + parents).view(-1), kept)
        return Beams(scores, tokens, history, active), cache


class Finished:
    """The finished hypotheses of every sentence, kept on the device until the search ends
    (`best` reads them at once), and each sentence's `nbest` best scores so far (B, n), best
    first, also on the device: the n-th is the score a live hypothesis must beat (-inf until
    there are n)."""

    def __init__(self, batch: int, nbest: int, penalties: Tensor):
        self.nbest = nbest
        self.penalties = penalties  # (L + 1,) float64, `length_penalties`
        self.top = torch.full((batch, nbest), -math.inf, dtype=torch.float64,
                              device=penalties.device)
        # Whether a step's best candidate has ended (`Stop.best_ends`).
        self.best_ended = torch.zeros(batch, dtype=torch.bool, device=penalties.device)
        # How many hypotheses have ended, kept among the n best or not (`Stop.patience`).
        self.ended = torch.zeros(batch, dtype=torch.long, device=penalties.device)
        self.rows: list[Tensor] = []  # `finished_rows` of each step where some finished

    @property
    def kth_best(self) -> Tensor:
        """(B,) the n-th best score, in the live scores' float32."""
        return self.top[:, -1].float()

    def collect(self, best: Tensor, ends: Tensor, live: Beams, beam: int) -> Tensor:
        """Of the first K candidates (B', 2K) extending `live`, the ones ending in EOS that may
        be among their sentence's n best: (B', K), True where one scores above the sentence's
        n-th best so far (one that does not has n as good, found before it and so ranked
        ahead of it). Their scores join the n best now; `keep` keeps their tokens, once their
        count is read."""
        ending = ends[:, :beam] & (best[:, :beam] > -math.inf)
        scores = (best[:, :beam].double() / self.penalty(live)).masked_fill(~ending, -math.inf)
        top = self.top[live.active]
        self.top[live.active] = torch.cat([top, scores], dim=1).topk(self.nbest, dim=1).values
        self.best_ended[live.active] |= ending[:, 0]
        self.ended[live.active] += ending.sum(dim=1)
        return scores > top[:, -1:]

    def keep(self, finishing: Tensor, count: int, best: Tensor, origin: Tensor,
             live: Beams) -> None:
        """Keeps, on the device, the `count` hypotheses `finishing` (B', K) (`collect`)."""
        if count == 0:
            return
        positions, beam = true_positions(finishing.flatten(), count), finishing.shape[1]
        rows, ranks = positions // beam, positions % beam
        log_probs = best[rows, ranks].double()
        self.rows.append(finished_rows(live.active[rows], log_probs,
                                       log_probs / self.penalty(live),
                                       live.history[rows, origin[rows, ranks]]))

    def penalty(self, live: Beams) -> Tensor:
        """The length penalty of the hypotheses that end now: their tokens and EOS."""
        return self.penalties[live.history.shape[2] + 1]

    def best(self) -> list[list[Hypothesis]]:
        """Each sentence's `nbest` best, best first (one empty hypothesis if none finished)."""
        return best_hypotheses(self.rows, len(self.top), self.nbest)


def best_hypotheses(rows: list[Tensor], batch: int, nbest: int) -> list[list[Hypothesis]]:
    """Each of `batch` sentences' `nbest` best of the finished hypotheses `rows`
    (`finished_rows`), best first; one empty hypothesis where none finished."""
    found: list[list[Hypothesis]] = [[] for _ in range(batch)]
    for sentence, hypothesis in read_hypotheses(rows):
        found[sentence].append(hypothesis)
    return [sorted(hypotheses, key=lambda h: -h.score)[:nbest]
            or [Hypothesis([], -math.inf, -math.inf)] for hypotheses in found]


# ----------------------------------------------------------------------------------- sampling


def sentence_uniforms(seed: int, sentence_ids: list[int], steps: int) -> Tensor:
    """(B, steps) uniform numbers in [0, 1), row i drawn from a generator seeded by (seed,
    sentence_ids[i]) alone: a sentence's samples depend on the seed and on which sentence it
    is (its input line), not on the batch it is decoded in."""
    rows = []
    for sentence in sentence_ids:
        generator = torch.Generator().manual_seed(
            (seed * 0x9E3779B97F4A7C15 + sentence) % (2 ** 63))
        rows.append(torch.rand(steps, generator=generator, dtype=torch.float64))
    return torch.stack(rows) if rows else torch.empty(0, steps, dtype=torch.float64)


def draw(log_probs: Tensor, uniforms: Tensor, temperature: float = 1.0, topk: int = 0,
         topp: float = 1.0) -> Tensor:
    """One token per row of log_probs (N, V), sampled by inversion with `uniforms` (N,) from
    the distribution ∝ p^(1/temperature), restricted to the `topk` most probable tokens (0: all)
    and then to the smallest set of them holding `topp` of the mass (nucleus sampling, Holtzman
    et al. 2020). Tokens at -inf are never drawn."""
    scaled = log_probs / temperature
    if 0 < topk < scaled.shape[-1]:
        values, tokens = scaled.topk(topk, dim=-1)
    else:
        values, tokens = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(values.double(), dim=-1)
    if topp < 1.0:  # keep a token while the mass before it is under p (the first: always)
        probs = probs * ((probs.cumsum(dim=-1) - probs) < topp)
    cdf = probs.cumsum(dim=-1)
    threshold = uniforms.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    pick = (cdf <= threshold).sum(dim=-1).clamp(max=cdf.shape[-1] - 1)
    return tokens.gather(1, pick.unsqueeze(1)).squeeze(1)


def _draw_step(constraint: Constraint, state, first: Tensor, log_probs: Tensor,
               limits: Tensor, step: int, at_a_limit: bool, uniforms: Tensor,
               drawing: tuple[float, int, float], active: Tensor
               ) -> tuple[Tensor, Tensor, Any]:
    """One step of `sample`: a draw among the constraint's candidates (a free search's: the
    log-probabilities themselves), each live row one beam (`first`: zeros); a row at its
    `limits` can only end. Returns the tokens, their log-probabilities and the constraint's new
    state."""
    at_limit = limits <= step + 1
    candidates, columns = constraint.candidates(log_probs.unsqueeze(1), state, active,
                                                limits - step - 1, at_limit)
    if at_a_limit:
        only_eos_at_limit(candidates, at_limit, constraint.eos_column)
    picked = draw(candidates.squeeze(1), uniforms, *drawing)
    gained = candidates.squeeze(1).gather(1, picked.unsqueeze(1)).squeeze(1).double()
    origin = first[:len(picked)]
    tokens = constraint.token_ids(columns, origin, picked.unsqueeze(1)).squeeze(1)
    return tokens, gained, constraint.advance(state, origin, tokens.unsqueeze(1))


@torch.inference_mode()
def sample(model: SearchModel, src_tokens: Tensor, uniforms: Tensor, temperature: float = 1.0,
           topk: int = 0, topp: float = 1.0, max_len_a: float = TRANSLATION.max_len_a,
           max_len_b: int = TRANSLATION.max_len_b, banned: tuple[int, ...] | None = None,
           longest: int | None = None,
           cancelled: Callable[[], Iterable[int]] | None = None,
           constraint: Constraint | None = None,
           output_ids: Tensor | None = None) -> list[list[Hypothesis]]:
    """Ancestral sampling (for back-translation): each sentence's next token drawn by `draw`
    from the model's distribution until EOS or its length limit (where EOS is forced), with
    `uniforms` (B, ≥ longest limit) the random numbers of each sentence (`sentence_uniforms`).
    Returns one hypothesis per sentence, its score the sum of the model's log-probabilities.
    `cancelled`: as `beam_search`'s. `constraint`: as `beam_search`'s, each sentence one
    hypothesis (K = 1), drawn among its candidates (None: the free search).
    `output_ids`: as `beam_search`'s."""
    config = model.config
    batch, device = src_tokens.shape[0], src_tokens.device
    setup = start_search(model, src_tokens, max_len_a, max_len_b, longest, banned, constraint,
                         output_ids, cancelled)
    limits, limit_lengths, cache = setup.limits, setup.limit_lengths, setup.cache
    constraint, called_off = setup.constraint, setup.called_off
    uniforms = uniforms.to(device)  # once: indexed by the live rows on the device each step
    drawing = (temperature, topk, topp)
    active = torch.arange(batch, device=device)
    tokens = torch.full((batch,), config.bos_id, dtype=torch.long, device=device)
    history = torch.empty((batch, 0), dtype=torch.long, device=device)
    scores = torch.zeros(batch, dtype=torch.float64, device=device)
    finished: list[Tensor] = []  # `finished_rows`, read after the search
    state = constraint.start(batch, 1, device)
    first = torch.zeros((batch, 1), dtype=torch.long, device=device)  # each row's one "beam"
    for step in range(max(limit_lengths)):
        logits, cache = model.decode_step(tokens, cache)
        tokens, gained, state = _draw_step(
            constraint, state, first, setup.log_probs(logits), limits[active], step,
            step + 1 in limit_lengths, uniforms[active, step], drawing, active)
        scores += gained
        ends = tokens == config.eos_id
        called_off_rows = called_off.rows(active)
        leaving = ends if called_off_rows is None else ends | called_off_rows
        # The step's one read, as in beam_search: how many end, how many leave.
        ending_count, leaving_count = read_counts(ends, leaving)
        if ending_count:
            ending = true_positions(ends, ending_count)
            finished.append(finished_rows(active[ending], scores[ending], scores[ending],
                                          history[ending]))
        if leaving_count:
            if leaving_count == len(ends):
                break
            kept = true_positions(~leaving, len(ends) - leaving_count)
            active, tokens, history, scores = active[kept], tokens[kept], history[kept], \
                scores[kept]
            cache = cache.reorder(kept, kept)
            state = constraint.select(state, first[:len(ends)], kept)
        history = torch.cat([history, tokens.unsqueeze(1)], dim=1)
    found: list[list[Hypothesis]] = [[] for _ in range(batch)]
    for sentence, hypothesis in read_hypotheses(finished):
        found[sentence] = [hypothesis]
    return found
