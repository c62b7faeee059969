"""Subword vocabularies: learning a SentencePiece model (`attn vocab`) and carrying it around.

A vocabulary travels as the bytes of its SentencePiece model: inside every data file and every
model file, so that models and dictionaries never drift apart. Its identity is the SHA-256 of
those bytes. The special ids are fixed: pad 0, unk 1, bos 2, eos 3.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .errors import AttnError
from .files import STRICT, Utf8Policy, atomic_output, check_readable, read_lines
from .formats import BOS_ID, EOS_ID, PAD_ID, SPECIAL_PIECES, UNK_ID
from .tags import opus_language_code


def checksum(model_bytes: bytes) -> str:
    return hashlib.sha256(model_bytes).hexdigest()


# A vocabulary whose ids are not its SentencePiece model's (an imported model's: OPUS-MT maps
# pieces to ids with a vocab.json) travels as this line, the pieces in id order as a JSON list on
# the next line, then the SentencePiece model (whose bytes never begin with "attn").
PIECE_MAP_MAGIC = b"attn-piece-map-v1\n"
# Lines from which `Vocabulary.encode` hands SentencePiece the list (its threads) rather than
# a line at a time
POOLED_LINES = 64


@dataclass(frozen=True)
class Vocabulary:
    """A SentencePiece model held as bytes, with its processor built on first use; optionally
    with its own ids for the pieces (`with_pieces`)."""

    model_bytes: bytes = field(repr=False)

    @classmethod
    def with_pieces(cls, spm_bytes: bytes, pieces: list[str]) -> "Vocabulary":
        """The SentencePiece model `spm_bytes` splitting text into pieces, and id i naming
        pieces[i]: a piece the list lacks is the id of "<unk>"."""
        listing = json.dumps(list(pieces), ensure_ascii=False).encode()
        return cls(PIECE_MAP_MAGIC + listing + b"\n" + spm_bytes)

    @cached_property
    def _parts(self) -> tuple[bytes, tuple[str, ...] | None]:
        if not self.model_bytes.startswith(PIECE_MAP_MAGIC):
            return self.model_bytes, None
        listing, _, spm_bytes = self.model_bytes[len(PIECE_MAP_MAGIC):].partition(b"\n")
        try:
            pieces = tuple(json.loads(listing))
        except ValueError:
            raise AttnError("bad vocabulary (its piece list is not JSON)") from None
        if "<unk>" not in pieces:
            raise AttnError("bad vocabulary (its piece list has no <unk>)")
        return spm_bytes, pieces

    @property
    def spm_bytes(self) -> bytes:
        """The SentencePiece model alone."""
        return self._parts[0]

    @property
    def pieces(self) -> tuple[str, ...] | None:
        """The piece of each id when the ids are not the SentencePiece model's (else None)."""
        return self._parts[1]

    @cached_property
    def _piece_ids(self) -> dict[str, int]:
        return {piece: index for index, piece in enumerate(self.pieces)}

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Vocabulary":
        data = check_readable(path, "vocabulary").read_bytes()
        vocabulary = cls(data)
        try:
            vocabulary.processor  # noqa: B018 - validate now, naming the file
        except AttnError as error:
            raise AttnError(f"{path}: {error}") from None
        return vocabulary

    @cached_property
    def processor(self):
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(self.spm_bytes)
        except Exception:  # sentencepiece raises a bare RuntimeError/OSError for bad protos
            raise AttnError("not a SentencePiece model (bad or truncated vocabulary)") from None
        if self.pieces is not None:  # the ids are the piece list's; the config names specials
            return processor
        specials = {PAD_ID: processor.pad_id(), UNK_ID: processor.unk_id(),
                    BOS_ID: processor.bos_id(), EOS_ID: processor.eos_id()}
        if any(expected != actual for expected, actual in specials.items()):
            raise AttnError("this SentencePiece model's special ids are not attn's "
                            "(pad 0, unk 1, bos 2, eos 3): make it with `attn vocab`")
        return processor

    @cached_property
    def checksum(self) -> str:
        return checksum(self.model_bytes)

    def __len__(self) -> int:
        return self.processor.get_piece_size() if self.pieces is None else len(self.pieces)

    def encode(self, lines: list[str], threads: int = 0) -> list[list[int]]:
        """The ids of each line. With a piece list (an OPUS-MT model's), a line starting with
        a language code `>>fra<<` starts with that piece, and SentencePiece cuts the rest, as
        MarianTokenizer does (`tags.opus_language_code`). A few lines (a server's request) a
        line at a time: SentencePiece's call on a list starts threads at every call (~0.13 ms
        alone, ~0.8 ms in a busy server, the GIL held), for ~6 µs of work a line."""
        if self.pieces is None:
            if len(lines) < POOLED_LINES and not threads:
                return [self.processor.encode(line) for line in lines]
            return self.processor.encode(lines, num_threads=threads or -1)
        ids, unk = self._piece_ids, self._piece_ids["<unk>"]
        codes, texts = zip(*map(opus_language_code, lines)) if lines else ((), ())
        cut = self.processor.encode(list(texts), out_type=str, num_threads=threads or -1)
        return [([ids.get(code, unk)] if code is not None else [])
                + [ids.get(piece, unk) for piece in line] for code, line in zip(codes, cut)]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Text of each line of ids. A line at a time: SentencePiece's batch call starts a
        thread pool at every call, a cost a decoder calling it for each output line would pay
        once per line, for work far smaller than the pool's start."""
        if self.pieces is None:
            return [self.processor.decode(line) for line in ids]
        return [self.processor.decode_pieces([self.pieces[i] for i in line]) for line in ids]

    def piece(self, index: int) -> str:
        """The piece id `index` names."""
        return self.processor.id_to_piece(index) if self.pieces is None else self.pieces[index]


def sample_lines(paths: Iterable[str], sample_size: int, seed: int,
                 policy: Utf8Policy = STRICT) -> tuple[list[str], int]:
    """Up to `sample_size` non-empty lines of the files, a uniform sample (reservoir sampling,
    bounded memory) when there are more; in file order when all fit. Returns (lines, total).
    `policy`: what invalid UTF-8 does (an error by default)."""
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    for path in paths:
        for line in read_lines(path, policy):
            if not line.strip():
                continue
            seen += 1
            if len(reservoir) < sample_size:
                reservoir.append(line)
            else:
                slot = rng.randrange(seen)
                if slot < sample_size:
                    reservoir[slot] = line
    return reservoir, seen


def learn(lines: list[str], size: int, model_type: str = "bpe", coverage: float = 1.0,
          seed: int = 1, threads: int = 0, verbose: bool = False,
          symbols: list[str] | None = None) -> Vocabulary:
    """Train a SentencePiece model on `lines` (already sampled) and return it. `symbols`,
    whitespace-separated tokens of the text, always become single pieces (the bracket tokens of
    linearized trees, say)."""
    import sentencepiece

    if not lines:
        raise AttnError("no text to learn a vocabulary from (the input is empty)")
    sentencepiece.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, model_type=model_type,
            vocab_size=size, character_coverage=coverage,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            pad_piece=SPECIAL_PIECES[PAD_ID], unk_piece=SPECIAL_PIECES[UNK_ID],
            bos_piece=SPECIAL_PIECES[BOS_ID], eos_piece=SPECIAL_PIECES[EOS_ID],
            input_sentence_size=0, shuffle_input_sentence=False,  # we sampled already
            max_sentence_length=1 << 16, num_threads=threads or os.cpu_count() or 1,
            # A token standing alone is word-initial for SentencePiece: "▁(NP", one piece.
            user_defined_symbols=[f"\u2581{symbol}" for symbol in symbols or []],
            minloglevel=0 if verbose else 2)
    except RuntimeError as error:
        detail = str(error).strip().splitlines()[-1] if str(error).strip() else "unknown"
        raise AttnError(f"SentencePiece could not learn a {size}-piece {model_type} vocabulary: "
                        f"{detail}") from None
    return Vocabulary(model.getvalue())


def vocab_listing(vocabulary: Vocabulary) -> Iterator[str]:
    """The `.vocab` companion: one `piece<TAB>score` line per id, as spm_train writes it."""
    processor = vocabulary.processor
    for piece_id in range(len(vocabulary)):
        yield f"{processor.id_to_piece(piece_id)}\t{processor.get_score(piece_id):g}\n"


def companion_vocab_path(model_path: str | os.PathLike) -> Path:
    model_path = Path(model_path)
    if model_path.suffix == ".model":
        return model_path.with_suffix(".vocab")
    return model_path.with_name(model_path.name + ".vocab")


def write(vocabulary: Vocabulary, model_path: str | os.PathLike) -> Path:
    """Write `spm.model` and `spm.vocab` atomically; returns the .vocab path."""
    with atomic_output(model_path) as handle:
        handle.write(vocabulary.model_bytes)
    listing_path = companion_vocab_path(model_path)
    with atomic_output(listing_path, "w") as handle:
        handle.writelines(vocab_listing(vocabulary))
    return listing_path
