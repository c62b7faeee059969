"""`attn train --tensorboard DIR` and `--wandb PROJECT`: each metrics.jsonl row, as the run writes
it, also sent to TensorBoard (torch.utils.tensorboard; `pip install 'attn[tensorboard]'`) and to
Weights & Biases (`pip install 'attn[wandb]'`): every numeric field under its metrics.jsonl name,
against the row's step, validation rows included. Presentation only: report.TrainingDisplay
calls them, and only the main process's display is ever started, so other ranks write nothing.

Each row is flushed as it is sent: TensorBoard's event file at once; W&B's service writes its
run file every WANDB_FLUSH_SECONDS. A resumed run goes on where its logs stand, each step once.
`live-logs.json` in the run directory says, after every row, the last step each log holds (and
the W&B run's id): on resume, TensorBoard drops what its directory holds after min(that step,
the checkpoint's) (`purge_step`: a killed run's steps past its checkpoint, which the resumed run
trains again), and W&B, which cannot drop a step, goes on in the same run and skips the rows it
holds (a resumed run computes them again: bitwise on a CPU); then each log is sent the rows of
metrics.jsonl it lacks up to the checkpoint: all of them for a directory or project new to the
run (a first `--tensorboard` on a resumed run, too).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from ..errors import AttnError, say
from ..files import atomic_output, read_metrics
from ..formats import METRICS_FILE

# In the run directory: the last step each live log holds, and the W&B run to resume.
LIVE_LOGS_FILE = "live-logs.json"
# Seconds between W&B's writes of its run file (its own default: 15): the most a kill -9 loses.
WANDB_FLUSH_SECONDS = 1.0


def require_extras(tensorboard: bool, wandb: bool) -> None:
    """Refuse, in one line naming the extra, an option whose package is not installed: before
    the run starts, not at its first row."""
    if tensorboard:
        try:
            import tensorboard as _  # noqa: F401 (torch.utils.tensorboard needs it)
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise AttnError("train --tensorboard needs TensorBoard: "
                            "pip install 'attn[tensorboard]'") from None
    if wandb:
        try:
            import wandb as _  # noqa: F401
        except ImportError:
            raise AttnError("train --wandb needs wandb (Weights & Biases): "
                            "pip install 'attn[wandb]'") from None


def scalars(row: dict) -> dict[str, float]:
    """What a live log plots of a metrics row: its numeric fields but the step (the x axis)."""
    return {key: value for key, value in row.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class LiveLogs:
    """The run's live logs: opened by `start` (on the main process, once the run knows its
    start step), sent each row as it is written, closed by `close`, whatever ended the run."""

    def __init__(self, run_dir: Path, tensorboard: Path | None = None,
                 wandb_project: str | None = None, wandb_mode: str | None = None,
                 config: dict | None = None):
        if wandb_mode is not None and wandb_project is None:
            raise AttnError("--wandb-mode needs --wandb PROJECT")
        require_extras(tensorboard is not None, wandb_project is not None)
        self.run_dir, self.tensorboard = Path(run_dir), tensorboard
        self.wandb_project, self.wandb_mode, self.config = wandb_project, wandb_mode, config
        self.logs: dict[str, TensorBoardLog | WandbLog] = {}
        self.state: dict = {}  # live-logs.json
        self.held: dict[str, int] = {}

    def __bool__(self) -> bool:
        return self.tensorboard is not None or self.wandb_project is not None

    def start(self, start_step: int) -> None:
        """Open each log where the run starts, then send it the rows it lacks up to there."""
        if not self:
            return
        self.state = _read_state(self.run_dir / LIVE_LOGS_FILE)
        if self.tensorboard is not None:
            self.logs["tensorboard"] = TensorBoardLog(self.tensorboard, self.state, start_step)
        if self.wandb_project is not None:
            self.logs["wandb"] = WandbLog(self.wandb_project, self.wandb_mode, self.run_dir,
                                          self.state, start_step, self.config)
        # Each log holds every step up to this one already: a row at a step past it is sent.
        # Fixed for the session, as a step may have two rows (the last one's validation).
        self.held = {name: self.state[name]["step"] for name in self.logs}
        rows, _ = read_metrics(self.run_dir / METRICS_FILE)
        for row in rows:
            if row["step"] <= start_step:  # a new run's directory may hold an older one's rows
                self.row(row, save=False)
        self._save()

    def row(self, row: dict, save: bool = True) -> None:
        """One metrics row to every log that does not hold its step yet."""
        sent = False
        for name, log in self.logs.items():
            if row["step"] > self.held[name]:
                log.row(row)
                self.state[name]["step"] = max(self.state[name]["step"], row["step"])
                sent = True
        if sent and save:
            self._save()

    def close(self, failed: bool = False) -> None:
        """Each log flushed and closed (`failed`: the run ended by an error)."""
        logs, self.logs = self.logs, {}
        for log in logs.values():
            log.close(failed)

    def _save(self) -> None:
        with atomic_output(self.run_dir / LIVE_LOGS_FILE, "w") as handle:
            json.dump(self.state, handle, indent=1)


def _read_state(path: Path) -> dict:
    """live-logs.json as the last row left it ({} for a run without one, or a damaged one: the
    logs are then sent every row again, which is safe, only longer)."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


class TensorBoardLog:
    """Scalars in a TensorBoard directory, flushed at each row."""

    def __init__(self, log_dir: Path, state: dict, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(log_dir).absolute()
        held = state.get("tensorboard", {})
        # What the directory holds is known only where the last row said so; else it may hold
        # anything (another run's, a kill's), and all of it is dropped and written again.
        last = held["step"] if held.get("dir") == str(log_dir) else -1
        purge = min(last, start_step) + 1
        state["tensorboard"] = {"dir": str(log_dir), "step": purge - 1}
        try:
            self.writer = SummaryWriter(str(log_dir), purge_step=purge)
        except OSError as error:
            raise AttnError(f"--tensorboard: cannot write {log_dir}: "
                            f"{error.strerror or error}") from None

    def row(self, row: dict) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, global_step=row["step"])
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbLog:
    """A Weights & Biases run: the same run for every session of a training run (its id kept in
    live-logs.json), each row committed as it comes, the files in RUN_DIR/wandb (WANDB_DIR
    elsewhere). Mode: as `--wandb-mode` says; else WANDB_MODE where set; else offline, which
    needs no network (`wandb sync RUN_DIR/wandb/offline-run-*` uploads the sessions in order)."""

    def __init__(self, project: str, mode: str | None, run_dir: Path, state: dict,
                 start_step: int, config: dict | None):
        import wandb

        held = state.get("wandb", {})
        # A new W&B run, sent every row: for a new training run (one started again after a
        # kill before its first checkpoint, perhaps with other options, included) or project
        if start_step == 0 or held.get("project") != project:
            held = {"project": project, "id": secrets.token_hex(4), "step": -1}
        state["wandb"] = held
        if mode is None and "WANDB_MODE" not in os.environ:
            mode = "offline"
        # attn's stderr is not copied into the run, and W&B's summary at the end is left out
        quiet = {"console": "off", "quiet": True}
        try:
            settings = wandb.Settings(**quiet,
                                      x_transaction_log_flush_interval=WANDB_FLUSH_SECONDS)
        except Exception:  # noqa: BLE001 (a wandb without the setting: its own interval)
            settings = wandb.Settings(**quiet)
        try:
            self.run = wandb.init(project=project, id=held["id"], resume="allow",
                                  name=run_dir.name, mode=mode, config=config,
                                  dir=None if "WANDB_DIR" in os.environ else str(run_dir),
                                  settings=settings)
        except Exception as error:  # noqa: BLE001 (wandb's errors: a login, a network)
            said = " ".join(str(error).split())[:300]
            raise AttnError(f"--wandb {project}: W&B did not start ({type(error).__name__}: "
                            f"{said}); --wandb-mode offline needs no network or login") from None
        # The x axis is the training step (W&B's own _step counts rows)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def row(self, row: dict) -> None:
        # Committed at once: with log(step=...) a row would wait for the next step's, and a
        # second row at a step (the last one's validation) would be dropped.
        self.run.log({"step": row["step"], **scalars(row)})

    def close(self, failed: bool) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # W&B's service process writes the run's file after `finish` returns: its teardown
        # waits for that (it would at the process's exit; a library caller may go on).
        wandb.teardown()
        if getattr(self.run, "offline", False):
            sessions = Path(self.run.dir).parent.parent  # RUN_DIR/wandb/offline-run-*/files
            say(f"train: W&B run {self.run.id} is offline: `wandb sync {sessions}/offline-run-*`"
                " uploads it")
