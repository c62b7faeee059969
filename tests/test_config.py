"""Configuration (config.py): the presets against the paper's Table 3, the model config's JSON,
and `attn train`'s options, each declared once with what a resumed run may do with it."""

from __future__ import annotations

import dataclasses
from enum import Enum

import pytest
import torch
import typer

from attn_cli import config
from attn_cli.cli import app
from attn_cli.config import PRESETS, ModelConfig, TrainOptions
from attn_cli.errors import AttnError
from attn_cli.model import Transformer
from attn_cli.train.report import parameter_groups

# -------------------------------------------------------------------------------------- presets


def test_every_preset_is_post_norm():
    """The paper's LayerNorm(x + Sublayer(x)), for Table 3's presets and our own: pre-norm is
    an option, never a preset's silent choice."""
    for name, preset in PRESETS.items():
        assert preset.norm == "post", name


def test_config_round_trips_through_json():
    config = PRESETS["big"].model_config(37000)
    assert ModelConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError):
        ModelConfig.from_json(config.to_json().replace('"version": 1', '"version": 99'))


def parameters(preset: str, vocab: int = 37000) -> int:
    with torch.device("meta"):
        return sum(parameter_groups(Transformer(PRESETS[preset].model_config(vocab))).values())


@pytest.mark.parametrize("preset,millions", [("base", 65), ("big", 213)])
def test_parameter_counts_match_table3(preset, millions):
    assert parameters(preset) == pytest.approx(millions * 1e6, rel=0.04)


def test_every_table3_row_is_near_its_count():
    """Table 3 rounds, and its vocabulary was 'about 37K': allow 8% (row C1 is the furthest)."""
    for name, preset in PRESETS.items():
        if preset.paper_params_millions is not None:
            assert parameters(name) == pytest.approx(preset.paper_params_millions * 1e6,
                                                     rel=0.08), name


def test_table3_rows_change_only_what_the_table_says():
    base = PRESETS["base"]
    assert PRESETS["base-B1"].d_k == 16 and PRESETS["base-B1"].d_v == 64
    assert PRESETS["base-A1"].heads * PRESETS["base-A1"].d_k == base.d_model
    assert PRESETS["base-E"].positions == "learned"
    assert PRESETS["base-D3"].label_smoothing == 0.0 and PRESETS["base-D3"].dropout == 0.1
    assert PRESETS["big"].dropout == 0.3 and PRESETS["big"].d_model == 1024
    assert PRESETS["parse-wsj"].encoder_layers == 4 and PRESETS["parse-wsj"].d_model == 1024
    small = PRESETS["small"]  # the benchmarks' configuration
    assert (small.encoder_layers, small.decoder_layers, small.d_model, small.d_ff,
            small.heads) == (3, 3, 256, 1024, 4)


# ------------------------------------------------------------------------- attn train's options


@pytest.mark.parametrize("text,expected", [("10m", (600.0, "time")), ("90s", (90.0, "time")),
                                           ("2h", (7200.0, "time")), ("5000", (5000.0, "steps")),
                                           ("300u", (300.0, "steps"))])
def test_intervals(text, expected):
    assert config.parse_interval(text) == expected


def test_bad_interval():
    with pytest.raises(AttnError, match="interval"):
        config.parse_interval("soon")


# The `train` parameters that are no option of the run itself: they plan a --dry-run, or say
# where its metrics rows are also sent (train/live_logs.py; a resumed run may change them).
PLANNING_ONLY = {"vocab_size", "nproc", "dry_run", "tensorboard", "wandb_project", "wandb_mode"}


def test_every_train_option_is_a_parameter_of_the_train_command_and_back():
    """TrainOptions declares each option once (with its resume rule); the `train` command
    passes its parameters of the same names into it: both must list the same names, with the
    same defaults, or an option is lost, or typed where resuming cannot see it."""
    fields = {field.name: field for field in dataclasses.fields(TrainOptions)}
    parameters = {param.name: param for param in typer.main.get_command(app).commands[
        "train"].params}
    assert sorted(set(fields) - set(parameters)) == []
    assert sorted(set(parameters) - set(fields)) == sorted(PLANNING_ONLY)
    for name, field in fields.items():
        if field.default is dataclasses.MISSING:  # data and output: None until --dry-run says
            assert parameters[name].default is None, name
            continue
        default = parameters[name].default
        assert (default.value if isinstance(default, Enum) else default) == field.default, name


def test_every_train_option_says_what_a_resumed_run_may_do_with_it():
    rules = {config.RECIPE, config.FREE, config.PER_NODE}
    for field in dataclasses.fields(TrainOptions):
        assert field.metadata.get("on_resume") in rules, field.name
        # paths, and only they, may differ from node to node (the files' contents are compared)
        assert ("Path" in str(field.type)) == (field.metadata["on_resume"] == config.PER_NODE), \
            field.name
    # a resumed run says when it changes the recipe: no recipe option is changed freely
    assert not config.train_options_where(config.RECIPE) & config.FREELY_CHANGED
