"""Training, as in §5 of the paper: Adam (β1 0.9, β2 0.98, ε 1e-9), the inverse-square-root
schedule with linear warmup, label smoothing, dropout, batches of ~25000 source + 25000 target
tokens per step over all processes, and checkpoints every 10 minutes.

Reproducibility is by construction, so that 1 process equals N processes and a resumed run equals
an uninterrupted one:
- the sequence of micro-batches is a function of (seed, epoch) and their token budget alone,
  whatever the world size; step s consumes the next `accumulation × world_size` micro-batches,
  rank r takes every world_size-th of them; the budget is the global batch shared out evenly,
  so the global batch is the same on any number of processes (BatchPlan);
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
from typing import Callable, ClassVar, Protocol

import numpy as np
import torch

from . import checkpoints
from .config import ModelConfig, Preset, get_preset
from .data import Batch, ParallelData, collate, token_batches
from .devices import autocast, pick_device, resolve_dtype, warn_if_bf16_is_emulated
from .files import AttnError
from .formats import METRICS_FILE
from .model import Transformer
from .modelfile import unwrap
from .validation import Validator, best_steps, metric_key, scored_steps

# ---------------------------------------------------------------------------------- the recipe


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """§5.3: lrate = d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5), times `scale`."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


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
    max_tokens: int  # per forward pass (padding included): the micro-batch's budget
    world_size: int
    accumulation: int  # forward passes per process per step

    @property
    def micro_batches_per_step(self) -> int:
        return self.accumulation * self.world_size

    @property
    def step_tokens(self) -> int:
        """The budget of a whole step: --batch-tokens, rounded up by less than a token per pass."""
        return self.max_tokens * self.micro_batches_per_step

    def describe(self) -> str:
        return (f"batch plan  {self.batch_tokens} tokens/side/step over {self.world_size} "
                f"process(es): {self.max_tokens} tokens per forward pass, "
                f"{self.accumulation} accumulation step(s) per process "
                f"({self.step_tokens} tokens/side in all)")

    def record(self) -> dict:
        return dataclasses.asdict(self)

    def brief(self) -> str:
        return (f"{self.world_size} process(es) x {self.accumulation} pass(es) x "
                f"{self.max_tokens} tokens")


def batch_plan(batch_tokens: int, max_tokens: int | None, world_size: int) -> BatchPlan:
    """As few forward passes as the cap `max_tokens` allows, all of one budget, the smallest
    that adds up to `batch_tokens`: the global batch is the same for any process count (a
    budget left at the cap would round it up by up to a pass: 28,672 instead of 25,000 on
    1 process with a 4096 cap, 36,864 on 3)."""
    per_process = math.ceil(batch_tokens / world_size)
    cap = min(max_tokens or per_process, per_process)
    accumulation = math.ceil(per_process / cap)
    budget = math.ceil(batch_tokens / (world_size * accumulation))  # ≤ cap
    return BatchPlan(batch_tokens, budget, world_size, accumulation)


class MicroBatchStream:
    """The endless sequence of micro-batches (index arrays), epoch after epoch, each epoch
    bucketed and shuffled from (seed, epoch). `position` is what resuming needs.

    A run resumed with another budget per micro-batch (another process count or --max-tokens)
    goes on from the same place in the data: the epoch's batches used so far stay as they were
    cut (`earlier_budgets`: (budget, batches) for each earlier part of the epoch), and the rest
    of the epoch is cut with the new budget from the pairs they left, so that no pair is
    skipped or seen twice."""

    def __init__(self, data: ParallelData, max_tokens: int, seed: int, epoch: int = 0,
                 offset: int = 0, earlier_budgets: tuple[tuple[int, int], ...] = ()):
        self.data, self.max_tokens, self.seed = data, max_tokens, seed
        self.epoch, self.offset = epoch, offset
        self.earlier_budgets = tuple((int(budget), int(count))
                                     for budget, count in earlier_budgets)
        self._batches = self._epoch_batches()

    def _epoch_batches(self) -> list[np.ndarray]:
        """This epoch's batches: each earlier budget's share cut from the pairs the ones before
        it left, the rest with this stream's budget."""
        unused = np.arange(len(self.data))
        batches: list[np.ndarray] = []
        for budget, count in (*self.earlier_budgets, (self.max_tokens, None)):
            if len(unused) == 0:
                break
            cut = token_batches(self.data.src_lengths[unused], self.data.tgt_lengths[unused],
                                budget, self.seed, self.epoch)[:count]
            cut = [unused[indices] for indices in cut]
            batches += cut
            if count is not None:
                unused = np.setdiff1d(unused, np.concatenate(cut))
        return batches

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.offset

    @property
    def epoch_length(self) -> int:
        """Micro-batches in the current epoch."""
        return len(self._batches)

    def next_epoch(self) -> None:
        self.epoch, self.offset, self.earlier_budgets = self.epoch + 1, 0, ()
        self._batches = self._epoch_batches()

    def change_budget(self, max_tokens: int) -> None:
        """Go on with micro-batches of `max_tokens` from the same place in the data."""
        if max_tokens == self.max_tokens:
            return
        used_at_this_budget = self.offset - sum(count for _, count in self.earlier_budgets)
        previous, self.max_tokens = self.max_tokens, max_tokens
        if self.offset >= len(self._batches):
            self.next_epoch()
            return
        if used_at_this_budget > 0:
            self.earlier_budgets += ((previous, used_at_this_budget),)
        self._batches = self._epoch_batches()

    def take(self, count: int) -> list[np.ndarray]:
        taken = []
        while len(taken) < count:
            if self.offset >= len(self._batches):
                self.next_epoch()
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
        # float32 matmuls on tensor cores (TF32: 10-bit mantissa inputs, float32 sums) on
        # Ampere and later, as mixed-precision trainers do; bf16/fp16 runs are unaffected.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        # The cores this process may run on (not the machine's) shared out among a node's
        # processes. A single process keeps OMP_NUM_THREADS when it is set (torch has read it);
        # under torchrun it is not the user's word: torchrun sets it to 1 unless told otherwise.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if world_size > 1 or "OMP_NUM_THREADS" not in os.environ:
            cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                     else os.cpu_count() or 1)
            torch.set_num_threads(max(1, cores // local_world))
    if world_size > 1:
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes),
                                **({"device_id": device} if device.type == "cuda" else {}))
        print(f"train: rank {rank}/{world_size} on {socket.gethostname()} pid {os.getpid()}, "
              f"{device} ({backend}), {torch.get_num_threads()} threads",
              file=sys.stderr, flush=True)
    return Processes(rank, world_size, local_rank, device)


def all_reduce_sum(values: list[float] | torch.Tensor, processes: Processes) -> list[float]:
    """The values summed over the processes, read to the host (the one wait for the device)."""
    tensor = torch.as_tensor(values, dtype=torch.float64).to(processes.device)
    if processes.distributed:
        import torch.distributed as dist

        dist.all_reduce(tensor)
    return tensor.tolist()


# --------------------------------------------------------------------------------- the options


@dataclass(frozen=True)
class TrainOptions:
    data: Path
    output: Path
    preset: str = "base"
    valid: Path | None = None
    valid_metric: str = "loss"  # validation.METRICS
    valid_beam: int = 1
    valid_ref: Path | None = None  # references (text or gold trees); None: valid's targets
    batch_tokens: int | None = None  # None: the preset's
    max_tokens: int | None = None
    max_steps: int | None = None
    max_time: str | None = None
    save_every: str | None = None
    keep: int = 20
    keep_best: int = 0  # also kept: this many best checkpoints by valid_metric
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

    def recipe(self) -> "Recipe":
        """The preset with this run's overrides: what the run actually uses."""
        return Recipe.from_preset(get_preset(self.preset), **{
            name: getattr(self, name) for name in Recipe.PRESET_FIELDS})

    def record(self) -> dict:
        """Every option, the recipe's filled in, as JSON values: what a checkpoint keeps to tell
        a resumed run what it changes."""
        filled = {**dataclasses.asdict(self), **dataclasses.asdict(self.recipe())}
        return {key: str(value) if isinstance(value, Path) else value
                for key, value in filled.items()}


@dataclass(frozen=True)
class Recipe:
    """§5's numbers for a run: the preset's, where an option does not override them. The field
    names are the option names."""

    batch_tokens: int  # per side, per step, over all processes
    max_steps: int
    save_every: str  # a time (10m) or steps (5000)
    lr_scale: float
    warmup: int
    label_smoothing: float
    dropout: float

    # option (field) name → the preset's field
    PRESET_FIELDS: ClassVar[dict[str, str]] = {
        "batch_tokens": "batch_tokens", "max_steps": "max_steps", "save_every": "save_every",
        "lr_scale": "lr_scale", "warmup": "warmup_steps", "label_smoothing": "label_smoothing",
        "dropout": "dropout"}

    @classmethod
    def from_preset(cls, preset: Preset, **overrides) -> "Recipe":
        """The preset's recipe, with the overrides that are not None."""
        return cls(**{name: getattr(preset, field) if overrides.get(name) is None
                      else overrides[name] for name, field in cls.PRESET_FIELDS.items()})


# Options a resumed run may change without a --reset flag (they do not alter what was learned).
FREELY_CHANGED = {"max_steps", "max_time", "save_every", "keep", "device", "log_every", "resume",
                  "valid", "output", "reset_optimizer", "reset_schedule", "dist_timeout_minutes",
                  "max_tokens", "dtype", "data", "valid_metric", "valid_beam", "valid_ref",
                  "keep_best"}


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
                     seed: tuple[int, int]) -> torch.Tensor:
    """Accumulate the gradients of this process's share of one step's micro-batches (every
    world_size-th, from its rank), each loss multiplied by `loss_scale`. DDP synchronises the
    gradients on the last backward only. Returns this process's (loss sum, NLL sum) as a
    float64 tensor on the device: summed there, read once per step (a read per micro-batch
    would make the host wait for the device each time)."""
    pad_id = unwrap(trained).config.pad_id
    positions = range(processes.rank, len(micro_batches), processes.world_size)
    sums = torch.zeros(2, dtype=torch.float64, device=processes.device)
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
                loss, nll = trained(src, tgt_in, output_mask=keep, targets=tgt_out[keep],
                                    label_smoothing=epsilon)
            scaler.scale(loss * loss_scale).backward()
        sums += torch.stack([loss.detach(), nll]).double()
    return sums


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: ParallelData, max_tokens: int, epsilon: float,
             processes: Processes, dtype: str) -> dict[str, float]:
    """Validation loss (label-smoothed, like the training loss) and perplexity (exp of the
    per-token NLL, EOS included), each process scoring its share of the batches."""
    bare = unwrap(model)
    was_training = bare.training
    bare.eval()
    batches = token_batches(data.src_lengths, data.tgt_lengths, max_tokens, seed=0)
    totals = torch.zeros(3, dtype=torch.float64, device=processes.device)
    for indices in batches[processes.rank::processes.world_size]:
        src, tgt_in, tgt_out = to_device(collate(data, indices), processes.device)
        keep = tgt_out != bare.config.pad_id
        with autocast(processes.device, dtype):
            loss, nll = bare(src, tgt_in, output_mask=keep, targets=tgt_out[keep],
                             label_smoothing=epsilon)
        totals += torch.stack([loss, nll, keep.sum()]).double()
    loss_sum, nll_sum, tokens = all_reduce_sum(totals, processes)
    bare.train(was_training)
    return {"valid_loss": loss_sum / tokens, "valid_nll": nll_sum / tokens,
            "valid_ppl": math.exp(min(nll_sum / tokens, 700))}


def train(options: TrainOptions, display: Display | None = None) -> Path | None:
    """Run (or resume) training; returns the last checkpoint written (None on other ranks).
    `display` shows progress and metrics rows on the main process."""
    processes = start_processes(options.device, options.dist_timeout_minutes)
    try:
        return _train(options, processes,
                      display if display is not None and processes.is_main else _Quiet())
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
    batch_plan: dict | None = None  # the plan `offset` counts in (None: a new run, an old state)
    earlier_budgets: tuple[tuple[int, int], ...] = ()  # MicroBatchStream's


def _resume_step(options: TrainOptions, processes: Processes) -> int | None:
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
            decision["step"] = existing[-1][0]
        elif options.resume:
            _log(processes, f"nothing to resume in {run_dir}: starting a new run")
    if processes.distributed:
        import torch.distributed as dist

        sent = [decision]
        dist.broadcast_object_list(sent, src=0)
        decision = sent[0]
    if "error" in decision:
        raise AttnError(decision["error"])
    return decision.get("step")


def _start_or_resume(options: TrainOptions, processes: Processes, config: ModelConfig,
                     data: ParallelData, dtype: str, step: int | None):
    """A new model and optimizer, or checkpoint `step`'s with Adam's moments, the data
    position and the schedule as they were."""
    run_dir = Path(options.output)
    torch.manual_seed(options.seed)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == "fp16")
    if step is None:
        model = Transformer(config).to(processes.device).train()
        return model, _adam(model), scaler, _Position()

    if not (checkpoints.checkpoint_path(run_dir, step).exists()
            and checkpoints.state_path(run_dir, step).exists()):
        raise AttnError(f"{run_dir} holds no checkpoint-{step}.st and its state, which rank 0 "
                        "resumes from: every process must see rank 0's run directory at its -o "
                        "path (on several nodes, a shared file system)")
    loaded, state = checkpoints.load_checkpoint(run_dir, step, processes.device)
    _check_resume(loaded.config, config, loaded.src_vocab.checksum,
                  data.metadata["src_vocab_sha256"], state.options, options, processes)
    model = loaded.model.train()
    optimizer = _adam(model)
    if options.reset_optimizer:
        _log(processes, "--reset-optimizer: Adam's moments start from zero")
    else:
        checkpoints.restore_adam(model, optimizer, state.adam)
        if state.scaler and dtype == "fp16":
            scaler.load_state_dict(state.scaler)
    schedule_offset = state.schedule_offset
    if options.reset_schedule:
        schedule_offset = state.step
        _log(processes, f"--reset-schedule: warmup starts again at step {state.step + 1}")
    _log(processes, f"resuming {run_dir} from step {state.step} (epoch {state.epoch}, batch "
         f"{state.offset})")
    return model, optimizer, scaler, _Position(state.step, state.epoch, state.offset,
                                               state.elapsed_seconds, schedule_offset,
                                               state.batch_plan, state.earlier_budgets)


def _adam(model: torch.nn.Module) -> torch.optim.Adam:
    """§5.3: Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 (the rate is set every step). Fused (one
    kernel for every parameter) where torch has it: CUDA, and CPUs from torch 2.4 (3% of a
    `small` step on 2 cores)."""
    parameters = list(model.parameters())
    try:
        return torch.optim.Adam(parameters, lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
    except RuntimeError:  # this torch has no fused Adam for this device
        return torch.optim.Adam(parameters, lr=0.0, betas=(0.9, 0.98), eps=1e-9)


@dataclass
class _Run:
    """What one training run works with; fixed once the run has started."""

    options: TrainOptions
    recipe: Recipe
    processes: Processes
    display: Display
    run_dir: Path
    data: ParallelData
    valid: ParallelData | None
    validator: Validator | None  # decodes and scores the validation set (main process)
    dtype: str
    plan: BatchPlan
    config: ModelConfig
    model: Transformer
    trained: torch.nn.Module  # the model, wrapped by DDP when distributed
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    stream: MicroBatchStream
    schedule_offset: int  # the step the warmup counts from (--reset-schedule)


@dataclass
class _Window:
    """Losses and tokens summed since the last metrics row."""

    loss: float = 0.0
    nll: float = 0.0
    tgt: int = 0
    src: int = 0
    start: float = dataclasses.field(default_factory=time.monotonic)

    def add(self, loss: float, nll: float, tgt: int, src: int) -> None:
        self.loss, self.nll = self.loss + loss, self.nll + nll
        self.tgt, self.src = self.tgt + tgt, self.src + src

    def row(self, step: int, lr: float, epoch: int, elapsed: float) -> dict:
        seconds = max(time.monotonic() - self.start, 1e-9)
        return {"step": step, "loss": self.loss / self.tgt, "nll": self.nll / self.tgt, "lr": lr,
                "tokens_per_s": self.tgt / seconds, "src_tokens_per_s": self.src / seconds,
                "epoch": epoch, "elapsed_s": elapsed}


class _Clock:
    """Training time (a resumed run goes on counting) and when the next save is due."""

    def __init__(self, elapsed_before: float, step: int, save_every: str, max_time: str | None):
        self.started = self.last_save_time = time.monotonic()
        self.elapsed_before, self.last_save_step = elapsed_before, step
        self.saved_once = False
        self.save_amount, self.save_unit = parse_interval(save_every)
        self.max_seconds = parse_interval(max_time)[0] if max_time else math.inf

    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    def save_due(self, next_step: int) -> bool:
        if self.save_unit == "steps":
            return next_step - self.last_save_step >= self.save_amount
        return time.monotonic() - self.last_save_time >= self.save_amount

    def time_up(self) -> bool:
        return self.elapsed() >= self.max_seconds

    def saved(self, step: int) -> None:
        self.last_save_time, self.last_save_step = time.monotonic(), step
        self.saved_once = True


def _train(options: TrainOptions, processes: Processes, display: Display) -> Path | None:
    """The loop of §5: a step at a time until max_steps, --max-time or a signal; a metrics row
    every --log-every steps; a checkpoint (after validation) when one is due and at the end."""
    run, position = _start(options, processes, display)
    step = position.step
    clock = _Clock(position.elapsed_seconds, step, run.recipe.save_every, options.max_time)
    window, last_checkpoint = _Window(), None
    display.start(run.recipe.max_steps, step)
    with StopRequest() as stop, contextlib.ExitStack() as cleanup:
        cleanup.callback(display.stop)
        while step < run.recipe.max_steps:
            # Rank 0's clock decides time-based saving and stopping for every rank (a decision
            # taken apart would leave one rank waiting in a collective for the others).
            loss, nll, tgt, src, lr, votes = _step(run, step, lambda next_step=step + 1: [
                float(stop.requested), float(clock.save_due(next_step) and processes.is_main),
                float(clock.time_up() and processes.is_main)])
            stop_votes, save_votes, time_votes = votes
            step += 1
            window.add(loss, nll, tgt, src)
            display.step(step, loss / tgt, lr,
                         window.tgt / max(time.monotonic() - window.start, 1e-9))
            if step % options.log_every == 0 or save_votes:
                row = window.row(step, lr, run.stream.position[0], clock.elapsed())
                checkpoint = _record(run, step, row, save=bool(save_votes), clock=clock)
                last_checkpoint = checkpoint or last_checkpoint
                window = _Window()
            if stop_votes or time_votes:
                stop_reason = ("stopped by a signal" if stop_votes
                               else f"reached --max-time {options.max_time}")
                break
        else:
            stop_reason = f"reached {run.recipe.max_steps} steps"
    if clock.last_save_step != step or not clock.saved_once:  # the same on every rank
        last_checkpoint = _record(run, step, {"step": step, "elapsed_s": clock.elapsed()},
                                  save=True, clock=clock)
    _log(processes, f"{stop_reason}; last checkpoint {last_checkpoint}")
    return last_checkpoint if processes.is_main else None


def _start(options: TrainOptions, processes: Processes,
           display: Display) -> tuple[_Run, _Position]:
    """Data, model, optimizer and batches of a new or resumed run, the same on every rank."""
    recipe = options.recipe()
    preset = get_preset(options.preset)
    run_dir = Path(options.output)
    resume_step = _resume_step(options, processes)
    dtype = resolve_dtype(options.dtype, processes.device)

    def prepare():
        data = ParallelData(options.data)
        valid = ParallelData(options.valid) if options.valid else None
        if valid is not None:
            data.check_same_vocab(valid)
        config = preset.model_config(len(data.src_vocab),
                                     None if data.shared_vocab else len(data.tgt_vocab),
                                     dropout=recipe.dropout)
        started = _start_or_resume(options, processes, config, data, dtype, resume_step)
        return data, valid, config, started

    data, valid, config, (model, optimizer, scaler, position) = _same_on_every_rank(
        processes, prepare, lambda prepared: _rank_facts(options, *prepared[:2],
                                                          prepared[3][3]))
    validator = None
    if valid is not None and options.valid_metric != "loss" and processes.is_main:
        validator = Validator.build(options.valid_metric, valid,
                                    str(options.valid_ref) if options.valid_ref else None,
                                    options.valid_beam)
    if processes.is_main:
        warn_if_bf16_is_emulated(dtype, processes.device, "train")
    plan = batch_plan(recipe.batch_tokens, options.max_tokens, processes.world_size)
    trained = model
    if processes.distributed:
        from torch.nn.parallel import DistributedDataParallel

        # Gradients live in DDP's communication buckets (no copy in and out of them each step).
        trained = DistributedDataParallel(
            model, device_ids=[processes.device.index] if processes.device.type == "cuda"
            else None, gradient_as_bucket_view=True)
    if processes.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            checkpoints.truncate_metrics(run_dir, position.step)
        _log(processes, f"{preset.name}: {sum(p.numel() for p in model.parameters()):,} "
             f"parameters, {len(data)} training pairs, {dtype} on {processes.device}")
        _log(processes, plan.describe())
    stream = _resumed_stream(data, plan, options.seed, position, processes)
    return _Run(options, recipe, processes, display, run_dir, data, valid, validator, dtype,
                plan, config, model, trained, optimizer, scaler, stream,
                position.schedule_offset), position


def _resumed_stream(data: ParallelData, plan: BatchPlan, seed: int, position: _Position,
                    processes: Processes) -> MicroBatchStream:
    """The micro-batches from where the run stopped. Under another plan than the checkpoint's
    (another process count, --max-tokens or --batch-tokens) the run goes on from the same
    place in the data with the new plan's global batch, and says so."""
    saved = BatchPlan(**position.batch_plan) if position.batch_plan else None
    stream = MicroBatchStream(data, saved.max_tokens if saved else plan.max_tokens, seed,
                              position.epoch, position.offset, position.earlier_budgets)
    if stream.offset > stream.epoch_length:  # only with another data file than the run's
        _log(processes, f"resume: the data position (epoch {stream.epoch}, batch "
             f"{stream.offset}) lies past the end of that epoch in {data.path} "
             f"({stream.epoch_length} batches): going on with epoch {stream.epoch + 1}")
        stream.next_epoch()
    if saved is not None and saved != plan:
        if saved.max_tokens == plan.max_tokens:
            how = "micro-batches cut as before"
        else:
            how = (f"the rest of epoch {stream.epoch} (from its micro-batch {stream.offset}) cut "
                   f"into {plan.max_tokens}-token micro-batches from the pairs not yet used")
        _log(processes, f"resume: batch plan {saved.brief()} -> {plan.brief()} "
             f"({saved.step_tokens} -> {plan.step_tokens} tokens/side/step); {how}")
        stream.change_budget(plan.max_tokens)
    return stream


# What a rank's facts leave out of the options: paths, which may differ from node to node
# (the files' contents are compared instead).
PER_NODE_OPTIONS = {"data", "output", "valid", "valid_ref"}


def _rank_facts(options: TrainOptions, data: ParallelData, valid: ParallelData | None,
                position: _Position) -> dict:
    """What every rank must share with rank 0: the options, the data (by checksum) and the
    point it resumes from."""
    return {
        "options": {key: value for key, value in options.record().items()
                    if key not in PER_NODE_OPTIONS},
        "data file": _file_sha256(data.path),
        "validation file": _file_sha256(valid.path) if valid is not None else None,
        "resumed from": {"step": position.step, "epoch": position.epoch,
                         "offset": position.offset, "elapsed_s": position.elapsed_seconds},
    }


def _file_sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _same_on_every_rank(processes: Processes, prepare: Callable, facts: Callable):
    """`prepare()` on every rank, then each rank's `facts(prepared)` compared with rank 0's: a
    rank that failed or differs stops every rank with an error naming it (a rank that stopped
    alone would leave the others waiting for it until --dist-timeout)."""
    if not processes.distributed:
        return prepare()
    import torch.distributed as dist

    prepared, report = None, {"host": socket.gethostname()}
    try:
        prepared = prepare()
        report["facts"] = facts(prepared)
    except AttnError as error:
        report["error"] = str(error)
    reports: list = [None] * processes.world_size
    dist.all_gather_object(reports, report)
    problem = rank_disagreement(reports)
    if problem:
        raise AttnError(problem)
    return prepared


def rank_disagreement(reports: list[dict]) -> str | None:
    """The first rank that failed, or whose facts differ from rank 0's, and how (None: they all
    agree). `reports[r]`: rank r's {"host", and "facts" or "error"}."""
    for rank, report in enumerate(reports):
        if "error" in report:
            return f"rank {rank} (on {report['host']}): {report['error']}"
    reference = reports[0]["facts"]
    for rank, report in enumerate(reports[1:], start=1):
        for name, theirs in reference.items():
            mine = report["facts"].get(name)
            if mine == theirs:
                continue
            if isinstance(theirs, dict) and isinstance(mine, dict):
                key = next(key for key in sorted(set(theirs) | set(mine))
                           if theirs.get(key) != mine.get(key))
                what = f"{name}: {key} is {mine.get(key)!r} where rank 0 has {theirs.get(key)!r}"
            elif isinstance(theirs, str) or isinstance(mine, str):
                what = (f"its {name} differs from rank 0's (sha256 {str(mine)[:16]} against "
                        f"{str(theirs)[:16]})")
            else:
                what = f"{name}: {mine!r} where rank 0 has {theirs!r}"
            return (f"rank {rank} (on {report['host']}) does not match rank 0: {what}; every "
                    "process must run the same command on the same files")
    return None


def _step(run: _Run, step: int, votes: Callable[[], list[float]]):
    """One optimizer step (the `step + 1`-th): its micro-batches forward and backward, the
    learning rate of the schedule, Adam. `votes()`, taken once the gradients are in, are summed
    over the processes with the losses. Returns (loss sum, NLL sum, target tokens, source
    tokens, lr, summed votes)."""
    micro_batches = run.stream.take(run.plan.micro_batches_per_step)
    tgt_tokens = sum(int(run.data.tgt_lengths[b].sum()) + len(b) for b in micro_batches)
    src_tokens = sum(int(run.data.src_lengths[b].sum()) + len(b) for b in micro_batches)
    # Each rank's losses are scaled so that the gradients DDP averages add up to the gradient
    # of (global loss sum / global target tokens).
    loss_scale = run.processes.world_size / tgt_tokens
    sums = forward_backward(run.trained, run.data, micro_batches, loss_scale,
                            run.recipe.label_smoothing, run.processes, run.dtype, run.scaler,
                            seed=(run.options.seed, step))
    lr = inverse_sqrt_lr(step + 1 - run.schedule_offset, run.config.d_model,
                         run.recipe.warmup, run.recipe.lr_scale)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    votes_now = torch.tensor(votes(), dtype=torch.float64).to(run.processes.device)
    loss_sum, nll_sum, *summed = all_reduce_sum(torch.cat([sums, votes_now]), run.processes)
    if not math.isfinite(loss_sum):
        run.optimizer.zero_grad(set_to_none=True)
        good = checkpoints.list_checkpoints(run.run_dir, need_state=True)
        kept = f"the last good checkpoint is {good[-1][1]}" if good else \
            "no checkpoint was written yet"
        raise TrainingDiverged(f"the loss became {loss_sum} at step {step + 1}; {kept}. "
                               "Try a lower --lr-scale or a longer --warmup.")
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return loss_sum, nll_sum, tgt_tokens, src_tokens, lr, summed


def _record(run: _Run, step: int, row: dict, save: bool, clock: _Clock) -> Path | None:
    """A metrics row (with validation when saving), then the checkpoint when `save`. The row
    goes to disk first: a run killed between the two resumes from the previous checkpoint and
    rewrites this row, never loses it. Returns the checkpoint written (None: none)."""
    if save and run.valid is not None:
        row.update(validate(run))
    if len(row) > 2:  # more than the step and the time
        _write_metrics(run.run_dir, row, run.processes)
    checkpoint = None
    if save:
        checkpoint = _save(run.run_dir, step, run, row["elapsed_s"])
        clock.saved(step)
    if len(row) > 2:
        run.display.row(row)
    return checkpoint


def validate(run: _Run) -> dict:
    """The validation fields of a metrics row: loss and perplexity (every process), the
    metric's score (decoded on the main process), which metric, and the seconds it all took
    (apart from training time: the next row's tokens/s counts training steps only)."""
    started = time.monotonic()
    fields = evaluate(run.trained, run.valid, run.plan.max_tokens, run.recipe.label_smoothing,
                      run.processes, run.dtype)
    if run.validator is not None:
        try:
            with autocast(run.processes.device, run.dtype):
                fields[metric_key(run.validator.metric)] = run.validator.score(run.model)
        except (AttnError, RecursionError, RuntimeError, ValueError) as error:
            # A validation that fails must not end hours of training: said, and the run goes on.
            _log(run.processes, f"validation by {run.validator.metric} failed, the run goes "
                 f"on without that score: {type(error).__name__}: {error}")
    fields["valid_metric"] = run.options.valid_metric
    fields["valid_s"] = time.monotonic() - started
    return fields


class TrainingDiverged(AttnError):
    pass


class Display(Protocol):
    """What the run shows as it goes (train_report.TrainingDisplay), on the main process."""

    def start(self, total_steps: int, start_step: int) -> None: ...

    def step(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None: ...

    def row(self, row: dict) -> None: ...

    def stop(self) -> None: ...


class _Quiet:
    """The display of a run nobody watches (other ranks; library calls that pass none)."""

    def start(self, total_steps: int, start_step: int) -> None:
        pass

    def step(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        pass

    def row(self, row: dict) -> None:
        pass

    def stop(self) -> None:
        pass


def _save(run_dir: Path, step: int, run: _Run, elapsed: float) -> Path | None:
    """The model and its training state after `step`, then the old checkpoints pruned."""
    if not run.processes.is_main:
        return None
    epoch, offset = run.stream.position
    state = checkpoints.ResumeState(step=step, epoch=epoch, offset=offset,
                                    elapsed_seconds=elapsed, options=run.options.record(),
                                    adam={},
                                    scaler=run.scaler.state_dict() if run.scaler.is_enabled()
                                    else {}, schedule_offset=run.schedule_offset,
                                    batch_plan=run.plan.record(),
                                    earlier_budgets=run.stream.earlier_budgets)
    tgt_vocab = None if run.data.shared_vocab else run.data.tgt_vocab
    path = checkpoints.save_checkpoint(run_dir, step, run.model, run.optimizer, state,
                                       run.data.src_vocab, tgt_vocab,
                                       {"preset": run.options.preset})
    best = set()
    if run.options.keep_best and run.valid is not None:
        metric, scores = scored_steps(run_dir, run.options.valid_metric)
        saved = {step for step, _ in checkpoints.list_checkpoints(run_dir)}
        best = set(best_steps({step: score for step, score in scores.items() if step in saved},
                              metric, run.options.keep_best))
    checkpoints.prune_checkpoints(run_dir, run.options.keep, best)
    return path


def _write_metrics(run_dir: Path, row: dict, processes: Processes) -> None:
    if not processes.is_main:
        return
    with open(run_dir / METRICS_FILE, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()


def _check_resume(saved_config: ModelConfig, config: ModelConfig, saved_vocab: str,
                  data_vocab: str, saved_options: dict, options: TrainOptions,
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
    recorded = options.record()
    for key in sorted(set(recorded) | set(saved_options)):
        if key in ("resume", "schedule_offset"):
            continue
        before, after = saved_options.get(key), recorded.get(key)
        if before != after:
            note = "" if key in FREELY_CHANGED else " (changes the recipe)"
            _log(processes, f"resume: {key} {before} -> {after}{note}")
