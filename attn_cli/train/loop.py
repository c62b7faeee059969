"""Training, as in §5 of the paper: Adam (β1 0.9, β2 0.98, ε 1e-9), the inverse-square-root
schedule with linear warmup, label smoothing, dropout, batches of ~25000 source + 25000 target
tokens per step over all processes, and checkpoints every 10 minutes. The loop, in call order:
`train` starts the processes, `_start` the run (new, fine-tuning a model file, or resumed),
`_step` makes one optimizer step, `_record` writes a metrics row (validated at a save) and a
checkpoint, `_out_of_patience` stops a run that no longer improves (--patience).

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
what they agree on), resume.py (what a resumed run restores and may change).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from .. import checkpoints
from ..batching import Batch, BatchPlan, StepStream, batch_plan, collate, token_batches
from ..checkpoints import ResumePoint, metric_key
from ..config import Architecture, ModelConfig, Recipe, TrainOptions, get_preset, parse_interval
from ..data import ParallelData
from ..devices import autocast, resolve_dtype, warn_if_bf16_is_emulated
from ..errors import AttnError, TrainingDiverged
from ..files import file_sha256
from ..model import Transformer
from ..modelfile import LoadedModel, load_model, read_model_header, unwrap
from . import resume
from .distributed import (
    Processes,
    all_reduce_sum,
    collective_failed,
    from_main,
    gather_to_main,
    gradient_sync_dtype,
    same_on_every_rank,
    start_processes,
    stop_processes,
)
from .validation import Validator


def train(options: TrainOptions, display: Display | None = None) -> Path | None:
    """Run (or resume) training; returns the last checkpoint written (None on other ranks).
    `display` shows progress and metrics rows on the main process."""
    processes = start_processes(options.device, options.dist_timeout_minutes)
    lock, finished = None, False
    try:
        lock = _lock_run_directory(Path(options.output), processes)
        last = _train(options, processes,
                      display if display is not None and processes.is_main else _Quiet())
        finished = True
        return last
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


def _lock_run_directory(run_dir: Path, processes: Processes) -> checkpoints.RunLock | None:
    """The main process locks the run directory (checkpoints.RunLock); where another training
    holds it, every process stops with the main one's error line."""
    lock, refused = None, None
    if processes.is_main:
        try:
            lock = checkpoints.RunLock(run_dir)
        except AttnError as error:
            refused = str(error)
    refused = from_main(refused, processes)
    if refused:
        raise AttnError(refused)
    return lock


def _train(options: TrainOptions, processes: Processes, display: Display) -> Path | None:
    """The loop of §5: a step at a time until max_steps, --max-time, a signal or --patience; a
    metrics row every --log-every steps; a checkpoint (after validation) when one is due and at
    the end."""
    run, point = _start(options, processes, display)
    step = point.step
    clock = _Clock(point.elapsed_seconds, step, run.recipe.save_every, options.max_time)
    window, last_checkpoint = _Window(), None
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
                row = window.row(step, result.lr, run.steps.position[0], clock.elapsed())
                checkpoint = _record(run, step, row, save=bool(result.votes.save), clock=clock)
                last_checkpoint = checkpoint or last_checkpoint
                window = _Window()
            if result.votes.stop or result.votes.time_up:
                stop_reason = ("stopped by a signal" if result.votes.stop
                               else f"reached --max-time {options.max_time}")
            elif result.votes.save:  # validated, when the run has validation data
                stop_reason = _out_of_patience(run, step, clock)
        stop_reason = stop_reason or f"reached {run.recipe.max_steps} steps"
    if clock.last_save_step != step or not clock.saved_once:  # the same on every rank
        last_checkpoint = _record(run, step, {"step": step, "elapsed_s": clock.elapsed()},
                                  save=True, clock=clock)
    processes.log(f"{stop_reason}; last checkpoint {last_checkpoint}")
    return last_checkpoint if processes.is_main else None


# ------------------------------------------------------------------------------- the start


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
    validator: Validator | None  # decodes the validation set (a share per process), scores it
    dtype: str
    plan: BatchPlan
    config: ModelConfig
    model: Transformer
    trained: torch.nn.Module  # the model, wrapped by DDP when distributed
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    steps: StepStream
    schedule_offset: int  # the step the warmup counts from (--reset-schedule)
    votes: torch.Tensor  # (3,) float64 on the host, page-locked on a GPU: a step's votes
    provenance: dict[str, str]  # what every checkpoint records besides the preset (--init)


@dataclass
class _Prepared:
    """What every process reads or builds for itself before they compare notes."""

    data: ParallelData
    valid: ParallelData | None
    config: ModelConfig
    model: Transformer
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    point: ResumePoint
    provenance: dict[str, str]


def _start(options: TrainOptions, processes: Processes,
           display: Display) -> tuple[_Run, ResumePoint]:
    """Data, model, optimizer and batches of a new or resumed run, the same on every rank."""
    recipe = options.recipe()
    preset = get_preset(options.preset)
    run_dir = Path(options.output)
    resume_step = resume.resume_step(options, processes)
    dtype = resolve_dtype(options.dtype, processes.device)

    def prepare() -> _Prepared:
        data = ParallelData(options.data)
        valid = ParallelData(options.valid) if options.valid else None
        if valid is not None:
            data.check_same_vocab(valid)
        model, optimizer, scaler, point, provenance = _model_and_optimizer(
            options, processes, recipe, data, dtype, resume_step)
        return _Prepared(data, valid, model.config, model, optimizer, scaler, point,
                         provenance)

    prepared = same_on_every_rank(processes, prepare, lambda prepared: resume.rank_facts(
        options, prepared.data, prepared.valid, prepared.point,
        prepared.provenance.get("init_sha256")))
    model, point = prepared.model, prepared.point
    validator = None  # on every process: each decodes its share of the validation set
    if prepared.valid is not None and options.valid_metric != "loss":
        validator = Validator.build(options.valid_metric, prepared.valid,
                                    str(options.valid_ref) if options.valid_ref else None,
                                    options.valid_beam)
    if processes.is_main:
        warn_if_bf16_is_emulated(dtype, processes.device, "train")
    plan = batch_plan(recipe.batch_tokens, options.max_tokens, processes.world_size)
    trained = model
    if processes.distributed:
        from torch.nn.parallel import DistributedDataParallel

        # Gradients live in DDP's communication buckets (no copy in and out of them each step;
        # `_step` zeroes them in place, which keeps them there). The one buffer, the sinusoid
        # table, is a constant: not sent again before every forward pass.
        constant_buffers = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                            inspect.signature(DistributedDataParallel).parameters
                            else {"broadcast_buffers": False})  # torch < 2.13's name
        trained = DistributedDataParallel(
            model, device_ids=[processes.device.index] if processes.device.type == "cuda"
            else None, gradient_as_bucket_view=True, **constant_buffers)
        if gradient_sync_dtype(options.grad_sync, processes) == "bf16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            trained.register_comm_hook(None, default_hooks.bf16_compress_hook)
            processes.log("gradients all-reduced in bf16 (--grad-sync)")
    if processes.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            torn = checkpoints.truncate_metrics(run_dir, point.step)
            if torn:
                processes.log(f"resume: {torn}")
        what = (preset.name if "init" not in prepared.provenance else
                f"fine-tuning {prepared.provenance['init']} with {preset.name}'s recipe")
        processes.log(f"{what}: {sum(p.numel() for p in model.parameters()):,} "
                      f"parameters, {len(prepared.data)} training pairs, {dtype} on "
                      f"{processes.device}")
        processes.log(plan.describe())
    stream = resume.resumed_stream(prepared.data, plan, options.seed, point, processes)
    on_gpu = processes.device.type == "cuda"
    steps = StepStream(stream, plan, processes.rank, ahead=on_gpu, pinned=on_gpu)
    votes = torch.zeros(3, dtype=torch.float64)
    return _Run(options, recipe, processes, display, run_dir, prepared.data, prepared.valid,
                validator, dtype, plan, prepared.config, model, trained, prepared.optimizer,
                prepared.scaler, steps, point.schedule_offset,
                votes.pin_memory() if on_gpu else votes, prepared.provenance), point


def _model_and_optimizer(options: TrainOptions, processes: Processes, recipe: Recipe,
                         data: ParallelData, dtype: str, step: int | None):
    """A new model (the preset's, or --init's model file) and optimizer from step 0, or
    checkpoint `step`'s with Adam's moments, the data position and the schedule as they were:
    (model, optimizer, scaler, resume point, provenance)."""
    torch.manual_seed(options.seed)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == "fp16")
    if step is not None:
        loaded, state = resume.load(options, processes, _preset_config(options, recipe, data),
                                    data, step)
        model = loaded.model.train()
        optimizer = adam(model)
        point = resume.restore(state, model, optimizer, scaler, options, dtype, processes)
        # the model file it was seeded from, as its checkpoint recorded it (--init may have
        # moved since; it is not read again)
        return model, optimizer, scaler, point, checkpoints.init_provenance(loaded)
    if options.init is not None:
        model, provenance = _init_model(options.init, recipe, data, processes.device)
    else:
        model = Transformer(_preset_config(options, recipe, data)).to(processes.device)
        provenance = {}
    return model.train(), adam(model), scaler, ResumePoint(), provenance


def _preset_config(options: TrainOptions, recipe: Recipe, data: ParallelData) -> ModelConfig:
    """The preset's network for the data's vocabulary, with the recipe's dropout."""
    return get_preset(options.preset).model_config(
        len(data.src_vocab), None if data.shared_vocab else len(data.tgt_vocab),
        dropout=recipe.dropout)


# ------------------------------------------------------------------ fine-tuning: --init


def _init_model(init: Path, recipe: Recipe, data: ParallelData,
                device: torch.device) -> tuple[Transformer, dict[str, str]]:
    """Fine-tuning: the network of the model file `init` (its config as it is, whatever fields
    it has, with the recipe's dropout) holding its weights, loaded strictly; and the provenance
    its run's checkpoints record. The optimizer and the schedule start afresh at step 0."""
    try:
        loaded = load_model(init)
    except AttnError as error:
        raise AttnError(f"--init: {error}") from None
    _check_init_vocabulary(init, loaded, data)
    model = Transformer(dataclasses.replace(loaded.config, dropout=recipe.dropout)).to(device)
    model.load_state_dict(loaded.model.state_dict(), strict=True)
    return model, {"init": str(init), "init_sha256": file_sha256(init)}


def _check_init_vocabulary(init: Path, loaded: LoadedModel, data: ParallelData) -> None:
    """The data must be in the model's pieces: the vocabularies' checksums must agree."""
    for side, vocabulary in (("src", loaded.src_vocab), ("tgt", loaded.tgt_vocab)):
        binarized_with = data.metadata.get(f"{side}_vocab_sha256")
        if binarized_with != vocabulary.checksum:
            raise AttnError(f"{data.path} was binarized with another vocabulary than the model "
                            f"file {init} ({side} vocabulary sha256 {str(binarized_with)[:12]} "
                            f"vs {vocabulary.checksum[:12]}): binarize it with the model's "
                            f"(`attn binarize --vocab {init} ...`)")


def init_config(init: Path) -> ModelConfig:
    """The network of the model file `init` (its header only: no weights read)."""
    try:
        return read_model_header(init)[1]
    except AttnError as error:
        raise AttnError(f"--init: {error}") from None


def check_init_preset(init: Path, preset_name: str) -> None:
    """A --preset given beside --init must describe the model file's architecture (its dropout
    aside, a recipe option): the file's architecture is the one trained, and a contradicting
    preset is a mistake to say, not an override to drop silently."""
    config = init_config(init)
    preset = get_preset(preset_name)
    differ = [field.name for field in dataclasses.fields(Architecture)
              if field.name != "dropout"
              and getattr(preset, field.name) != getattr(config, field.name)]
    if differ:
        model_has = ", ".join(f"{name} {getattr(config, name)}" for name in differ)
        preset_has = ", ".join(str(getattr(preset, name)) for name in differ)
        raise AttnError(f"--preset {preset_name} contradicts --init {init}: the model has "
                        f"{model_has} where the preset has {preset_has} (the architecture comes "
                        "from the model file: leave out --preset, or give one of that "
                        "architecture for its recipe)")


def adam(model: torch.nn.Module) -> torch.optim.Adam:
    """§5.3: Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 (the rate is set every step). Fused (one
    kernel for every parameter) where torch has it: CUDA, and CPUs from torch 2.4 (3% of a
    `small` step on 2 cores)."""
    parameters = list(model.parameters())
    try:
        return torch.optim.Adam(parameters, lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
    except RuntimeError:  # this torch has no fused Adam for this device
        return torch.optim.Adam(parameters, lr=0.0, betas=(0.9, 0.98), eps=1e-9)


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
    sums = forward_backward(run.trained, taken.mine, loss_scale, run.recipe.label_smoothing,
                            run.processes, run.dtype, run.scaler, seed=(run.options.seed, step))
    lr = inverse_sqrt_lr(step + 1 - run.schedule_offset, run.config.d_model,
                         run.recipe.warmup, run.recipe.lr_scale)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    asked = votes()
    # Written in place and copied without waiting: the last step's copy from this buffer ended
    # before its sums were read.
    run.votes[0], run.votes[1], run.votes[2] = asked.stop, asked.save, asked.time_up
    votes_now = run.votes.to(run.processes.device, non_blocking=True)
    loss_sum, nll_sum, *summed = all_reduce_sum(torch.cat([sums, votes_now]), run.processes)
    # Zeroed in place under DDP: gradients set to None would leave its buckets (a fresh
    # allocation and a copy into them at every step); alone, None saves the zeroing.
    keep_buckets = run.processes.distributed
    if not math.isfinite(loss_sum):
        run.optimizer.zero_grad(set_to_none=not keep_buckets)
        good = checkpoints.list_checkpoints(run.run_dir, need_state=True)
        kept = f"the last good checkpoint is {good[-1][1]}" if good else \
            "no checkpoint was written yet"
        raise TrainingDiverged(f"the loss became {loss_sum} at step {step + 1}; {kept}. "
                               "Try a lower --lr-scale or a longer --warmup.")
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=not keep_buckets)
    return StepResult(loss_sum, nll_sum, tgt_tokens, src_tokens, lr, Votes(*summed))


def dropout_seed(seed: int, step: int, micro_batch: int) -> int:
    """Dropout masks depend on the run's seed, the step and the micro-batch's place in the step:
    the same whichever process draws them, and again the same after a resume."""
    return (seed * 1_000_003 + step * 10_007 + micro_batch) % (2 ** 63)


def forward_backward(trained: torch.nn.Module, batches: list[tuple[int, Batch]],
                     loss_scale: float, epsilon: float, processes: Processes, dtype: str,
                     scaler: torch.amp.GradScaler, seed: tuple[int, int]) -> torch.Tensor:
    """Accumulate the gradients of this process's share of one step's micro-batches
    (batching.process_share: each with its place in the step), each loss multiplied by
    `loss_scale`. DDP synchronises the gradients on the last backward only. Returns this
    process's (loss sum, NLL sum) as a float64 tensor on the device: summed there, read once
    per step (a read per micro-batch would make the host wait for the device each time)."""
    sums = torch.zeros(2, dtype=torch.float64, device=processes.device)
    for count, (place, host_batch) in enumerate(batches, start=1):
        torch.manual_seed(dropout_seed(*seed, place))
        batch = host_batch.to(processes.device)
        last = count == len(batches)
        sync = contextlib.nullcontext() if last or not processes.distributed else \
            trained.no_sync()
        with sync:
            with autocast(processes.device, dtype):
                loss, nll = trained(batch.src_tokens, batch.tgt_input,
                                    output_positions=batch.target_positions,
                                    targets=batch.targets, label_smoothing=epsilon)
            scaler.scale(loss * loss_scale).backward()
        sums += torch.stack([loss.detach(), nll]).double()
    return sums


# --------------------------------------------------------------------- metrics and saving


def _record(run: _Run, step: int, row: dict, save: bool, clock: _Clock) -> Path | None:
    """A metrics row (with validation when saving), then the checkpoint when `save`. The row
    goes to disk first: a run killed between the two resumes from the previous checkpoint and
    rewrites this row, never loses it. Returns the checkpoint written (None: none)."""
    if save and run.valid is not None:
        row.update(validate(run))
    if len(row) > 2 and run.processes.is_main:  # more than the step and the time
        checkpoints.append_metrics(run.run_dir, row)
    checkpoint = None
    if save:
        checkpoint = _save(run.run_dir, step, run, row["elapsed_s"])
        clock.saved(step)
    if len(row) > 2:
        run.display.row(row)
    return checkpoint


def validate(run: _Run) -> dict:
    """The validation fields of a metrics row: loss and perplexity, the metric's score, which
    metric, and the seconds it all took (apart from training time: the next row's tokens/s
    counts training steps only). Every process takes its share of the work."""
    started = time.monotonic()
    fields = evaluate(run.trained, run.valid, run.plan.max_tokens, run.recipe.label_smoothing,
                      run.processes, run.dtype)
    if run.validator is not None:
        score = validation_score(run.validator, run.model, run.processes, run.dtype)
        if score is not None:
            fields[metric_key(run.validator.metric)] = score
    fields["valid_metric"] = run.options.valid_metric
    fields["valid_s"] = time.monotonic() - started
    return fields


# What a validation by decoding may raise without ending hours of training: said, and the run
# goes on without that score.
_VALIDATION_ERRORS = (AttnError, RecursionError, RuntimeError, ValueError)


def validation_score(validator: Validator, model: Transformer, processes: Processes,
                     dtype: str) -> float | None:
    """The validation metric's score (main process; None elsewhere, and where it failed): each
    process decodes every world_size-th batch, the main process gathers the outputs and scores
    them. On 8 GPUs the decoding takes an eighth of the time one process would, with no GPU
    waiting for another; the outputs are those of one process (each batch is searched
    alone)."""
    try:
        with autocast(processes.device, dtype):
            share = {"output": validator.search(model, processes.rank, processes.world_size)}
    except _VALIDATION_ERRORS as error:
        share = {"error": f"{type(error).__name__}: {error}"}
    shares = gather_to_main(share, processes)
    if not processes.is_main:
        return None
    failed = next((share["error"] for share in shares if "error" in share), None)
    try:
        if failed is None:
            output = {index: tokens for share in shares for index, tokens in
                      share["output"].items()}
            return validator.score_texts(validator.texts(output))
    except _VALIDATION_ERRORS as error:
        failed = f"{type(error).__name__}: {error}"
    processes.log(f"validation by {validator.metric} failed, the run goes on without that "
                  f"score: {failed}")
    return None


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: ParallelData, max_tokens: int, epsilon: float,
             processes: Processes, dtype: str) -> dict[str, float]:
    """Validation loss (label-smoothed, like the training loss) and perplexity (exp of the
    per-token NLL, EOS included), each process scoring its share of the batches."""
    bare = unwrap(model)
    was_training = bare.training
    bare.eval()
    batches = token_batches(data.src_lengths, data.tgt_lengths, max_tokens, seed=0)
    totals = torch.zeros(2, dtype=torch.float64, device=processes.device)
    tokens = 0
    for indices in batches[processes.rank::processes.world_size]:
        batch = collate(data, indices)
        tokens += batch.target_count
        batch = batch.to(processes.device)
        with autocast(processes.device, dtype):
            loss, nll = bare(batch.src_tokens, batch.tgt_input,
                             output_positions=batch.target_positions, targets=batch.targets,
                             label_smoothing=epsilon)
        totals += torch.stack([loss, nll]).double()
    totals = torch.cat([totals, torch.tensor([tokens], dtype=torch.float64,
                                             device=processes.device)])
    loss_sum, nll_sum, tokens = all_reduce_sum(totals, processes)
    bare.train(was_training)
    return {"valid_loss": loss_sum / tokens, "valid_nll": nll_sum / tokens,
            "valid_ppl": math.exp(min(nll_sum / tokens, 700))}


def _save(run_dir: Path, step: int, run: _Run, elapsed: float) -> Path | None:
    """The model and its training state after `step`, then the old checkpoints pruned."""
    if not run.processes.is_main:
        return None
    epoch, offset = run.steps.position
    point = ResumePoint(step=step, epoch=epoch, offset=offset, elapsed_seconds=elapsed,
                        schedule_offset=run.schedule_offset, batch_plan=run.plan.record(),
                        earlier_budgets=run.steps.earlier_budgets)
    state = checkpoints.ResumeState(point, options=run.options.record(), adam={},
                                    scaler=run.scaler.state_dict() if run.scaler.is_enabled()
                                    else {})
    tgt_vocab = None if run.data.shared_vocab else run.data.tgt_vocab
    try:
        path = checkpoints.save_checkpoint(run_dir, step, run.model, run.optimizer, state,
                                           run.data.src_vocab, tgt_vocab,
                                           {"preset": run.options.preset, **run.provenance})
    except AttnError as error:  # a full disk: say what the run can go on from
        good = checkpoints.list_checkpoints(run_dir, need_state=True)
        raise AttnError(f"{error}; the last checkpoint safe to resume from is {good[-1][1]}"
                        if good else f"{error}; no checkpoint was written yet") from None
    best = set()
    if run.options.keep_best and run.valid is not None:
        metric, scores = checkpoints.scored_steps(run_dir, run.options.valid_metric)
        saved = {step for step, _ in checkpoints.list_checkpoints(run_dir)}
        best = set(checkpoints.best_steps({step: score for step, score in scores.items()
                                           if step in saved}, metric, run.options.keep_best))
    checkpoints.prune_checkpoints(run_dir, run.options.keep, best, run.options.keep_state)
    return path


def _out_of_patience(run: _Run, step: int, clock: _Clock) -> str | None:
    """Why the run stops early (None: it goes on): --patience validations in a row have not
    beaten the best by --valid-metric. Counted from the validations in metrics.jsonl at the
    save cadence's steps (not those of a save where a run was stopped off it), so that a
    resumed run counts as the uninterrupted one did; rank 0 reads them and decides for every
    rank."""
    if not run.options.patience or run.valid is None:
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

    def add(self, result: StepResult) -> None:
        self.loss, self.nll = self.loss + result.loss_sum, self.nll + result.nll_sum
        self.tgt, self.src = self.tgt + result.tgt_tokens, self.src + result.src_tokens

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
