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


@pytest.mark.parametrize("members", [1, 2])
def test_gold_log_probs_a_block_at_a_time_are_the_whole_logits_formula(members, monkeypatch):
    """`score -m` gathers the gold tokens' log-probabilities a few positions at a time (here 4
    rows of logits per block, so a batch spans several blocks, one ending mid-sentence): the
    same numbers as log_softmax over the whole (B, T, V) logits, averaged and renormalised for
    an ensemble (review F13r)."""
    import attn_cli.ensemble

    models = [random_model(vocab=30, seed=seed) for seed in (3, 4)][:members]
    src = torch.tensor([[5, 9, 3, 0], [7, 8, 9, 3]])
    tgt_input = torch.tensor([[2, 6, 7, 8, 0], [2, 9, 9, 5, 4]])
    tgt_output = torch.tensor([[6, 7, 8, 3, 0], [9, 9, 5, 4, 3]])
    each = [torch.log_softmax(model(src, tgt_input), dim=-1) for model in models]
    whole = each[0] if members == 1 else torch.log_softmax(torch.stack(each).mean(0), dim=-1)
    expected = whole.gather(-1, tgt_output.unsqueeze(-1)).squeeze(-1)
    monkeypatch.setattr(attn_cli.ensemble, "GOLD_BLOCK_ELEMENTS", 4 * 30)
    with torch.no_grad():
        got = Ensemble(models).gold_log_probs(src, tgt_input, tgt_output)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)


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
