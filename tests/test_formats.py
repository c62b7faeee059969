"""The file formats, pinned by committed files (tests/fixtures, written by make_fixtures.py): a
model, its training state, a data file and attention maps, and what decode and score gave with
them. A change that makes attn read or write one of them otherwise without a new version in
formats.py fails here; after a version moves, `python -m tests.fixtures.make_fixtures` writes
the new fixtures (and old files are refused, each with one line naming its version)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from attn_cli import checkpoints
from attn_cli.data import ParallelData, binarize
from attn_cli.formats import (
    ATTENTION_FORMAT,
    DATA_FORMAT,
    FORMAT_VERSIONS,
    MODEL_FORMAT,
    STATE_FORMAT,
)
from attn_cli.modelfile import load_model, save_model
from attn_cli.train.start import adam
from attn_cli.vocab import Vocabulary

from .conftest import assert_clean_error, run_attn

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())
CHECKPOINT = FIXTURES / GOLDEN["checkpoint"]
STATE = checkpoints.state_path(CHECKPOINT.parent, int(CHECKPOINT.stem.split("-")[1]))
REGENERATE = "python -m tests.fixtures.make_fixtures"


def layout(path: Path) -> tuple[dict, dict]:
    """A safetensors file's metadata and {tensor: (dtype, shape)}."""
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {name: (str(handle.get_slice(name).get_dtype()),
                          tuple(handle.get_slice(name).get_shape())) for name in handle.keys()}
    return metadata, tensors


@pytest.mark.parametrize("fmt", [MODEL_FORMAT, DATA_FORMAT, STATE_FORMAT, ATTENTION_FORMAT])
def test_the_fixtures_are_of_the_versions_this_attn_writes(fmt):
    assert GOLDEN["format_versions"][fmt] == FORMAT_VERSIONS[fmt], (
        f"{fmt}'s version moved: run `{REGENERATE}` and commit the new fixtures")


def test_the_model_fixture_decodes_and_scores_as_it_did():
    """The golden outputs of a model sure of them (every greedy token 0.3+ nats ahead of the
    next): a change here is a change of the format or of decoding."""
    inputs = "\n".join(GOLDEN["inputs"]) + "\n"
    for option, key in (("4", "beam4"), ("1", "greedy")):
        result = run_attn("decode", "-m", CHECKPOINT, "--beam", option, "--device", "cpu",
                          stdin=inputs)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == GOLDEN[key]
    result = run_attn("decode", "-m", CHECKPOINT, "--nbest", "2", "--device", "cpu",
                      stdin="\n".join(GOLDEN["nbest2_inputs"]) + "\n")
    found = [line.split("\t") for line in result.stdout.splitlines()]
    expected = [line.split("\t") for line in GOLDEN["nbest2"]]
    assert [(index, text) for index, _, text in found] == \
        [(index, text) for index, _, text in expected]
    assert [float(score) for _, score, _ in found] == \
        pytest.approx([float(score) for _, score, _ in expected], abs=2e-4)


def test_score_reproduces_the_fixtures_log_probabilities(tmp_path):
    (tmp_path / "src").write_text("\n".join(GOLDEN["inputs"]) + "\n")
    (tmp_path / "tgt").write_text("\n".join(GOLDEN["greedy"]) + "\n")
    result = run_attn("score", "-m", CHECKPOINT, tmp_path / "src", tmp_path / "tgt",
                      "--format", "json", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    log_probs = [json.loads(line)["log_prob"] for line in result.stdout.splitlines()]
    assert log_probs == pytest.approx(GOLDEN["log_probs"], abs=1e-3)


def test_a_model_written_now_has_the_fixtures_layout(tmp_path):
    loaded = load_model(CHECKPOINT)
    written = tmp_path / "model.st"
    metadata, _ = layout(CHECKPOINT)
    own = {"format", "format_version", "config", "attn_version", "src_vocab_sha256",
           "tgt_vocab_sha256"}
    save_model(written, loaded.model, loaded.src_vocab, None,
               **{key: value for key, value in metadata.items() if key not in own})
    new_metadata, new_tensors = layout(written)
    old_metadata, old_tensors = layout(CHECKPOINT)
    new_metadata.pop("attn_version"), old_metadata.pop("attn_version")
    assert new_metadata == old_metadata, "the model format changed: bump MODEL_FORMAT_VERSION"
    assert new_tensors == old_tensors, "the model format changed: bump MODEL_FORMAT_VERSION"
    assert all(torch.equal(load_file(written)[name], tensor)
               for name, tensor in load_file(CHECKPOINT).items())


def test_a_training_state_written_now_has_the_fixtures_layout(tmp_path):
    """Read as a resumed run reads it, written back as a run writes it: the same bytes' worth
    (every tensor, every metadata field)."""
    step = int(CHECKPOINT.stem.split("-")[1])
    loaded, state = checkpoints.load_checkpoint(CHECKPOINT.parent, step, "cpu")
    optimizer = adam(loaded.model)
    checkpoints.restore_adam(loaded.model, optimizer, state.adam)
    run_dir = tmp_path / "run"
    checkpoints.save_checkpoint(run_dir, step, loaded.model, optimizer, state, loaded.src_vocab,
                                None, {"preset": loaded.metadata["preset"]})
    new_metadata, new_tensors = layout(checkpoints.state_path(run_dir, step))
    old_metadata, old_tensors = layout(STATE)
    assert new_metadata == old_metadata, "the state format changed: bump STATE_FORMAT_VERSION"
    assert new_tensors == old_tensors, "the state format changed: bump STATE_FORMAT_VERSION"
    new, old = load_file(checkpoints.state_path(run_dir, step)), load_file(STATE)
    assert all(torch.equal(new[name], old[name]) for name in old)


def test_a_run_resumes_from_the_fixture_state(tmp_path):
    """The committed state is one `attn train --resume` takes (its architecture is no preset's:
    resuming it refuses the preset's, naming the difference, which needs the state read)."""
    run_dir = tmp_path / "run"
    shutil.copytree(CHECKPOINT.parent, run_dir)
    result = run_attn("train", FIXTURES / "data.st", "-o", run_dir, "--preset", "tiny",
                      "--resume", "--device", "cpu")
    assert_clean_error(result, "has another architecture", "d_model 32 -> 64")


def test_a_data_file_binarized_now_is_the_fixture(tmp_path):
    copies = {}
    for name in ("train.src", "train.tgt"):
        copies[name] = tmp_path / name
        shutil.copy(FIXTURES / name, copies[name])
    written = tmp_path / "data.st"
    binarize(copies["train.src"], copies["train.tgt"], written,
             Vocabulary.from_file(FIXTURES / "spm.model"))
    assert layout(written) == layout(FIXTURES / "data.st"), \
        "the data format changed: bump DATA_FORMAT_VERSION"
    assert written.read_bytes() == (FIXTURES / "data.st").read_bytes()
    assert len(ParallelData(FIXTURES / "data.st")) == len(
        (FIXTURES / "train.src").read_text().splitlines())


def test_attention_maps_written_now_have_the_fixtures_layout(tmp_path):
    written = tmp_path / "maps.st"
    result = run_attn("decode", "-m", CHECKPOINT, "--device", "cpu", "--attention", written,
                      stdin="\n".join(GOLDEN["attention_lines"]) + "\n")
    assert result.returncode == 0, result.stderr
    assert layout(written) == layout(FIXTURES / "attention.st"), \
        "the attention format changed: bump ATTENTION_FORMAT_VERSION"
    new, old = load_file(written), load_file(FIXTURES / "attention.st")
    assert all(torch.allclose(new[name].float(), old[name].float(), atol=2e-3) for name in old)


@pytest.mark.parametrize("fixture,command", [
    ("model", ("decode", "-m", "{path}")),
    ("state", ("train", str(FIXTURES / "data.st"), "-o", "{run}", "--resume", "--preset",
               "tiny")),
    ("data", ("train", "{path}", "-o", "{run}", "--preset", "tiny", "--dry-run")),
    ("attention", ("plot", "attention", "{path}", "--line", "1", "-o", "{run}/x.png")),
])
def test_a_file_of_another_version_is_one_clean_error(fixture, command, tmp_path):
    """What a reader does with a file of a version it does not know: one line naming it."""
    run_dir = tmp_path / "run"
    shutil.copytree(CHECKPOINT.parent, run_dir)
    sources = {"model": CHECKPOINT, "state": STATE, "data": FIXTURES / "data.st",
               "attention": FIXTURES / "attention.st"}
    source = sources[fixture]
    path = (run_dir / source.name) if fixture in ("model", "state") else tmp_path / source.name
    metadata, _ = layout(source)
    save_file(load_file(source), str(path), metadata={**metadata, "format_version": "99"})
    args = [part.format(path=path, run=run_dir) for part in command]
    result = run_attn(*args, stdin="x\n")
    assert_clean_error(result, "format version 99", "reads version")
