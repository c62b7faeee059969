"""Model files: safetensors holding the weights, the config and the vocabulary — self-contained,
so that `attn decode -m model.st` needs nothing else. Never pickle.

Tensors: the unwrapped module's state dict (the shared embedding stored once, as
`tgt_embed.weight`), plus `vocab.src` (and `vocab.tgt` for a separate target vocabulary) holding
the SentencePiece model bytes. Metadata: format, format_version, config (JSON), vocab checksums,
and free-form provenance (preset, step, attn version).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from . import __version__, stfile
from .config import ModelConfig
from .errors import AttnError
from .files import atomic_path
from .formats import (
    MODEL_FORMAT,
    MODEL_FORMAT_VERSION,
    SHARED_EMBEDDING,
    SOURCE_EMBEDDING,
    VOCAB_TENSORS,
)
from .model import Transformer
from .vocab import Vocabulary

SRC_VOCAB, TGT_VOCAB = VOCAB_TENSORS


@dataclass
class LoadedModel:
    model: Transformer
    src_vocab: Vocabulary
    tgt_vocab: Vocabulary  # the same object as src_vocab when the vocabulary is shared
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def same_vocabularies(self, other: "LoadedModel") -> bool:
        """Whether `other` reads and writes the same pieces (source and target)."""
        return (other.src_vocab.checksum == self.src_vocab.checksum
                and other.tgt_vocab.checksum == self.tgt_vocab.checksum)


def unwrap(model: torch.nn.Module) -> Transformer:
    """The bare Transformer inside DistributedDataParallel and/or torch.compile wrappers."""
    while not isinstance(model, Transformer):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict without aliases (a shared embedding appears once), contiguous, on the CPU."""
    model = unwrap(model)
    state = model.state_dict()
    if model.config.share_embeddings:
        state.pop(SOURCE_EMBEDDING)
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}


def save_model(path: str | os.PathLike, model: torch.nn.Module, src_vocab: Vocabulary,
               tgt_vocab: Vocabulary | None = None, **provenance: str) -> None:
    """Write a model file atomically: its weights, config and vocabularies, and `provenance`
    (preset, step, averaged_from, ...) as metadata."""
    from safetensors.torch import save_file

    config = unwrap(model).config
    payload = weights(model)
    payload[SRC_VOCAB] = torch.frombuffer(bytearray(src_vocab.model_bytes), dtype=torch.uint8)
    separate_target = tgt_vocab is not None and tgt_vocab is not src_vocab
    if separate_target:
        payload[TGT_VOCAB] = torch.frombuffer(bytearray(tgt_vocab.model_bytes),
                                              dtype=torch.uint8)
    metadata = {
        "format": MODEL_FORMAT, "format_version": MODEL_FORMAT_VERSION,
        "config": config.to_json(), "attn_version": __version__,
        "src_vocab_sha256": src_vocab.checksum,
        "tgt_vocab_sha256": (tgt_vocab if separate_target else src_vocab).checksum,
        **{key: str(value) for key, value in provenance.items()},
    }
    with atomic_path(path) as temp:
        save_file(payload, str(temp), metadata=metadata)


def read_model_header(path: str | os.PathLike) -> tuple[stfile.Header, ModelConfig]:
    """Check that `path` is an attn model file and return its header and config (no weights)."""
    header = stfile.read_attn_header(path, MODEL_FORMAT, "model file")
    try:
        config = ModelConfig.from_json(header.metadata["config"])
    except (KeyError, ValueError, TypeError) as error:
        raise AttnError(f"model file {path} has a bad config: {error}") from None
    if SRC_VOCAB not in header.tensors:
        raise AttnError(f"model file {path} is corrupt (no vocabulary inside)")
    return header, config


def init_config(init: str | os.PathLike) -> ModelConfig:
    """The network of the model file `attn train --init` starts from (its header only: no
    weights read), for the check of a --preset given beside it and for --dry-run."""
    try:
        return read_model_header(init)[1]
    except AttnError as error:
        raise AttnError(f"--init: {error}") from None


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a model file; every way it can be wrong is an AttnError naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    header, config = read_model_header(path)
    try:
        tensors = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise AttnError(f"model file {path} is corrupt: {error}") from None
    vocabularies = {}
    for name in VOCAB_TENSORS:
        if name in tensors:
            vocabulary = Vocabulary(tensors.pop(name).numpy().tobytes())
            try:
                vocabulary.processor  # noqa: B018 - validate now
            except AttnError as error:
                raise AttnError(f"model file {path}: {error}") from None
            vocabularies[name] = vocabulary
    src_vocab = vocabularies[SRC_VOCAB]
    tgt_vocab = vocabularies.get(TGT_VOCAB, src_vocab)
    if len(src_vocab) != config.src_vocab_size or len(tgt_vocab) != config.tgt_vocab_size:
        raise AttnError(f"model file {path} is corrupt: its vocabulary ({len(src_vocab)}/"
                        f"{len(tgt_vocab)} pieces) does not match its config "
                        f"({config.src_vocab_size}/{config.tgt_vocab_size})")
    # Built on the meta device: no memory and no random weights drawn (slow for `big`) for
    # what the file overwrites; load_state_dict(assign=True) then takes the file's tensors.
    with torch.device("meta"):
        model = Transformer(config)
    if config.share_embeddings:
        tensors[SOURCE_EMBEDDING] = tensors.get(SHARED_EMBEDDING)
    expected = model.state_dict()
    problems = sorted(set(expected) ^ set(tensors))
    problems += [f"{name} {tuple(tensors[name].shape)} != {tuple(expected[name].shape)}"
                 for name in expected if name in tensors
                 and tensors[name] is not None and tensors[name].shape != expected[name].shape]
    if problems or any(t is None for t in tensors.values()):
        raise AttnError(f"model file {path}: weights do not match its config "
                        f"({', '.join(problems[:4]) or 'missing ' + SHARED_EMBEDDING})")
    model.load_state_dict(tensors, assign=True)
    model.eval()
    return LoadedModel(model.to(device), src_vocab, tgt_vocab, dict(header.metadata))
