"""Run directories and checkpoint averaging (checkpoints.py, `attn average`, §6.1), on model files
with random weights."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from safetensors.torch import load_file

from attn_cli import checkpoints
from attn_cli.checkpoints import (
    list_checkpoints,
    prune_checkpoints,
    state_path,
    truncate_metrics,
)
from attn_cli.config import PRESETS
from attn_cli.errors import AttnError
from attn_cli.formats import METRICS_FILE
from attn_cli.model import Transformer
from attn_cli.modelfile import load_model
from attn_cli.train.start import adam
from attn_cli.vocab import Vocabulary

from .conftest import assert_clean_error, run_attn
from .toys import save_random_model


@pytest.fixture(scope="module")
def vocabulary(spm_model) -> Vocabulary:
    return Vocabulary.from_file(spm_model)


# ------------------------------------------------------------------------------- run directories


def test_checkpoints_are_listed_by_step_and_complete_with_their_state(tmp_path):
    for step in (9, 10, 100):
        (tmp_path / f"checkpoint-{step}.st").write_bytes(b"model")
    state_path(tmp_path, 10).write_bytes(b"state")
    (tmp_path / "checkpoint-x.st").write_bytes(b"not a step")
    assert [step for step, _ in list_checkpoints(tmp_path)] == [9, 10, 100]  # not name order
    assert list_checkpoints(tmp_path, need_state=True) == [(10, tmp_path / "checkpoint-10.st")]
    assert list_checkpoints(tmp_path / "absent") == []


def test_pruning_keeps_the_newest_checkpoints_whole_and_the_best_models(tmp_path):
    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}.st").write_bytes(b"model")
        state_path(tmp_path, step).write_bytes(b"state")
    prune_checkpoints(tmp_path, keep=2, best={2})
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "checkpoint-2.st", "checkpoint-6.st", "checkpoint-6.state.st", "checkpoint-8.st",
        "checkpoint-8.state.st"]  # a best model stays, without its state: no run resumes there
    prune_checkpoints(tmp_path, keep=2, best={2}, keep_state=1)  # attn train's default
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "checkpoint-2.st", "checkpoint-6.st", "checkpoint-8.st", "checkpoint-8.state.st"]


def test_a_resumed_run_drops_the_metrics_rows_after_its_checkpoint(tmp_path):
    rows = [{"step": step, "loss": 1.0 / step} for step in (1, 2, 3, 4)]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows),
                                         encoding="utf-8")
    truncate_metrics(tmp_path, 2)
    kept = (tmp_path / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in kept] == rows[:2]


# ------------------------------------------------------------------------------------- averaging


def run_directory(path, vocabulary, steps) -> None:
    """A run directory's model files, checkpoint-STEP.st for each of `steps`, random weights."""
    path.mkdir()
    for step in steps:
        save_random_model(path / f"checkpoint-{step}.st", vocabulary, seed=step, preset="tiny",
                          step=str(step))


def test_average_equals_the_manual_mean(vocabulary, tmp_path):
    run_dir = tmp_path / "run"
    run_directory(run_dir, vocabulary, (3, 6, 9, 12))
    out = tmp_path / "avg.st"
    averaged = run_attn("average", run_dir, "--last", 3, "-o", out)
    assert averaged.returncode == 0, averaged.stderr
    for step in (6, 9, 12):
        assert f"checkpoint-{step}.st (step {step})" in averaged.stderr
    assert "checkpoint-3.st" not in averaged.stderr
    parts = [load_file(str(run_dir / f"checkpoint-{step}.st")) for step in (6, 9, 12)]
    mean = load_file(str(out))
    for name in parts[0]:
        if name.startswith("vocab."):
            assert torch.equal(mean[name], parts[0][name])
        else:
            torch.testing.assert_close(mean[name], sum(p[name] for p in parts) / 3)
    loaded = load_model(out)  # a model file like any other, without optimizer state
    assert "step" not in loaded.metadata and not any("exp_avg" in n for n in mean)


def test_average_orders_checkpoints_by_step_not_name(vocabulary, tmp_path):
    run_dir = tmp_path / "run"
    run_directory(run_dir, vocabulary, (5, 10))
    result = run_attn("average", run_dir, "--last", 1, "-o", tmp_path / "a.st")
    assert "checkpoint-10.st (step 10)" in result.stderr  # not checkpoint-5 (name order)


def test_average_refuses_mismatched_models(vocabulary, tmp_path):
    tiny = save_random_model(tmp_path / "a.st", vocabulary, preset="tiny")
    small = save_random_model(tmp_path / "b.st", vocabulary, preset="small")
    result = run_attn("average", tiny, small, "-o", tmp_path / "x.st")
    assert_clean_error(result, "another architecture")
    assert not (tmp_path / "x.st").exists()


def test_average_of_an_empty_directory(tmp_path):
    assert_clean_error(run_attn("average", tmp_path, "--last", 5, "-o", tmp_path / "x.st"),
                       "no checkpoint")


def test_adam_state_is_saved_from_the_host_and_restored_where_fused_adam_keeps_it():
    """Fused Adam keeps each parameter's step as a float32 tensor on the parameter's device
    (the GPU): saved, every tensor is copied to the host first; restored, the step goes back
    to the parameter's device as float32, and the next step continues the count."""
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"].model_config(20, dropout=0.0))
    optimizer = adam(model)
    model(torch.tensor([[4, 5, 3]]), torch.tensor([[2, 6, 7]])).sum().backward()
    optimizer.step()
    saved = checkpoints.adam_tensors(model, optimizer)
    assert saved and all(tensor.device.type == "cpu" for tensor in saved.values())
    again = adam(model)
    checkpoints.restore_adam(model, again, saved)
    fused = bool(again.defaults.get("fused"))
    for parameter in model.parameters():
        step = again.state[parameter]["step"]
        assert torch.is_tensor(step) and step.dtype == torch.float32 and float(step) == 1.0
        assert step.device == (parameter.device if fused else torch.device("cpu"))
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(again.state[parameter][moment], optimizer.state[parameter][moment])


def test_a_held_run_directory_is_refused_naming_the_holder_and_how_to_free_it(tmp_path):
    """A second lock on a run directory fails with one line: who holds it, and the lock file to
    delete where its host is gone (a shared file system's lock can outlive a crashed node)."""
    run_dir = tmp_path / "run"
    held = checkpoints.RunLock(run_dir)
    try:
        with pytest.raises(AttnError) as refused:
            checkpoints.RunLock(run_dir)
    finally:
        held.release()
    message = str(refused.value)
    assert message.startswith(f"{run_dir} is in use by another attn train (pid {os.getpid()} "
                              f"on {socket.gethostname()})")
    assert message.endswith(f"; if that host is down, delete {run_dir / 'train.lock'}")
    checkpoints.RunLock(run_dir).release()  # free again
