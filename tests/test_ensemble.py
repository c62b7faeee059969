"""Ensembles (ensemble.py): several models searched and scored as one, `-m A -m B`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attn_cli.ensemble import Ensemble
from attn_cli.search import beam_search
from attn_cli.vocab import Vocabulary

from .conftest import assert_clean_error, run_attn
from .toys import random_model, save_random_model

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_an_ensemble_averages_the_models_log_probabilities():
    first, second = random_model(vocab=30, seed=3), random_model(vocab=30, seed=4)
    src = torch.tensor([[5, 9, 3, 0], [7, 8, 9, 3]])
    tokens = torch.tensor([2, 2])
    ensemble = Ensemble([first, second])
    memory, mask = ensemble.encode(src)
    log_probs, cache = ensemble.decode_step(tokens, ensemble.start_decoding(memory, mask))
    expected = []
    for model in (first, second):
        logits, _ = model.decode_step(tokens, model.start_decoding(*model.encode(src)))
        expected.append(torch.log_softmax(logits, dim=-1))
    torch.testing.assert_close(log_probs, (expected[0] + expected[1]) / 2)
    # Searched as one model: a model twice is the model; the cache reorders every member.
    assert [h[0].tokens for h in beam_search(Ensemble([first, first]), src, beam=3,
                                             max_len_b=8)] == \
        [h[0].tokens for h in beam_search(first, src, beam=3, max_len_b=8)]
    both = beam_search(ensemble, src, beam=3, max_len_b=8, nbest=3)
    assert all(len(h) == 3 for h in both)


def test_decode_and_score_take_an_ensemble(trained, corpus, tmp_path):
    model, _ = trained
    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:10]
    stdin = "\n".join(lines) + "\n"
    common = ["decode", "--beam", "2", "--max-len-b", "6", "--dtype", "fp32"]
    alone = run_attn(*common, "-m", model, stdin=stdin)
    twice = run_attn(*common, "-m", model, "-m", model, stdin=stdin)
    assert twice.returncode == 0, twice.stderr
    assert twice.stdout == alone.stdout and twice.stdout.count("\n") == 10
    (tmp_path / "src").write_text(stdin, encoding="utf-8")
    (tmp_path / "tgt").write_text("\n".join(corpus["val.de"].read_text(
        encoding="utf-8").splitlines()[:10]) + "\n", encoding="utf-8")
    one = run_attn("score", "-m", model, tmp_path / "src", tmp_path / "tgt")
    two = run_attn("score", "-m", model, "-m", model, tmp_path / "src", tmp_path / "tgt")
    assert two.returncode == 0, two.stderr
    for a, b in zip(one.stdout.splitlines(), two.stdout.splitlines()):
        assert float(a.split("\t")[0]) == pytest.approx(float(b.split("\t")[0]), abs=1e-3)
    # A model with another vocabulary (the committed fixtures' 24 pieces) joins no ensemble.
    other = save_random_model(tmp_path / "other.st",
                              Vocabulary.from_file(FIXTURES / "spm.model"))
    assert_clean_error(run_attn(*common, "-m", model, "-m", other, stdin=stdin),
                       "other.st", "vocabular")
    assert_clean_error(run_attn("score", "-m", model, "-m", other, tmp_path / "src",
                                tmp_path / "tgt"), "other.st", "vocabular")
