"""Toy data of our own for end-to-end tests: a treebank whose brackets follow from its words, and
the sequence-reversal task."""

from __future__ import annotations

import random

# A toy English grammar whose brackets follow from the words: determiners open noun phrases,
# prepositions open prepositional phrases, verbs open verb phrases.
LEXICON = {"DT": ["the", "a"], "NN": ["cat", "dog", "mat", "man", "park", "hat"],
           "JJ": ["big", "small", "red"], "VBD": ["saw", "liked", "found"],
           "VBZ": ["sleeps", "runs"], "IN": ["on", "in", "with"]}


def _word(rng: random.Random, tag: str) -> str:
    return f"({tag} {rng.choice(LEXICON[tag])})"


def _noun_phrase(rng: random.Random, depth: int) -> str:
    words = [_word(rng, "DT")] + ([_word(rng, "JJ")] if rng.random() < 0.4 else [])
    simple = f"(NP {' '.join(words + [_word(rng, 'NN')])})"
    if depth < 2 and rng.random() < 0.35:
        return f"(NP {simple} (PP {_word(rng, 'IN')} {_noun_phrase(rng, depth + 1)}))"
    return simple


def toy_treebank(count: int, seed: int) -> str:
    """`count` trees in the Penn Treebank's file format (outer empty brackets, a final '.')."""
    rng = random.Random(seed)
    trees = []
    for _ in range(count):
        if rng.random() < 0.3:
            verb_phrase = f"(VP {_word(rng, 'VBZ')})"
        else:
            verb_phrase = f"(VP {_word(rng, 'VBD')} {_noun_phrase(rng, 0)})"
        trees.append(f"( (S {_noun_phrase(rng, 0)} {verb_phrase} (. .)) )")
    return "\n".join(trees) + "\n"


def reversal_pairs(count: int, seed: int, letters: str = "abcdefghij", shortest: int = 3,
                   longest: int = 7) -> tuple[list[str], list[str]]:
    """Sequences of letters (space-separated) and the same sequences reversed."""
    rng = random.Random(seed)
    sources, targets = [], []
    for _ in range(count):
        word = [rng.choice(letters) for _ in range(rng.randint(shortest, longest))]
        sources.append(" ".join(word))
        targets.append(" ".join(reversed(word)))
    return sources, targets
