"""Training (paper §5). So far: the model summary `attn train --dry-run` prints."""

from __future__ import annotations

import torch

from .config import ModelConfig, Preset
from .model import Transformer


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


def describe_model(preset: Preset, config: ModelConfig) -> str:
    """The `--dry-run` report: architecture, recipe and parameter counts, ending `params: N`."""
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
        f"label smoothing {preset.label_smoothing}",
        f"schedule    Adam 0.9/0.98/1e-9, warmup {preset.warmup_steps}, lr scale "
        f"{preset.lr_scale}, {preset.max_steps} steps, {preset.batch_tokens} tokens/side/step",
    ]
    lines += [f"  {name:<10}{count:>14,}" for name, count in groups.items()]
    if preset.paper_params_millions is not None:
        paper = preset.paper_params_millions * 1e6
        lines.append(f"Table 3: {preset.paper_params_millions:g}M with a ~37K vocabulary "
                     f"(this: {total / 1e6:.1f}M, {100 * (total - paper) / paper:+.1f}%)")
    lines.append(f"params: {total}")
    return "\n".join(lines)
