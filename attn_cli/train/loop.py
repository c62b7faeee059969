"""Training, as in §5 of the paper: Adam (β1 0.9, β2 0.98, ε 1e-9), the inverse-square-root
schedule with linear warmup, label smoothing, dropout, batches of ~25000 source + 25000 target
tokens per step over all processes, and checkpoints every 10 minutes. The loop, in call order:
`train` starts the processes, `_start` the run (start.start: new, fine-tuning a model file, or
resumed), `_step` makes one optimizer step, `_record` writes a metrics row (validated at a save:
validation.Validation) and a checkpoint, `_out_of_patience` stops a run that no longer improves
(--patience).

Reproducibility is by construction, so that 1 process equals N processes and a resumed run equals
an uninterrupted one:
- the sequence of micro-batches is a function of (seed, epoch) and their token budget alone,
  whatever the world size; step s consumes the next `accumulation × world_size` micro-batches,
  rank r takes every world_size-th of them; the budget is the global batch shared out evenly,
  so the global batch is the same on any number of processes (batching.BatchPlan);
- each step's loss is normalised by the step's global target-token count, which every rank
  computes from the lengths without communicating;
- dropout is seeded from (seed, step, the micro-batch's place in the step), whichever process
  draws it, so no RNG state has to travel.
Where each of those lives: batching.py (the micro-batches), distributed.py (the processes and
what they agree on), start.py (where a run starts, and what a resumed run restores and may
change); guided.py holds --guided-alignment's reference alignments (not in the paper), built
from each micro-batch's pair indices, so that they follow the same rules.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch

from .. import checkpoints
from ..batching import Batch, BatchPlan, StepStream, batch_plan
from ..checkpoints import ResumePoint
from ..config import Recipe, TrainOptions, parse_interval
from ..devices import autocast, choose_cudnn_attention, warn_if_bf16_is_emulated
from ..errors import AttnError, TrainingDiverged, batch_must_fit
from .compiled import compilations, compile_layers, compile_wanted
from .distributed import (
    EveryRankStops,
    Processes,
    all_reduce_sum,
    collective_failed,
    from_main,
    start_processes,
    stop_processes,
    wrap_for_ddp,
)
from .guided import alignment_targets
from .guided import check_options as check_guidance_options
from .start import (
    Start,
    announce,
    check_data_options,
    lock_run_directory,
    resumed_stream,
    start,
)
from .validation import Validation


def train(options: TrainOptions, display: Display | None = None) -> Path | None:
    """Run (or resume) training; returns the last checkpoint written (None on other ranks).
    `display` shows progress and metrics rows on the main process."""
    check_guidance_options(options)
    check_data_options(options)
    processes = start_processes(options.device, options.dist_timeout_minutes,
                                options.start_timeout_minutes)
    lock, finished = None, False
    try:
        lock = lock_run_directory(Path(options.output), processes)
        last = _train(options, processes,
                      display if display is not None and processes.is_main else _Quiet())
        finished = True
        return last
    except EveryRankStops:
        finished = True  # every rank stops here: each waits for the others, then tears down
        raise
    except RuntimeError as error:
        if not (processes.distributed and collective_failed(error)):
            raise
        said = " ".join(str(error).split())
        raise AttnError(f"rank {processes.rank}: waiting for the other processes failed: "
                        f"{said[:300]} (another process stopped, or took longer than "
                        f"--dist-timeout {options.dist_timeout_minutes:g} min: it must exceed "
                        "a validation and a save)") from None
    finally:
        stop_processes(processes, finished)
        if lock is not None:
            lock.release()


def _train(options: TrainOptions, processes: Processes, display: Display) -> Path | None:
    """The loop of §5: a step at a time until max_steps, --max-time, a signal or --patience; a
    metrics row every --log-every steps; a checkpoint (after validation) when one is due and at
    the end."""
    run = _start(options, processes, display)
    step = run.point.step
    clock = _Clock(run.point.elapsed_seconds, step, run.recipe.save_every, options.max_time)
    window, last_checkpoint = _Window(), None
    corpora = run.data.names if len(run.data.parts) > 1 else None
    display.start(run.recipe.max_steps, step)
    with StopRequest() as stop, contextlib.ExitStack() as cleanup:
        cleanup.callback(display.stop)
        cleanup.callback(run.steps.close)

        def votes() -> Votes:  # taken at the end of the step that follows `step`
            # Rank 0's clock decides time-based saving and stopping for every rank (a decision
            # taken apart would leave one rank waiting in a collective for the others).
            return Votes(stop=float(stop.requested),
                         save=float(clock.save_due(step + 1) and processes.is_main),
                         time_up=float(clock.time_up() and processes.is_main))

        # A resumed run that had run out of patience stops again where it stopped.
        stop_reason = _out_of_patience(run, step, clock) if step else None
        while stop_reason is None and step < run.recipe.max_steps:
            result = _step(run, step, votes)
            step += 1
            window.add(result)
            display.step(step, result.loss_sum / result.tgt_tokens, result.lr,
                         window.tgt / max(time.monotonic() - window.start, 1e-9))
            if step % options.log_every == 0 or result.votes.save:
                row = window.row(step, result.lr, run.steps.position[0], clock.elapsed(),
                                 corpora)
                checkpoint = _record(run, step, row, save=bool(result.votes.save), clock=clock)
                last_checkpoint = checkpoint or last_checkpoint
                window = _Window()
            if result.votes.stop or result.votes.time_up:
                stop_reason = (STOPPED_BY_SIGNAL if result.votes.stop
                               else f"reached --max-time {options.max_time}")
            elif result.votes.save:  # validated, when the run has validation data
                stop_reason = _out_of_patience(run, step, clock)
        stop_reason = stop_reason or f"reached {run.recipe.max_steps} steps"
    if clock.last_save_step != step or not clock.saved_once:  # the same on every rank
        # Stopped by a signal, the save comes without validation: torchrun (and Slurm) kill
        # 30 s after SIGTERM, and a validation may take longer; the next save validates.
        signalled = stop_reason == STOPPED_BY_SIGNAL
        if signalled and run.validation is not None:
            processes.log("stopped by a signal: saving without validating (torchrun and "
                          "Slurm kill 30 s after SIGTERM)")
        last_checkpoint = _record(run, step, {"step": step, "elapsed_s": clock.elapsed()},
                                  save=True, clock=clock, validate=not signalled)
    if run.graphs_before is not None:
        processes.log(f"{compilations() - run.graphs_before} graphs compiled in this run "
                      "(--compile)")
    processes.log(f"{stop_reason}; last checkpoint {last_checkpoint}")
    return last_checkpoint if processes.is_main else None


STOPPED_BY_SIGNAL = "stopped by a signal"


# ------------------------------------------------------------------------------- the start


@dataclass
class _Run(Start):
    """One training run: what it started with (start.Start: the data, the model, Adam, the
    point it goes on from), and what it works with from there; fixed once it has started."""

    options: TrainOptions
    recipe: Recipe
    processes: Processes
    display: Display
    plan: BatchPlan
    ddp_model: torch.nn.Module  # the model, wrapped by DDP when distributed
    steps: StepStream
    validation: Validation | None  # at every save, when the run has validation data
    votes: torch.Tensor  # (3,) float64 on the host, page-locked on a GPU: a step's votes
    # the graphs compiled in this process before the run, if its layers are compiled (--compile;
    # train/compiled.py), else None
    graphs_before: int | None

    @property
    def run_dir(self) -> Path:
        return Path(self.options.output)


def _start(options: TrainOptions, processes: Processes, display: Display) -> _Run:
    """Data, model, optimizer and batches of a new or resumed run, the same on every rank."""
    if choose_cudnn_attention(options.cudnn_attention, processes.device):
        processes.log("attention never on cuDNN's kernels (--cudnn-attention off)")
    recipe = options.recipe()
    begun = start(options, processes)
    plan = batch_plan(recipe.batch_tokens, options.max_tokens, processes.world_size)
    validation = None if begun.valid is None else Validation.build(
        begun.valid, options.valid_metric, options.valid_ref, options.valid_beam,
        plan.max_tokens, recipe.label_smoothing)
    if processes.is_main:
        warn_if_bf16_is_emulated(begun.dtype, processes.device, "train")
    if processes.is_main:
        announce(begun, options, plan, processes)
    # before DDP wraps the model: the compiler's trial pass must not reach DDP's gradient hooks
    graphs_before = None
    if compile_wanted(options.compile, processes.device, plan.max_tokens):
        graphs_before = compilations()  # (dynamo is imported only here: it takes a second)
        if not compile_layers(begun.model, begun.dtype, log=processes.log,
                              agree=lambda failed: all_reduce_sum([float(failed)],
                                                                  processes)[0] > 0):
            graphs_before = None
    ddp_model = wrap_for_ddp(begun.model, processes, options.grad_sync)
    stream = resumed_stream(begun.data, begun.mix, plan, options.seed, begun.point, processes)
    on_gpu = processes.device.type == "cuda"
    steps = StepStream(stream, plan, processes.rank, ahead=on_gpu, pinned=on_gpu)
    votes = torch.zeros(3, dtype=torch.float64)
    return _Run(**vars(begun), options=options, recipe=recipe, processes=processes,
                display=display, plan=plan, ddp_model=ddp_model, steps=steps,
                validation=validation, votes=votes.pin_memory() if on_gpu else votes,
                graphs_before=graphs_before)


# --------------------------------------------------------------------------------- a step


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """§5.3: lrate = d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5), times `scale`."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


@dataclass(frozen=True)
class Votes:
    """What every process must decide alike after a step, each process's 1 (yes) or 0, summed
    over the processes: any yes decides. Saving and stopping on time are rank 0's votes alone
    (its clock is the job's)."""

    stop: float = 0.0  # a signal asked to stop
    save: float = 0.0  # a checkpoint is due
    time_up: float = 0.0  # --max-time is reached


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, summed over the processes."""

    loss_sum: float  # label-smoothed
    nll_sum: float
    tgt_tokens: int
    src_tokens: int
    lr: float
    votes: Votes
    # guided alignment: the alignment cross-entropy summed over the aligned target pieces, and
    # their count (None: not guided)
    alignment_sum: float | None = None
    aligned: int | None = None
    # several data files: the pairs and target tokens (EOS included) drawn from each
    corpus_pairs: np.ndarray | None = None
    corpus_tgt_tokens: np.ndarray | None = None


def _step(run: _Run, step: int, votes: Callable[[], Votes]) -> StepResult:
    """One optimizer step (the `step + 1`-th): its micro-batches forward and backward, the
    learning rate of the schedule, Adam. `votes()`, taken once the gradients are in, are summed
    over the processes with the losses: one read from the device per step."""
    taken = run.steps.next()
    tgt_tokens = sum(int(run.data.tgt_lengths[b].sum()) + len(b) for b in taken.micro_batches)
    src_tokens = sum(int(run.data.src_lengths[b].sum()) + len(b) for b in taken.micro_batches)
    # Each rank's losses are scaled so that the gradients DDP averages add up to the gradient
    # of (global loss sum / global target tokens).
    loss_scale = run.processes.world_size / tgt_tokens
    guided = run.options.guided_alignment
    alignments = [alignment_targets(run.data, taken.micro_batches[place],
                                    batch.tgt_input.shape[1], batch.src_tokens.shape[1])
                  for place, batch in taken.mine] if guided else None
    with _batch_must_fit(run.options, run.recipe):
        sums = forward_backward(run.ddp_model, taken.mine, loss_scale,
                                run.recipe.label_smoothing, run.processes, run.dtype, run.scaler,
                                seed=(run.options.seed, step), alignments=alignments,
                                alignment_lambda=run.options.alignment_lambda)
    lr = inverse_sqrt_lr(step + 1 - run.point.schedule_offset, run.model.config.d_model,
                         run.recipe.warmup, run.recipe.lr_scale)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    asked = votes()
    # Written in place and copied without waiting: the last step's copy from this buffer ended
    # before its sums were read.
    run.votes[0], run.votes[1], run.votes[2] = asked.stop, asked.save, asked.time_up
    votes_now = run.votes.to(run.processes.device, non_blocking=True)
    loss_sum, nll_sum, *sums_then_votes = all_reduce_sum(torch.cat([sums, votes_now]),
                                                         run.processes)
    alignment_sum, aligned = sums_then_votes[:2] if guided else (None, None)
    summed = sums_then_votes[-3:]
    # Zeroed in place under DDP: gradients set to None would leave its buckets (a fresh
    # allocation and a copy into them at every step); alone, None saves the zeroing.
    keep_buckets = run.processes.distributed
    if not math.isfinite(loss_sum + (alignment_sum or 0.0)):
        run.optimizer.zero_grad(set_to_none=not keep_buckets)
        good = checkpoints.list_checkpoints(run.run_dir, need_state=True)
        kept = f"the last good checkpoint is {good[-1][1]}" if good else \
            "no checkpoint was written yet"
        what, loss = ("loss", loss_sum) if not math.isfinite(loss_sum) else \
            ("alignment loss", alignment_sum)
        raise TrainingDiverged(f"the {what} became {loss} at step {step + 1}; {kept}. "
                               "Try a lower --lr-scale or a longer --warmup.")
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=not keep_buckets)
    return StepResult(loss_sum, nll_sum, tgt_tokens, src_tokens, lr, Votes(*summed),
                      alignment_sum, None if aligned is None else round(aligned),
                      *_per_corpus(run, taken.micro_batches))


def _per_corpus(run: _Run, micro_batches: list[np.ndarray]) -> tuple:
    """(pairs, target tokens) a step drew from each data file, from every process's
    micro-batches (each process has them all: nothing to communicate); (None, None) with one
    data file."""
    if len(run.data.parts) == 1:
        return None, None
    pairs = np.concatenate(micro_batches)
    corpus = run.mix.corpus_of(pairs)
    count = len(run.data.parts)
    return (np.bincount(corpus, minlength=count),
            np.bincount(corpus, weights=run.data.tgt_lengths[pairs] + 1,
                        minlength=count).astype(np.int64))


def dropout_seed(seed: int, step: int, micro_batch: int) -> int:
    """Dropout masks depend on the run's seed, the step and the micro-batch's place in the step:
    the same whichever process draws them, and again the same after a resume."""
    return (seed * 1_000_003 + step * 10_007 + micro_batch) % (2 ** 63)


def forward_backward(ddp_model: torch.nn.Module, batches: list[tuple[int, Batch]],
                     loss_scale: float, epsilon: float, processes: Processes, dtype: str,
                     scaler: torch.amp.GradScaler, seed: tuple[int, int],
                     alignments: list[tuple[np.ndarray, np.ndarray, int]] | None = None,
                     alignment_lambda: float = 0.0) -> torch.Tensor:
    """Accumulate the gradients of this process's share of one step's micro-batches
    (batching.process_share: each with its place in the step), each loss multiplied by
    `loss_scale`. DDP synchronises the gradients on the last backward only. Returns this
    process's (loss sum, NLL sum) as a float64 tensor on the device: summed there, read once
    per step (a read per micro-batch would make the host wait for the device each time).

    Guided alignment: `alignments` holds each micro-batch's reference (guided.alignment_targets),
    the loss is then loss + alignment_lambda × the alignment cross-entropy, and the sums go on
    with (alignment cross-entropy sum, target pieces aligned)."""
    sums = torch.zeros(2 if alignments is None else 4, dtype=torch.float64,
                       device=processes.device)
    for count, (place, host_batch) in enumerate(batches, start=1):
        torch.manual_seed(dropout_seed(*seed, place))
        batch = host_batch.to(processes.device)
        last = count == len(batches)
        sync = contextlib.nullcontext() if last or not processes.distributed else \
            ddp_model.no_sync()
        guidance = {}
        if alignments is not None:  # the reference, and its count of aligned target pieces
            positions, weights, aligned = alignments[count - 1]
            guidance["alignment"] = (
                torch.from_numpy(positions).to(processes.device, non_blocking=True),
                torch.from_numpy(weights).to(processes.device, non_blocking=True))
        with sync:
            with autocast(processes.device, dtype):
                loss, nll, *alignment = ddp_model(batch.src_tokens, batch.tgt_input,
                                                  output_positions=batch.target_positions,
                                                  targets=batch.targets,
                                                  label_smoothing=epsilon, **guidance)
            objective = loss + alignment_lambda * alignment[0] if alignment else loss
            scaler.scale(objective * loss_scale).backward()
        if alignment:
            sums[:3] += torch.stack([loss.detach(), nll, alignment[0].detach()]).double()
            sums[3] += aligned  # a host number: no copy to the device to wait for
        else:
            sums += torch.stack([loss.detach(), nll]).double()
    return sums


def _batch_must_fit(options: TrainOptions, recipe: Recipe) -> contextlib.AbstractContextManager:
    """The device out of memory in a step's forward and backward passes: one line naming the
    option that sized them, with its value, and the one that makes them fit."""
    if options.max_tokens:
        return batch_must_fit(f"forward passes of up to {options.max_tokens} tokens",
                              f"lower --max-tokens ({options.max_tokens}; gradient accumulation "
                              "keeps the batch --batch-tokens)")
    return batch_must_fit("one forward pass per step of the whole --batch-tokens "
                          f"({recipe.batch_tokens})",
                          "add --max-tokens (gradient accumulation keeps the batch)")


# --------------------------------------------------------------------- metrics and saving


def _record(run: _Run, step: int, row: dict, save: bool, clock: _Clock,
            validate: bool = True) -> Path | None:
    """A metrics row (with validation when saving and `validate`), then the checkpoint when
    `save`. The row goes to disk first: a run killed between the two resumes from the previous
    checkpoint and rewrites this row, never loses it. Returns the checkpoint written (None:
    none)."""
    if save and validate and run.validation is not None:
        row.update(run.validation.row(run.model, run.processes, run.dtype))
    if len(row) > 2 and run.processes.is_main:  # more than the step and the time
        checkpoints.append_metrics(run.run_dir, row)
    checkpoint = None
    if save:
        checkpoint = _save(run.run_dir, step, run, row["elapsed_s"])
        clock.saved(step)
    if len(row) > 2:
        run.display.row(row)
    return checkpoint


def _save(run_dir: Path, step: int, run: _Run, elapsed: float) -> Path | None:
    """The model and its training state after `step`, then the old checkpoints pruned."""
    if not run.processes.is_main:
        return None
    epoch, offset = run.steps.position
    point = ResumePoint(step=step, epoch=epoch, offset=offset, elapsed_seconds=elapsed,
                        schedule_offset=run.point.schedule_offset, batch_plan=run.plan.record(),
                        earlier_budgets=run.steps.earlier_budgets)
    state = checkpoints.ResumeState(point, options=run.options.record(), adam={},
                                    scaler=run.scaler.state_dict() if run.scaler.is_enabled()
                                    else {})
    tgt_vocab = None if run.data.shared_vocab else run.data.tgt_vocab
    metadata = {"preset": run.options.preset, **run.provenance}
    described = run.options.architecture_name()
    if described != run.options.preset:  # the preset's network changed: say how
        metadata["architecture"] = described
    try:
        path = checkpoints.save_checkpoint(run_dir, step, run.model, run.optimizer, state,
                                           run.data.src_vocab, tgt_vocab, metadata)
    except AttnError as error:  # a full disk: say what the run can go on from
        good = checkpoints.list_checkpoints(run_dir, need_state=True)
        raise AttnError(f"{error}; the last checkpoint safe to resume from is {good[-1][1]}"
                        if good else f"{error}; no checkpoint was written yet") from None
    checkpoints.prune_after_save(run_dir, run.options.keep, run.options.keep_state,
                                 run.options.keep_best if run.validation is not None else 0,
                                 run.options.valid_metric)
    return path


def _out_of_patience(run: _Run, step: int, clock: _Clock) -> str | None:
    """Why the run stops early (None: it goes on): --patience validations in a row have not
    beaten the best by --valid-metric. Counted from the validations in metrics.jsonl at the
    save cadence's steps (not those of a save where a run was stopped off it), so that a
    resumed run counts as the uninterrupted one did; rank 0 reads them and decides for every
    rank."""
    if not run.options.patience or run.validation is None:
        return None
    reason = None
    if run.processes.is_main:
        metric, scores = checkpoints.scored_steps(run.run_dir, run.options.valid_metric)
        scores = {at: score for at, score in scores.items() if clock.on_cadence(at)}
        if scores:
            best, since = checkpoints.validations_since_best(scores, metric)
            if since >= run.options.patience:
                reason = (f"stopped early at step {step}: {since} validations without beating "
                          f"step {best}'s {metric} {scores[best]:.4g} "
                          f"(--patience {run.options.patience})")
    return from_main(reason, run.processes)


# ---------------------------------------------------------------------- the run's companions


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


@dataclass
class _Window:
    """Losses and tokens summed since the last metrics row."""

    loss: float = 0.0
    nll: float = 0.0
    tgt: int = 0
    src: int = 0
    start: float = field(default_factory=time.monotonic)
    alignment: float | None = None  # guided alignment: its cross-entropy sum
    aligned: int = 0  # and the target pieces it was summed over
    corpus_pairs: np.ndarray | None = None  # several data files: drawn from each
    corpus_tgt_tokens: np.ndarray | None = None

    def add(self, result: StepResult) -> None:
        self.loss, self.nll = self.loss + result.loss_sum, self.nll + result.nll_sum
        self.tgt, self.src = self.tgt + result.tgt_tokens, self.src + result.src_tokens
        if result.alignment_sum is not None:
            self.alignment = (self.alignment or 0.0) + result.alignment_sum
            self.aligned += result.aligned
        if result.corpus_pairs is not None:
            self.corpus_pairs = result.corpus_pairs + (0 if self.corpus_pairs is None
                                                       else self.corpus_pairs)
            self.corpus_tgt_tokens = result.corpus_tgt_tokens + (
                0 if self.corpus_tgt_tokens is None else self.corpus_tgt_tokens)

    def row(self, step: int, lr: float, epoch: int, elapsed: float,
            corpora: list[str] | None = None) -> dict:
        """The metrics row of the window; with several data files (`corpora`: their names,
        Corpora.names), the pairs and target tokens drawn from each, as `pairs/NAME` and
        `tgt_tokens/NAME` (flat numbers, grouped by name's prefix)."""
        seconds = max(time.monotonic() - self.start, 1e-9)
        row = {"step": step, "loss": self.loss / self.tgt, "nll": self.nll / self.tgt, "lr": lr,
               "tokens_per_s": self.tgt / seconds, "src_tokens_per_s": self.src / seconds,
               "epoch": epoch, "elapsed_s": elapsed}
        if self.alignment is not None:  # per aligned target piece: 0 is the reference itself
            row["alignment_loss"] = self.alignment / max(self.aligned, 1)
        if corpora is not None and self.corpus_pairs is not None:
            row.update({f"pairs/{name}": int(count)
                        for name, count in zip(corpora, self.corpus_pairs)})
            row.update({f"tgt_tokens/{name}": int(count)
                        for name, count in zip(corpora, self.corpus_tgt_tokens)})
        return row


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
        if self.save_unit == "steps":  # on the multiples, whatever saves came between
            return self.on_cadence(next_step)
        return time.monotonic() - self.last_save_time >= self.save_amount

    def on_cadence(self, step: int) -> bool:
        """A step-counted cadence saves (and validates) at the multiples of --save-every, so
        that a run stopped off them (a signal, --max-time, --max-steps) and resumed saves where
        the uninterrupted run does. A timed cadence: every step may be one."""
        return self.save_unit != "steps" or step % self.save_amount == 0

    def time_up(self) -> bool:
        return self.elapsed() >= self.max_seconds

    def saved(self, step: int) -> None:
        self.last_save_time, self.last_save_step = time.monotonic(), step
        self.saved_once = True


class Display(Protocol):
    """What the run shows as it goes (report.TrainingDisplay), on the main process."""

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
