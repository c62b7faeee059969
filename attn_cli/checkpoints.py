"""Run directories: checkpoints, the resume state beside them, and checkpoint averaging (§6.1).

runs/NAME/checkpoint-STEP.st        a self-contained model file (decode accepts it as is)
runs/NAME/checkpoint-STEP.state.st  what resuming needs besides the weights: Adam's moments, step,
                                    data position, the options of the run (safetensors, no pickle)
runs/NAME/metrics.jsonl             one JSON object per log interval

A checkpoint counts only once both files exist; the state is written first, the model file last,
each atomically, so a kill at any moment leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from . import stfile
from .errors import AttnError, say
from .files import atomic_output, atomic_path, cannot_write, read_metrics
from .formats import (
    ADAM_MOMENTS,
    METRICS_FILE,
    MODEL_FORMAT,
    STATE_FORMAT,
    STATE_FORMAT_VERSION,
    VALID_METRICS,
    adam_tensor,
)
from .modelfile import LoadedModel, load_model, read_model_header, save_model, unwrap
from .vocab import Vocabulary

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)\.st$")
# The provenance of a fine-tuned model (`train --init`): the model file its run started from,
# and that file's checksum, and how that model's vocabulary names languages (`lang_codes`: an
# NLLB-200 or M2M-100 import's, which decoding needs). Every checkpoint of the run records
# them, and averages keep them.
INIT_PROVENANCE = ("init", "init_sha256", "lang_codes")


def init_provenance(model: LoadedModel) -> dict[str, str]:
    """What a model file (a checkpoint, an average) records of the file its run was seeded
    from by `train --init`: {} for a run trained from scratch."""
    return {key: model.metadata[key] for key in INIT_PROVENANCE if key in model.metadata}


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / f"checkpoint-{step}.st"


def state_path(run_dir: Path, step: int) -> Path:
    return run_dir / f"checkpoint-{step}.state.st"


def list_checkpoints(run_dir: str | os.PathLike,
                     need_state: bool = False) -> list[tuple[int, Path]]:
    """(step, path) of the run's complete checkpoints, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for entry in run_dir.iterdir():
        match = CHECKPOINT_PATTERN.match(entry.name)
        if match and (not need_state or state_path(run_dir, int(match.group(1))).exists()):
            found.append((int(match.group(1)), entry))
    return sorted(found)


@dataclass(frozen=True)
class ResumePoint:
    """Where a run stands after a step: what a resumed run goes on from."""

    step: int = 0
    epoch: int = 0  # data position: the epoch whose batch order is being consumed...
    offset: int = 0  # ...and how many of its micro-batches are used up
    elapsed_seconds: float = 0.0
    schedule_offset: int = 0  # the step the warmup counts from (--reset-schedule)
    # How the run's batches were cut (batching.BatchPlan's fields): the offset counts
    # micro-batches of this budget. None: a new run.
    batch_plan: dict | None = None
    # (budget, micro-batches) of the current epoch cut with earlier budgets, in order
    earlier_budgets: tuple[tuple[int, int], ...] = ()


@dataclass
class ResumeState:
    """Everything besides the weights that makes a resumed run continue exactly."""

    point: ResumePoint
    options: dict  # the run's options, to report what a resume changes
    adam: dict[str, torch.Tensor]  # "exp_avg.NAME", "exp_avg_sq.NAME", "step.NAME"
    scaler: dict  # fp16 loss-scaler state (empty otherwise)


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, state: ResumeState, src_vocab: Vocabulary,
                    tgt_vocab: Vocabulary | None, provenance: dict[str, str]) -> Path:
    from safetensors.torch import save_file

    tensors = adam_tensors(model, optimizer)
    point = state.point
    metadata = {"format": STATE_FORMAT, "format_version": STATE_FORMAT_VERSION,
                "step": str(step), "epoch": str(point.epoch), "offset": str(point.offset),
                "elapsed_seconds": repr(point.elapsed_seconds),
                "options": json.dumps(state.options, sort_keys=True),
                "scaler": json.dumps(state.scaler),
                "schedule_offset": str(point.schedule_offset),
                "batch_plan": json.dumps(point.batch_plan),
                "earlier_budgets": json.dumps(point.earlier_budgets)}
    with atomic_path(state_path(run_dir, step)) as temp:
        save_file(tensors, str(temp), metadata=metadata)
    path = checkpoint_path(run_dir, step)
    try:
        save_model(path, model, src_vocab, tgt_vocab, step=str(step), **provenance)
    except AttnError:  # a state without its model is no checkpoint: not left behind
        state_path(run_dir, step).unlink(missing_ok=True)
        raise
    return path


def adam_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Adam's per-parameter state keyed by parameter name (stable across processes and runs)."""
    names = {id(p): name for name, p in unwrap(model).named_parameters()}
    tensors = {}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter)
            if not state:
                continue
            name = names[id(parameter)]
            for moment in ADAM_MOMENTS:
                tensors[adam_tensor(moment, name)] = state[moment].detach().to("cpu").contiguous()
            # fused Adam's step is a tensor on the parameter's device
            tensors[adam_tensor("step", name)] = torch.as_tensor(
                state["step"], dtype=torch.float32).reshape(1).to("cpu")
    return tensors


def restore_adam(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 tensors: dict[str, torch.Tensor]) -> None:
    fused = bool(optimizer.defaults.get("fused"))  # fused Adam keeps its step on the device
    for name, parameter in unwrap(model).named_parameters():
        if adam_tensor("exp_avg", name) not in tensors:
            continue
        optimizer.state[parameter] = {
            "step": tensors[adam_tensor("step", name)].reshape(()).clone().to(
                parameter.device if fused else "cpu"),
            **{moment: tensors[adam_tensor(moment, name)].to(parameter.device)
               for moment in ADAM_MOMENTS},
        }


def load_checkpoint(run_dir: Path, step: int, device) -> tuple[LoadedModel, ResumeState]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    loaded = load_model(checkpoint_path(run_dir, step), device=device)
    path = state_path(run_dir, step)
    metadata = stfile.read_attn_header(path, STATE_FORMAT, "training state").metadata
    try:
        adam = load_file(str(path))
        point = ResumePoint(step=int(metadata["step"]), epoch=int(metadata["epoch"]),
                            offset=int(metadata["offset"]),
                            elapsed_seconds=float(metadata["elapsed_seconds"]),
                            schedule_offset=int(metadata["schedule_offset"]),
                            batch_plan=json.loads(metadata["batch_plan"]),
                            earlier_budgets=tuple(tuple(cut) for cut in json.loads(
                                metadata["earlier_budgets"])))
        options, scaler = json.loads(metadata["options"]), json.loads(metadata["scaler"])
    except (SafetensorError, OSError, KeyError, ValueError) as error:
        raise AttnError(f"training state {path} is corrupt: {type(error).__name__}: "
                        f"{error}") from None
    return loaded, ResumeState(point, options, adam, scaler)


def prune_checkpoints(run_dir: Path, keep: int, best: set[int] = frozenset(),
                      keep_state: int | None = None) -> None:
    """Keep the model files of the newest `keep` checkpoints and of the steps `best`
    (`--keep-best`), and the training states of the newest `keep_state` (None: as many as
    `keep`): a run resumes from its newest checkpoint, and a state is twice a model's size."""
    complete = list_checkpoints(run_dir)
    keep_state = keep if keep_state is None else min(keep_state, keep)
    for step, path in complete[:max(0, len(complete) - keep)]:
        if step not in best:
            path.unlink(missing_ok=True)
    for step, _ in complete[:max(0, len(complete) - keep_state)]:
        state_path(run_dir, step).unlink(missing_ok=True)


def prune_after_save(run_dir: Path, keep: int, keep_state: int | None = None,
                     keep_best: int = 0, metric: str | None = None) -> None:
    """After a save, `prune_checkpoints` keeping the `keep_best` best model files (`--keep-best`)
    by their validation scores for `metric` in metrics.jsonl (`scored_steps`), of the
    checkpoints still on disk."""
    best = set()
    if keep_best:
        metric, scores = scored_steps(run_dir, metric)
        saved = {step for step, _ in list_checkpoints(run_dir)}
        best = set(best_steps({step: score for step, score in scores.items() if step in saved},
                              metric, keep_best))
    prune_checkpoints(run_dir, keep, best, keep_state)


def append_metrics(run_dir: Path, row: dict) -> None:
    """One row at the end of the run's metrics.jsonl, flushed."""
    try:
        with open(run_dir / METRICS_FILE, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
            handle.flush()
    except OSError as error:
        raise cannot_write(run_dir / METRICS_FILE, error) from None


def metric_key(metric: str) -> str:
    """The metrics.jsonl field holding the metric's validation score."""
    return f"valid_{metric}"


def scored_steps(run_dir: str | Path, metric: str | None = None) -> tuple[str, dict[int, float]]:
    """(metric, {step: validation score}) from a run's metrics.jsonl: the metric asked for, or
    the one the run was validated by (its last validation row's `valid_metric`, else loss)."""
    rows, _ = read_metrics(Path(run_dir) / METRICS_FILE)
    if metric is None:
        named = [row["valid_metric"] for row in rows if "valid_metric" in row]
        metric = named[-1] if named else "loss"
    key = metric_key(metric)
    scores = {int(row["step"]): float(row[key]) for row in rows
              if key in row and math.isfinite(float(row[key]))}
    return metric, scores


def _best_first(metric: str) -> float:
    """A score times this sorts the best first: lower is better for loss, higher for the
    metrics of decoded output (formats.VALID_METRICS)."""
    return -1.0 if VALID_METRICS[metric] == "higher" else 1.0


def best_steps(scores: dict[int, float], metric: str, count: int) -> list[int]:
    """The `count` best steps by score, best first (the later step first on a tie)."""
    sign = _best_first(metric)
    ranked = sorted(scores, key=lambda step: (sign * scores[step], -step))
    return ranked[:count]


def validations_since_best(scores: dict[int, float], metric: str) -> tuple[int, int]:
    """(the step that first reached the best score, how many validations since): the
    validations in a row that did not beat it, which `train --patience` counts. A tie does not
    beat the best (a BLEU of 0 validation after validation is no progress)."""
    sign = _best_first(metric)
    best = min(scores, key=lambda step: (sign * scores[step], step))
    return best, sum(step > best for step in scores)


def truncate_metrics(run_dir: Path, step: int) -> str | None:
    """Drop metrics rows after `step` (a resumed run redoes those steps) and a torn last line;
    returns what was torn, if anything."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return None
    rows, torn = read_metrics(path)
    with atomic_output(path, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows if row.get("step", 0) <= step)
    return torn


def intact_checkpoint(run_dir: Path, step: int) -> str | None:
    """Why checkpoint `step` cannot be resumed from (None: its model and state files both
    read as what they claim to be, every tensor inside the file)."""
    try:
        stfile.read_attn_header(checkpoint_path(run_dir, step), MODEL_FORMAT, "model file")
        stfile.read_attn_header(state_path(run_dir, step), STATE_FORMAT, "training state")
    except AttnError as error:
        return str(error)
    return None


# ------------------------------------------------------------------------------------ averaging


def select_for_average(inputs: list[str], last: int | None, best: int | None = None,
                       metric: str | None = None) -> list[tuple[str, Path]]:
    """(label, path) of the checkpoints to average: the last N of a run directory by step, its
    N best by a validation metric (`metric`, default: the one the run was validated by; the
    label then gives the score), or the files given."""
    if last and best:
        raise AttnError("give --last or --best, not both")
    if len(inputs) == 1 and Path(inputs[0]).is_dir():
        found = list_checkpoints(inputs[0])
        if not found:
            raise AttnError(f"no checkpoint-STEP.st files in {inputs[0]}")
        if best:
            return _best_for_average(inputs[0], dict(found), best, metric)
        chosen = found[-last:] if last else found
        return [(f"step {step}", path) for step, path in chosen]
    if last or best:
        raise AttnError("--last and --best take one run directory; give either a directory "
                        "or files")
    return [(Path(path).name, Path(path)) for path in inputs]


def _best_for_average(run_dir: str, found: dict[int, Path], count: int,
                      metric: str | None) -> list[tuple[str, Path]]:
    metric, scores = scored_steps(run_dir, metric)
    scored = {step: score for step, score in scores.items() if step in found}
    if not scored:
        raise AttnError(f"no checkpoint in {run_dir} has a {metric_key(metric)} score in its "
                        f"{METRICS_FILE} (train with --valid, and --valid-metric {metric})")
    chosen = best_steps(scored, metric, count)  # fewer when fewer are scored, as --last
    return [(f"step {step}, {metric_key(metric)} {scored[step]:.4g}", found[step])
            for step in sorted(chosen)]


def average_models(paths: list[Path]) -> tuple[LoadedModel, dict[str, torch.Tensor]]:
    """Element-wise mean of the parameters in float32, reading one file at a time. Refuses
    files whose architecture or vocabulary differ from the first one's."""
    first = load_model(paths[0])
    sums = {name: tensor.detach().to(torch.float32).clone()
            for name, tensor in first.model.state_dict().items()}
    for path in paths[1:]:
        _, config = read_model_header(path)
        if config != first.config:
            raise AttnError(f"{path} has another architecture than {paths[0]}: "
                            "only checkpoints of one run can be averaged")
        other = load_model(path)
        if not first.same_vocabularies(other):
            raise AttnError(f"{path} has another vocabulary than {paths[0]}")
        for name, tensor in other.model.state_dict().items():
            sums[name] += tensor.to(torch.float32)
    # State dicts list the shared embedding twice (same tensor): each name was summed once.
    return first, {name: total / len(paths) for name, total in sums.items()}


def write_average(output: Path, first: LoadedModel, mean: dict[str, torch.Tensor],
                  sources: list[str]) -> None:
    model = first.model
    model.load_state_dict(mean)
    tgt_vocab = None if first.tgt_vocab is first.src_vocab else first.tgt_vocab
    save_model(output, model, first.src_vocab, tgt_vocab,
               averaged_from=json.dumps(sources),
               preset=first.metadata.get("preset", ""),
               **({"architecture": first.metadata["architecture"]}
                  if "architecture" in first.metadata else {}),
               **init_provenance(first))


class RunLock:
    """An advisory lock on a run directory (flock on its train.lock) while a training writes to
    it: a second `attn train -o` on the same directory (a Makefile started twice: the recipes
    pass --resume) would otherwise train beside the first, both writing checkpoints. The kernel
    drops the lock when the process ends in any way, kill -9 included; the file itself stays
    and names the last holder."""

    FILE = "train.lock"

    def __init__(self, run_dir: Path):
        import fcntl
        import socket

        run_dir.mkdir(parents=True, exist_ok=True)
        self.handle = open(run_dir / self.FILE, "a+", encoding="utf-8")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.seek(0)
            holder = self.handle.read().strip() or "another process"
            self.handle.close()
            # On a shared file system a lock can outlive the node that crashed holding it
            # (NFSv3's lock manager): deleting the file frees the directory then.
            raise AttnError(f"{run_dir} is in use by another attn train ({holder}): let it "
                            "finish, or stop it (Ctrl-C or SIGTERM saves a checkpoint) and "
                            "--resume; or choose another -o; if that host is down, delete "
                            f"{run_dir / self.FILE}") from None
        except OSError as error:  # a file system without locks (some NFS mounts)
            say(f"train: warning: cannot lock {run_dir} ({error.strerror}): a second "
                "training on it would not be refused")
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self.handle.flush()

    def release(self) -> None:
        self.handle.close()  # closing the file releases the lock
