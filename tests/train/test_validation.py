"""Validation by BLEU / chrF / F1 while training, the best checkpoints kept, and averaged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attn_cli.batching import source_budget, token_budget_batches
from attn_cli.checkpoints import best_steps, list_checkpoints, scored_steps, state_path
from attn_cli.data import ParallelData
from attn_cli.modelfile import load_model
from attn_cli.train.validation import Validator, shared_budget

from ..conftest import assert_clean_error, run_attn


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Tests taking `bleu_run` are marked slow: the run decodes the validation set at every save
# (seconds of setup, even on a quiet machine).
@pytest.fixture(scope="module")
def bleu_run(data_files, tmp_path_factory) -> Path:
    """A tiny run validated by BLEU at every 3rd step, keeping the last checkpoint and the 2
    best by BLEU."""
    run_dir = tmp_path_factory.mktemp("bleu-run") / "run"
    result = run_attn("train", data_files[0], "-o", run_dir, "--preset", "tiny", "--max-steps",
                      "15", "--save-every", "3", "--log-every", "3", "--lr-scale", "3",
                      "--valid", data_files[1], "--valid-metric", "bleu", "--keep", "1",
                      "--keep-best", "2", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "valid_bleu" in result.stderr and "valid_s" in result.stderr
    return run_dir


@pytest.mark.slow
def test_validation_bleu_is_what_decode_and_score_give(bleu_run, corpus, tmp_path):
    """The BLEU training records for a checkpoint is the BLEU of `attn decode --beam 1` of the
    validation sources, scored by `attn score` against the detokenized references."""
    row = rows_of(bleu_run)[-1]
    assert row["valid_metric"] == "bleu" and row["step"] == 15
    hypotheses = run_attn("decode", "-m", bleu_run / "checkpoint-15.st", "--beam", "1",
                          "--dtype", "fp32", stdin=corpus["val.en"].read_text(encoding="utf-8"))
    assert hypotheses.returncode == 0, hypotheses.stderr
    (tmp_path / "hyp").write_text(hypotheses.stdout, encoding="utf-8")
    scored = run_attn("score", "--ref", corpus["val.de"], tmp_path / "hyp", "--metrics", "bleu",
                      "--format", "json")
    assert scored.returncode == 0, scored.stderr
    # Decoding here uses oneDNN's packed weights, training's plain matmuls: a rare token may
    # differ between the two, hence the tolerance.
    assert row["valid_bleu"] == pytest.approx(json.loads(scored.stdout)["BLEU"]["score"],
                                              abs=0.5)


@pytest.mark.slow
def test_keep_best_keeps_the_best_models_and_the_last_state(bleu_run):
    metric, scores = scored_steps(bleu_run)
    assert metric == "bleu" and sorted(scores) == [3, 6, 9, 12, 15]
    kept = {step for step, _ in list_checkpoints(bleu_run)}
    expected_best = set(best_steps(scores, "bleu", 2))
    assert kept == expected_best | {15}
    for step in kept - {15}:  # best ones keep their model only: runs resume from the last
        assert not state_path(bleu_run, step).exists()
    assert state_path(bleu_run, 15).exists()


@pytest.mark.slow
def test_average_best_takes_the_best_by_the_runs_metric(bleu_run, tmp_path):
    result = run_attn("average", bleu_run, "--best", "2", "-o", tmp_path / "best.st")
    assert result.returncode == 0, result.stderr
    _, scores = scored_steps(bleu_run)
    kept = {step for step, _ in list_checkpoints(bleu_run)}
    best = best_steps({s: v for s, v in scores.items() if s in kept}, "bleu", 2)
    averaged = load_model(tmp_path / "best.st")  # the model file names its sources
    named = [int(Path(path).stem.split("-")[1])
             for path in json.loads(averaged.metadata["averaged_from"])]
    assert sorted(named) == sorted(best)
    assert "valid_bleu" in result.stderr
    # By loss instead: the steps with a valid_loss score that still have a checkpoint.
    by_loss = run_attn("average", bleu_run, "--best", "1", "--metric", "loss", "-o",
                       tmp_path / "loss.st")
    assert by_loss.returncode == 0, by_loss.stderr
    assert "valid_loss" in by_loss.stderr


def test_best_steps_rank_by_direction():
    scores = {1: 10.0, 2: 30.0, 3: 20.0, 4: 30.0}
    assert best_steps(scores, "bleu", 2) == [4, 2]  # higher is better; a tie: later first
    assert best_steps(scores, "loss", 2) == [1, 3]  # lower is better


@pytest.mark.slow
def test_validation_options_refuse_bad_input(data_files, bleu_run, tmp_path):
    base = ["train", data_files[0], "-o", tmp_path / "r", "--preset", "tiny", "--max-steps",
            "1", "--device", "cpu"]
    assert_clean_error(run_attn(*base, "--valid-metric", "bleu"), "--valid")
    assert_clean_error(run_attn(*base, "--valid-metric", "rouge"), "--valid-metric")
    short = tmp_path / "short.de"
    short.write_text("one line\n", encoding="utf-8")
    assert_clean_error(run_attn(*base, "--valid", data_files[1], "--valid-metric", "bleu",
                                "--valid-ref", short), "short.de", "1 lines", "50 pairs")
    assert_clean_error(run_attn("average", bleu_run, "--best", "2", "--last", "2", "-o",
                                tmp_path / "x.st"), "--last", "--best")
    fewer = run_attn("average", bleu_run, "--best", "9", "-o", tmp_path / "all.st")
    assert fewer.returncode == 0, fewer.stderr  # as --last: the ones there are
    assert "the mean of 3 checkpoint(s)" in fewer.stderr
    assert_clean_error(run_attn("average", bleu_run, "--best", "1", "--metric", "f1", "-o",
                                tmp_path / "x.st"), "valid_f1")
    assert_clean_error(run_attn("average", bleu_run / "checkpoint-15.st", "--best", "1", "-o",
                                tmp_path / "x.st"), "run directory")


@pytest.mark.slow
def test_validation_f1_is_what_parse_and_score_give(word_parser, tmp_path):
    """A parser validated by F1: the score training would record for it is EVALB's F1 of
    `attn parse --beam 1 --constrain` of the validation sentences against the gold trees."""
    directory = word_parser
    result = run_attn("binarize", "--vocab", directory / "spm.model", directory / "dev.src",
                      directory / "dev.tgt", "-o", tmp_path / "dev.st")
    assert result.returncode == 0, result.stderr
    model = load_model(directory / "parser.st").model
    validator = Validator.build("f1", ParallelData(tmp_path / "dev.st"),
                                str(directory / "dev.mrg"))
    f1 = validator.score(model)
    parsed = run_attn("parse", "-m", directory / "parser.st", "--beam", "1", "--dtype", "fp32",
                      "--constrain", stdin=(directory / "dev.src").read_text(encoding="utf-8"))
    assert parsed.returncode == 0, parsed.stderr
    (tmp_path / "parsed").write_text(parsed.stdout, encoding="utf-8")
    scored = run_attn("score", "--trees", "--ref", directory / "dev.mrg", tmp_path / "parsed",
                      "--format", "json")
    assert scored.returncode == 0, scored.stderr
    assert f1 == pytest.approx(json.loads(scored.stdout)["all"]["f1"], abs=0.01)
    assert f1 > 50  # a parser that learned something: the score is not vacuous
    # Without --valid-ref the gold trees are the validation targets rebuilt over the words:
    # the targets themselves score 100, the parser's output less.
    data = ParallelData(tmp_path / "dev.st")
    from_targets = Validator.build("f1", data)
    targets = data.src_vocab.decode([data.pair(i)[1].tolist() for i in range(len(data))])
    assert from_targets.score_texts(targets) == pytest.approx(100.0)
    assert 50 < from_targets.score_texts(validator.hypotheses(model)) < 100


def test_validation_shared_out_among_processes_decodes_what_one_process_does(trained,
                                                                             data_files):
    """With N processes each decodes every N-th batch of the validation set; the shares put
    together are the one process's output, whatever N."""
    model = load_model(trained[0]).model.eval()
    validator = Validator.build("bleu", ParallelData(data_files[1]), batch_tokens=300)
    whole = validator.search(model)
    assert sorted(whole) == list(range(len(validator.sources)))
    for world_size in (2, 3):
        shares = [validator.search(model, rank, world_size) for rank in range(world_size)]
        assert all(shares) and sum(map(len, shares)) == len(whole)
        merged = {index: tokens for share in shares for index, tokens in share.items()}
        assert merged == whole
    assert validator.texts(whole) == validator.hypotheses(model)


@pytest.mark.parametrize("beam", [1, 4])
def test_every_one_of_8_gpus_gets_validation_sentences_to_decode(beam):
    """3,000 sentences of ~30 tokens fit 64,000-token GPU batches in 2: the budget shrinks so
    that each of 8 processes decodes a share, and stays the device's for one process."""
    lengths = [10 + (index * 7919) % 41 for index in range(3000)]
    gpu = torch.device("cuda")  # only compared: no GPU is needed
    whole = token_budget_batches(lengths, source_budget(shared_budget(lengths, 1, gpu), beam))
    assert len(whole) <= 2 * beam
    batches = token_budget_batches(lengths, source_budget(shared_budget(lengths, 8, gpu), beam))
    shares = [sum(len(batch) for batch in batches[rank::8]) for rank in range(8)]
    assert min(shares) > 0 and sum(shares) == 3000


def test_a_failing_validation_does_not_end_the_run(data_files, tmp_path, monkeypatch):
    def broken(self, model, rank=0, world_size=1):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(Validator, "search", broken)
    result = run_attn("train", data_files[0], "-o", tmp_path / "run", "--preset", "tiny",
                      "--max-steps", "4", "--save-every", "2", "--valid", data_files[1],
                      "--valid-metric", "bleu", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("validation by bleu failed, the run goes on") == 2
    assert [step for step, _ in list_checkpoints(tmp_path / "run")] == [2, 4]
    assert all("valid_bleu" not in row and "valid_loss" in row
               for row in rows_of(tmp_path / "run"))
