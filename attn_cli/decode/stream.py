"""Iteration-level batching: one beam search that sentences join and leave at any step.

A batch searched to its end holds a worker until its last sentence ends, its rows thinning as
the others finish, and a sentence that arrives meanwhile waits for the next batch. A `Stream`
(Orca's and vLLM's scheduling, applied to an encoder-decoder) is one search per worker that
never waits: sentences added between two steps are encoded together (one encoder pass for
those that arrived together) and join at the next step with their own memory, every step runs
all the hypotheses in flight whatever their positions, and a sentence whose search is over
leaves at that step, answered then. Each sentence's search is `search.beam_search`'s for it
alone, the same rules over its own scores (decode/native/step.cpp, `Stream`): what it finds
does not depend on what it flew with, as a batch's sentences do not.

It runs on attn's C++ step with its fused kernels (`native.NativeDecoder`, float32, a free
search: no shortlist, sampling or phrases to hold; a sentence's output may start with a prefix
it forces as `prefix.PrefixConstraint` does, a model's target-language token among them);
`supported` says whether a translator's lines can fly in one.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..batching import pad_sequences
from ..search import Hypothesis, banned_ids, output_limits, read_hypotheses
from .native import STOP_RULES, NativeDecoder


def supported(translator) -> bool:
    """Whether `translator`'s lines can be searched in a Stream: its step is the C++ one with
    the fused kernels (one float32 model on a CPU), and its search is a free beam search (not
    sampling, no shortlist, no phrases banned; a line's own controls, its glossary terms
    among them, are the caller's to check)."""
    stepped = translator.stepped
    return (isinstance(stepped, NativeDecoder) and stepped.fused and stepped.fusable
            and not translator.options.sample and translator.controls.shortlist is None
            and not translator.controls.bans)


class Stream:
    """A translator's free beam search as a stream of sentences (`supported(translator)`).
    `add` sentences under keys of the caller's, `step` until `sentences` is 0; `call_off` a
    key to have it leave at the next step."""

    def __init__(self, translator):
        self.translator = translator
        self.native: NativeDecoder = translator.stepped
        options, config = translator.options, translator.config
        self.nbest = min(options.nbest, options.beam)
        self._stream = self.native.stream(
            beam=options.beam, nbest=self.nbest, stop=STOP_RULES[options.stop],
            alpha=options.alpha, banned=banned_ids(config, None, torch.device("cpu")))
        self._longest = 1
        self._keys: dict[int, Hashable] = {}
        self._next = 0

    @property
    def sentences(self) -> int:
        """Sentences in flight."""
        return self._stream.sentences()

    @property
    def rows(self) -> int:
        """Hypotheses the next step runs."""
        return self._stream.rows()

    @torch.inference_mode()
    def add(self, keys: list[Hashable], ids: list[list[int]],
            prefixes: list[tuple[int, ...]] | None = None) -> None:
        """Sentences `ids` (source ids, EOS included) join at the next step, one encoder pass
        for all of them; `keys` name them in what `step` returns; `prefixes[i]`, the target ids
        sentence i's outputs start with (`Controls.prefix`; None: none), kept in what `step`
        returns as the batch search keeps them."""
        if not ids:
            return
        translator, options = self.translator, self.translator.options
        src = pad_sequences(ids, translator.config.pad_id)
        limits = output_limits(src, translator.config.pad_id, options.max_len_a,
                               options.max_len_b, translator.longest_output).tolist()
        memory, src_mask = self.native.encode(src)
        memory_kv = self.native.start_decoding(memory, src_mask).memory_kv
        for row, (key, limit) in enumerate(zip(keys, limits)):
            # its rows of the batch's memory (views, no copy) and its padding mask
            own = [part for keys_t, values in memory_kv for part in (keys_t[row], values[row])]
            mask = src_mask[row].reshape(-1) if len(ids[row]) < src.shape[1] else None
            number = self._next
            self._next += 1
            self._keys[number] = key
            self._stream.add(number, own, mask, limit, list(prefixes[row]) if prefixes else [])
            self._longest = max(self._longest, limit)

    def call_off(self, key: Hashable) -> None:
        """The sentence `key` leaves at the next step (what it found so far, meaningless)."""
        for number, known in self._keys.items():
            if known == key:
                self._stream.call_off(number)

    def step(self) -> list[tuple[Hashable, list[Hypothesis]]]:
        """One step of every sentence in flight (the GIL released for it): the sentences whose
        search ended, each with its `nbest` best hypotheses, best first (one empty hypothesis
        of score -inf where none finished)."""
        with torch.inference_mode():
            ended = self._stream.step(self.native.positions(self._longest))
        found = []
        for number, rows in ended:
            hypotheses = sorted((hypothesis for _, hypothesis in read_hypotheses(rows)),
                                key=lambda h: -h.score)[:self.nbest]
            found.append((self._keys.pop(number),
                          hypotheses or [Hypothesis([], -float("inf"), -float("inf"))]))
        return found
