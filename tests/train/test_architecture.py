"""`attn train`'s architecture options over a preset (TrainOptions.architecture): the network
built and recorded, the model file naming what changed, inconsistent ones refused in one line,
and a resume held to the network it started with."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from attn_cli.config import TrainOptions
from attn_cli.errors import AttnError

from ..conftest import REPO, assert_clean_error, decode, run_attn, train_args

DATA = REPO / "tests" / "fixtures" / "data.st"


def file_facts(path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    return json.loads(metadata["config"]), metadata


def test_a_preset_with_other_layers_trains_and_its_file_says_so(tmp_path):
    run_dir = tmp_path / "run"
    result = run_attn(*train_args(DATA, run_dir, "--max-steps", 2, "--encoder-layers", 3,
                                  "--decoder-layers", 1, "--norm", "pre"))
    assert result.returncode == 0, result.stderr
    config, metadata = file_facts(run_dir / "checkpoint-2.st")
    assert (config["encoder_layers"], config["decoder_layers"], config["norm"]) == (3, 1, "pre")
    assert config["d_model"] == 64 and config["heads"] == 4  # the rest is tiny's
    assert metadata["preset"] == "tiny"
    assert metadata["architecture"] == "tiny + encoder_layers=3 + decoder_layers=1 + norm=pre"
    assert len(decode(run_dir / "checkpoint-2.st", ["A dog runs.", ""])) == 2
    # a resume keeps the network, and is refused another
    again = run_attn(*train_args(DATA, run_dir, "--max-steps", 3, "--encoder-layers", 3,
                                 "--decoder-layers", 1, "--norm", "pre", "--resume"))
    assert again.returncode == 0, again.stderr
    assert_clean_error(run_attn(*train_args(DATA, run_dir, "--max-steps", 4, "--encoder-layers",
                                            3, "--resume")),
                       "has another architecture (decoder_layers 1 -> 2, norm pre -> post)")


def test_d_model_and_heads_give_d_k_and_d_v_unless_they_are_given():
    assert TrainOptions(None, None, preset="tiny", d_model=96, heads=3).architecture() == {
        "d_model": 96, "heads": 3, "d_k": 32, "d_v": 32}
    assert TrainOptions(None, None, preset="tiny", heads=8, d_k=10, d_v=12).architecture() == {
        "heads": 8, "d_k": 10, "d_v": 12}
    assert TrainOptions(None, None, preset="tiny").architecture() == {}
    assert TrainOptions(None, None, preset="small", decoder_layers=1).architecture_name() == \
        "small + decoder_layers=1"


@pytest.mark.parametrize("options, message", [
    (dict(d_model=60, heads=8), "--d-model 60 is not divisible by --heads 8"),
    (dict(heads=5), "--d-model 64 is not divisible by --heads 5"),
    (dict(norm="middle"), "--norm must be one of post, pre, not 'middle'"),
    (dict(d_ff=0), "--d-ff must be a whole number of at least 1, not 0"),
])
def test_options_that_make_no_network_are_one_error(options, message):
    with pytest.raises(AttnError) as raised:
        TrainOptions(None, None, preset="tiny", **options).architecture()
    assert message in str(raised.value)


def test_the_command_refuses_them_in_one_line_before_it_starts(tmp_path):
    assert_clean_error(run_attn(*train_args(DATA, tmp_path / "a", "--d-model", 60, "--heads",
                                            8)), "is not divisible by --heads 8")
    assert_clean_error(run_attn(*train_args(DATA, tmp_path / "b", "--norm", "middle")),
                       "--norm")
    trained = tmp_path / "c"
    assert run_attn(*train_args(DATA, trained, "--max-steps", 1)).returncode == 0
    assert_clean_error(run_attn(*train_args(DATA, tmp_path / "d", "--init",
                                            trained / "checkpoint-1.st", "--heads", 2)),
                       "brings its own network: leave out --heads")


def test_dry_run_shows_the_network_and_what_changed():
    result = run_attn("train", "--preset", "small", "--encoder-layers", 6, "--decoder-layers",
                      1, "--dry-run", "--vocab-size", 8000)
    assert result.returncode == 0, result.stderr
    assert "encoder     6 layers" in result.stdout and "decoder     1 layers" in result.stdout
    assert "network     small + encoder_layers=6 + decoder_layers=1" in result.stdout
