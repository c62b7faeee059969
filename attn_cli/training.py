"""Training, as in §5 of the paper: Adam (β1 0.9, β2 0.98, ε 1e-9), the inverse-square-root
schedule with linear warmup, label smoothing, dropout, batches of ~25000 source + 25000 target
tokens per step over all processes, and checkpoints every 10 minutes.

Reproducibility is by construction, so that 1 process equals N processes and a resumed run equals
an uninterrupted one:
- the sequence of micro-batches is a function of (seed, epoch) alone, whatever the world size;
  step s consumes the next `accumulation × world_size` micro-batches, rank r takes every
  world_size-th of them;
- each step's loss is normalised by the step's global target-token count, which every rank
  computes from the lengths without communicating;
- dropout is seeded from (seed, step, the micro-batch's place in the step), whichever process
  draws it, so no RNG state has to travel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import checkpoints
from .config import ModelConfig, Preset, get_preset
from .data import Batch, ParallelData, collate, token_batches
from .devices import autocast, pick_device, resolve_dtype
from .files import AttnError
from .model import Transformer
from .modelfile import unwrap

# ---------------------------------------------------------------------------------- the recipe


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """§5.3: lrate = d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5), times `scale`."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor, epsilon: float,
                        pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """§5.4 label smoothing (Szegedy et al. 2016): cross-entropy against (1 - ε)·onehot + ε/V,
    summed over non-padding targets. Returns (smoothed loss sum, negative log-likelihood sum);
    the NLL is what perplexity is made of."""
    logits = logits.float()
    smoothed = F.cross_entropy(logits, target, ignore_index=pad_id, label_smoothing=epsilon,
                               reduction="sum")
    if epsilon == 0.0:
        return smoothed, smoothed.detach()
    with torch.no_grad():
        nll = F.cross_entropy(logits, target, ignore_index=pad_id, reduction="sum")
    return smoothed, nll


def parse_interval(text: str) -> tuple[float, str]:
    """'10m', '90s', '2h' → (seconds, 'time'); '5000' or '5000u' → (steps, 'steps')."""
    text = text.strip().lower()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]], "time"
        return float(int(text.rstrip("u"))), "steps"
    except ValueError:
        raise AttnError(f"cannot read the interval {text!r}: use steps (5000) or a time "
                        "(30s, 10m, 12h)") from None


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is split: tokens per forward pass, passes per process per step."""

    batch_tokens: int  # per side, per optimizer step, over all processes
    max_tokens: int  # per forward pass (padding included)
    world_size: int
    accumulation: int  # forward passes per process per step

    @property
    def micro_batches_per_step(self) -> int:
        return self.accumulation * self.world_size

    def describe(self) -> str:
        return (f"batch plan  {self.batch_tokens} tokens/side/step over {self.world_size} "
                f"process(es): {self.max_tokens} tokens per forward pass, "
                f"{self.accumulation} accumulation step(s) per process")


def batch_plan(batch_tokens: int, max_tokens: int | None, world_size: int) -> BatchPlan:
    per_process = math.ceil(batch_tokens / world_size)
    max_tokens = min(max_tokens or per_process, per_process)
    return BatchPlan(batch_tokens, max_tokens, world_size, math.ceil(per_process / max_tokens))


class MicroBatchStream:
    """The endless sequence of micro-batches (index arrays), epoch after epoch, each epoch
    bucketed and shuffled from (seed, epoch). `position` is what resuming needs."""

    def __init__(self, data: ParallelData, max_tokens: int, seed: int, epoch: int = 0,
                 offset: int = 0):
        self.data, self.max_tokens, self.seed = data, max_tokens, seed
        self.epoch, self.offset = epoch, offset
        self._batches = self._epoch_batches(epoch)

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        return token_batches(self.data.src_lengths, self.data.tgt_lengths, self.max_tokens,
                             self.seed, epoch)

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.offset

    def take(self, count: int) -> list[np.ndarray]:
        taken = []
        while len(taken) < count:
            if self.offset == len(self._batches):
                self.epoch, self.offset = self.epoch + 1, 0
                self._batches = self._epoch_batches(self.epoch)
            taken.append(self._batches[self.offset])
            self.offset += 1
        return taken


# ------------------------------------------------------------------------------ the processes


@dataclass(frozen=True)
class Processes:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def start_processes(device_option: str, timeout_minutes: float) -> Processes:
    """One process, or one of torchrun's (WORLD_SIZE, RANK, LOCAL_RANK in the environment):
    NCCL on CUDA, gloo on CPU."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_option, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world_size > 1:
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes),
                                **({"device_id": device} if device.type == "cuda" else {}))
        print(f"train: rank {rank}/{world_size} on {socket.gethostname()} pid {os.getpid()}, "
              f"{device} ({backend}), {torch.get_num_threads()} threads",
              file=sys.stderr, flush=True)
    return Processes(rank, world_size, local_rank, device)


def all_reduce_sum(values: list[float], processes: Processes) -> list[float]:
    if not processes.distributed:
        return values
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=processes.device)
    dist.all_reduce(tensor)
    return tensor.tolist()


# --------------------------------------------------------------------------------- the options


@dataclass(frozen=True)
class TrainOptions:
    data: Path
    output: Path
    preset: str = "base"
    valid: Path | None = None
    batch_tokens: int | None = None  # None: the preset's
    max_tokens: int | None = None
    max_steps: int | None = None
    max_time: str | None = None
    save_every: str | None = None
    keep: int = 20
    seed: int = 1
    device: str = "auto"
    dtype: str = "auto"
    lr_scale: float | None = None
    warmup: int | None = None
    label_smoothing: float | None = None
    dropout: float | None = None
    log_every: int = 100
    resume: bool = False
    reset_optimizer: bool = False
    reset_schedule: bool = False
    dist_timeout_minutes: float = 30.0

    def recipe(self) -> dict:
        """The options with the preset's values filled in: what the run actually uses."""
        preset = get_preset(self.preset)
        filled = dataclasses.asdict(self)
        for option, preset_field in (("batch_tokens", "batch_tokens"),
                                     ("max_steps", "max_steps"), ("save_every", "save_every"),
                                     ("lr_scale", "lr_scale"), ("warmup", "warmup_steps"),
                                     ("label_smoothing", "label_smoothing"),
                                     ("dropout", "dropout")):
            if filled[option] is None:
                filled[option] = getattr(preset, preset_field)
        return {key: str(value) if isinstance(value, Path) else value
                for key, value in filled.items()}


# Options a resumed run may change without a --reset flag (they do not alter what was learned).
FREELY_CHANGED = {"max_steps", "max_time", "save_every", "keep", "device", "log_every", "resume",
                  "valid", "output", "reset_optimizer", "reset_schedule", "dist_timeout_minutes",
                  "max_tokens", "dtype", "data"}


# ------------------------------------------------------------------------------------ the loop


class StopRequest:
    """SIGINT/SIGTERM: finish the step, save, exit 0. A second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def to_device(batch: Batch, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(array).to(device, non_blocking=True)
                 for array in (batch.src_tokens, batch.tgt_input, batch.tgt_output))


def dropout_seed(seed: int, step: int, micro_batch: int) -> int:
    """Dropout masks depend on the run's seed, the step and the micro-batch's place in the step:
    the same whichever process draws them, and again the same after a resume."""
    return (seed * 1_000_003 + step * 10_007 + micro_batch) % (2 ** 63)


def forward_backward(trained: torch.nn.Module, data: ParallelData,
                     micro_batches: list[np.ndarray], loss_scale: float, epsilon: float,
                     processes: Processes, dtype: str, scaler: torch.amp.GradScaler,
                     seed: tuple[int, int]) -> tuple[float, float]:
    """Accumulate the gradients of this process's share of one step's micro-batches (every
    world_size-th, from its rank), each loss multiplied by `loss_scale`. DDP synchronises the
    gradients on the last backward only. Returns this process's (loss sum, NLL sum)."""
    pad_id = unwrap(trained).config.pad_id
    positions = range(processes.rank, len(micro_batches), processes.world_size)
    loss_sum = nll_sum = 0.0
    for count, position in enumerate(positions, start=1):
        torch.manual_seed(dropout_seed(*seed, position))
        src, tgt_in, tgt_out = to_device(collate(data, micro_batches[position]),
                                         processes.device)
        keep = tgt_out != pad_id
        last = count == len(positions)
        sync = contextlib.nullcontext() if last or not processes.distributed else \
            trained.no_sync()
        with sync:
            with autocast(processes.device, dtype):
                logits = trained(src, tgt_in, output_mask=keep)
            loss, nll = label_smoothed_loss(logits, tgt_out[keep], epsilon, pad_id)
            scaler.scale(loss * loss_scale).backward()
        loss_sum += loss.item()
        nll_sum += nll.item()
    return loss_sum, nll_sum


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: ParallelData, max_tokens: int, epsilon: float,
             processes: Processes, dtype: str) -> dict[str, float]:
    """Validation loss (label-smoothed, like the training loss) and perplexity (exp of the
    per-token NLL, EOS included), each process scoring its share of the batches."""
    bare = unwrap(model)
    was_training = bare.training
    bare.eval()
    batches = token_batches(data.src_lengths, data.tgt_lengths, max_tokens, seed=0)
    totals = [0.0, 0.0, 0.0]
    for indices in batches[processes.rank::processes.world_size]:
        src, tgt_in, tgt_out = to_device(collate(data, indices), processes.device)
        keep = tgt_out != bare.config.pad_id
        with autocast(processes.device, dtype):
            logits = bare(src, tgt_in, output_mask=keep)
        loss, nll = label_smoothed_loss(logits, tgt_out[keep], epsilon, bare.config.pad_id)
        totals[0] += loss.item()
        totals[1] += nll.item()
        totals[2] += int(keep.sum())
    loss_sum, nll_sum, tokens = all_reduce_sum(totals, processes)
    bare.train(was_training)
    return {"valid_loss": loss_sum / tokens, "valid_nll": nll_sum / tokens,
            "valid_ppl": math.exp(min(nll_sum / tokens, 700))}


def train(options: TrainOptions) -> Path | None:
    """Run (or resume) training; returns the last checkpoint written (None on other ranks)."""
    processes = start_processes(options.device, options.dist_timeout_minutes)
    try:
        return _train(options, processes)
    finally:
        if processes.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()


def _log(processes: Processes, message: str) -> None:
    if processes.is_main:
        print(f"train: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _Position:
    step: int = 0
    epoch: int = 0
    offset: int = 0
    elapsed_seconds: float = 0.0
    schedule_offset: int = 0  # the step the warmup counts from (--reset-schedule)

    def __iter__(self):
        return iter(dataclasses.astuple(self))


def _start_or_resume(options: TrainOptions, processes: Processes, config: ModelConfig,
                     recipe: dict, data: ParallelData, dtype: str):
    """A new model and optimizer, or the last checkpoint's with Adam's moments, the data
    position and the schedule as they were. Refuses to overwrite a run without --resume."""
    run_dir = Path(options.output)
    existing = checkpoints.list_checkpoints(run_dir, need_state=True)
    if existing and not options.resume:
        raise AttnError(f"{run_dir} already holds checkpoints (last: step {existing[-1][0]}); "
                        "add --resume to continue that run, or choose another -o")
    torch.manual_seed(options.seed)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == "fp16")
    if not (options.resume and existing):
        if options.resume:
            _log(processes, f"nothing to resume in {run_dir}: starting a new run")
        model = Transformer(config).to(processes.device).train()
        recipe["schedule_offset"] = 0
        return model, _adam(model), scaler, _Position()

    loaded, state = checkpoints.load_checkpoint(run_dir, existing[-1][0], processes.device)
    _check_resume(loaded.config, config, loaded.src_vocab.checksum,
                  data.metadata["src_vocab_sha256"], state.options, recipe, options, processes)
    model = loaded.model.train()
    optimizer = _adam(model)
    if options.reset_optimizer:
        _log(processes, "--reset-optimizer: Adam's moments start from zero")
    else:
        checkpoints.restore_adam(model, optimizer, state.adam)
        if state.scaler and dtype == "fp16":
            scaler.load_state_dict(state.scaler)
    schedule_offset = state.options.get("schedule_offset", 0)
    if options.reset_schedule:
        schedule_offset = state.step
        _log(processes, f"--reset-schedule: warmup starts again at step {state.step + 1}")
    recipe["schedule_offset"] = schedule_offset
    if processes.is_main:
        checkpoints.truncate_metrics(run_dir, state.step)
    _log(processes, f"resuming {run_dir} from step {state.step} (epoch {state.epoch}, batch "
         f"{state.offset})")
    return model, optimizer, scaler, _Position(state.step, state.epoch, state.offset,
                                               state.elapsed_seconds, schedule_offset)


def _adam(model: torch.nn.Module) -> torch.optim.Adam:
    """§5.3: Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 (the rate is set every step)."""
    return torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)


def _train(options: TrainOptions, processes: Processes) -> Path | None:
    recipe = options.recipe()
    preset = get_preset(options.preset)
    run_dir = Path(options.output)
    data = ParallelData(options.data)
    valid = ParallelData(options.valid) if options.valid else None
    if valid is not None:
        data.check_same_vocab(valid)
    dtype = resolve_dtype(options.dtype, processes.device)
    plan = batch_plan(recipe["batch_tokens"], options.max_tokens, processes.world_size)
    save_amount, save_unit = parse_interval(recipe["save_every"])
    max_seconds = parse_interval(options.max_time)[0] if options.max_time else math.inf
    config = preset.model_config(len(data.src_vocab),
                                 None if data.shared_vocab else len(data.tgt_vocab),
                                 dropout=recipe["dropout"])

    model, optimizer, scaler, position = _start_or_resume(options, processes, config, recipe,
                                                          data, dtype)
    step, epoch, offset, elapsed_before, schedule_offset = position

    trained = model
    if processes.distributed:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(
            model, device_ids=[processes.device.index] if processes.device.type == "cuda"
            else None)

    if processes.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _log(processes, f"{preset.name}: {sum(p.numel() for p in model.parameters()):,} "
             f"parameters, {len(data)} training pairs, {dtype} on {processes.device}")
        _log(processes, plan.describe())
    stream = MicroBatchStream(data, plan.max_tokens, options.seed, epoch, offset)
    tgt_lengths = data.tgt_lengths
    src_lengths = data.src_lengths
    epsilon = recipe["label_smoothing"]
    started = time.monotonic()
    last_save_time = started
    last_save_step = step
    window = {"loss": 0.0, "nll": 0.0, "tgt": 0, "src": 0, "start": time.monotonic()}
    last_checkpoint = None
    progress = _Progress(processes.is_main, recipe["max_steps"], step)
    with StopRequest() as stop, progress:
        while step < recipe["max_steps"]:
            micro_batches = stream.take(plan.micro_batches_per_step)
            step_tgt_tokens = sum(int(tgt_lengths[b].sum()) + len(b) for b in micro_batches)
            step_src_tokens = sum(int(src_lengths[b].sum()) + len(b) for b in micro_batches)
            # Each rank's losses are scaled so that the gradients DDP averages add up to the
            # gradient of (global loss sum / global target tokens).
            loss_scale = processes.world_size / step_tgt_tokens
            loss_sum, nll_sum = forward_backward(trained, data, micro_batches, loss_scale,
                                                 epsilon, processes, dtype, scaler,
                                                 seed=(options.seed, step))
            lr = inverse_sqrt_lr(step + 1 - schedule_offset, config.d_model, recipe["warmup"],
                                 recipe["lr_scale"])
            for group in optimizer.param_groups:
                group["lr"] = lr
            # Rank 0's clock decides time-based saving and stopping for every rank (a decision
            # taken apart would leave one rank waiting in a collective for the others).
            due = (step + 1 - last_save_step >= save_amount if save_unit == "steps"
                   else time.monotonic() - last_save_time >= save_amount)
            time_up = elapsed_before + time.monotonic() - started >= max_seconds
            loss_sum, nll_sum, stop_votes, save_votes, time_votes = all_reduce_sum(
                [loss_sum, nll_sum, float(stop.requested), float(due and processes.is_main),
                 float(time_up and processes.is_main)], processes)
            if not math.isfinite(loss_sum):
                optimizer.zero_grad(set_to_none=True)
                good = checkpoints.list_checkpoints(run_dir, need_state=True)
                kept = f"the last good checkpoint is {good[-1][1]}" if good else \
                    "no checkpoint was written yet"
                raise TrainingDiverged(f"the loss became {loss_sum} at step {step + 1}; {kept}. "
                                       "Try a lower --lr-scale or a longer --warmup.")
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window["loss"] += loss_sum
            window["nll"] += nll_sum
            window["tgt"] += step_tgt_tokens
            window["src"] += step_src_tokens
            progress.update(step, loss_sum / step_tgt_tokens, lr,
                            window["tgt"] / max(time.monotonic() - window["start"], 1e-9))
            if step % options.log_every == 0 or save_votes:
                seconds = max(time.monotonic() - window["start"], 1e-9)
                row = {"step": step, "loss": window["loss"] / window["tgt"],
                       "nll": window["nll"] / window["tgt"], "lr": lr,
                       "tokens_per_s": window["tgt"] / seconds,
                       "src_tokens_per_s": window["src"] / seconds,
                       "epoch": stream.position[0],
                       "elapsed_s": elapsed_before + time.monotonic() - started}
                if save_votes and valid is not None:
                    row.update(evaluate(trained, valid, plan.max_tokens, epsilon, processes, dtype))
                # The row goes to disk before the checkpoint: a run killed between the two
                # resumes from the previous checkpoint and rewrites this row, never loses it.
                _write_metrics(run_dir, row, processes)
                if save_votes:
                    last_checkpoint = _save(run_dir, step, model, optimizer, stream, scaler,
                                            elapsed_before + time.monotonic() - started,
                                            recipe, data, options, processes)
                    last_save_time, last_save_step = time.monotonic(), step
                progress.log(row)
                window = {"loss": 0.0, "nll": 0.0, "tgt": 0, "src": 0,
                          "start": time.monotonic()}
            if stop_votes or time_votes:
                stop_reason = ("stopped by a signal" if stop_votes
                               else f"reached --max-time {options.max_time}")
                break
        else:
            stop_reason = f"reached {recipe['max_steps']} steps"
    if last_save_step != step or last_checkpoint is None:
        row = {"step": step, "elapsed_s": elapsed_before + time.monotonic() - started}
        if valid is not None:
            row.update(evaluate(trained, valid, plan.max_tokens, epsilon, processes, dtype))
        if len(row) > 2:  # before the checkpoint, as in the loop
            _write_metrics(run_dir, row, processes)
            progress.log(row)
        last_checkpoint = _save(run_dir, step, model, optimizer, stream, scaler,
                                row["elapsed_s"], recipe, data, options, processes)
    _log(processes, f"{stop_reason}; last checkpoint {last_checkpoint}")
    return last_checkpoint if processes.is_main else None


class TrainingDiverged(AttnError):
    pass


def _save(run_dir, step, model, optimizer, stream, scaler, elapsed, recipe, data, options,
          processes) -> Path | None:
    if not processes.is_main:
        return None
    epoch, offset = stream.position
    state = checkpoints.ResumeState(step=step, epoch=epoch, offset=offset,
                                    elapsed_seconds=elapsed, options=recipe, adam={},
                                    scaler=scaler.state_dict() if scaler.is_enabled() else {})
    tgt_vocab = None if data.shared_vocab else data.tgt_vocab
    path = checkpoints.save_checkpoint(run_dir, step, model, optimizer, state, data.src_vocab,
                                       tgt_vocab, {"preset": options.preset})
    checkpoints.prune_checkpoints(run_dir, options.keep)
    return path


def _write_metrics(run_dir: Path, row: dict, processes: Processes) -> None:
    if not processes.is_main:
        return
    with open(run_dir / checkpoints.METRICS_FILE, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()


def _check_resume(saved_config: ModelConfig, config: ModelConfig, saved_vocab: str,
                  data_vocab: str, saved_options: dict, recipe: dict, options: TrainOptions,
                  processes: Processes) -> None:
    """Refuse a changed architecture or vocabulary; say which options differ."""
    if saved_vocab != data_vocab:
        raise AttnError(f"{options.data} was binarized with another vocabulary than the run "
                        f"in {options.output}: resuming needs the same vocabulary")
    architecture = {f.name for f in dataclasses.fields(ModelConfig)} - {"dropout"}
    changed = [name for name in sorted(architecture)
               if getattr(saved_config, name) != getattr(config, name)]
    if changed:
        differences = ", ".join(f"{name} {getattr(saved_config, name)} -> "
                                f"{getattr(config, name)}" for name in changed)
        raise AttnError(f"the run in {options.output} has another architecture "
                        f"({differences}); start a new run to change it")
    for key in sorted(set(recipe) | set(saved_options)):
        if key in ("resume", "schedule_offset"):
            continue
        before, after = saved_options.get(key), recipe.get(key)
        if before != after:
            note = "" if key in FREELY_CHANGED else " (changes the recipe)"
            _log(processes, f"resume: {key} {before} -> {after}{note}")


# -------------------------------------------------------------------------------- the display


class _Progress:
    """A rich progress bar on a terminal; plain log lines otherwise (CI logs, files)."""

    def __init__(self, enabled: bool, total_steps: int, start_step: int):
        self.enabled = enabled
        self.live = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.live = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                 console=Console(stderr=True), transient=False)
            self.task = self.live.add_task("train", total=total_steps, completed=start_step,
                                           status="")

    def __enter__(self):
        if self.live:
            self.live.start()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.live.stop()

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        if self.live:
            self.live.update(self.task, completed=step,
                             status=f"loss {loss:.3f} lr {lr:.2e} {tokens_per_s:,.0f} tgt tok/s")

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        parts = [f"step {row['step']}"]
        for key, fmt in (("loss", ".4f"), ("nll", ".4f"), ("lr", ".3e"), ("tokens_per_s", ",.0f"),
                         ("src_tokens_per_s", ",.0f"), ("valid_loss", ".4f"),
                         ("valid_ppl", ".3f"), ("elapsed_s", ".0f")):
            if key in row:
                parts.append(f"{key} {row[key]:{fmt}}")
        line = "train: " + "  ".join(parts)
        if self.live:
            self.live.console.print(line)
        else:
            print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the dry-run report


def dry_run_report(options: TrainOptions, vocab_size: int | None, world_size: int) -> str:
    """What `train` would build and how it would batch, without data (given --vocab-size)."""
    preset = get_preset(options.preset)
    recipe = options.recipe()
    if options.data is not None:
        data = ParallelData(options.data)
        src_size = len(data.src_vocab)
        tgt_size = None if data.shared_vocab else len(data.tgt_vocab)
    elif vocab_size is not None:
        src_size, tgt_size = vocab_size, None
    else:
        raise AttnError("--dry-run needs a data file or --vocab-size")
    config = preset.model_config(src_size, tgt_size, dropout=recipe["dropout"])
    plan = batch_plan(recipe["batch_tokens"], options.max_tokens, world_size)
    return describe_model(preset, config, recipe, plan)


def parameter_groups(model: Transformer) -> dict[str, int]:
    """Parameter counts by part; the shared embedding is counted once."""
    counted: set[int] = set()

    def count(module: torch.nn.Module) -> int:
        total = 0
        for parameter in module.parameters():
            if id(parameter) not in counted:
                counted.add(id(parameter))
                total += parameter.numel()
        return total

    groups = {"embeddings": count(model.tgt_embed) + count(model.src_embed)}
    if model.config.positions == "learned":
        groups["positions"] = count(model.learned_positions)
    groups["encoder"] = count(model.encoder_layers) + (
        count(model.encoder_norm) if model.config.norm == "pre" else 0)
    groups["decoder"] = count(model.decoder_layers) + (
        count(model.decoder_norm) if model.config.norm == "pre" else 0)
    return groups


def describe_model(preset: Preset, config: ModelConfig, recipe: dict | None = None,
                   plan: BatchPlan | None = None) -> str:
    """The `--dry-run` report: architecture, recipe and parameter counts, ending `params: N`."""
    recipe = recipe or {"warmup": preset.warmup_steps, "lr_scale": preset.lr_scale,
                        "max_steps": preset.max_steps, "batch_tokens": preset.batch_tokens,
                        "label_smoothing": preset.label_smoothing}
    with torch.device("meta"):  # shapes only: instant even for `big`
        model = Transformer(config)
    groups = parameter_groups(model)
    total = sum(groups.values())
    vocabulary = (f"{config.src_vocab_size} shared (source, target, output projection)"
                  if config.share_embeddings else
                  f"{config.src_vocab_size} source, {config.tgt_vocab_size} target (tied to the "
                  "output projection)")
    lines = [
        f"preset      {preset.name}: {preset.description}",
        f"encoder     {config.encoder_layers} layers",
        f"decoder     {config.decoder_layers} layers",
        f"layer       d_model {config.d_model}, d_ff {config.d_ff}, {config.heads} heads "
        f"(d_k {config.d_k}, d_v {config.d_v}), {config.norm}-norm",
        f"positions   {config.positions}",
        f"vocabulary  {vocabulary}",
        f"dropout     {config.dropout} (attention {config.attention_dropout}), "
        f"label smoothing {recipe['label_smoothing']}",
        f"schedule    Adam 0.9/0.98/1e-9, warmup {recipe['warmup']}, lr scale "
        f"{recipe['lr_scale']}, {recipe['max_steps']} steps, {recipe['batch_tokens']} "
        "tokens/side/step",
    ]
    if plan is not None:
        lines.append(plan.describe())
    lines += [f"  {name:<10}{count:>14,}" for name, count in groups.items()]
    if preset.paper_params_millions is not None:
        paper = preset.paper_params_millions * 1e6
        lines.append(f"Table 3: {preset.paper_params_millions:g}M with a ~37K vocabulary "
                     f"(this: {total / 1e6:.1f}M, {100 * (total - paper) / paper:+.1f}%)")
    lines.append(f"params: {total}")
    return "\n".join(lines)
