"""Model files: self-contained safetensors, atomic writes, clear errors for anything else."""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from attn_cli import stfile
from attn_cli.config import PRESETS
from attn_cli.errors import AttnError
from attn_cli.files import atomic_output
from attn_cli.model import Transformer
from attn_cli.modelfile import load_model, read_model_header, save_model
from attn_cli.vocab import Vocabulary


@pytest.fixture(scope="module")
def vocabulary(spm_model) -> Vocabulary:
    return Vocabulary.from_file(spm_model)


@pytest.fixture(scope="module")
def saved(vocabulary, tmp_path_factory):
    config = PRESETS["tiny"].model_config(len(vocabulary))
    torch.manual_seed(1)
    model = Transformer(config).eval()
    path = tmp_path_factory.mktemp("models") / "model.st"
    save_model(path, model, vocabulary, preset="tiny", step="12")
    return model, path


def test_round_trip_restores_config_weights_and_vocab(saved, vocabulary):
    model, path = saved
    loaded = load_model(path)
    assert loaded.config == model.config
    assert loaded.src_vocab.model_bytes == vocabulary.model_bytes
    assert loaded.tgt_vocab is loaded.src_vocab
    assert loaded.model.src_embed is loaded.model.tgt_embed  # sharing survives the round trip
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], tensor, rtol=0, atol=0)
    src = torch.randint(4, len(vocabulary), (2, 6))
    tgt = torch.randint(4, len(vocabulary), (2, 4))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(src, tgt), model(src, tgt))
    assert loaded.metadata["preset"] == "tiny" and loaded.metadata["step"] == "12"


def test_model_file_is_plain_safetensors_without_pickle(saved):
    _, path = saved
    header_size = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8:8 + header_size])
    assert header["__metadata__"]["format"] == "attn-model"
    assert "vocab.src" in header and "tgt_embed.weight" in header
    assert "src_embed.weight" not in header  # the shared matrix is stored once


def test_separate_vocabularies_round_trip(vocabulary, tmp_path):
    config = PRESETS["tiny"].model_config(len(vocabulary), len(vocabulary))
    assert not config.share_embeddings
    model = Transformer(config)
    path = tmp_path / "separate.st"
    save_model(path, model, vocabulary, vocabulary)
    loaded = load_model(path)
    assert loaded.model.src_embed is not loaded.model.tgt_embed
    torch.testing.assert_close(loaded.model.src_embed.weight, model.src_embed.weight)


@pytest.mark.parametrize("changes", [{"positions": "learned"}, {"norm": "pre"},
                                     {"share_embeddings": False}])
def test_every_architecture_loads_to_the_same_function(vocabulary, tmp_path, changes):
    """Built on the meta device and filled from the file: learned positions, pre-norm and
    separate embeddings come back whole (the sinusoids, in no file, are recomputed)."""
    config = dataclasses.replace(PRESETS["tiny"].model_config(len(vocabulary)), **changes)
    torch.manual_seed(3)
    model = Transformer(config).eval()
    save_model(tmp_path / "model.st", model, vocabulary)
    loaded = load_model(tmp_path / "model.st").model
    assert all(not tensor.is_meta for tensor in [*loaded.parameters(), *loaded.buffers()])
    torch.testing.assert_close(loaded.sinusoids, model.sinusoids, rtol=0, atol=0)
    src = torch.randint(4, len(vocabulary), (2, 7))
    tgt = torch.randint(4, len(vocabulary), (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, tgt), model(src, tgt), rtol=0, atol=0)


def test_loading_a_model_stays_out_of_torch_dynamo(saved):
    """Building on the meta device must not run torch's Python reference kernels (normal_,
    arange on meta tensors), whose first call imports torch._dynamo: 0.8 s of every decode's
    start-up."""
    _, path = saved
    code = ("import sys\nfrom attn_cli.modelfile import load_model\n"
            f"load_model({str(path)!r})\nprint('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("damage,message", [
    (lambda data: b"", "empty"),
    (lambda data: data[:len(data) // 2], "truncated"),
    (lambda data: data[:5], "not a safetensors"),
    (lambda data: b"\x00" * 8 + data[8:], "not a safetensors"),
    (lambda data: data[:8] + b"{garbage" + data[16:], "not a safetensors"),
])
def test_damaged_model_files_are_clear_errors(saved, tmp_path, damage, message):
    _, path = saved
    broken = tmp_path / "broken.st"
    broken.write_bytes(damage(path.read_bytes()))
    with pytest.raises(AttnError, match=message) as raised:
        load_model(broken)
    assert str(broken) in str(raised.value)


def test_foreign_safetensors_file_is_rejected(tmp_path):
    foreign = tmp_path / "foreign.st"
    save_file({"weight": torch.zeros(3)}, str(foreign))
    with pytest.raises(AttnError, match="not an attn model"):
        load_model(foreign)


def test_data_file_given_as_model_is_named_as_such(tmp_path):
    data_like = tmp_path / "train.st"
    save_file({"src.ids": torch.zeros(3, dtype=torch.int32)}, str(data_like),
              metadata={"format": "attn-data"})
    with pytest.raises(AttnError, match="data file"):
        read_model_header(data_like)


def test_missing_model_file(tmp_path):
    with pytest.raises(AttnError, match="does not exist"):
        load_model(tmp_path / "absent.st")


def test_weights_that_do_not_match_the_config(saved, vocabulary, tmp_path):
    model, _ = saved
    other = Transformer(dataclasses.replace(model.config, d_ff=128))
    path = tmp_path / "mismatch.st"
    save_model(path, other, vocabulary)
    # Rewrite the metadata to claim the original config while keeping the other weights.
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    metadata["config"] = model.config.to_json()
    save_file(load_file(str(path)), str(path), metadata=metadata)
    with pytest.raises(AttnError, match="do not match its config"):
        load_model(path)


def test_atomic_output_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "keep.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output(target, "w") as handle:
            handle.write("half of the new")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_a_bf16_tensor_is_refused_by_the_memory_mapped_reader(tmp_path):
    """numpy has no bfloat16: mapping one must be an error, not float64 garbage."""
    path = tmp_path / "bf16.st"
    save_file({"x": torch.ones(4, dtype=torch.bfloat16)}, str(path))
    header = stfile.read_header(path)
    with pytest.raises(AttnError, match="'x' is BF16"):
        stfile.memmap_tensor(path, header, "x")
