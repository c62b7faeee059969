"""Vocabulary shortlists: decoding with the output projection over a few target pieces only.

Not in the paper. For a small model the output projection is the largest matmul of a decoder
step (the d256 demo's: V·D = 2.0M multiply-adds a row against ~3.1M for its three layers), and
most of the vocabulary is never a plausible next piece of a given source. Marian's lexical
shortlist and CTranslate2's vocabulary map keep, for a batch, the union of each source
piece's likely translations and the most frequent target pieces, and project onto those
alone (`model.OutputSubset`; the softmax normalises over them).

The lexical table here is IBM model 1 (Brown et al. 1993), p(target piece | source piece),
trained by EM over the pieces of a data file from `attn binarize` (each target piece may also
come from NULL). It is what fast_align computes without its diagonal prior, which a shortlist
does not need (only which pieces, not where), and it runs on the data file itself: no
alignment tool, no text. A shortlist file (`attn shortlist`) holds, per source piece, its
`best` most probable target pieces, and the `frequent` most frequent target pieces of the
data, always kept with the end of sentence, the unknown piece and any tag piece; decoding also
keeps the pieces of the batch's prefixes and constraints (`Translator.search`). `vmap_lines`
writes the same shortlist as CTranslate2's vocabulary map, so that the two decoders are
compared on the same candidates.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from ..errors import AttnError
from ..files import atomic_path
from ..formats import EOS_ID, UNK_ID
from ..tags import vocabulary_tags

SHORTLIST_FORMAT = "attn-shortlist"
SHORTLIST_FORMAT_VERSION = "1"
CANDIDATES = "shortlist.candidates"  # (source vocabulary, best) int32, -1 where fewer
ALWAYS = "shortlist.always"  # (k,) int32

# Marian's common setting keeps 100 frequent and 100 best per source word over 32k-piece
# vocabularies; these defaults were measured on Multi30k (benchmarks/README.md, issue 44).
BEST = 20
FREQUENT = 100
THRESHOLD = 0.01
ITERATIONS = 5
MAX_PAIRS = 1_000_000
CHUNK_ENTRIES = 20_000_000  # (source, target) co-occurrences held at once: ~0.5 GB of arrays


@dataclass(frozen=True)
class LexicalTable:
    """IBM model 1's p(target | source) for every co-occurring pair: `keys` (sorted int64,
    source * target_size + target; source = source_size is NULL) and `probs` (float64)."""

    keys: np.ndarray
    probs: np.ndarray
    target_size: int
    target_counts: np.ndarray  # how often each target piece occurs in the pairs read


def sampled_pairs(count: int, max_pairs: int, seed: int = 1) -> np.ndarray:
    """Which pairs of `count` the table is learned from: all of them, or `max_pairs` drawn
    without replacement (sorted: the data file is read in order)."""
    if count <= max_pairs:
        return np.arange(count)
    return np.sort(np.random.default_rng(seed).choice(count, max_pairs, replace=False))


def _chunks(data, pairs: np.ndarray, source_size: int) -> Iterator[tuple[np.ndarray, ...]]:
    """The pairs in chunks of at most CHUNK_ENTRIES co-occurrences: for each, every (source
    piece or NULL, target piece) of each pair as (keys-to-be: source ids, target ids) and the
    target token each belongs to (its index within the chunk)."""
    src_lengths = data.src_lengths[pairs].astype(np.int64)
    tgt_lengths = data.tgt_lengths[pairs].astype(np.int64)
    entries = (src_lengths + 1) * tgt_lengths
    start = 0
    while start < len(pairs):
        budget = np.cumsum(entries[start:])
        stop = start + max(1, int(np.searchsorted(budget, CHUNK_ENTRIES, side="right")))
        yield _cooccurrences(data, pairs[start:stop], src_lengths[start:stop],
                             tgt_lengths[start:stop], source_size)
        start = stop


def _cooccurrences(data, pairs: np.ndarray, src_lengths: np.ndarray, tgt_lengths: np.ndarray,
                   source_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source id per entry, target id per entry, target token per entry) of the pairs: each
    target token with every source token of its pair and NULL (`source_size`)."""
    sources_per_pair = src_lengths + 1
    # each pair's source ids then NULL, end to end
    extended = np.full(int(sources_per_pair.sum()), source_size, dtype=np.int64)
    extended_start = np.cumsum(sources_per_pair) - sources_per_pair
    pair_of_source = np.repeat(np.arange(len(pairs)), src_lengths)
    within = np.arange(len(pair_of_source)) - np.repeat(np.cumsum(src_lengths) - src_lengths,
                                                        src_lengths)
    extended[extended_start[pair_of_source] + within] = data.ids["src"][
        data.offsets["src"][pairs][pair_of_source] + within]
    pair_of_token = np.repeat(np.arange(len(pairs)), tgt_lengths)
    within = np.arange(len(pair_of_token)) - np.repeat(np.cumsum(tgt_lengths) - tgt_lengths,
                                                       tgt_lengths)
    targets = data.ids["tgt"][data.offsets["tgt"][pairs][pair_of_token] + within].astype(np.int64)
    sources_per_token = sources_per_pair[pair_of_token]
    token_of_entry = np.repeat(np.arange(len(targets)), sources_per_token)
    within = np.arange(len(token_of_entry)) - np.repeat(
        np.cumsum(sources_per_token) - sources_per_token, sources_per_token)
    sources = extended[extended_start[pair_of_token][token_of_entry] + within]
    return sources, targets[token_of_entry], token_of_entry


def ibm_model1(data, iterations: int = ITERATIONS, max_pairs: int = MAX_PAIRS, seed: int = 1,
               progress: Callable[[str], None] | None = None) -> LexicalTable:
    """IBM model 1 over the pieces of `data` (a `data.ParallelData`), `iterations` rounds of
    EM from uniform probabilities (whose first round is co-occurrence counting)."""
    source_size = len(data.src_vocab)
    target_vocab = data.tgt_vocab or data.src_vocab
    target_size = len(target_vocab)
    pairs = sampled_pairs(len(data), max_pairs, seed)
    pairs = pairs[(data.src_lengths[pairs] > 0) & (data.tgt_lengths[pairs] > 0)]
    if len(pairs) == 0:
        raise AttnError(f"data file {data.path} has no pairs to learn a shortlist from")
    keys = np.empty(0, dtype=np.int64)
    target_counts = np.zeros(target_size, dtype=np.int64)
    for sources, targets, tokens in _chunks(data, pairs, source_size):
        keys = np.union1d(keys, sources * target_size + targets)
        first = np.flatnonzero(np.diff(tokens, prepend=-1))  # each target token once
        target_counts += np.bincount(targets[first], minlength=target_size)
    probs = np.ones(len(keys))
    source_of_key = keys // target_size
    for iteration in range(iterations):
        counts = np.zeros(len(keys))
        for sources, targets, tokens in _chunks(data, pairs, source_size):
            index = np.searchsorted(keys, sources * target_size + targets)
            p = probs[index]
            posterior = p / np.bincount(tokens, weights=p)[tokens]  # over the token's sources
            counts += np.bincount(index, weights=posterior, minlength=len(keys))
        totals = np.bincount(source_of_key, weights=counts, minlength=source_size + 1)
        probs = counts / totals[source_of_key]
        if progress:
            progress(f"EM round {iteration + 1} of {iterations}")
    return LexicalTable(keys, probs, target_size, target_counts)


@dataclass
class Shortlist:
    """Per source piece its candidate target pieces (`candidates`, (source size, best), -1
    padded), and the target pieces always kept (`always`); the vocabularies' checksums, and
    the file it was read from (`name`, for the errors that name it)."""

    candidates: np.ndarray
    always: np.ndarray
    src_checksum: str
    tgt_checksum: str
    metadata: dict[str, str]
    # both tables as tensors, by device, made at a batch's first need
    _tables: dict = field(default_factory=dict, repr=False, compare=False)
    name: str = field(default="(not from a file)", compare=False)

    @property
    def best(self) -> int:
        return self.candidates.shape[1]

    def ids_for(self, src_tokens, keep: Iterable[int] = ()):
        """The sorted target ids a batch of sources (a (B, S) tensor of ids, any padding) may
        write: its pieces' candidates, the ones always kept, and `keep` (a batch's prefix and
        constraint pieces). A tensor on the sources' device."""
        import torch

        candidates, always = self._device_tables(src_tokens.device)
        chosen = torch.zeros(self.target_size, dtype=torch.bool, device=src_tokens.device)
        rows = candidates.index_select(0, src_tokens.reshape(-1).unique()).reshape(-1)
        chosen[rows[rows >= 0]] = True
        chosen[always] = True
        extra = list(keep)
        if extra:
            chosen[torch.tensor(extra, dtype=torch.long, device=src_tokens.device)] = True
        return chosen.nonzero().squeeze(1)

    def _device_tables(self, device):
        import torch

        if device not in self._tables:
            self._tables[device] = (
                torch.from_numpy(self.candidates.astype(np.int64)).to(device),
                torch.from_numpy(self.always.astype(np.int64)).to(device))
        return self._tables[device]

    @property
    def target_size(self) -> int:
        return int(self.metadata["target_size"])

    def check_vocabularies(self, src_vocab, tgt_vocab, model_name: str) -> None:
        """The shortlist must be of the model's vocabularies: else one error line."""
        if src_vocab.checksum != self.src_checksum or tgt_vocab.checksum != self.tgt_checksum:
            raise AttnError(f"shortlist {self.name} was made for other vocabularies than "
                            f"{model_name}'s: make one with `attn shortlist` from data "
                            "binarized with the model's vocabulary")

    def save(self, path: str | os.PathLike) -> None:
        from safetensors.numpy import save_file

        metadata = {**self.metadata, "format": SHORTLIST_FORMAT,
                    "format_version": SHORTLIST_FORMAT_VERSION,
                    "src_vocab_sha256": self.src_checksum, "tgt_vocab_sha256": self.tgt_checksum}
        with atomic_path(path) as temp:
            save_file({CANDIDATES: np.ascontiguousarray(self.candidates, dtype=np.int32),
                       ALWAYS: np.ascontiguousarray(self.always, dtype=np.int32)},
                      str(temp), metadata=metadata)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Shortlist":
        from safetensors.numpy import load_file

        from .. import stfile
        from ..files import check_readable

        check_readable(path, "shortlist")
        header = stfile.read_header(path, "shortlist")
        found = header.metadata.get("format")
        if found != SHORTLIST_FORMAT:
            raise AttnError(f"shortlist {path} is not a shortlist file (its format is "
                            f"{found!r}); make one with `attn shortlist`")
        version = header.metadata.get("format_version")
        if version != SHORTLIST_FORMAT_VERSION:
            raise AttnError(f"shortlist {path} has format version {version}; this attn reads "
                            f"version {SHORTLIST_FORMAT_VERSION}")
        tensors = load_file(str(path))
        if set(tensors) != {CANDIDATES, ALWAYS} or tensors[CANDIDATES].ndim != 2:
            raise AttnError(f"shortlist {path} is corrupt (tensors {sorted(tensors)})")
        metadata = dict(header.metadata)
        candidates, always = tensors[CANDIDATES], tensors[ALWAYS]
        size = int(metadata.get("target_size", "0"))
        if size <= 0 or candidates.max(initial=-1) >= size or always.max(initial=-1) >= size \
                or always.min(initial=0) < 0:
            raise AttnError(f"shortlist {path} is corrupt (ids past its target vocabulary)")
        return cls(candidates, always, metadata.pop("src_vocab_sha256", ""),
                   metadata.pop("tgt_vocab_sha256", ""), metadata, name=str(path))

    def vmap_lines(self, src_vocab, tgt_vocab) -> Iterator[str]:
        """CTranslate2's vocabulary map of this shortlist: a first line with an empty source,
        the pieces always kept, then one line per source piece with candidates,
        `piece<TAB>candidate candidate ...` (CTranslate2 adds <unk>, <s> and </s> itself)."""
        yield "\t" + " ".join(tgt_vocab.piece(int(i)) for i in self.always)
        for source, row in enumerate(self.candidates):
            kept = row[row >= 0]
            if len(kept):
                yield (src_vocab.piece(source) + "\t"
                       + " ".join(tgt_vocab.piece(int(i)) for i in kept))


def build(table: LexicalTable, data, best: int = BEST, frequent: int = FREQUENT,
          threshold: float = THRESHOLD) -> Shortlist:
    """The shortlist of a lexical table: each source piece's `best` most probable target
    pieces (at least `threshold` probable), and the `frequent` most frequent target pieces
    with the end of sentence and the unknown piece, always."""
    source_size, size = len(data.src_vocab), table.target_size
    sources, targets = table.keys // size, table.keys % size
    # by source, then the most probable first
    order = np.lexsort((-table.probs, sources))
    sources, targets, probs = sources[order], targets[order], table.probs[order]
    starts = np.flatnonzero(np.diff(sources, prepend=-1))
    rank = np.arange(len(sources)) - np.repeat(starts, np.diff(np.append(starts, len(sources))))
    kept = (rank < best) & (sources < source_size) & (probs >= threshold)
    candidates = np.full((source_size, best), -1, dtype=np.int32)
    candidates[sources[kept], rank[kept]] = targets[kept]
    tgt_vocab = data.tgt_vocab or data.src_vocab
    specials = [EOS_ID, UNK_ID]  # (decoding adds the model's own, which an import may move)
    # tag pieces (tags.py), for a model that writes them (a target-side language tag)
    found = vocabulary_tags(tgt_vocab)
    specials += [*found.targets.values(), *found.others.values()]
    by_count = np.argsort(-table.target_counts, kind="stable")
    common = by_count[:frequent][table.target_counts[by_count[:frequent]] > 0]
    always = np.unique(np.concatenate([common, specials]).astype(np.int32))
    metadata = {"target_size": str(size), "best": str(best), "frequent": str(frequent),
                "threshold": repr(threshold), "lexical_table": "IBM model 1",
                "source_data": os.path.basename(str(data.path))}
    return Shortlist(candidates, always, data.src_vocab.checksum, tgt_vocab.checksum, metadata)
