"""The search constraint of `attn parse --constrain`: hypotheses that are well-formed linearized
trees over exactly the input's words (not in the paper, which repairs the output afterwards), and
how a parser model's vocabulary spells its terminals. Plugs into `search.beam_search` through its
`Constraint` protocol."""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor

from ..formats import WORD_SCORES
from ..search import Unconstrained
from .trees import PLACEHOLDER, terminal_word


def model_terminals(tgt_vocab) -> str:
    """How the parser's training trees spelled their terminals: a model trained on placeholders
    has the placeholder as one piece of its (target) vocabulary (a bracket symbol of `attn
    vocab --symbols`); one trained on words does not."""
    processor = tgt_vocab.processor
    placeholder = processor.piece_to_id("\u2581" + PLACEHOLDER)
    return "placeholders" if placeholder != processor.unk_id() else "words"


def tree_constraints(terminals: str = "auto", score_words: str = "given"):
    """What `load_translator(constraint_for=...)` (decode/translator.py) takes for `attn parse
    --constrain`: given a parser model, its `tree_constraint_for`, with the terminals the model
    spells (`model_terminals`) unless `terminals` says."""

    def for_model(loaded):
        kind = model_terminals(loaded.tgt_vocab) if terminals == "auto" else terminals
        return tree_constraint_for(loaded.tgt_vocab, loaded.config.eos_id, kind, score_words)

    return for_model


def tree_constraint_for(tgt_vocab, eos_id: int, terminals: str, score_words: str = "given"):
    """A function making the search constraint of `attn parse --constrain` for a batch of
    sentences (raw lines): with placeholder terminals, as many placeholders as words; with word
    terminals, exactly the input's pieces, in order, scored as `score_words` says (see
    `TreeConstraint`)."""
    pieces = [tgt_vocab.piece(i) for i in range(len(tgt_vocab))]
    placeholder = PLACEHOLDER if terminals == "placeholders" else None
    template = TreeConstraint.for_pieces(pieces, eos_id, [], placeholder=placeholder,
                                         score_words=score_words)

    def make(lines: list[str]) -> TreeConstraint:
        if placeholder is not None:
            return template.for_batch([len(line.split()) for line in lines])
        spelled = [" ".join(terminal_word(word) for word in line.split()) for line in lines]
        required = tgt_vocab.encode(spelled)
        return template.for_batch([len(ids) for ids in required], required)
    return make


class TreeConstraint(Unconstrained):
    """Search constraint for linearized trees (an option of `attn parse`, not in the paper):
    exactly one terminal per word (per piece of the sentence, in order, when the terminals are
    the words themselves, and brackets only between words, never inside one), closing brackets
    only inside an open one and never right after it (no empty constituent), EOS only when
    every terminal is placed and every bracket closed, nothing but brackets and terminals. The
    state per hypothesis is (terminals emitted, open brackets, opening brackets in a row)."""

    NEVER, TERMINAL, OPEN, CLOSE, END = range(5)
    # Opening brackets in a row (a unary chain and the phrases it starts): at most 6 in the
    # Penn Treebank sample; the bound keeps a search from stalling on brackets alone.
    MAX_OPEN_RUN = 8

    def __init__(self, piece_classes: Tensor, word_counts: list[int],
                 required: list[list[int]] | None = None,
                 piece_starts_word: Tensor | None = None, score_words: str = "given"):
        if score_words not in WORD_SCORES:
            raise ValueError(f"score_words must be one of {WORD_SCORES}, not {score_words!r}")
        self.piece_classes = piece_classes  # (V,) long: the class of every vocabulary piece
        self.piece_starts_word = piece_starts_word  # (V,) bool: the piece begins a word
        # With word terminals the input fixes the words; only the brackets are to be found.
        # "given" scores a word by the model's probability of *a* word at that point (a word's
        # first piece: the mass of every word-starting piece; its other pieces: 1), so a model
        # unsure *which* word comes next is not pushed into brackets it does not believe in.
        # "joint" scores the input's own pieces, p(tree and words).
        self.score_words = score_words
        self.word_counts = word_counts  # terminals per sentence of the batch
        self.word_count_of = torch.tensor(word_counts, dtype=torch.long)
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
        # The columns a step ranks: the brackets and EOS, and the placeholder terminals; with
        # word terminals the sentence's next piece is one more column of each row's own. Every
        # other piece is never allowed, so the search ranks ~50 columns, not the vocabulary.
        kinds = [self.OPEN, self.CLOSE, self.END] + (
            [self.TERMINAL] if self.required is None else [])
        self.columns = torch.isin(piece_classes, torch.tensor(kinds)).nonzero().squeeze(1)  # (F,)
        self.column_classes = piece_classes[self.columns]
        self.eos_column = int((self.column_classes == self.END).nonzero()[0])
        # Where a hypothesis is stuck (no class fits its room), what the repair may take.
        self.when_stuck = torch.tensor([False, True, False, True, True])
        self.word_starts = None  # the pieces that start a word, which "given" sums over
        if self.required is not None:
            self.word_starts = ((piece_classes == self.TERMINAL)
                                & self.piece_starts_word).nonzero().squeeze(1)

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

    def to(self, device) -> "TreeConstraint":
        """This constraint with its tensors on `device`."""
        moved = copy.copy(self)
        for name in ("piece_classes", "word_count_of", "columns", "column_classes", "required",
                     "boundary", "word_starts", "when_stuck"):
            tensor = getattr(self, name)
            setattr(moved, name, None if tensor is None else tensor.to(device))
        return moved

    def start(self, batch: int, beam: int, device) -> tuple[Tensor, Tensor, Tensor]:
        """Every hypothesis's state at the start: no terminal placed, no bracket open."""
        zeros = torch.zeros(batch, beam, dtype=torch.long, device=device)
        return zeros, zeros.clone(), zeros.clone()

    def candidates(self, log_probs: Tensor, state: tuple[Tensor, Tensor, Tensor],
                   active: Tensor, steps_left: Tensor, at_limit: Tensor) -> tuple[Tensor, Tensor]:
        """`next_tokens`' scores, -inf where a token may not come next (anything goes in a row
        at its length limit (`at_limit` (B',)): the search then takes its EOS), and their token
        ids: what the search ranks."""
        scores, allowed, tokens = self.next_tokens(log_probs, state, active, steps_left)
        scores.masked_fill_(~(allowed | at_limit.view(-1, 1, 1)), -math.inf)
        return scores, tokens

    def next_tokens(self, log_probs: Tensor, state: tuple[Tensor, Tensor, Tensor],
                    active: Tensor, steps_left: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The tokens that may come next, of the (B', K, V) log-probabilities of the live
        hypotheses: (their scores, whether each is allowed, their token ids), each (B', K, C).
        `active` (B'): the sentence of each row; `steps_left` (B',): the tokens that may still
        follow this one (every choice must leave room to place the missing terminals, close the
        open brackets and end). The sentence's next piece is scored as `score_words` says."""
        by_class = self.allowed_classes(state, active, steps_left)  # (B', K, classes)
        scores = log_probs.index_select(-1, self.columns)  # (B', K, F)
        allowed = by_class[..., self.column_classes]
        tokens = self.columns.expand(*scores.shape)
        if self.required is None:
            return scores, allowed, tokens
        placed = state[0].clamp(max=self.required.shape[1] - 1)  # (B', K)
        next_piece = self.required[active].gather(1, placed).unsqueeze(-1)  # (B', K, 1)
        piece_score = log_probs.gather(-1, next_piece)
        if self.score_words == "given":
            starts = self.boundary[active].gather(1, placed)
            any_word = torch.logsumexp(log_probs.index_select(-1, self.word_starts), dim=-1)
            given = torch.where(starts, any_word, torch.zeros_like(any_word)).unsqueeze(-1)
            # Past the last word the "next piece" is padding: it keeps its own (banned) score.
            missing = (state[0] < self.word_count_of[active].unsqueeze(-1)).unsqueeze(-1)
            piece_score = torch.where(missing, given, piece_score)
        return (torch.cat([scores, piece_score], dim=-1),
                torch.cat([allowed, by_class[..., self.TERMINAL, None]], dim=-1),
                torch.cat([tokens, next_piece], dim=-1))

    def token_ids(self, columns: Tensor, origin: Tensor, picked: Tensor) -> Tensor:
        """The token ids of the candidates the search `picked` (B', 2K), columns of the rows
        `origin` (B', 2K) of `columns` (B', K, C) (`candidates`)."""
        return columns.flatten(1).gather(1, origin * columns.shape[-1] + picked)

    def allowed_classes(self, state: tuple[Tensor, Tensor, Tensor], active: Tensor,
                        steps_left: Tensor) -> Tensor:
        """(B', K, classes) True where a token of that class may come next (see
        `candidates`)."""
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
        return by_class | (stuck & self.when_stuck)

    def advance(self, state: tuple[Tensor, Tensor, Tensor], origin: Tensor,
                tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The state of every candidate: its parent beam's, plus the token it adds."""
        placed, depth, opened = (part.gather(1, origin) for part in state)
        kind = self.piece_classes[tokens]
        opening = kind == self.OPEN
        return (placed + (kind == self.TERMINAL).long(),
                depth + opening.long() - (kind == self.CLOSE).long(),
                torch.where(opening, opened + 1, 0))

    def longest(self, state: tuple[Tensor, Tensor, Tensor], chosen: Tensor, active: Tensor,
                length: int) -> Tensor:
        """(B',) the most tokens, EOS included, that any of the candidates `chosen` (B', K) of
        length `length` can still end with: every missing terminal, at most MAX_OPEN_RUN
        opening brackets before each, a closing one for each of those and each still open, and
        the EOS. (A closing bracket never follows an opening one, so each gap between two
        terminals holds closings, then at most MAX_OPEN_RUN openings.) Far tighter than the
        search's length limit near the end of a sentence, which lets its exact early stop come
        as soon as no live tree can still beat the finished ones."""
        placed, depth, _ = (part.gather(1, chosen) for part in state)
        missing = (self.word_count_of[active].unsqueeze(-1) - placed).clamp(min=0)
        return (length + missing * (1 + 2 * self.MAX_OPEN_RUN) + depth + 1).amax(dim=1)

    def bound(self, state: tuple[Tensor, Tensor, Tensor], chosen: Tensor, active: Tensor,
              length: int, limit: Tensor) -> Tensor:
        """(B',) the early stop's bound: `longest`, or the length `limit` if that is less."""
        return torch.minimum(limit, self.longest(state, chosen, active, length))

    def select(self, state: tuple[Tensor, Tensor, Tensor], chosen: Tensor,
               kept: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """The state of the candidates that live on, of the sentences still searching."""
        state = tuple(part.gather(1, chosen) for part in state)
        return state if kept is None else tuple(part[kept] for part in state)
