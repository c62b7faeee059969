"""Where a run starts (start.py), here from its own checkpoint: resumed exactly where it stopped,
after a kill -9 or a SIGTERM; what a resumed run may change, and what it refuses. (A new run is
in test_loop.py, fine-tuning a model file in test_finetune.py.)"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from attn_cli import config
from attn_cli.checkpoints import ResumePoint, adam_tensors, list_checkpoints, state_path
from attn_cli.config import PRESETS
from attn_cli.modelfile import weights
from attn_cli.train import loop as training
from attn_cli.train.distributed import Processes
from attn_cli.train.start import start

from ..conftest import (
    REPO,
    assert_clean_error,
    assert_same_weights,
    final_weights,
    run_attn,
    train_args,
)

FIXTURES = REPO / "tests" / "fixtures"


def test_one_call_starts_a_new_run_at_step_0_and_a_resumed_one_at_its_checkpoint(data_files,
                                                                                 tmp_path):
    """`start` decides where a run starts: a new run at step 0 with Adam's moments empty;
    with --resume the newest checkpoint's weights, Adam's moments and data position."""
    options = config.TrainOptions(data=data_files[0], output=tmp_path / "run", preset="tiny",
                                  max_steps=3, save_every="3", device="cpu")
    processes = Processes(0, 1, torch.device("cpu"))
    new = start(options, processes)
    assert (new.resumed, new.point, new.provenance, new.valid) == (False, ResumePoint(), {}, None)
    assert not new.optimizer.state and new.model.training
    training.train(options)
    resumed = start(dataclasses.replace(options, resume=True, max_steps=6), processes)
    assert resumed.resumed and resumed.point.step == 3 and resumed.point.batch_plan
    saved = load_file(str(tmp_path / "run" / "checkpoint-3.st"))
    assert all(torch.equal(tensor, saved[name])
               for name, tensor in weights(resumed.model).items())
    adam = load_file(str(state_path(tmp_path / "run", 3)))
    restored = adam_tensors(resumed.model, resumed.optimizer)
    assert restored.keys() == adam.keys()
    assert all(torch.equal(tensor, adam[name]) for name, tensor in restored.items())


def test_refuses_to_overwrite_a_run_without_resume(data_files, tmp_path):
    run_dir = tmp_path / "run"
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 1)).returncode == 0
    assert_clean_error(run_attn(*train_args(data_files[0], run_dir, "--max-steps", 2)),
                       "--resume")


@pytest.mark.slow
def test_kill_and_resume_reaches_the_same_parameters(data_files, tmp_path):
    """Killed with -9 and resumed: the parameters of the uninterrupted run, bitwise (every run
    on one thread: tests/train/conftest.py)."""
    common = ["--max-steps", 24, "--save-every", 4, "--seed", 5]
    reference = run_attn(*train_args(data_files[0], tmp_path / "whole", *common))
    assert reference.returncode == 0, reference.stderr

    run_dir = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-m", "attn_cli",
                                *map(str, train_args(data_files[0], run_dir, *common))],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoint-8.st").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)  # kill -9: no chance to save
    process.wait()
    steps = [step for step, _ in list_checkpoints(run_dir)]
    assert 8 in steps and steps[-1] < 24, steps
    resumed = run_attn(*train_args(data_files[0], run_dir, *common, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {run_dir} from step {steps[-1]}" in resumed.stderr
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, 25))


def test_a_steps_metrics_row_is_on_disk_before_its_checkpoint(data_files, tmp_path,
                                                              monkeypatch):
    """A kill between the two writes must not lose the row: the checkpoint marks the step done,
    and a resumed run only rewrites rows after its checkpoint."""
    run_dir = tmp_path / "run"
    saved_steps = []
    save = training._save

    def checking_save(run_dir_, step, *args, **kwargs):
        rows = (run_dir_ / "metrics.jsonl").read_text().splitlines()
        assert json.loads(rows[-1])["step"] == step
        saved_steps.append(step)
        return save(run_dir_, step, *args, **kwargs)

    monkeypatch.setattr(training, "_save", checking_save)
    training.train(config.TrainOptions(
        data=data_files[0], output=run_dir, valid=data_files[1], preset="tiny", max_steps=6,
        save_every="3", log_every=100, device="cpu"))
    assert saved_steps == [3, 6]


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_zero(data_files, tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "attn_cli",
                                *map(str, train_args(data_files[0], run_dir,
                                                     "--max-steps", 100000))],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "stopped by a signal" in stderr
    steps = [step for step, _ in list_checkpoints(run_dir, need_state=True)]
    assert len(steps) == 1 and steps[0] >= 3


def test_resume_refuses_a_training_state_of_another_format_version(data_files, tmp_path):
    run_dir = tmp_path / "run"
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 1)).returncode == 0
    state = run_dir / "checkpoint-1.state.st"
    with safe_open(str(state), "pt") as handle:
        metadata = {**handle.metadata(), "format_version": "99"}
    save_file(load_file(str(state)), str(state), metadata=metadata)
    assert_clean_error(run_attn(*train_args(data_files[0], run_dir, "--max-steps", 2,
                                            "--resume")), "format version 99")


@pytest.mark.parametrize("keep", [3000, -1000])
def test_resume_from_a_truncated_training_state_is_one_error_line(keep, tmp_path):
    """A state file cut short (a full disk, an interrupted copy), in its header or in its
    tensors: one error line naming the file, no traceback (the committed run of
    tests/fixtures, its state cut)."""
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / "run", run_dir)
    step, _ = list_checkpoints(run_dir)[-1]
    state = state_path(run_dir, step)
    state.write_bytes(state.read_bytes()[:keep])
    result = run_attn("train", FIXTURES / "data.st", "-o", run_dir, "--preset", "tiny",
                      "--resume", "--device", "cpu")
    assert_clean_error(result, f"training state {state}", "truncated")


def test_resume_reports_changes_and_refuses_another_architecture(data_files, tmp_path):
    run_dir = tmp_path / "run"
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 2)).returncode == 0
    changed = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 3, "--resume",
                                   "--lr-scale", "0.25"))
    assert changed.returncode == 0, changed.stderr
    assert "resume: lr_scale 0.5 -> 0.25 (changes the recipe)" in changed.stderr
    other = run_attn("train", data_files[0], "-o", run_dir, "--preset", "small", "--resume",
                     "--max-steps", "4")
    assert_clean_error(other, "another architecture", "d_model 64 -> 256")


@pytest.mark.slow
def test_reset_schedule_restarts_the_warmup_and_the_restart_is_kept(data_files, tmp_path):
    run_dir = tmp_path / "run"
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 4)).returncode == 0
    reset = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 6, "--resume",
                                 "--reset-schedule"))
    assert reset.returncode == 0 and "warmup starts again at step 5" in reset.stderr
    # A later resume keeps counting from the restart (the offset is part of the state).
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 7,
                                "--resume")).returncode == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lr = {row["step"]: row["lr"] for row in rows if "lr" in row}
    tiny = PRESETS["tiny"]
    for step, counted in ((4, 4), (5, 1), (6, 2), (7, 3)):
        assert lr[step] == pytest.approx(training.inverse_sqrt_lr(
            counted, tiny.d_model, tiny.warmup_steps, tiny.lr_scale)), step


def test_resume_refuses_another_vocabulary(data_files, other_vocab_data, tmp_path):
    run_dir = tmp_path / "run"
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 1)).returncode == 0
    assert_clean_error(run_attn(*train_args(other_vocab_data, run_dir, "--max-steps", 2,
                                            "--resume")), "another vocabulary")
