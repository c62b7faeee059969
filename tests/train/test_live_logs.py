"""`attn train --tensorboard DIR` and `--wandb PROJECT` (train/live_logs.py): the rows of
metrics.jsonl, read back from TensorBoard's event files (tensorboard's EventAccumulator) and from
W&B's offline run files (their records, read below), a resumed run's each step once, and a
missing extra refused in one line."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest

from attn_cli import checkpoints
from attn_cli.errors import AttnError
from attn_cli.train import live_logs

from ..conftest import assert_clean_error, run_attn, train_args

# The tests of real logs (the others need neither package).
NEEDS_BOTH = pytest.mark.skipif(any(importlib.util.find_spec(name) is None
                                    for name in ("tensorboard", "wandb")),
                                reason="pip install 'attn[tensorboard,wandb]'")

# What a resumed run computes again exactly; the speeds and times are its own.
SAME_ON_RESUME = ("loss", "nll", "lr", "epoch")


@pytest.fixture(scope="module", autouse=True)
def wandb_offline_here(tmp_path_factory):
    """W&B's settings, caches and login of this machine left alone; WANDB_MODE and WANDB_DIR
    unset, so that the runs are offline (the default) in their run directories."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY", "WANDB_PROJECT"):
            patch.delenv(name, raising=False)
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR",
                     "WANDB_ARTIFACT_DIR"):
            patch.setenv(name, str(home / name.lower()))
        patch.setenv("WANDB_SILENT", "true")
        yield


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def as_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{field: [(step, value), ...]}: what a live log plots of the rows."""
    series: dict[str, list] = {}
    for row in rows:
        for key, value in live_logs.scalars(row).items():
            series.setdefault(key, []).append((row["step"], value))
    return series


def tensorboard_series(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars TensorBoard shows from a directory (what a purge dropped left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def assert_same_series(found: dict, expected: dict, fields=None) -> None:
    """The same fields, each at the same steps in the same order, with values equal to float32
    (TensorBoard keeps float32)."""
    if fields is not None:
        found = {key: found[key] for key in fields}
        expected = {key: expected[key] for key in fields}
    assert sorted(found) == sorted(expected)
    for key in expected:
        assert [step for step, _ in found[key]] == [step for step, _ in expected[key]], key
        assert [value for _, value in found[key]] == pytest.approx(
            [value for _, value in expected[key]], rel=1e-6), key


def wandb_records(path: Path):
    """The records of a W&B run file (`run-ID.wandb`): LevelDB's log format (a 7-byte header,
    then 32 KiB blocks of chunks: CRC, length, type: full, first, middle, last) around
    protobuf records, as wandb writes it and its `wandb sync` reads it."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    position, block, parts = 7, 32768, []
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's padding
            position += left
            continue
        parts.append(data[position + 7:position + 7 + length])
        position += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def wandb_sessions(run_dir: Path) -> list[tuple[str, list[dict]]]:
    """(run id, the rows logged) of each W&B session of a run, oldest first: the history
    records, without W&B's own fields (_step, _runtime, _timestamp)."""
    sessions = []
    for directory in sorted((run_dir / "wandb").glob("offline-run-*")):
        path, = directory.glob("run-*.wandb")
        rows = []
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                rows.append({key: value for key, value in items.items()
                             if not key.startswith("_")})
        sessions.append((path.stem.removeprefix("run-"), rows))
    return sessions


# ------------------------------------------------------------------------------- whole runs


@pytest.mark.slow
@NEEDS_BOTH
def test_tensorboard_and_wandb_hold_what_metrics_jsonl_holds(data_files, tmp_path):
    """Every numeric field of every row, validation rows included, against its step. Asked for
    first when a run is resumed, each log is sent the rows before from metrics.jsonl. The last
    step has two rows (its training row, then the validation of the save at the end, off the
    --save-every cadence), and W&B keeps both."""
    run_dir, board = tmp_path / "run", tmp_path / "board"
    common = ["--save-every", 2, "--valid", data_files[1]]
    first = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 2, *common))
    assert first.returncode == 0, first.stderr
    resumed = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 3, "--resume",
                                   *common, "--tensorboard", board, "--wandb", "attn-tests"))
    assert resumed.returncode == 0, resumed.stderr
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 3]
    assert "valid_loss" in rows[1] and "valid_loss" in rows[3] and "valid_loss" not in rows[2]
    assert_same_series(tensorboard_series(board), as_series(rows))
    assert len(list(board.glob("events.out.tfevents.*"))) == 1
    (run_id, logged), = wandb_sessions(run_dir)
    assert logged == [{key: value for key, value in row.items() if key != "valid_metric"}
                      for row in rows]
    state = json.loads((run_dir / live_logs.LIVE_LOGS_FILE).read_text())
    assert state["wandb"] == {"project": "attn-tests", "id": run_id, "step": 3}
    assert state["tensorboard"] == {"dir": str(board.absolute()), "step": 3}


# `attn train ARGS`, killed (SIGKILL) once the live logs have had step KILL_AFTER's row and W&B's
# service has had the time to write its file (it does every live_logs.WANDB_FLUSH_SECONDS).
KILLED_AFTER_A_ROW = """
import os, signal, sys, time
from attn_cli import cli
from attn_cli.train import live_logs

send = live_logs.LiveLogs.row

def send_then_die(self, row, save=True):
    send(self, row, save)
    if row["step"] == int(os.environ["KILL_AFTER"]):
        time.sleep(live_logs.WANDB_FLUSH_SECONDS + 0.3)
        os.kill(os.getpid(), signal.SIGKILL)

live_logs.LiveLogs.row = send_then_die
cli.main(sys.argv[1:])
"""


@pytest.mark.slow
@NEEDS_BOTH
def test_a_killed_run_loses_no_row_and_resumed_sends_each_step_once(data_files, tmp_path):
    """kill -9 after step 5's row: both logs hold rows 1-5. Resumed from the checkpoint of step
    3, the run trains 4-5 again: TensorBoard drops the killed run's 4-5 (purge_step) for the
    resumed run's; W&B, which cannot drop a step, keeps them (the same losses) and is sent the
    steps after them only; both go on in the same directory and W&B run."""
    run_dir, board = tmp_path / "run", tmp_path / "board"
    script = tmp_path / "killed.py"
    script.write_text(KILLED_AFTER_A_ROW, encoding="utf-8")
    common = ["--save-every", 3, "--tensorboard", board, "--wandb", "attn"]
    killed = subprocess.run([sys.executable, script, *map(str, train_args(
        data_files[0], run_dir, "--max-steps", 6, *common))], capture_output=True, text=True,
        env={**os.environ, "KILL_AFTER": "5"}, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    before = metrics(run_dir)
    assert [row["step"] for row in before] == [1, 2, 3, 4, 5]
    assert_same_series(tensorboard_series(board), as_series(before))
    (first_id, sent), = wandb_sessions(run_dir)
    assert sent == before

    resumed = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 6, "--resume",
                                   *common))
    assert resumed.returncode == 0, resumed.stderr
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, 7))
    assert_same_series(tensorboard_series(board), as_series(rows))
    assert len(list(board.glob("events.out.tfevents.*"))) == 2
    assert_same_series(as_series(before), as_series(rows[:5]), SAME_ON_RESUME)  # exactly
    (_, _), (second_id, after) = wandb_sessions(run_dir)
    assert second_id == first_id
    assert after == rows[5:]


@NEEDS_BOTH
def test_a_process_of_another_rank_writes_no_live_log(data_files, tmp_path, monkeypatch):
    """loop.train starts the display of the main process only: a process of rank 1 (here
    alone, so that it trains without a process group) writes nothing, its live logs included.
    (Under torchrun, 2 processes wrote one events file and one W&B session: by hand, 15 s.)"""
    monkeypatch.setenv("RANK", "1")
    result = run_attn(*train_args(data_files[0], tmp_path / "run", "--max-steps", 1,
                                  "--tensorboard", tmp_path / "board", "--wandb", "attn"))
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------- what W&B is called with


class FakeWandb(types.ModuleType):
    """wandb's calls attn makes, recorded."""

    def __init__(self):
        super().__init__("wandb")
        self.calls: list[tuple] = []

    def Settings(self, **settings):  # noqa: N802 (wandb's name)
        return settings

    def init(self, **arguments):
        self.calls.append(("init", arguments))
        return types.SimpleNamespace(
            log=lambda row: self.calls.append(("log", row)),
            define_metric=lambda name, **how: self.calls.append(("define_metric", name, how)),
            finish=lambda exit_code: self.calls.append(("finish", exit_code)))

    def teardown(self):
        self.calls.append(("teardown",))

    def logged(self) -> list[dict]:
        return [call[1] for call in self.calls if call[0] == "log"]


def test_wandb_is_sent_each_row_and_finished_after_a_sigterm(data_files, tmp_path, monkeypatch):
    """SIGTERM finishes the step, saves and exits 0: W&B has had every row, step by step, and
    is finished as a run that ended well."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    original = live_logs.WandbLog.row

    def row_then_sigterm(self, row):
        original(self, row)
        if row["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler: stop after this step

    monkeypatch.setattr(live_logs.WandbLog, "row", row_then_sigterm)
    run_dir = tmp_path / "run"
    result = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 10, "--wandb", "p",
                                  "--wandb-mode", "online"))
    assert result.returncode == 0, result.stderr
    assert "stopped by a signal" in result.stderr
    (_, init), *_ = wandb.calls
    assert init["project"] == "p" and init["mode"] == "online" and init["resume"] == "allow"
    assert init["dir"] == str(run_dir) and init["config"]["max_steps"] == 10
    assert ("define_metric", "*", {"step_metric": "step"}) in wandb.calls
    assert wandb.logged() == metrics(run_dir)
    assert [row["step"] for row in wandb.logged()] == [1, 2, 3]
    assert wandb.calls[-2:] == [("finish", 0), ("teardown",)]


def test_wandb_is_finished_as_failed_when_the_run_fails(data_files, tmp_path, monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setenv("WANDB_MODE", "disabled")

    original = checkpoints.append_metrics

    def disk_full_at_step_2(run_dir, row):
        if row["step"] == 2:
            raise AttnError(f"cannot write {run_dir}/metrics.jsonl: No space left on device")
        original(run_dir, row)

    monkeypatch.setattr(checkpoints, "append_metrics", disk_full_at_step_2)
    result = run_attn(*train_args(data_files[0], tmp_path / "run", "--max-steps", 4,
                                  "--wandb", "p"))
    assert_clean_error(result, "No space left on device")
    assert wandb.calls[0][1]["mode"] is None  # WANDB_MODE decides
    assert [row["step"] for row in wandb.logged()] == [1]
    assert wandb.calls[-2:] == [("finish", 1), ("teardown",)]


# ------------------------------------------------------------------------ a missing extra


@pytest.mark.parametrize("option,value,module,extra", [
    ("--tensorboard", "board", "tensorboard", "tensorboard"),
    ("--wandb", "project", "wandb", "wandb"),
])
def test_a_missing_extra_is_refused_in_one_line_before_the_run_starts(
        data_files, tmp_path, monkeypatch, option, value, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # import fails
    run_dir = tmp_path / "run"
    result = run_attn(*train_args(data_files[0], run_dir, option, tmp_path / value))
    assert_clean_error(result, f"train {option} needs ", f"pip install 'attn[{extra}]'")
    assert not run_dir.exists()
