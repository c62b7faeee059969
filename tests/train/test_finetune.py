"""Fine-tuning (`attn train --init MODEL.st`) and early stopping (`--patience N`), through the
real command: a model trained on one toy domain adapts to another faster than a new model
learns it, its run starts afresh at step 0 and records where it came from; a run that stops
improving stops, and a resumed run stops where the uninterrupted one did."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
import torch

from attn_cli.checkpoints import list_checkpoints, validations_since_best
from attn_cli.config import PRESETS
from attn_cli.model import Transformer
from attn_cli.modelfile import load_model, read_model_header, save_model
from attn_cli.train import loop as training
from attn_cli.vocab import Vocabulary

from ..conftest import assert_clean_error, assert_same_weights, final_weights, run_attn

LETTERS = "abcdefghij"


def domain_pairs(count: int, seed: int, shift: int) -> tuple[list[str], list[str]]:
    """A toy domain: sequences of letters, each letter of the target `shift` letters on from the
    source's (0: a copy). Two shifts are two domains of one vocabulary."""
    rng = random.Random(seed)
    sources, targets = [], []
    for _ in range(count):
        word = [rng.choice(LETTERS) for _ in range(rng.randint(3, 6))]
        sources.append(" ".join(word))
        targets.append(" ".join(LETTERS[(LETTERS.index(letter) + shift) % len(LETTERS)]
                                for letter in word))
    return sources, targets


# Domain A copies, domain B shifts every letter by 3: a model of A has learned where to look and
# what a sequence is, but writes every letter of B wrong.
DOMAINS = {"a": 0, "b": 3}


@pytest.fixture(scope="module")
def domains(tmp_path_factory) -> dict[str, Path]:
    """Both domains as text, one vocabulary learned over both, each domain's training and
    validation data binarized with it: {"a.train": a.train.st, ..., "vocab": v.model}."""
    directory = tmp_path_factory.mktemp("domains")
    texts = []
    for domain, shift in DOMAINS.items():
        for split, count, seed in (("train", 1000, 1), ("valid", 50, 2)):
            name = f"{domain}.{split}"
            for side, lines in zip(("src", "tgt"), domain_pairs(count, seed, shift)):
                path = directory / f"{name}.{side}"
                path.write_text("\n".join(lines) + "\n", encoding="utf-8")
                texts.append(path)
    paths = {"vocab": directory / "v.model"}
    assert run_attn("vocab", *texts, "-o", paths["vocab"], "--size", "24",
                    "--type", "unigram").returncode == 0
    for domain in DOMAINS:
        for split in ("train", "valid"):
            name = f"{domain}.{split}"
            paths[name] = directory / f"{name}.st"
            result = run_attn("binarize", "--vocab", paths["vocab"], directory / f"{name}.src",
                              directory / f"{name}.tgt", "-o", paths[name])
            assert result.returncode == 0, result.stderr
    return paths


def train(data: Path, run_dir: Path, *extra) -> str:
    """`attn train` of the tiny preset on the CPU without dropout, its stderr."""
    result = run_attn("train", data, "-o", run_dir, "--preset", "tiny", "--dropout", "0",
                      "--batch-tokens", "1000", "--device", "cpu", *map(str, extra))
    assert result.returncode == 0, result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def model_a(domains, tmp_path_factory) -> Path:
    """A model of domain A: 200 steps reach a validation NLL of 0.07-0.21 (seeds 1-4)."""
    run_dir = tmp_path_factory.mktemp("domain-a") / "run"
    train(domains["a.train"], run_dir, "--label-smoothing", "0", "--max-steps", 200,
          "--warmup", 100, "--lr-scale", 0.5, "--save-every", 200, "--log-every", 200)
    return run_dir / "checkpoint-200.st"


# The fine-tuning and the new run on domain B: 40 steps warming up all along (the weights of A
# are not hit by a high rate at once), the same options and seed for both.
ON_B = ("--max-steps", 40, "--warmup", 40, "--lr-scale", 0.5, "--save-every", 40,
        "--log-every", 1, "--seed", 1)


@pytest.fixture(scope="module")
def runs_on_b(domains, model_a, tmp_path_factory) -> dict[str, Path]:
    """{"finetuned": its run directory, "scratch": the new run's}, both 40 steps on domain B."""
    directory = tmp_path_factory.mktemp("domain-b")
    train(domains["b.train"], directory / "finetuned", *ON_B, "--valid", domains["b.valid"],
          "--init", model_a)
    train(domains["b.train"], directory / "scratch", *ON_B, "--valid", domains["b.valid"])
    return {"finetuned": directory / "finetuned", "scratch": directory / "scratch"}


def nll_on(model: Path, domain: str, domains: dict[str, Path]) -> float:
    """The model's NLL per target token on the domain's validation pairs (`attn score -m`)."""
    text = domains[f"{domain}.valid"].with_suffix("")
    scored = run_attn("score", "-m", model, f"{text}.src", f"{text}.tgt", "--format", "json")
    assert scored.returncode == 0, scored.stderr
    rows = [json.loads(line) for line in scored.stdout.splitlines()]
    return -sum(row["log_prob"] for row in rows) / sum(row["tokens"] for row in rows)


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------ fine-tuning


@pytest.mark.long  # its two 40-step runs (~12 s): with the long tests, for make test's 4 minutes
def test_finetuning_adapts_to_a_new_domain_better_than_training_anew(domains, model_a,
                                                                       runs_on_b):
    """Measured (seeds 1-8 of the runs on B, seeds 1-4 of A): A's model on B 5.85-5.97 nats
    per token (it copies the letters B shifts); fine-tuned for 40 steps 0.50-1.04; a new model
    after the same 40 steps 1.61-1.77. The bounds leave a margin of 1.4x and more."""
    start = nll_on(model_a, "b", domains)
    finetuned = nll_on(runs_on_b["finetuned"] / "checkpoint-40.st", "b", domains)
    scratch = nll_on(runs_on_b["scratch"] / "checkpoint-40.st", "b", domains)
    assert finetuned < 0.5 * start, (start, finetuned, scratch)
    assert finetuned < 0.8 * scratch, (start, finetuned, scratch)


@pytest.mark.long  # runs_on_b's runs, as the test above
def test_finetuning_starts_at_step_0_with_a_fresh_schedule_and_records_its_init(model_a,
                                                                                runs_on_b):
    run_dir = runs_on_b["finetuned"]
    rows = rows_of(run_dir)
    assert [row["step"] for row in rows] == list(range(1, 41))
    # The warmup counts from the fine-tuning's first step, not from A's 200 steps.
    assert rows[0]["lr"] == pytest.approx(training.inverse_sqrt_lr(1, 64, 40, 0.5), rel=1e-12)
    assert rows[-1]["lr"] == pytest.approx(training.inverse_sqrt_lr(40, 64, 40, 0.5),
                                           rel=1e-12)
    saved = load_model(run_dir / "checkpoint-40.st")
    assert saved.metadata["init"] == str(model_a)
    assert saved.metadata["init_sha256"] == hashlib.sha256(model_a.read_bytes()).hexdigest()
    assert saved.metadata["step"] == "40" and saved.metadata["preset"] == "tiny"
    # ... and so does their average.
    averaged = run_dir / "average.st"
    assert run_attn("average", run_dir, "--last", "1", "-o", averaged).returncode == 0
    assert load_model(averaged).metadata["init"] == str(model_a)


def test_without_preset_the_architecture_is_the_models_and_the_recipe_bases(domains, model_a,
                                                                           tmp_path):
    """The model file's architecture, whatever the default preset's; the recipe (here: its
    dropout, 0.1) from the preset."""
    run_dir = tmp_path / "run"
    result = run_attn("train", domains["b.train"], "-o", run_dir, "--init", model_a,
                      "--batch-tokens", "1000", "--max-steps", "1", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert f"{model_a} with base's recipe" in result.stderr
    _, config = read_model_header(run_dir / "checkpoint-1.st")
    _, init_config = read_model_header(model_a)
    assert config.dropout == 0.1 and init_config.dropout == 0.0
    assert {**vars(config), "dropout": 0.0} == vars(init_config)


def test_dry_run_describes_the_model_files_network(domains, model_a):
    """--dry-run --init plans what the run would train: the model file's network (with the
    recipe's dropout), its parameter count that of the file's tensors, not the preset's."""
    result = run_attn("train", domains["b.train"], "--init", model_a, "--dry-run",
                      "--warmup", "100")
    assert result.returncode == 0, result.stderr
    loaded = load_model(model_a)
    config = loaded.config
    assert f"init        {model_a}" in result.stdout
    assert f"d_model {config.d_model}, d_ff {config.d_ff}, {config.heads} heads" in result.stdout
    assert "warmup 100" in result.stdout and "dropout     0.1 " in result.stdout
    total = sum(p.numel() for p in loaded.model.parameters())  # tied weights counted once
    assert result.stdout.strip().endswith(f"params: {total}")
    assert "Table 3" not in result.stdout


def test_init_refuses_a_contradicting_preset(domains, model_a, tmp_path):
    result = run_attn("train", domains["b.train"], "-o", tmp_path / "run", "--init", model_a,
                      "--preset", "base", "--max-steps", "1", "--device", "cpu")
    assert_clean_error(result, "--preset base contradicts --init", str(model_a), "d_model 64")
    assert not (tmp_path / "run").exists()


def test_init_refuses_data_of_another_vocabulary(domains, model_a, tmp_path):
    other_vocab = tmp_path / "other.model"
    text = domains["b.train"].with_suffix("")
    assert run_attn("vocab", f"{text}.src", f"{text}.tgt", "-o", other_vocab, "--size", "20",
                    "--type", "bpe").returncode == 0
    other_data = tmp_path / "other.st"
    assert run_attn("binarize", "--vocab", other_vocab, f"{text}.src", f"{text}.tgt", "-o",
                    other_data).returncode == 0
    result = run_attn("train", other_data, "-o", tmp_path / "run", "--init", model_a,
                      "--preset", "tiny", "--max-steps", "1", "--device", "cpu")
    assert_clean_error(result, str(other_data), str(model_a), "another vocabulary",
                       f"--vocab {model_a}")
    # ... which binarizing with the model file's own vocabulary mends.
    assert run_attn("binarize", "--vocab", model_a, f"{text}.src", f"{text}.tgt", "-o",
                    other_data).returncode == 0
    assert run_attn("train", other_data, "-o", tmp_path / "run", "--init", model_a, "--preset",
                    "tiny", "--max-steps", "1", "--device", "cpu").returncode == 0


def test_init_keeps_the_options_of_imported_models(domains, tmp_path):
    """A model file of options the paper has not (`attn import hf`'s: swish, biases) is
    fine-tuned as it is: built from its config, its weights loaded strictly."""
    vocabulary = Vocabulary.from_file(domains["vocab"])
    torch.manual_seed(0)
    config = PRESETS["tiny"].model_config(len(vocabulary), activation="swish",
                                          attention_bias=True, output_bias=True)
    imported = tmp_path / "imported.st"
    save_model(imported, Transformer(config), vocabulary)
    run_dir = tmp_path / "run"
    train(domains["b.train"], run_dir, "--init", imported, "--max-steps", 2)
    _, tuned = read_model_header(run_dir / "checkpoint-2.st")
    assert (tuned.activation, tuned.attention_bias, tuned.output_bias) == ("swish", True, True)
    assert {**vars(tuned), "dropout": config.dropout} == vars(config)


@pytest.mark.parametrize("content", [None, b"not a model at all"])
def test_init_refuses_a_missing_or_corrupt_model_file(content, domains, tmp_path):
    model = tmp_path / "model.st"
    if content is not None:
        model.write_bytes(content)
    for preset in ([], ["--preset", "tiny"]):  # read to train from, or to check the preset
        result = run_attn("train", domains["b.train"], "-o", tmp_path / "run", "--init", model,
                          *preset, "--max-steps", "1", "--device", "cpu")
        assert_clean_error(result, f"--init: model file {model}")


# ------------------------------------------------------------------------------- --patience


@pytest.mark.parametrize("metric,scores,expected", [
    ("loss", {2: 3.0, 4: 2.5, 6: 2.6, 8: 2.5}, (4, 2)),  # a tie does not beat the best
    ("loss", {2: 3.0, 4: 2.5, 6: 2.4}, (6, 0)),
    ("bleu", {2: 10.0, 4: 12.0, 6: 11.0}, (4, 1)),  # higher is better
    ("bleu", {2: 0.0, 4: 0.0, 6: 0.0}, (2, 2)),
    ("chrf", {5: 30.0}, (5, 0)),
])
def test_patience_counts_the_validations_since_the_first_best(metric, scores, expected):
    assert validations_since_best(scores, metric) == expected


def test_patience_needs_validation_data(domains, tmp_path):
    assert_clean_error(run_attn("train", domains["b.train"], "-o", tmp_path / "run",
                                "--preset", "tiny", "--patience", "2", "--max-steps", "1"),
                       "--patience", "--valid")


# Fine-tuning A's model on B validated on A: A is forgotten, so its validation loss never
# beats the first validation's (step 4) and --patience 2 stops the run at step 12, long before
# --max-steps. Measured over 60 steps (seeds 1, 2): 0.89-0.95 at step 4, 2.54-3.36 after.
FORGETTING = ("--max-steps", 100, "--warmup", 10, "--lr-scale", 0.05, "--save-every", 4,
              "--log-every", 4, "--patience", 2, "--seed", 1)


@pytest.mark.slow
def test_patience_stops_early_and_a_resumed_run_stops_at_the_same_step(domains, model_a,
                                                                       tmp_path):
    """The stop, saved as a normal end is; and a run stopped at step 8 (a validation since the
    best already behind it) and resumed stops at the same step with the same weights: the count
    comes from the run's recorded validations, not from the process's memory."""
    whole = tmp_path / "whole"
    said = train(domains["b.train"], whole, *FORGETTING, "--valid", domains["a.valid"],
                 "--init", model_a)
    assert ("stopped early at step 12: 2 validations without beating step 4's loss "
            in said), said
    assert f"(--patience 2); last checkpoint {whole / 'checkpoint-12.st'}" in said
    assert [step for step, _ in list_checkpoints(whole)] == [4, 8, 12]
    assert [row["step"] for row in rows_of(whole) if "valid_loss" in row] == [4, 8, 12]

    parted = tmp_path / "parted"
    train(domains["b.train"], parted, *FORGETTING, "--valid", domains["a.valid"], "--init",
          model_a, "--max-steps", 8)
    resumed = train(domains["b.train"], parted, *FORGETTING, "--valid", domains["a.valid"],
                    "--init", model_a, "--resume")
    assert "stopped early at step 12: 2 validations" in resumed, resumed
    assert_same_weights(final_weights(whole), final_weights(parted))
    assert load_model(parted / "checkpoint-12.st").metadata["init"] == str(model_a)
    # Resumed once more, it stops where it stopped, without training on.
    again = train(domains["b.train"], parted, *FORGETTING, "--valid", domains["a.valid"],
                  "--resume")
    assert "stopped early at step 12" in again, again
    assert list_checkpoints(parted)[-1][0] == 12


@pytest.mark.slow
def test_a_run_stopped_off_the_save_cadence_resumes_on_it_and_counts_as_the_whole(
        domains, model_a, tmp_path):
    """Stopped at step 6 (not a multiple of --save-every 4), the run saves and validates there;
    resumed, it saves at 8 and 12 as the uninterrupted run does (not 10), and its step-6
    validation, worse than step 4's, is not one of the cadence's: counted, it would stop the
    run at step 8."""
    whole = tmp_path / "whole"
    train(domains["b.train"], whole, *FORGETTING, "--valid", domains["a.valid"], "--init",
          model_a)
    parted = tmp_path / "parted"
    train(domains["b.train"], parted, *FORGETTING, "--valid", domains["a.valid"], "--init",
          model_a, "--max-steps", 6)
    assert [row["step"] for row in rows_of(parted) if "valid_loss" in row] == [4, 6]
    resumed = train(domains["b.train"], parted, *FORGETTING, "--valid", domains["a.valid"],
                    "--resume")
    assert "stopped early at step 12: 2 validations" in resumed, resumed
    assert "resume: init" not in resumed  # --init left out: nothing changed
    assert [step for step, _ in list_checkpoints(parted)] == [4, 6, 8, 12]
    assert_same_weights(final_weights(whole), final_weights(parted))
    # Resumed again without --init, from checkpoints written by a run resumed without it: the
    # checkpoints' provenance, not the options, says the architecture is the model file's.
    again = train(domains["b.train"], parted, *FORGETTING, "--valid", domains["a.valid"],
                  "--resume", "--max-steps", 16, "--patience", 0)
    assert list_checkpoints(parted)[-1][0] == 16, again
