"""Lexical constraints (`attn decode --constraints`, `--glossary`) and banned phrases (`--ban`):
phrases each output must hold, and phrases no output may hold. Not in the paper: what an MT
engineer needs to force a company's terms or keep a word out.

Positive constraints are searched with dynamic beam allocation (Post & Vilar 2018, "Fast Lexically
Constrained Decoding with Dynamic Beam Allocation"), in the vectorized form of Hu et al. 2019
("Improved Lexically Constrained Decoding for Translation and Monolingual Rewriting"), which is
fairseq's `--constraints`:
- each step's candidates are the search's usual 2K best extensions, each beam's own best
  token, and each beam's next token of every phrase it has not met (so a hypothesis can always
  start or continue a phrase, however unlikely the model finds it);
- a candidate's bank is how many constraint tokens it has met; the K beams are dealt out over the
  banks in turns, most met first, each bank's best first (an empty bank's turns go to the
  others): hypotheses that have met more are kept even when they score lower, so that they
  survive until they can finish;
- EOS only for a hypothesis that has met every phrase. At its length limit, where the search
  must end it, one that has not is finished with `UNMET_PENALTY` off its score: any output that
  holds every phrase beats it, and a sentence whose phrases do not fit still gets an output.

A phrase's progress is tracked per hypothesis as in string matching (Knuth-Morris-Pratt): a token
that breaks a partial match falls back to the longest prefix of the phrase that still ends the
output, so "a a b" is found in "a a a b". A phrase whose last piece ends in a letter or digit is
met only where its word ends there (`WordPieces`): "▁Jeans" followed by "anzug" is "Jeansanzug",
not "Jeans"; it waits for a piece that starts a word, punctuation or the output's end.
Everything is a tensor on the search's device; a step reads nothing.

Banned phrases are suppressed as CTranslate2's `suppress_sequences`: the last piece of a phrase is
-inf wherever the output so far ends with the pieces before it. Phrases are pieces of the target
vocabulary, so a phrase the model spells with other pieces ("▁Ne w" for "▁New") is not caught.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..search import Unconstrained, topk_over_beams

# What an output that misses a constraint at its length limit loses (log-probability): more
# than any output's own score, so that every output holding its phrases ranks first.
UNMET_PENALTY = 1e4


def padded(phrase_lists: list[list[list[int]]]) -> tuple[Tensor, Tensor]:
    """Each sentence's phrases (lists of ids) → (B, N, P) ids padded with -1 and (B, N) their
    lengths (0: no phrase there). At least one phrase and one piece wide."""
    count = max(1, max(map(len, phrase_lists), default=0))
    width = max(1, max((len(phrase) for phrases in phrase_lists for phrase in phrases),
                       default=0))
    ids = torch.full((len(phrase_lists), count, width), -1, dtype=torch.long)
    lengths = torch.zeros(len(phrase_lists), count, dtype=torch.long)
    for row, phrases in enumerate(phrase_lists):
        for column, phrase in enumerate(phrases):
            ids[row, column, :len(phrase)] = torch.tensor(phrase, dtype=torch.long)
            lengths[row, column] = len(phrase)
    return ids, lengths


def failure_links(phrase: list[int]) -> list[int]:
    """Knuth-Morris-Pratt's table: for each count m of matched pieces (0..len), the length of
    the longest proper prefix of phrase[:m] that is also its suffix."""
    links = [0] * (len(phrase) + 1)
    for m in range(2, len(phrase) + 1):
        k = links[m - 1]
        while k and phrase[k] != phrase[m - 1]:
            k = links[k]
        links[m] = k + 1 if phrase[k] == phrase[m - 1] else 0
    return links


@dataclass
class WordPieces:
    """Which pieces of a target vocabulary go on a word (`continues`: a piece that starts with a
    letter or digit, no "▁") and which end with a letter or digit (`ends_in_word`): what a
    phrase's word boundary needs. (V,) bool each."""

    continues: Tensor
    ends_in_word: Tensor

    @classmethod
    def of(cls, pieces: list[str], specials: set[int]) -> "WordPieces":
        continues = [index not in specials and not piece.startswith("\u2581")
                     and piece[:1].isalnum() for index, piece in enumerate(pieces)]
        ends = [index not in specials and piece[-1:].isalnum()
                for index, piece in enumerate(pieces)]
        return cls(torch.tensor(continues), torch.tensor(ends))


def holds(tokens: list[int], phrase: tuple[int, ...] | list[int],
          words: WordPieces | None = None) -> bool:
    """Whether an output's tokens hold the phrase, as `LexicalConstraint` counts it met (its word
    ending with it, where `words` says the phrase ends in a word)."""
    width = len(phrase)
    boundary = words is not None and bool(words.ends_in_word[phrase[-1]])
    for start in range(len(tokens) - width + 1):
        if list(tokens[start:start + width]) == list(phrase):
            after = start + width
            if not boundary or after == len(tokens) or not bool(words.continues[tokens[after]]):
                return True
    return False


@dataclass
class Progress:
    """The state of `LexicalConstraint`: for each live hypothesis (B', K), how many pieces of
    each phrase (N) it has matched (a phrase's length: met, for good), and each row's
    sentence (B',)."""

    matched: Tensor  # (B', K, N)
    rows: Tensor  # (B',)


class LexicalConstraint(Unconstrained):
    """Every output of a sentence holds each of its phrases (`phrases` (B, N, P), `lengths`
    (B, N), as `padded` makes them), searched with dynamic beam allocation (module doc). A
    phrase with `boundary` (B, N) True is met one step after its last piece, by a token that
    does not go on with its word (`continues` (V,)); EOS meets it too. It ranks the candidates
    its own way: dynamic beam allocation."""

    ranks = True

    def __init__(self, phrases: Tensor, lengths: Tensor, links: Tensor, eos_id: int,
                 boundary: Tensor | None = None, continues: Tensor | None = None):
        self.phrases, self.lengths, self.links, self.eos_column = phrases, lengths, links, eos_id
        self.eos_id = eos_id
        self.boundary = torch.zeros_like(lengths, dtype=torch.bool) if boundary is None \
            else boundary
        self.continues = torch.zeros(1, dtype=torch.bool) if continues is None else continues
        self.full = lengths + self.boundary.long()  # (B, N) steps to meet each phrase
        self.banks = int(lengths.sum(dim=1).max()) + 1
        # How many fallbacks a mismatch may take (0 when no phrase repeats its own start).
        self.fallbacks = int((links > 0).sum(dim=-1).max()) if links.numel() else 0

    @classmethod
    def for_batch(cls, phrase_lists: list[list[list[int]]], eos_id: int,
                  words: WordPieces | None = None) -> "LexicalConstraint":
        """The constraint of a batch: each sentence's phrases (maybe none), as target ids; with
        `words`, the target vocabulary's, each phrase ending in a word waits for its end."""
        phrases, lengths = padded(phrase_lists)
        # One place more than the longest phrase: where a boundary is checked.
        phrases = torch.cat([phrases, torch.full_like(phrases[:, :, :1], -1)], dim=2)
        links = torch.zeros(phrases.shape[0], phrases.shape[1], phrases.shape[2],
                            dtype=torch.long)
        boundary = torch.zeros_like(lengths, dtype=torch.bool)
        for row, sentence_phrases in enumerate(phrase_lists):
            for column, phrase in enumerate(sentence_phrases):
                links[row, column, :len(phrase) + 1] = torch.tensor(failure_links(phrase))
                if words is not None:
                    boundary[row, column] = bool(words.ends_in_word[phrase[-1]])
        return cls(phrases, lengths, links, eos_id, boundary,
                   None if words is None else words.continues)

    def to(self, device) -> "LexicalConstraint":
        moved = copy.copy(self)
        for name in ("phrases", "lengths", "links", "boundary", "continues", "full"):
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    def start(self, batch: int, beam: int, device) -> Progress:
        return Progress(torch.zeros(batch, beam, self.phrases.shape[1], dtype=torch.long,
                                    device=device), torch.arange(batch, device=device))

    def unmet(self, state: Progress) -> Tensor:
        """(B', K) True where a hypothesis has not met all its phrases (one waiting only for
        its word to end has: EOS ends it)."""
        return (state.matched < self.lengths[state.rows].unsqueeze(1)).any(dim=-1)

    def candidates(self, log_probs: Tensor, state: Progress, active: Tensor, steps_left: Tensor,
                   at_limit: Tensor) -> tuple[Tensor, None]:
        """EOS at -inf for a hypothesis with a phrase still to meet; at its length limit, where
        it must end, `UNMET_PENALTY` off instead (module doc)."""
        unmet = self.unmet(state)
        eos = log_probs[:, :, self.eos_id]
        penalty = torch.where(at_limit.unsqueeze(-1), UNMET_PENALTY, math.inf)
        log_probs[:, :, self.eos_id] = torch.where(unmet, eos - penalty, eos)
        return log_probs, None

    def advance(self, state: Progress, origin: Tensor, tokens: Tensor) -> Progress:
        """The progress of each candidate: beam `origin` (B', C) extended by `tokens` (B', C).
        A token that continues a phrase's match adds one; one that breaks it falls back along
        the phrase's failure links (KMP) to the longest match it still continues."""
        matched = state.matched.gather(1, origin.unsqueeze(-1).expand(-1, -1,
                                                                      state.matched.shape[2]))
        rows = state.rows
        phrases = self.phrases[rows].unsqueeze(1)  # (B', 1, N, P + 1)
        lengths = self.lengths[rows].unsqueeze(1)  # (B', 1, N)
        full = self.full[rows].unsqueeze(1)
        links = self.links[rows].unsqueeze(1).expand(-1, matched.shape[1], -1, -1)
        met = matched >= full
        token = tokens.unsqueeze(-1)  # (B', C, 1)
        width = phrases.shape[-1]
        # Where a phrase's pieces are all there, the next token must start a word (or not be
        # a piece of one): no boundary to wait for, `full` is `lengths` and this never counts.
        ends_word = ~self.continues[tokens.clamp(max=len(self.continues) - 1)].unsqueeze(-1) \
            if len(self.continues) > 1 else torch.ones_like(token, dtype=torch.bool)

        def continues(count: Tensor) -> Tensor:
            expected = phrases.expand(-1, count.shape[1], -1, -1).gather(
                -1, count.clamp(max=width - 1).unsqueeze(-1)).squeeze(-1)
            return torch.where(count == lengths, ends_word, expected == token) & (count < full)

        grown = torch.where(continues(matched), matched + 1, -1)  # -1: not settled yet
        fallen = matched
        for _ in range(self.fallbacks):  # the failure links of a partial match
            fallen = links.gather(-1, fallen.clamp(max=width - 1).unsqueeze(-1)).squeeze(-1)
            grown = torch.where((grown < 0) & (fallen > 0) & continues(fallen), fallen + 1,
                                grown)
        restart = torch.where(continues(torch.zeros_like(matched)), 1, 0)
        grown = torch.where(grown < 0, restart, grown)
        return Progress(torch.where(met, matched, grown), rows)

    def banks_of(self, state: Progress) -> Tensor:
        """(B', C) the constraint pieces each hypothesis has matched: its bank. A phrase
        waiting for its word to end counts as met: a step of its own would add banks that
        thin out the beam (measured: 3.5 BLEU lost at beam 4 on Multi30k with a glossary),
        and a hypothesis whose word goes on falls back to a lower bank anyway."""
        return torch.minimum(state.matched, self.lengths[state.rows].unsqueeze(1)).sum(dim=-1)

    def rank(self, scores: Tensor, log_probs: Tensor, columns: None, state: Progress,
             beam: int) -> tuple[Tensor, Tensor, Tensor]:
        """The search's 2K candidates, ordered so that its rules (an EOS among the first K
        finishes; the first K that are not EOS live on) keep what dynamic beam allocation keeps:
        the finishing ones first, then the K that live, each group best first."""
        batch, beams, vocab = log_probs.shape
        device = log_probs.device
        best, origin, tokens = topk_over_beams(scores, log_probs, 2 * beam)
        own_best, own_token = log_probs.max(dim=-1)  # (B', K) each beam's best token
        # Each beam's next piece of every phrase it has not met.
        rows = state.rows
        lengths = self.lengths[rows].unsqueeze(1)
        open_phrase = state.matched < lengths  # (B', K, N)
        next_piece = self.phrases[rows].unsqueeze(1).expand(-1, beams, -1, -1).gather(
            -1, state.matched.clamp(max=self.phrases.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        next_piece = torch.where(open_phrase, next_piece, own_token.unsqueeze(-1))
        piece_scores = log_probs.gather(-1, next_piece)  # (B', K, N)
        beam_ids = torch.arange(beams, device=device).view(1, beams, 1)
        extra_scores = torch.cat([own_best.unsqueeze(-1), piece_scores], dim=-1) + \
            scores.unsqueeze(-1)
        extra_tokens = torch.cat([own_token.unsqueeze(-1), next_piece], dim=-1)
        extra_origin = beam_ids.expand_as(extra_tokens)
        best = torch.cat([best, extra_scores.flatten(1)], dim=1)
        origin = torch.cat([origin, extra_origin.flatten(1)], dim=1)
        tokens = torch.cat([tokens, extra_tokens.flatten(1)], dim=1)
        best = drop_duplicates(best, origin * vocab + tokens)
        # Each candidate's bank, and the turns dynamic beam allocation deals them.
        banks = self.banks_of(self.advance(state, origin, tokens))
        width = best.shape[1]
        order = torch.sort(best, dim=1, descending=True, stable=True).indices
        order = order.gather(1, torch.sort(banks.gather(1, order), dim=1, descending=True,
                                           stable=True).indices)
        sorted_banks = banks.gather(1, order)
        positions = torch.arange(width, device=device).expand(batch, -1)
        starts = torch.cat([torch.ones_like(sorted_banks[:, :1], dtype=torch.bool),
                            sorted_banks[:, 1:] != sorted_banks[:, :-1]], dim=1)
        turn = positions - torch.where(starts, positions, 0).cummax(dim=1).values
        key = turn * self.banks + (self.banks - 1 - sorted_banks)
        key = torch.where(best.gather(1, order) > -math.inf, key, key + width * self.banks)
        dealt = order.gather(1, torch.sort(key, dim=1, stable=True).indices)
        # In the dealt order: the EOS among the first K finish, the first K others live.
        ends = tokens.gather(1, dealt) == self.eos_id
        finishing = ends & (positions < beam)
        living = ~ends & ((~ends).cumsum(dim=1) <= beam)
        group = torch.where(finishing, 0, torch.where(living, 1, 2))
        dealt_scores = best.gather(1, dealt)
        within = torch.sort(dealt_scores, dim=1, descending=True, stable=True).indices
        final = within.gather(1, torch.sort(group.gather(1, within), dim=1,
                                            stable=True).indices)[:, :2 * beam]
        final = dealt.gather(1, final)
        return best.gather(1, final), origin.gather(1, final), tokens.gather(1, final)

    def select(self, state: Progress, chosen: Tensor, kept: Tensor | None) -> Progress:
        matched = state.matched.gather(1, chosen.unsqueeze(-1).expand(
            -1, -1, state.matched.shape[2]))
        if kept is None:
            return Progress(matched, state.rows)
        return Progress(matched[kept], state.rows[kept])


def drop_duplicates(scores: Tensor, keys: Tensor) -> Tensor:
    """`scores` (B, W) with every candidate whose key (beam·V + token) came before in its row
    at -inf: the same hypothesis must not take two beams."""
    order = torch.sort(keys, dim=1, stable=True)
    repeated = torch.zeros_like(keys, dtype=torch.bool)
    repeated[:, 1:] = order.values[:, 1:] == order.values[:, :-1]
    again = torch.zeros_like(repeated).scatter_(1, order.indices, repeated)
    return scores.masked_fill(again, -math.inf)


class BannedPhrases(Unconstrained):
    """No output holds any of `phrases` (M, Q) (ids padded with -1, `lengths` (M,)): the
    phrase's last piece is -inf wherever the output ends with the pieces before it. The state
    is each hypothesis's last Q - 1 tokens (-1 before the first)."""

    def __init__(self, phrases: Tensor, lengths: Tensor, eos_id: int):
        self.eos_column = eos_id
        width = phrases.shape[1]
        self.last = phrases.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)  # (M,)
        # The pieces before the last, right-aligned to the window of recent tokens, and which
        # of the window's places they fill.
        context = torch.full((len(phrases), max(0, width - 1)), -1, dtype=torch.long)
        for row, (phrase, length) in enumerate(zip(phrases.tolist(), lengths.tolist())):
            if length > 1:
                context[row, width - length:] = torch.tensor(phrase[:length - 1])
        self.context, self.needed = context, context >= 0

    @classmethod
    def from_phrases(cls, phrases: list[list[int]], eos_id: int) -> "BannedPhrases":
        ids, lengths = padded([phrases])
        return cls(ids[0], lengths[0], eos_id)

    def to(self, device) -> "BannedPhrases":
        moved = copy.copy(self)
        moved.last, moved.context = self.last.to(device), self.context.to(device)
        moved.needed = self.needed.to(device)
        return moved

    def start(self, batch: int, beam: int, device) -> Tensor:
        return torch.full((batch, beam, self.context.shape[1]), -1, dtype=torch.long,
                          device=device)

    def candidates(self, log_probs: Tensor, state: Tensor, active: Tensor, steps_left: Tensor,
                   at_limit: Tensor) -> tuple[Tensor, None]:
        recent = state.unsqueeze(2)  # (B', K, 1, Q-1)
        ends_with = ((recent == self.context) | ~self.needed).all(dim=-1)  # (B', K, M)
        last = self.last.expand(*ends_with.shape)
        kept = log_probs.gather(-1, last)
        # "amin": where two phrases share a last piece, one that matches bans it.
        return log_probs.scatter_reduce(-1, last, kept.masked_fill(ends_with, -math.inf),
                                        "amin"), None

    def advance(self, state: Tensor, origin: Tensor, tokens: Tensor) -> Tensor:
        if state.shape[2] == 0:
            return state.new_empty(*tokens.shape, 0)
        recent = state.gather(1, origin.unsqueeze(-1).expand(-1, -1, state.shape[2]))
        return torch.cat([recent[:, :, 1:], tokens.unsqueeze(-1)], dim=-1)

    def select(self, state: Tensor, chosen: Tensor, kept: Tensor | None) -> Tensor:
        state = state.gather(1, chosen.unsqueeze(-1).expand(-1, -1, state.shape[2]))
        return state if kept is None else state[kept]
