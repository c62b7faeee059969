"""Training data: `attn binarize` writes it, `attn train` reads it memory-mapped.

A data file is safetensors with, per side, flat int32 token ids (no BOS/EOS: the model adds them)
and int64 offsets (n+1, offsets[i]:offsets[i+1] is pair i), the SentencePiece model bytes, and
metadata: format, vocab checksums, counts, special ids. Made with `--alignments` (guided alignment,
train/guided.py), it also holds each pair's word alignment in pieces, in the same layout: pairs
(m, 2) of (source piece, target piece), int16 (int32 past --max-len 32767), sorted by target
piece, and int64 offsets (n+1) into them. Memory stays bounded on both ends: binarize
streams chunks through temporary files; the reader maps the file and touches only what it batches.
Binarize's cleaning filters (cleaning.py) judge a chunk at a time too; only --dedup keeps
something of every pair (5 bytes a line).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import stfile
from .cleaning import EMPTY, TOO_LONG, Cleaner, CleanOptions, count_lines, dropped_output
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
    ALIGNMENT_OFFSETS,
    ALIGNMENT_PAIRS,
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
from .tags import SourceTags
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
    alignment_pairs: int | None = None  # piece pairs kept, with --alignments
    filtered: dict[str, int] = field(default_factory=dict)  # the cleaning filters' drops, by name

    def summary(self) -> str:
        aligned = "" if self.alignment_pairs is None else \
            f", {self.alignment_pairs} aligned piece pairs"
        cleaned = "".join(f", {count} dropped ({name})" for name, count in self.filtered.items())
        return (f"{self.lines} lines read, {self.pairs} pairs kept, {self.dropped_empty} dropped "
                f"(empty side), {self.dropped_too_long} dropped (too long){cleaned}; "
                f"{self.src_tokens} source + {self.tgt_tokens} target tokens{aligned} in "
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


def _mismatch(src_path, tgt_path, src_handle, tgt_handle, src_count, tgt_count,
              remedy: str = "") -> AttnError:
    src_count += sum(1 for _ in src_handle)
    tgt_count += sum(1 for _ in tgt_handle)
    return AttnError(f"line counts differ: {display_name(src_path)} has {src_count} lines, "
                     f"{display_name(tgt_path)} has {tgt_count}{remedy}")


def _encode_side(texts: list[str], vocabulary: Vocabulary, threads: int,
                 tags: SourceTags | None = None) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """One chunk of one side → (flat int32 ids, int64 lengths, the ids of each line), each
    line's ids after `tags`' (an empty line's stay empty)."""
    sequences = vocabulary.encode(texts, threads)
    if tags is not None:
        sequences = tags.prepend(sequences)
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    flat_ids = np.fromiter(itertools.chain.from_iterable(sequences), dtype="<i4",
                           count=int(lengths.sum()))
    return flat_ids, lengths, sequences


class _AlignmentWriter:
    """`binarize --alignments`: each kept pair's Pharaoh word alignment as piece pairs, appended
    to temporary files (memory does not grow), in the data file's layout (module docstring)."""

    def __init__(self, directory: str, path, corpus: dict, max_len: int, leading: int = 0):
        # `leading`: the tag pieces before each source (`--target-tag`, `--tag`), no word's
        self.path, self.corpus, self.leading = path, corpus, leading
        self.dtype = np.dtype("<i2") if max_len < 2 ** 15 else np.dtype("<i4")
        self.pairs_path = Path(directory) / ALIGNMENT_PAIRS
        self.offsets_path = Path(directory) / ALIGNMENT_OFFSETS
        self.pairs = open(self.pairs_path, "wb")
        self.offsets = open(self.offsets_path, "wb")
        self.offsets.write(np.zeros(1, dtype="<i8").tobytes())
        self.total = 0
        self.count = 0

    def chunk(self, raw_lines: list[bytes], first_line_number: int, texts: dict,
              ids: dict, vocabularies: dict) -> list[list[tuple[int, int]]]:
        """The piece pairs of each line of a chunk: its word pairs read and checked against the
        words of its source and target lines (alignment.read_pharaoh: a bad one is an error
        naming the file and line), each word mapped to its pieces (alignment.piece_words)."""
        from .alignment import clamped, piece_pairs, piece_words, read_pharaoh, word_spans

        lines = decode_chunk(raw_lines, self.path, first_line_number, STRICT)
        if self.leading:  # the words are the line's: its pieces without the tags first
            ids = {**ids, "src": [line_ids[self.leading:] for line_ids in ids["src"]]}
        pieces = {side: _pieces(vocabularies[side], texts[side], ids[side]) for side in SIDES}
        found = []
        for offset, line in enumerate(lines):
            words = {side: len(word_spans(texts[side][offset])) for side in SIDES}
            where = f"{display_name(self.path)} line {first_line_number + offset}"
            number = first_line_number + offset
            word_pairs = read_pharaoh(
                line, where, words["src"], words["tgt"],
                *(f"line {number} of {display_name(self.corpus[side])}" for side in SIDES))
            if not word_pairs:
                found.append([])
                continue
            owners = {side: clamped(piece_words(pieces[side][offset]), words[side])
                      for side in SIDES}
            # the tags own no word (-1): the piece pairs count them, aligning them nothing
            owners["src"] = [-1] * self.leading + owners["src"]
            found.append(piece_pairs(word_pairs, owners["src"], owners["tgt"]))
        return found

    def append(self, per_pair: list[list[tuple[int, int]]]) -> None:
        lengths = np.fromiter(map(len, per_pair), dtype=np.int64, count=len(per_pair))
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(per_pair)),
                           dtype=self.dtype, count=2 * int(lengths.sum()))
        flat.tofile(self.pairs)
        (self.total + np.cumsum(lengths, dtype="<i8")).astype("<i8").tofile(self.offsets)
        self.total += int(lengths.sum())
        self.count += len(lengths)

    def close(self) -> tuple[stfile.TensorSource, stfile.TensorSource]:
        self.pairs.close()
        self.offsets.close()
        return (stfile.TensorSource(ALIGNMENT_OFFSETS, np.dtype("<i8"), (self.count + 1,),
                                    file=self.offsets_path),
                stfile.TensorSource(ALIGNMENT_PAIRS, self.dtype, (self.total, 2),
                                    file=self.pairs_path))


def _pieces(vocabulary: Vocabulary, texts: list[str], ids: list[list[int]]) -> list[list[str]]:
    """The pieces of each line as text, one per id (an unknown piece keeps its surface and its
    "▁", which its id would lose; where SentencePiece's own pieces are not one per id, the
    pieces the ids name)."""
    found = vocabulary.processor.encode(texts, out_type=str)
    return [line_pieces if len(line_pieces) == len(line_ids)
            else [vocabulary.piece(token) for token in line_ids]
            for line_pieces, line_ids in zip(found, ids)]


def _cleaner(cleaning: CleanOptions | None, src_path, tgt_path) -> Cleaner | None:
    """binarize's filters (None: none asked for); --dedup's table is sized from the lines."""
    if cleaning is None or not cleaning.reasons:
        return None
    expected = (count_lines(src_path) or count_lines(tgt_path)) if cleaning.dedup else None
    return Cleaner(cleaning, expected)


def binarize(src_path: str | os.PathLike, tgt_path: str | os.PathLike,
             out_path: str | os.PathLike, src_vocab: Vocabulary,
             tgt_vocab: Vocabulary | None = None, max_len: int = 1024, threads: int = 0,
             chunk_lines: int = 10_000,
             progress: Callable[[BinarizeStats], None] | None = None,
             policy: Utf8Policy = STRICT,
             alignments_path: str | os.PathLike | None = None,
             cleaning: CleanOptions | None = None,
             dropped_path: str | os.PathLike | None = None,
             langs: tuple[str, str] | None = None,
             source_tags: SourceTags | None = None, target_tags: SourceTags | None = None,
             special_ids: SpecialIds | None = None) -> BinarizeStats:
    """Encode a parallel corpus into a data file. Pairs with an empty side or a side of more
    than `max_len` subwords are dropped and counted. `tgt_vocab`: a separate target vocabulary.
    `policy`: what invalid UTF-8 does (an error by default: training data should be clean).
    `alignments_path`: a Pharaoh word alignment of each pair (a line per pair, in order), kept
    in pieces for guided alignment. `cleaning`: the filters that drop more (cleaning.py), each
    counted; `dropped_path`: a file naming each dropped pair (cleaning.DroppedWriter); `langs`:
    the (source, target) languages, recorded in the metadata (`langs`, "en-de"); `source_tags`:
    the tags every source starts with (tags.py: a target language's, bt), and their metadata;
    `target_tags`: the ids every target starts with (an NLLB-200 or M2M-100 model's target
    language code, which its decoder writes first); `special_ids`: those of the model whose
    vocabularies these are (attn's own by default), recorded for `collate`."""
    stdin = [path for path in (src_path, tgt_path, alignments_path) if str(path) == "-"]
    if len(stdin) > 1:
        raise AttnError("only one of the source, the target and the alignments can be stdin")
    started = time.perf_counter()
    stats = BinarizeStats()
    vocabularies = {"src": src_vocab, "tgt": tgt_vocab or src_vocab}
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    paths = {"src": src_path, "tgt": tgt_path}
    cleaner = _cleaner(cleaning, src_path, tgt_path)
    if cleaner is not None:
        stats.filtered = cleaner.counts
    try:
        with dropped_output(dropped_path) as dropped, \
                tempfile.TemporaryDirectory(prefix=".binarize.", dir=out_path.parent) as scratch, \
                open_binary(src_path) as src_handle, open_binary(tgt_path) as tgt_handle, \
                _maybe_open(alignments_path) as align_handle:
            writers = {side: _SideWriter(scratch, side) for side in SIDES}
            aligner = None if alignments_path is None else \
                _AlignmentWriter(scratch, alignments_path, paths, max_len,
                                 0 if source_tags is None else len(source_tags.ids))
            while True:
                raw, raw_alignments = _take_chunk(
                    {"src": src_handle, "tgt": tgt_handle}, paths,
                    None if aligner is None else (align_handle, alignments_path),
                    chunk_lines, stats.lines)
                if not raw["src"]:
                    break
                texts = {side: decode_chunk(raw[side], paths[side], stats.lines + 1, policy)
                         for side in SIDES}
                del raw  # keep one chunk alive at a time: memory stays flat however long the corpus
                encoded = {side: _encode_side(texts[side], vocabularies[side], threads,
                                              source_tags if side == "src" else target_tags)
                           for side in SIDES}
                aligned = None if aligner is None else aligner.chunk(
                    raw_alignments, stats.lines + 1, texts,
                    {side: encoded[side][2] for side in SIDES}, vocabularies)
                first_line = stats.lines + 1
                reasons = _verdicts(encoded, max_len, stats, cleaner, texts)
                if dropped is not None:
                    dropped.write(reasons, texts, first_line)
                del texts, raw_alignments
                _append_kept(encoded, writers, reasons == 0, aligned, aligner)
                del encoded, aligned
                stats.pairs = writers["src"].count
                stats.src_tokens, stats.tgt_tokens = writers["src"].total, writers["tgt"].total
                if progress:
                    progress(stats)
            _check_some_kept(stats, src_path, tgt_path, max_len)
            tensors = _data_tensors(writers, aligner, stats, src_vocab, tgt_vocab)
            metadata = _data_metadata(stats, src_vocab, tgt_vocab, max_len, src_path, tgt_path,
                                      cleaning if cleaner is not None else None, langs,
                                      source_tags, alignments_path, special_ids)
            stfile.write_streaming(out_path, tensors, metadata)
        stats.seconds = time.perf_counter() - started
    except OSError as error:  # a full disk, a quota, a read-only file system
        raise cannot_write(out_path, error) from None
    return stats


def _data_tensors(writers: dict, aligner, stats: BinarizeStats, src_vocab: Vocabulary,
                  tgt_vocab: Vocabulary | None) -> list:
    """The data file's tensors: each side's ids and offsets, the alignments (if any) and the
    vocabularies' models."""
    tensors = writers["src"].close() + writers["tgt"].close()
    if aligner is not None:  # the 8-byte offsets first: every tensor stays aligned
        align_offsets, align_pairs = aligner.close()
        tensors = [align_offsets, *tensors, align_pairs]
        stats.alignment_pairs = aligner.total
    return tensors + [stfile.TensorSource(vocab_tensor(side), np.dtype(np.uint8),
                                          (len(vocabulary.model_bytes),),
                                          data=vocabulary.model_bytes)
                      for side, vocabulary in (("src", src_vocab), ("tgt", tgt_vocab))
                      if vocabulary is not None]


def _take_chunk(handles: dict, paths: dict, alignments: tuple | None, chunk_lines: int,
                lines_before: int) -> tuple[dict, list | None]:
    """The next `chunk_lines` raw lines of each side (and of the alignments, `alignments`:
    (handle, path)), or the error of files whose line counts differ."""
    raw = {side: take_lines(handles[side], chunk_lines) for side in SIDES}
    if len(raw["src"]) != len(raw["tgt"]):
        raise _mismatch(paths["src"], paths["tgt"], handles["src"], handles["tgt"],
                        lines_before + len(raw["src"]), lines_before + len(raw["tgt"]))
    if alignments is None:
        return raw, None
    handle, path = alignments
    raw_alignments = take_lines(handle, chunk_lines)
    if len(raw_alignments) != len(raw["src"]):
        raise _mismatch(path, paths["src"], handle, handles["src"],
                        lines_before + len(raw_alignments), lines_before + len(raw["src"]),
                        " (--alignments needs one line per training pair)")
    return raw, raw_alignments


def _check_some_kept(stats: BinarizeStats, src_path, tgt_path, max_len: int) -> None:
    """A data file needs a pair: the error of empty inputs, or of every pair dropped."""
    if stats.lines == 0:
        raise AttnError(f"{display_name(src_path)} and {display_name(tgt_path)} are empty")
    if stats.pairs == 0:
        cleaned = "".join(f", {count} by {name}" for name, count in stats.filtered.items())
        raise AttnError(f"no pair left after dropping {stats.dropped_empty} with an empty "
                        f"side and {stats.dropped_too_long} over {max_len} tokens{cleaned}")


@contextlib.contextmanager
def _maybe_open(path):
    if path is None:
        yield None
        return
    with open_binary(path) as handle:
        yield handle


def _verdicts(encoded: dict, max_len: int, stats: BinarizeStats, cleaner: Cleaner | None = None,
              texts: dict | None = None) -> np.ndarray:
    """Why each pair of a chunk is dropped (cleaning.REASONS; 0: kept): an empty side, a side
    over `max_len` subwords, then `cleaner`'s filters (on `texts`); counted in `stats`."""
    lengths = {side: encoded[side][1] for side in SIDES}
    empty = (lengths["src"] == 0) | (lengths["tgt"] == 0)
    too_long = ~empty & ((lengths["src"] > max_len) | (lengths["tgt"] > max_len))
    reasons = np.zeros(len(empty), dtype=np.uint8)
    reasons[empty] = EMPTY
    reasons[too_long] = TOO_LONG
    stats.lines += len(reasons)
    stats.dropped_empty += int(empty.sum())
    stats.dropped_too_long += int(too_long.sum())
    if cleaner is not None:
        cleaner.judge(reasons, texts, encoded)
    return reasons


def _append_kept(encoded: dict, writers: dict, keep: np.ndarray, aligned: list | None = None,
                 aligner: _AlignmentWriter | None = None) -> None:
    """A chunk's pairs where `keep` to the side writers (and their alignments `aligned` to
    `aligner`)."""
    for side in SIDES:
        flat_ids, side_lengths = encoded[side][:2]
        if not keep.all():
            flat_ids = flat_ids[np.repeat(keep, side_lengths)]
        writers[side].append(flat_ids, side_lengths[keep])
    if aligner is not None:
        aligner.append([pairs for pairs, kept in zip(aligned, keep) if kept])


def _data_metadata(stats: BinarizeStats, src_vocab: Vocabulary, tgt_vocab: Vocabulary | None,
                   max_len: int, src_path, tgt_path, cleaning: CleanOptions | None = None,
                   langs: tuple[str, str] | None = None, source_tags: SourceTags | None = None,
                   alignments_path=None, special_ids: SpecialIds | None = None
                   ) -> dict[str, str]:
    """What a data file says of itself: format, vocabularies, counts, special ids, sources; the
    cleaning filters (`filters`, as CleanOptions.describe) and what each dropped (`dropped_NAME`),
    the language pair (`langs`, "en-de"), the sources' tags (`SourceTags.metadata`) and the
    alignments' file and piece pairs (`stats.alignment_pairs`), where given."""
    target = tgt_vocab or src_vocab
    metadata = {
        "format": DATA_FORMAT, "format_version": DATA_FORMAT_VERSION,
        "src_vocab_sha256": src_vocab.checksum,
        "tgt_vocab_sha256": target.checksum,
        "shared_vocab": "true" if tgt_vocab is None else "false",
        "src_vocab_size": str(len(src_vocab)), "tgt_vocab_size": str(len(target)),
        "pairs": str(stats.pairs), "lines": str(stats.lines),
        "dropped_empty": str(stats.dropped_empty),
        "dropped_too_long": str(stats.dropped_too_long), "max_len": str(max_len),
        "src_tokens": str(stats.src_tokens), "tgt_tokens": str(stats.tgt_tokens),
        **(special_ids or SpecialIds()).metadata(),
        "src_file": Path(display_name(src_path)).name,
        "tgt_file": Path(display_name(tgt_path)).name,
    }
    if cleaning is not None:
        metadata["filters"] = cleaning.describe()
        metadata.update({f"dropped_{name.replace('-', '_')}": str(count)
                         for name, count in stats.filtered.items()})
    if langs is not None:
        metadata["langs"] = "-".join(langs)
    if source_tags is not None:
        metadata.update(source_tags.metadata)
    if alignments_path is not None:
        metadata["alignments_file"] = Path(display_name(alignments_path)).name
        metadata["alignment_pairs"] = str(stats.alignment_pairs)
    return metadata


@dataclass(frozen=True)
class SpecialIds:
    """The ids a data file's pairs are collated with (`batching.collate_pairs`)."""

    bos: int = BOS_ID
    eos: int = EOS_ID
    pad: int = PAD_ID
    unk: int = UNK_ID

    @classmethod
    def of_config(cls, config) -> "SpecialIds":
        return cls(config.bos_id, config.eos_id, config.pad_id, config.unk_id)

    def metadata(self) -> dict[str, str]:
        return {"pad_id": str(self.pad), "unk_id": str(self.unk), "bos_id": str(self.bos),
                "eos_id": str(self.eos)}


def special_ids_of(metadata: dict[str, str]) -> SpecialIds:
    """A data file's special ids, from its metadata (attn's own where it names none)."""
    try:
        return SpecialIds(*(int(metadata.get(f"{name}_id", default)) for name, default in (
            ("bos", BOS_ID), ("eos", EOS_ID), ("pad", PAD_ID), ("unk", UNK_ID))))
    except ValueError:
        raise AttnError("a data file's special ids are not numbers") from None


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
        self.alignment_offsets = self.alignment_pairs = None
        if ALIGNMENT_OFFSETS in header.tensors and ALIGNMENT_PAIRS in header.tensors:
            self.alignment_offsets = stfile.memmap_tensor(path, header, ALIGNMENT_OFFSETS)
            self.alignment_pairs = stfile.memmap_tensor(path, header, ALIGNMENT_PAIRS)
            if (len(self.alignment_offsets) != len(self) + 1
                    or self.alignment_pairs.ndim != 2 or self.alignment_pairs.shape[1] != 2
                    or self.alignment_offsets[-1] != len(self.alignment_pairs)):
                raise AttnError(f"data file {path} is corrupt (its alignments do not match "
                                "its pairs)")

    @property
    def has_alignments(self) -> bool:
        """Whether it was made with `attn binarize --alignments`."""
        return self.alignment_offsets is not None

    def alignment(self, index: int) -> np.ndarray:
        """Pair `index`'s alignment, (k, 2) (source piece, target piece), sorted by target."""
        return self.alignment_pairs[self.alignment_offsets[index]:
                                    self.alignment_offsets[index + 1]]

    @property
    def shared_vocab(self) -> bool:
        return self.tgt_vocab is None

    @property
    def special_ids(self) -> SpecialIds:
        """What its ids for BOS, EOS and padding are (`collate` puts them around each pair):
        attn's own, or those of the model whose vocabularies binarized it (an import's)."""
        return special_ids_of(self.metadata)

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


class Corpora:
    """Several data files read as one (`attn train A.st B.st ...`): pair i of the whole is pair
    i - starts[k] of file k, the files in the order given. It reads as a ParallelData does
    (lengths, pairs, the vocabulary) for what batches them; one file is read as it always was
    (its own lengths, alignments and path). The files must be made with the same vocabulary,
    and may not record different target languages unless each carries its target tag
    (`check_mixable`)."""

    def __init__(self, paths: list[str | os.PathLike]):
        self.parts = [ParallelData(path) for path in paths]
        for part in self.parts:
            if len(part) == 0:
                raise AttnError(f"data file {part.path} holds no pairs: binarize a corpus "
                                "into it, or leave it out")
        check_mixable(self.parts)
        first = self.parts[0]
        # The first file speaks for all in what they share: the vocabulary (its path names
        # it in messages about the vocabulary).
        self.path, self.metadata = first.path, first.metadata
        self.src_vocab, self.tgt_vocab = first.src_vocab, first.tgt_vocab
        self.sizes = tuple(len(part) for part in self.parts)
        self._starts = np.cumsum((0, *self.sizes[:-1]))
        if len(self.parts) == 1:
            self.src_lengths, self.tgt_lengths = first.src_lengths, first.tgt_lengths
        else:
            self.src_lengths = np.concatenate([part.src_lengths for part in self.parts])
            self.tgt_lengths = np.concatenate([part.tgt_lengths for part in self.parts])
        # --guided-alignment reads one file's alignments (train/start.check_data_options)
        self.alignment_offsets = first.alignment_offsets if len(self.parts) == 1 else None
        self.alignment_pairs = first.alignment_pairs if len(self.parts) == 1 else None

    @property
    def names(self) -> list[str]:
        """Each file's name as a label (metrics.jsonl's per-corpus keys): its stem, with its
        place in the order given (from 1) where two stems are the same."""
        stems = [part.path.stem for part in self.parts]
        return [stem if stems.count(stem) == 1 else f"{stem}-{place}"
                for place, stem in enumerate(stems, start=1)]

    @property
    def has_alignments(self) -> bool:
        return self.alignment_offsets is not None

    @property
    def shared_vocab(self) -> bool:
        return self.tgt_vocab is None

    @property
    def special_ids(self) -> SpecialIds:
        """The files' special ids (one vocabulary: one model's ids, `check_mixable`)."""
        return self.parts[0].special_ids

    def __len__(self) -> int:
        return len(self.src_lengths)

    def pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.parts) == 1:
            return self.parts[0].pair(index)
        part = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self.parts[part].pair(index - int(self._starts[part]))

    def check_same_vocab(self, other: ParallelData) -> None:
        self.parts[0].check_same_vocab(other)


def language_pair(metadata: dict[str, str]) -> tuple[str, str] | None:
    """The (source, target) languages a data file records (`attn binarize --langs en-fr`:
    metadata "langs"), lower-cased; None where it records none (files made before it, or
    without it)."""
    source, _, target = metadata.get("langs", "").strip().lower().partition("-")
    return (source, target) if source and target else None


def target_tag(metadata: dict[str, str]) -> str | None:
    """The target-language tag a data file's sources carry (metadata "target_tag"), if any."""
    return metadata.get("target_tag") or None


def check_mixable(parts: list[ParallelData]) -> None:
    """Data files trained on together must share the vocabulary (the token ids mean the same
    pieces), and must not ask for different target languages from the same sources: where two
    record different targets, every file must carry its target tag, which tells the model which
    one to write. Different source languages into one target are a many-to-one model, and
    files that record no languages are taken at their word."""
    first = parts[0]
    for part in parts[1:]:
        for key in ("src_vocab_sha256", "tgt_vocab_sha256"):
            if part.metadata.get(key) != first.metadata.get(key):
                side = key.partition("_")[0]
                raise AttnError(f"{part.path} was binarized with another vocabulary than "
                                f"{first.path} ({side} vocabulary sha256 "
                                f"{str(part.metadata.get(key))[:12]} vs "
                                f"{str(first.metadata.get(key))[:12]}): binarize every data "
                                "file of a run with the same --vocab")
    recorded = [(part, langs) for part in parts if (langs := language_pair(part.metadata))]
    untagged = [part for part in parts if target_tag(part.metadata) is None]
    for part, langs in recorded[1:]:
        first_recorded, first_langs = recorded[0]
        if langs[1] != first_langs[1] and untagged:
            raise AttnError(f"{part.path} records the language pair {'-'.join(langs)} and "
                            f"{first_recorded.path} {'-'.join(first_langs)}, and "
                            f"{untagged[0].path} carries no target tag: corpora of different "
                            "target languages need each its target tag (it tells the model "
                            "which language to write); binarize them with one, or train them "
                            "apart")
