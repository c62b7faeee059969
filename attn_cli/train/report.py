"""What `attn train` shows: the progress display (a rich bar on a terminal, plain lines in logs,
and the metrics rows sent on to TensorBoard or W&B: live_logs.py) and the `--dry-run` report.
Presentation only; loop.py calls the display through its `Display` protocol and knows nothing of
how it looks."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from ..batching import BatchPlan, batch_plan
from ..config import ModelConfig, Preset, Recipe, TrainOptions, get_preset
from ..data import ParallelData
from ..errors import AttnError, say
from ..model import Transformer
from ..modelfile import init_config
from .live_logs import LiveLogs


class TrainingDisplay:
    """A rich progress bar on a terminal; plain log lines otherwise (CI logs, files). Each
    metrics row also goes to the `live_logs` (--tensorboard, --wandb), which the display opens
    when the run starts (on the main process: the only display loop.py starts) and closes when
    used as a context manager ends, however the run ended: loop.py stops the display before the
    last checkpoint's validation row, which the logs must still receive."""

    def __init__(self, live_logs: LiveLogs | None = None):
        self.live = None
        self.live_logs = live_logs

    def __enter__(self) -> TrainingDisplay:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if self.live_logs is not None:
            self.live_logs.close(failed=error_type is not None)

    def start(self, total_steps: int, start_step: int) -> None:
        if self.live_logs is not None:  # first: W&B's lines come before the bar
            self.live_logs.start(start_step)
        if sys.stderr.isatty():
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
            self.live.start()

    def stop(self) -> None:
        if self.live:
            self.live.stop()

    def step(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        if self.live:
            self.live.update(self.task, completed=step,
                             status=f"loss {loss:.3f} lr {lr:.2e} {tokens_per_s:,.0f} tgt tok/s")

    def row(self, row: dict) -> None:
        parts = [f"step {row['step']}"]
        for key, fmt in (("loss", ".4f"), ("nll", ".4f"), ("alignment_loss", ".4f"),
                         ("lr", ".3e"), ("tokens_per_s", ",.0f"),
                         ("src_tokens_per_s", ",.0f"), ("valid_loss", ".4f"),
                         ("valid_ppl", ".3f"), ("valid_bleu", ".2f"), ("valid_chrf", ".2f"),
                         ("valid_f1", ".2f"), ("valid_s", ".1f"), ("elapsed_s", ".0f")):
            if key in row:
                parts.append(f"{key} {row[key]:{fmt}}")
        line = "train: " + "  ".join(parts)
        if self.live:
            self.live.console.print(line)
        else:
            say(line)
        if self.live_logs is not None:
            self.live_logs.row(row)


# ---------------------------------------------------------------------------- the dry-run report


def dry_run_report(options: TrainOptions, vocab_size: int | None, world_size: int) -> str:
    """What `train` would build and how it would batch, without data (given --vocab-size);
    with --init, the model file's network (its dropout the recipe's) under the preset's recipe."""
    preset = get_preset(options.preset)
    recipe = options.recipe()
    plan = batch_plan(recipe.batch_tokens, options.max_tokens, world_size)
    if options.init is not None:
        config = dataclasses.replace(init_config(options.init), dropout=recipe.dropout)
        return describe_model(preset, config, recipe, plan, init=options.init,
                              notes=guidance_lines(options, config))
    if options.data is not None:
        data = ParallelData(options.data)
        src_size = len(data.src_vocab)
        tgt_size = None if data.shared_vocab else len(data.tgt_vocab)
    elif vocab_size is not None:
        src_size, tgt_size = vocab_size, None
    else:
        raise AttnError("--dry-run needs a data file or --vocab-size")
    config = preset.model_config(src_size, tgt_size, dropout=recipe.dropout,
                                 **options.architecture())
    changed = [f"network     {options.architecture_name()}"] if options.architecture() else []
    return describe_model(preset, config, recipe, plan,
                          notes=changed + guidance_lines(options, config))


def guidance_lines(options: TrainOptions, config: ModelConfig) -> list[str]:
    """--guided-alignment's line of the report (none without it)."""
    if not options.guided_alignment:
        return []
    from ..alignment import layer_index

    layer = layer_index(options.alignment_layer, config.decoder_layers)
    return [f"alignment   guided: head {options.alignment_head} of decoder layer {layer} (from "
            f"0), lambda {options.alignment_lambda:g} (Garg et al. 2019; not in the paper)"]


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


def describe_model(preset: Preset, config: ModelConfig, recipe: Recipe | None = None,
                   plan: BatchPlan | None = None, init: Path | None = None,
                   notes: list[str] = ()) -> str:
    """The `--dry-run` report: architecture, recipe and parameter counts, ending `params: N`;
    `init`: the network is that model file's, fine-tuned with the preset's recipe; `notes`:
    lines on options of the run, after the batch plan."""
    recipe = recipe or Recipe.from_preset(preset)
    with torch.device("meta"):  # shapes only: instant even for `big`
        model = Transformer(config)
    groups = parameter_groups(model)
    total = sum(groups.values())
    vocabulary = (f"{config.src_vocab_size} shared (source, target, output projection)"
                  if config.share_embeddings else
                  f"{config.src_vocab_size} source, {config.tgt_vocab_size} target (tied to the "
                  "output projection)")
    lines = [
        f"preset      {preset.name}: {preset.description}" if init is None else
        f"init        {init} (its architecture; {preset.name}'s recipe, from step 0)",
        f"encoder     {config.encoder_layers} layers",
        f"decoder     {config.decoder_layers} layers",
        f"layer       d_model {config.d_model}, d_ff {config.d_ff}, {config.heads} heads "
        f"(d_k {config.d_k}, d_v {config.d_v}), {config.norm}-norm",
        f"positions   {config.positions}",
        f"vocabulary  {vocabulary}",
        f"dropout     {config.dropout} (attention {config.attention_dropout}), "
        f"label smoothing {recipe.label_smoothing}",
        f"schedule    Adam 0.9/0.98/1e-9, warmup {recipe.warmup}, lr scale "
        f"{recipe.lr_scale}, {recipe.max_steps} steps, {recipe.batch_tokens} "
        "tokens/side/step",
    ]
    if plan is not None:
        lines.append(plan.describe())
    lines += notes
    lines += [f"  {name:<10}{count:>14,}" for name, count in groups.items()]
    if preset.paper_params_millions is not None and init is None:
        paper = preset.paper_params_millions * 1e6
        lines.append(f"Table 3: {preset.paper_params_millions:g}M with a ~37K vocabulary "
                     f"(this: {total / 1e6:.1f}M, {100 * (total - paper) / paper:+.1f}%)")
    lines.append(f"params: {total}")
    return "\n".join(lines)
