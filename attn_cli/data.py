"""Training data: `attn binarize` writes it, `attn train` reads it memory-mapped.

A data file is safetensors with, per side, flat int32 token ids (no BOS/EOS: the model adds them)
and int64 offsets (n+1, offsets[i]:offsets[i+1] is pair i), the SentencePiece model bytes, and
metadata: format, vocab checksums, counts, special ids. Memory stays bounded on both ends: binarize
streams chunks through temporary files; the reader maps the file and touches only what it batches.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import stfile
from .errors import AttnError
from .files import (
    STRICT,
    Utf8Policy,
    cannot_write,
    decode_chunk,
    display_name,
    open_binary,
    take_lines,
)
from .formats import (
    BOS_ID,
    DATA_FORMAT,
    DATA_FORMAT_VERSION,
    EOS_ID,
    PAD_ID,
    SIDES,
    UNK_ID,
    ids_tensor,
    offsets_tensor,
    vocab_tensor,
)
from .vocab import Vocabulary


@dataclass
class BinarizeStats:
    lines: int = 0
    pairs: int = 0
    dropped_empty: int = 0
    dropped_too_long: int = 0
    src_tokens: int = 0
    tgt_tokens: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        return (f"{self.lines} lines read, {self.pairs} pairs kept, {self.dropped_empty} dropped "
                f"(empty side), {self.dropped_too_long} dropped (too long); "
                f"{self.src_tokens} source + {self.tgt_tokens} target tokens in "
                f"{self.seconds:.1f}s")


class _SideWriter:
    """Appends one side's ids and offsets to temporary files (memory does not grow)."""

    def __init__(self, directory: str, side: str):
        self.side = side
        self.ids_path = Path(directory) / ids_tensor(side)
        self.offsets_path = Path(directory) / offsets_tensor(side)
        self.ids = open(self.ids_path, "wb")
        self.offsets = open(self.offsets_path, "wb")
        self.offsets.write(np.zeros(1, dtype="<i8").tobytes())
        self.total = 0
        self.count = 0

    def append(self, flat_ids: np.ndarray, lengths: np.ndarray) -> None:
        flat_ids.astype("<i4", copy=False).tofile(self.ids)
        (self.total + np.cumsum(lengths, dtype="<i8")).astype("<i8").tofile(self.offsets)
        self.total += int(lengths.sum())
        self.count += len(lengths)

    def close(self) -> list[stfile.TensorSource]:
        self.ids.close()
        self.offsets.close()
        return [stfile.TensorSource(offsets_tensor(self.side), np.dtype("<i8"),
                                    (self.count + 1,), file=self.offsets_path),
                stfile.TensorSource(ids_tensor(self.side), np.dtype("<i4"),
                                    (self.total,), file=self.ids_path)]


def _mismatch(src_path, tgt_path, src_handle, tgt_handle, src_count, tgt_count) -> AttnError:
    src_count += sum(1 for _ in src_handle)
    tgt_count += sum(1 for _ in tgt_handle)
    return AttnError(f"line counts differ: {display_name(src_path)} has {src_count} lines, "
                     f"{display_name(tgt_path)} has {tgt_count}")


def _encode_side(raw_lines: list[bytes], path, first_line_number: int, vocabulary: Vocabulary,
                 threads: int, policy: Utf8Policy) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of one side → (flat int32 ids, int64 lengths)."""
    sequences = vocabulary.encode(decode_chunk(raw_lines, path, first_line_number, policy),
                                  threads)
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    flat_ids = np.fromiter(itertools.chain.from_iterable(sequences), dtype="<i4",
                           count=int(lengths.sum()))
    return flat_ids, lengths


def binarize(src_path: str | os.PathLike, tgt_path: str | os.PathLike,
             out_path: str | os.PathLike, src_vocab: Vocabulary,
             tgt_vocab: Vocabulary | None = None, max_len: int = 1024, threads: int = 0,
             chunk_lines: int = 10_000,
             progress: Callable[[BinarizeStats], None] | None = None,
             policy: Utf8Policy = STRICT) -> BinarizeStats:
    """Encode a parallel corpus into a data file. Pairs with an empty side or a side of more
    than `max_len` subwords are dropped and counted. `tgt_vocab`: a separate target vocabulary.
    `policy`: what invalid UTF-8 does (an error by default: training data should be clean)."""
    if str(src_path) == "-" and str(tgt_path) == "-":
        raise AttnError("source and target cannot both be stdin")
    started = time.perf_counter()
    stats = BinarizeStats()
    vocabularies = {"src": src_vocab, "tgt": tgt_vocab or src_vocab}
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    paths = {"src": src_path, "tgt": tgt_path}
    try:
        with tempfile.TemporaryDirectory(prefix=".binarize.", dir=out_path.parent) as scratch, \
                open_binary(src_path) as src_handle, open_binary(tgt_path) as tgt_handle:
            writers = {side: _SideWriter(scratch, side) for side in SIDES}
            while True:
                raw = {"src": take_lines(src_handle, chunk_lines),
                       "tgt": take_lines(tgt_handle, chunk_lines)}
                if len(raw["src"]) != len(raw["tgt"]):
                    raise _mismatch(src_path, tgt_path, src_handle, tgt_handle,
                                    stats.lines + len(raw["src"]), stats.lines + len(raw["tgt"]))
                if not raw["src"]:
                    break
                encoded = {side: _encode_side(raw[side], paths[side], stats.lines + 1,
                                              vocabularies[side], threads, policy)
                           for side in SIDES}
                del raw  # keep one chunk alive at a time: memory stays flat however long the corpus
                _append_kept(encoded, writers, max_len, stats)
                del encoded
                stats.pairs = writers["src"].count
                stats.src_tokens, stats.tgt_tokens = writers["src"].total, writers["tgt"].total
                if progress:
                    progress(stats)
            if stats.lines == 0:
                raise AttnError(f"{display_name(src_path)} and {display_name(tgt_path)} are empty")
            if stats.pairs == 0:
                raise AttnError(f"no pair left after dropping {stats.dropped_empty} with an empty "
                                f"side and {stats.dropped_too_long} over {max_len} tokens")
            tensors = writers["src"].close() + writers["tgt"].close()
            tensors += [stfile.TensorSource(vocab_tensor(side), np.dtype(np.uint8),
                                            (len(vocabulary.model_bytes),),
                                            data=vocabulary.model_bytes)
                        for side, vocabulary in (("src", src_vocab), ("tgt", tgt_vocab))
                        if vocabulary is not None]
            stfile.write_streaming(out_path, tensors, _data_metadata(
                stats, src_vocab, tgt_vocab, max_len, src_path, tgt_path))
        stats.seconds = time.perf_counter() - started
    except OSError as error:  # a full disk, a quota, a read-only file system
        raise cannot_write(out_path, error) from None
    return stats


def _append_kept(encoded: dict, writers: dict, max_len: int, stats: BinarizeStats) -> None:
    """A chunk's pairs to the side writers, less those with an empty side or a side over
    `max_len` subwords (counted in `stats`)."""
    lengths = {side: encoded[side][1] for side in SIDES}
    empty = (lengths["src"] == 0) | (lengths["tgt"] == 0)
    too_long = ~empty & ((lengths["src"] > max_len) | (lengths["tgt"] > max_len))
    keep = ~(empty | too_long)
    stats.lines += len(keep)
    stats.dropped_empty += int(empty.sum())
    stats.dropped_too_long += int(too_long.sum())
    for side in SIDES:
        flat_ids, side_lengths = encoded[side]
        if not keep.all():
            flat_ids = flat_ids[np.repeat(keep, side_lengths)]
        writers[side].append(flat_ids, side_lengths[keep])


def _data_metadata(stats: BinarizeStats, src_vocab: Vocabulary, tgt_vocab: Vocabulary | None,
                   max_len: int, src_path, tgt_path) -> dict[str, str]:
    """What a data file says of itself: format, vocabularies, counts, special ids, sources."""
    target = tgt_vocab or src_vocab
    return {
        "format": DATA_FORMAT, "format_version": DATA_FORMAT_VERSION,
        "src_vocab_sha256": src_vocab.checksum,
        "tgt_vocab_sha256": target.checksum,
        "shared_vocab": "true" if tgt_vocab is None else "false",
        "src_vocab_size": str(len(src_vocab)), "tgt_vocab_size": str(len(target)),
        "pairs": str(stats.pairs), "lines": str(stats.lines),
        "dropped_empty": str(stats.dropped_empty),
        "dropped_too_long": str(stats.dropped_too_long), "max_len": str(max_len),
        "src_tokens": str(stats.src_tokens), "tgt_tokens": str(stats.tgt_tokens),
        "pad_id": str(PAD_ID), "unk_id": str(UNK_ID), "bos_id": str(BOS_ID),
        "eos_id": str(EOS_ID),
        "src_file": Path(display_name(src_path)).name,
        "tgt_file": Path(display_name(tgt_path)).name,
    }


class ParallelData:
    """A data file, memory-mapped. `src_lengths`/`tgt_lengths` count subwords without EOS/BOS."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        header = stfile.read_attn_header(path, DATA_FORMAT, "data file",
                                         "; make one with `attn binarize`")
        self.metadata = header.metadata
        expected = {name(side) for side in SIDES for name in (ids_tensor, offsets_tensor)}
        missing = (expected | {vocab_tensor("src")}) - set(header.tensors)
        if missing:
            raise AttnError(f"data file {path} is corrupt (missing {sorted(missing)})")
        self.offsets = {side: stfile.memmap_tensor(path, header, offsets_tensor(side))
                        for side in SIDES}
        self.ids = {side: stfile.memmap_tensor(path, header, ids_tensor(side)) for side in SIDES}
        self.src_lengths = np.diff(self.offsets["src"])
        self.tgt_lengths = np.diff(self.offsets["tgt"])
        if (len(self.src_lengths) != len(self.tgt_lengths)
                or self.offsets["src"][-1] != len(self.ids["src"])
                or self.offsets["tgt"][-1] != len(self.ids["tgt"])):
            raise AttnError(f"data file {path} is corrupt (offsets do not match the ids)")
        vocabularies = {side: Vocabulary(bytes(stfile.memmap_tensor(path, header,
                                                                    vocab_tensor(side))))
                        for side in SIDES if vocab_tensor(side) in header.tensors}
        self.src_vocab = vocabularies["src"]
        self.tgt_vocab = vocabularies.get("tgt")

    @property
    def shared_vocab(self) -> bool:
        return self.tgt_vocab is None

    def __len__(self) -> int:
        return len(self.src_lengths)

    def pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return tuple(self.ids[side][self.offsets[side][index]:self.offsets[side][index + 1]]
                     for side in SIDES)

    def check_same_vocab(self, other: "ParallelData") -> None:
        for key in ("src_vocab_sha256", "tgt_vocab_sha256"):
            if self.metadata.get(key) != other.metadata.get(key):
                raise AttnError(f"{other.path} was binarized with another vocabulary than "
                                f"{self.path}: binarize both with the same --vocab")
