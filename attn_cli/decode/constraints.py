"""A batch's controls made into the search's constraint (search.py's protocol): each line's
prefix (`prefix.py`), the phrases it must hold and the phrases banned from every line
(`lexical.py`), chained where there are several, and nothing at all where nothing is controlled,
so that such a batch is searched as a free one, at no extra cost."""

from __future__ import annotations

from ..search import Chained
from .controls import Controls
from .lexical import BannedPhrases, LexicalConstraint, WordPieces, holds
from .prefix import PrefixConstraint


def search_constraint(controls: list[Controls], bans: list[list[int]] | None, eos_id: int,
                      words: WordPieces | None = None):
    """The search constraint of a batch whose lines have `controls` (and every line `bans`;
    `words`: the target vocabulary's, for phrases' word ends): None where nothing is
    controlled, so that such a batch is searched as a free one, at no extra cost; one
    constraint, or several chained (`search.Chained`)."""
    parts = []
    if any(line.prefix for line in controls):
        parts.append(PrefixConstraint.for_batch([list(line.prefix) for line in controls],
                                                eos_id))
    if any(line.phrases for line in controls):
        parts.append(LexicalConstraint.for_batch(
            [[list(phrase) for phrase in line.phrases] for line in controls], eos_id, words))
    if bans:
        parts.append(BannedPhrases.from_phrases(bans, eos_id))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else Chained(parts)


def holds_phrases(tokens: list[int], controls: Controls, words: WordPieces | None) -> bool:
    """Whether an output holds every phrase of its line's controls, as the search counts it."""
    return all(holds(tokens, phrase, words) for phrase in controls.phrases)


def free_controls(controls: list[Controls]) -> list[Controls]:
    """The controls without their phrases: the prefixes only."""
    return [Controls(line.prefix) if line.phrases else line for line in controls]
