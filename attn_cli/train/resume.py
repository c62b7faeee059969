"""Resuming a run exactly: which checkpoint (rank 0 decides for every process), what a resumed
run may change, what it restores, and where in the data it goes on.

A resumed run equals the uninterrupted one because everything that decides the next step is in
the checkpoint: the weights, Adam's moments, the schedule's start, the data position (epoch, and
micro-batches used, cut as they were: `earlier_budgets`), and dropout seeded from the step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .. import checkpoints
from ..batching import BatchPlan, MicroBatchStream
from ..checkpoints import ResumePoint, ResumeState
from ..config import FREELY_CHANGED, PER_NODE_OPTIONS, ModelConfig, TrainOptions
from ..data import ParallelData
from ..errors import AttnError
from ..files import file_sha256
from ..modelfile import LoadedModel
from .distributed import Processes, from_main


def resume_step(options: TrainOptions, processes: Processes) -> int | None:
    """The step of the checkpoint to resume from (None: a new run), as rank 0 finds its run
    directory, sent to every rank: no rank decides from its own disk, which on another node may
    hold other checkpoints or none. Refuses to overwrite a run without --resume."""
    decision: dict = {}
    if processes.is_main:
        run_dir = Path(options.output)
        existing = checkpoints.list_checkpoints(run_dir, need_state=True)
        if existing and not options.resume:
            decision["error"] = (f"{run_dir} already holds checkpoints (last: step "
                                 f"{existing[-1][0]}); add --resume to continue that run, or "
                                 "choose another -o")
        elif existing:
            decision.update(newest_intact(run_dir, [step for step, _ in existing], processes))
        elif options.resume:
            processes.log(f"nothing to resume in {run_dir}: starting a new run")
    decision = from_main(decision, processes)
    if "error" in decision:
        raise AttnError(decision["error"])
    return decision.get("step")


def newest_intact(run_dir: Path, steps: list[int], processes: Processes) -> dict:
    """{"step": the newest checkpoint whose model and state files are whole}, each newer one
    skipped named with why (a disk or copy fault, a kill in the middle of a copy), or {"error"}
    when none is."""
    skipped = []
    for step in reversed(steps):
        problem = checkpoints.intact_checkpoint(run_dir, step)
        if problem is None:
            for earlier in skipped:
                processes.log(f"resume: skipped {earlier}")
            return {"step": step}
        skipped.append(f"checkpoint-{step}: {problem}")
    return {"error": f"no checkpoint in {run_dir} can be resumed from: " + "; ".join(skipped)}


def load(options: TrainOptions, processes: Processes, config: ModelConfig, data: ParallelData,
         step: int) -> tuple[LoadedModel, ResumeState]:
    """Checkpoint `step` of the run and its state, checked against this run's architecture,
    vocabulary and options (`check_resume`)."""
    run_dir = Path(options.output)
    if not (checkpoints.checkpoint_path(run_dir, step).exists()
            and checkpoints.state_path(run_dir, step).exists()):
        raise AttnError(f"{run_dir} holds no checkpoint-{step}.st and its state, which rank 0 "
                        "resumes from: every process must see rank 0's run directory at its -o "
                        "path (on several nodes, a shared file system)")
    loaded, state = checkpoints.load_checkpoint(run_dir, step, processes.device)
    check_resume(loaded.config, config, loaded.src_vocab.checksum,
                 data.metadata["src_vocab_sha256"], state.options, options, processes,
                 seeded="init" in loaded.metadata)
    return loaded, state


def check_resume(saved_config: ModelConfig, config: ModelConfig, saved_vocab: str,
                 data_vocab: str, saved_options: dict, options: TrainOptions,
                 processes: Processes, seeded: bool = False) -> None:
    """Refuse a changed architecture or vocabulary; say which options differ. A run seeded by
    --init (`seeded`: its checkpoints record the model file) has that file's architecture,
    not the preset's, and goes on with it whether or not --init is given again."""
    if saved_vocab != data_vocab:
        raise AttnError(f"{options.data} was binarized with another vocabulary than the run "
                        f"in {options.output}: resuming needs the same vocabulary")
    architecture = {f.name for f in dataclasses.fields(ModelConfig)} - {"dropout"}
    changed = [] if seeded else [name for name in sorted(architecture)
                                 if getattr(saved_config, name) != getattr(config, name)]
    if changed:
        differences = ", ".join(f"{name} {getattr(saved_config, name)} -> "
                                f"{getattr(config, name)}" for name in changed)
        raise AttnError(f"the run in {options.output} has another architecture "
                        f"({differences}); start a new run to change it")
    recorded = options.record()
    for key in sorted(set(recorded) | set(saved_options)):
        if key == "resume" or (key == "init" and recorded.get(key) is None):
            continue  # --init seeds a new run only: leaving it out on resume changes nothing
        before, after = saved_options.get(key), recorded.get(key)
        if before != after:
            note = "" if key in FREELY_CHANGED else " (changes the recipe)"
            processes.log(f"resume: {key} {before} -> {after}{note}")


def restore(state: ResumeState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler, options: TrainOptions, dtype: str,
            processes: Processes) -> ResumePoint:
    """Adam's moments and the fp16 loss scale as they were (unless --reset-optimizer), and the
    point the run goes on from (the warmup restarted with --reset-schedule)."""
    if options.reset_optimizer:
        processes.log("--reset-optimizer: Adam's moments start from zero")
    else:
        checkpoints.restore_adam(model, optimizer, state.adam)
        if state.scaler and dtype == "fp16":
            scaler.load_state_dict(state.scaler)
    point = state.point
    if options.init is not None:
        processes.log(f"resume: --init {options.init} is not read: it seeds a new run, and this "
                      "one goes on from its checkpoint")
    if options.reset_schedule:
        point = dataclasses.replace(point, schedule_offset=point.step)
        processes.log(f"--reset-schedule: warmup starts again at step {point.step + 1}")
    processes.log(f"resuming {Path(options.output)} from step {point.step} (epoch "
                  f"{point.epoch}, batch {point.offset})")
    return point


def resumed_stream(data: ParallelData, plan: BatchPlan, seed: int, point: ResumePoint,
                   processes: Processes) -> MicroBatchStream:
    """The micro-batches from where the run stopped. Under another plan than the checkpoint's
    (another process count, --max-tokens or --batch-tokens) the run goes on from the same
    place in the data with the new plan's global batch, and says so."""
    saved = BatchPlan(**point.batch_plan) if point.batch_plan else None
    stream = MicroBatchStream(data, saved.max_tokens if saved else plan.max_tokens, seed,
                              point.epoch, point.offset, point.earlier_budgets)
    if stream.offset > stream.epoch_length:  # only with another data file than the run's
        processes.log(f"resume: the data position (epoch {stream.epoch}, batch "
                      f"{stream.offset}) lies past the end of that epoch in {data.path} "
                      f"({stream.epoch_length} batches): going on with epoch {stream.epoch + 1}")
        stream.next_epoch()
    if saved is not None and saved != plan:
        if saved.max_tokens == plan.max_tokens:
            how = "micro-batches cut as before"
        else:
            how = (f"the rest of epoch {stream.epoch} (from its micro-batch {stream.offset}) cut "
                   f"into {plan.max_tokens}-token micro-batches from the pairs not yet used")
        processes.log(f"resume: batch plan {saved.brief()} -> {plan.brief()} "
                      f"({saved.step_tokens} -> {plan.step_tokens} tokens/side/step); {how}")
        stream.change_budget(plan.max_tokens)
    return stream


def rank_facts(options: TrainOptions, data: ParallelData, valid: ParallelData | None,
               point: ResumePoint, init_sha256: str | None) -> dict:
    """What every rank must share with rank 0: the options (less the paths, which may differ
    from node to node: the files' contents are compared instead), the data and the model file
    a fine-tuning run starts from by checksum, and the point it resumes from."""
    return {
        "options": {key: value for key, value in options.record().items()
                    if key not in PER_NODE_OPTIONS},
        "data file": file_sha256(data.path),
        "validation file": file_sha256(valid.path) if valid is not None else None,
        "init model file": init_sha256,
        "resumed from": {"step": point.step, "epoch": point.epoch,
                         "offset": point.offset, "elapsed_s": point.elapsed_seconds},
    }
