"""Faults a long run meets, done for real (issue 27): a log torn by a kill in the middle of an
append, a checkpoint cut short. Each is one line to the user, nothing is lost, and `--resume`
goes on to the weights an unfaulted run reaches."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attn_cli.checkpoints import list_checkpoints, state_path
from attn_cli.formats import METRICS_FILE

from .conftest import assert_clean_error, assert_same_weights, final_weights, run_attn, train_args

# Two training states kept (the default is the newest only), so that a resume has one to go
# back to.
FIXTURES = Path(__file__).resolve().parent / "fixtures"
COMMON = ["--max-steps", 4, "--save-every", 2, "--seed", 3, "--keep-state", 2]


@pytest.fixture(scope="module")
def unfaulted(data_files, tmp_path_factory):
    """The run every faulted run must end as: 6 steps, checkpoints every 2."""
    run_dir = tmp_path_factory.mktemp("unfaulted") / "run"
    result = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 6, "--save-every", 2,
                                  "--seed", 3))
    assert result.returncode == 0, result.stderr
    return run_dir


def four_steps(data_files, run_dir):
    result = run_attn(*train_args(data_files[0], run_dir, *COMMON))
    assert result.returncode == 0, result.stderr
    assert [step for step, _ in list_checkpoints(run_dir)] == [2, 4]


def resume_to_six(data_files, run_dir):
    return run_attn(*train_args(data_files[0], run_dir, "--max-steps", 6, "--save-every", 2,
                                "--seed", 3, "--keep-state", 2, "--resume"))


def metrics_steps(run_dir) -> list[int]:
    lines = (run_dir / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["step"] for line in lines]  # every line whole again


def test_a_torn_last_metrics_line_is_dropped_and_the_run_goes_on(data_files, unfaulted,
                                                                 tmp_path):
    """kill -9 in the middle of an append leaves half a row: the resumed run says so, leaves
    it out and writes the row again."""
    run_dir = tmp_path / "run"
    four_steps(data_files, run_dir)
    with open(run_dir / METRICS_FILE, "a", encoding="utf-8") as log:
        log.write('{"step": 5, "loss": 1.')
    plotted = run_attn("plot", run_dir, "-o", tmp_path / "curves.png")  # reads it as it is
    assert plotted.returncode == 0, plotted.stderr
    resumed = resume_to_six(data_files, run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "its last line (5) is torn and was left out" in resumed.stderr
    assert metrics_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    assert_same_weights(final_weights(unfaulted), final_weights(run_dir))


def test_a_torn_line_inside_the_log_is_one_error_line(data_files, tmp_path):
    run_dir = tmp_path / "run"
    four_steps(data_files, run_dir)
    lines = (run_dir / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    lines[1] = lines[1][:10]
    (run_dir / METRICS_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert_clean_error(resume_to_six(data_files, run_dir), f"{run_dir / METRICS_FILE}:2",
                       "not a metrics row")


@pytest.mark.parametrize("cut", ["state", "model"])
def test_resume_skips_a_cut_checkpoint_for_the_newest_whole_one(data_files, unfaulted,
                                                                tmp_path, cut):
    """The newest checkpoint's state or model file cut to 3,000 bytes (a disk or copy fault):
    the resumed run names it and why, goes back to the checkpoint before, and ends where the
    unfaulted run ends."""
    run_dir = tmp_path / "run"
    four_steps(data_files, run_dir)
    path = state_path(run_dir, 4) if cut == "state" else run_dir / "checkpoint-4.st"
    path.write_bytes(path.read_bytes()[:3000])
    resumed = resume_to_six(data_files, run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resume: skipped checkpoint-4: {'training state' if cut == 'state' else 'model file'}"\
        f" {path} is" in resumed.stderr
    assert f"resuming {run_dir} from step 2" in resumed.stderr
    assert metrics_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    assert_same_weights(final_weights(unfaulted), final_weights(run_dir))


def test_no_whole_checkpoint_is_one_error_line_naming_each(data_files, tmp_path):
    run_dir = tmp_path / "run"
    four_steps(data_files, run_dir)
    for step in (2, 4):
        state = state_path(run_dir, step)
        state.write_bytes(state.read_bytes()[:3000])
    result = resume_to_six(data_files, run_dir)
    assert_clean_error(result, f"no checkpoint in {run_dir} can be resumed from",
                       "checkpoint-4: training state", "checkpoint-2: training state")


@pytest.mark.slow
def test_a_second_training_in_a_run_directory_in_use_is_refused(data_files, tmp_path):
    """A Makefile started twice: the second `attn train --resume -o SAME` while the first
    trains fails at once with one line naming the holder; once the first has ended (killed
    with -9 included: the kernel drops the lock), the directory is free again."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "attn_cli",
                              *map(str, train_args(data_files[0], run_dir, "--max-steps",
                                                   100000, "--save-every", 5))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoint-5.st").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        second = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 10, "--resume"))
        assert_clean_error(second, f"{run_dir} is in use by another attn train (pid "
                           f"{first.pid} on {socket.gethostname()})")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    steps = [step for step, _ in list_checkpoints(run_dir)]
    again = run_attn(*train_args(data_files[0], run_dir, "--max-steps", steps[-1] + 1,
                                 "--resume"))
    assert again.returncode == 0, again.stderr


def test_a_run_keeps_the_training_state_of_its_newest_checkpoint_only(unfaulted, data_files,
                                                                      tmp_path):
    """A state holds Adam's moments (twice a model's size): a run directory costs one, not
    `--keep` of them, unless `--keep-state N`."""
    assert [step for step, _ in list_checkpoints(unfaulted)] == [2, 4, 6]
    assert [step for step, _ in list_checkpoints(unfaulted, need_state=True)] == [6]
    run_dir = tmp_path / "run"
    four_steps(data_files, run_dir)
    assert [step for step, _ in list_checkpoints(run_dir, need_state=True)] == [2, 4]


@pytest.mark.parametrize("command,batch,remedy", [
    ("train", "out of GPU memory with forward passes of up to 600 tokens",
     "lower --max-tokens (600"),
    ("decode", "out of GPU memory with search batches of 6400 source tokens × beam",
     "lower --batch-tokens (6400)"),
    ("score", "out of GPU memory with batches of 8000 tokens", "lower --batch-tokens (8000)")])
def test_out_of_gpu_memory_is_one_line_naming_the_option_that_fits(command, batch, remedy,
                                                                   data_files, tmp_path,
                                                                   monkeypatch):
    """torch's CUDA out-of-memory error (raised here from the model, as a smaller GPU would):
    one line saying what ran out, the batch that asked for it and the option that makes the
    work fit, with its value as given (`--opt=value` too: the library knows it), exit 2."""
    from attn_cli.model import Transformer

    def out_of_memory(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "15.77 GiB of which 1.10 GiB is free.\nOf the allocated memory ...")

    model = FIXTURES / "run" / "checkpoint-600.st"
    (tmp_path / "src").write_text("a b\n", encoding="utf-8")
    argv = {"train": train_args(data_files[0], tmp_path / "run", "--max-steps", 2,
                                "--max-tokens=600"),
            "decode": ["decode", "-m", model, "--batch-tokens=6400"],
            "score": ["score", "-m", model, tmp_path / "src", tmp_path / "src"]}[command]
    monkeypatch.setattr(Transformer, "encode", out_of_memory)
    assert_clean_error(run_attn(*argv, stdin="a b\n"), batch, "(CUDA out of memory. Tried to "
                       "allocate 2.00 GiB. GPU 0 has a total capacity of 15.77 GiB", remedy)


def test_out_of_gpu_memory_outside_a_batch_is_one_line_too(tmp_path, monkeypatch):
    """Where no batch is to blame (here: loading the model), torch's own first line, once."""
    from attn_cli import ensemble

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\n...")

    monkeypatch.setattr(ensemble, "load_model", out_of_memory)
    result = run_attn("decode", "-m", FIXTURES / "run" / "checkpoint-600.st", stdin="a b\n")
    assert_clean_error(result, "out of GPU memory (CUDA out of memory. Tried to allocate "
                       "2.00 GiB.)")


def with_file_size_limit(limit: int):
    """preexec_fn: files of this process may not grow past `limit` bytes (a full disk, as a
    write sees it: EFBIG instead of ENOSPC, with SIGXFSZ ignored so that the write fails)."""
    import resource

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def attn_limited(limit: int, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attn_cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=with_file_size_limit(limit))


def assert_one_error_line(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.slow
def test_a_full_disk_while_saving_is_one_line_naming_what_is_safe(data_files, unfaulted,
                                                                  tmp_path):
    """The disk fills while a checkpoint is written: one line naming the file, the OS's reason
    and the checkpoint that is safe to resume from; no temporary file left, the earlier
    checkpoint intact, and once there is room `--resume` ends as the unfaulted run."""
    run_dir = tmp_path / "run"
    first = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 2, "--save-every", 2,
                                 "--seed", 3))
    assert first.returncode == 0, first.stderr
    before = {path.name: path.read_bytes() for path in run_dir.iterdir()}
    full = attn_limited(200_000, *train_args(data_files[0], run_dir, "--max-steps", 6,
                                             "--save-every", 2, "--seed", 3, "--resume"))
    assert_one_error_line(full, f"cannot write {run_dir}/checkpoint-4.state.st: File too large",
                          f"the last checkpoint safe to resume from is {run_dir}/checkpoint-2.st")
    assert not [path for path in run_dir.iterdir() if path.name.endswith(".tmp")]
    for name, content in before.items():
        if name.startswith("checkpoint-"):
            assert (run_dir / name).read_bytes() == content, name
    resumed = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 6, "--save-every", 2,
                                   "--seed", 3, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert_same_weights(final_weights(unfaulted), final_weights(run_dir))

    # Other writers: the same line, and nothing half-written left behind.
    averaged = attn_limited(200_000, "average", unfaulted, "--last", 2, "-o",
                            tmp_path / "model.st")
    assert_one_error_line(averaged, f"cannot write {tmp_path}/model.st: File too large")
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_file()) == []


@pytest.mark.slow
def test_every_writer_on_a_full_disk_is_one_line_and_leaves_nothing(corpus, spm_model,
                                                                   tmp_path):
    """binarize, vocab, export and decode --attention with files limited to 20 kB: one line
    naming the output and the reason, exit 2, no temporary file or directory left."""
    model = FIXTURES / "run" / "checkpoint-600.st"
    out = tmp_path / "out"
    out.mkdir()
    runs = {
        "binarize": ("binarize", "--vocab", spm_model, corpus["train.en"], corpus["train.de"],
                     "-o", out / "data.st"),
        "vocab": ("vocab", corpus["train.en"], corpus["train.de"], "-o", out / "v.model",
                  "--size", 300),
        "decode --attention": ("decode", "-m", model, "--attention", out / "maps.st"),
    }
    try:
        import ctranslate2  # noqa: F401

        runs["export"] = ("export", "ct2", model, "-o", out / "ct2")
    except ImportError:
        pass
    for name, argv in runs.items():
        result = subprocess.run([sys.executable, "-m", "attn_cli", *map(str, argv)],
                                input="A man rides a bike .\n" * 40, capture_output=True,
                                text=True, timeout=120, preexec_fn=with_file_size_limit(20_000))
        assert_one_error_line(result, f"cannot write {out}/")
        assert list(out.iterdir()) == [], (name, list(out.iterdir()))
