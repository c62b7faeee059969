"""`attn score` (scoring.py): text metrics through sacrebleu, and force-decoding with a model."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import sacrebleu
import torch

from attn_cli.errors import AttnError
from attn_cli.files import Utf8Policy
from attn_cli.scoring import ForcedScore, ForcedScores, text_score_lines, text_scores

from .conftest import REPO, assert_clean_error, run_attn

# --------------------------------------------------------------------------------- text metrics


def test_score_matches_sacrebleu(corpus, tmp_path):
    references = corpus["val.de"].read_text(encoding="utf-8").splitlines()
    hypotheses = [" ".join(line.split()[:-1]) for line in references]  # drop each last word
    hyp = tmp_path / "hyp.de"
    hyp.write_text("\n".join(hypotheses) + "\n", encoding="utf-8")
    result = run_attn("score", "--ref", corpus["val.de"], hyp, "--metrics", "bleu,chrf,ter")
    assert result.returncode == 0, result.stderr
    bleu, chrf, ter = result.stdout.splitlines()
    expected = sacrebleu.corpus_bleu(hypotheses, [references])
    assert bleu.startswith("BLEU|nrefs:1|case:mixed|eff:no|tok:13a")
    assert f"= {expected.score:.2f} " in bleu
    assert f"= {sacrebleu.corpus_chrf(hypotheses, [references]).score:.2f}" in chrf
    assert f"= {sacrebleu.corpus_ter(hypotheses, [references]).score:.2f}" in ter
    intl = run_attn("score", "--ref", corpus["val.de"], "--tokenize", "intl", "--metrics",
                    "bleu", stdin=hyp.read_text(encoding="utf-8"))
    expected_intl = sacrebleu.corpus_bleu(hypotheses, [references], tokenize="intl")
    assert "tok:intl" in intl.stdout and f"= {expected_intl.score:.2f} " in intl.stdout
    sentences = run_attn("score", "--ref", corpus["val.de"], hyp, "--sentence-level")
    assert len(sentences.stdout.splitlines()) == len(references)


def test_score_as_json(corpus, tmp_path):
    references = corpus["val.de"].read_text(encoding="utf-8").splitlines()
    hypotheses = [" ".join(line.split()[:-1]) for line in references]
    hyp = tmp_path / "hyp.de"
    hyp.write_text("\n".join(hypotheses) + "\n", encoding="utf-8")
    result = run_attn("score", "--ref", corpus["val.de"], hyp, "--format", "json")
    assert result.returncode == 0, result.stderr
    scores = json.loads(result.stdout)
    assert list(scores) == ["BLEU", "chrF2"]
    assert scores["BLEU"]["score"] == pytest.approx(
        sacrebleu.corpus_bleu(hypotheses, [references]).score, abs=1e-4)
    assert scores["BLEU"]["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    rows = run_attn("score", "--ref", corpus["val.de"], hyp, "--format", "json",
                    "--sentence-level", "--metrics", "chrf").stdout.splitlines()
    assert len(rows) == len(references)
    assert json.loads(rows[0]) == {"line": 1, "chrf": pytest.approx(
        sacrebleu.sentence_chrf(hypotheses[0], [references[0]]).score, abs=1e-4)}


def test_score_line_count_mismatch(corpus):
    assert_clean_error(run_attn("score", "--ref", corpus["val.de"], corpus["train.de"]),
                       "val.de", "train.de", "50", "300")


def test_compound_split_bleu_from_python_is_the_commands(tmp_path):
    """`text_scores(..., tokenize="compound-split")` is the paper's tokenized BLEU, the line
    `attn score --tokenize compound-split` prints."""
    hypotheses = ["Das Rich-Text Format ist gut.", "Hallo Welt!", "Ein Mann fährt Fahrrad."]
    references = ["Das Rich-Text-Format ist gut.", "Hallo, Welt!", "Ein Mann fährt ein Rad."]
    (tmp_path / "hyp").write_text("\n".join(hypotheses) + "\n", encoding="utf-8")
    (tmp_path / "ref").write_text("\n".join(references) + "\n", encoding="utf-8")
    command = run_attn("score", "--ref", tmp_path / "ref", tmp_path / "hyp", "--tokenize",
                       "compound-split", "--metrics", "bleu")
    assert command.returncode == 0, command.stderr
    (paper,) = text_scores(hypotheses, references, ["bleu"], tokenize="compound-split")
    assert command.stdout.splitlines() == [paper.line()]
    assert "tok:moses-like+compound-split" in paper.signature
    (plain,) = text_scores(hypotheses, references, ["bleu"])  # 13a: another score
    assert plain.score != pytest.approx(paper.score)


def test_a_bad_line_ends_the_output_after_the_lines_before_it(tmp_path):
    """Strict UTF-8: the per-line scores of the lines before an invalid one, then its error;
    no corpus score (of part of the corpus) at all."""
    (tmp_path / "hyp").write_bytes(b"ein Haus\nzwei H\xe4user\ndrei\n")
    (tmp_path / "ref").write_text("ein Haus\nzwei H\u00e4user\ndrei\n", encoding="utf-8")
    strict = Utf8Policy(strict=True)
    lines = text_score_lines(str(tmp_path / "hyp"), str(tmp_path / "ref"), ["chrf"],
                             sentence_level=True, policy=strict, as_json=True)
    assert json.loads(next(lines)) == {"line": 1, "chrf": 100.0}
    with pytest.raises(AttnError, match=":2: invalid UTF-8"):
        next(lines)
    with pytest.raises(AttnError, match=":2: invalid UTF-8"):
        next(text_score_lines(str(tmp_path / "hyp"), str(tmp_path / "ref"), ["bleu"],
                              policy=Utf8Policy(strict=True)))


def test_score_does_not_import_torch(corpus):
    code = ("import sys; from attn_cli.cli import main\n"
            f"try:\n    main(['score', '--ref', r'{corpus['val.de']}', r'{corpus['val.de']}'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stderr.strip().splitlines()[-1] == "False"


# ------------------------------------------------------------------------------- force-decoding


def test_force_decoding_perplexity_equals_training_validation(trained, corpus):
    model, valid_ppl = trained
    result = run_attn("score", "-m", model, corpus["val.en"], corpus["val.de"], "--format",
                      "json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 50
    perplexity = math.exp(-sum(row["log_prob"] for row in rows) / sum(row["tokens"]
                                                                      for row in rows))
    assert perplexity == pytest.approx(valid_ppl, rel=0.005)


def test_force_decoding_as_json(trained, corpus):
    model, _ = trained
    text = run_attn("score", "-m", model, corpus["val.en"], corpus["val.de"]).stdout
    assert all(len(line.split("\t")) == 2 for line in text.splitlines())
    rows = run_attn("score", "-m", model, corpus["val.en"], corpus["val.de"], "--format",
                    "json").stdout.splitlines()
    assert [json.loads(row) for row in rows] == [
        {"line": number, "log_prob": pytest.approx(float(line.split("\t")[0]), abs=1e-4),
         "tokens": int(line.split("\t")[1])}
        for number, line in enumerate(text.splitlines(), start=1)]


def test_score_reproduces_the_scores_of_decode_nbest(trained, corpus, tmp_path):
    """Search and scoring agree (as Sockeye tests): with α 0 the score `attn decode --nbest`
    prints is the hypothesis' log-probability, which `attn score -m` of the source and that
    hypothesis gives again. Both print 4 decimals: equal within one unit of the last."""
    model, _ = trained
    sources = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:8]
    common = ["-m", model, "--dtype", "fp32", "--device", "cpu"]
    decoded = run_attn("decode", *common, "--nbest", "4", "--beam", "4", "--alpha", "0",
                       "--max-len-b", "10", stdin="\n".join(sources) + "\n")
    assert decoded.returncode == 0, decoded.stderr
    rows = [line.split("\t") for line in decoded.stdout.splitlines()]
    assert len(rows) == 4 * len(sources)
    scores = [float(score) for _, score, _ in rows]
    assert all(math.isfinite(score) for score in scores)  # 4 hypotheses found for each line
    (tmp_path / "src").write_text("".join(sources[int(index)] + "\n" for index, _, _ in rows),
                                  encoding="utf-8")
    (tmp_path / "tgt").write_text("".join(text + "\n" for _, _, text in rows),
                                  encoding="utf-8")
    scored = run_attn("score", *common, tmp_path / "src", tmp_path / "tgt", "--format", "json")
    assert scored.returncode == 0, scored.stderr
    log_probs = [json.loads(line)["log_prob"] for line in scored.stdout.splitlines()]
    assert log_probs == pytest.approx(scores, abs=1e-4 + 1e-9)


def test_forced_scores_are_written_as_text_or_json_then_the_bad_line():
    scores = [ForcedScore(-1.23456, 5), ForcedScore(-0.5, 2)]
    forced = ForcedScores(scores, 2.04)
    assert list(forced.lines()) == ["-1.2346\t5", "-0.5000\t2"]
    assert list(forced.lines(as_json=True)) == ['{"line": 1, "log_prob": -1.2346, "tokens": 5}',
                                                '{"line": 2, "log_prob": -0.5, "tokens": 2}']
    assert forced.summary() == ("score: 2 pairs, 7 target tokens (EOS included), perplexity "
                                f"{math.exp(1.73456 / 7):.4f} in 2.0s")
    bad = ForcedScores(scores, 2.0, AttnError("hyp: line 3: invalid UTF-8"))
    written = []
    with pytest.raises(AttnError, match="line 3"):
        written.extend(bad.lines())
    assert written == ["-1.2346\t5", "-0.5000\t2"]


def test_force_decoding_out_of_memory_names_the_batch_and_the_option(monkeypatch):
    from attn_cli.model import Transformer
    from attn_cli.modelfile import load_model
    from attn_cli.scoring import force_decode

    fixtures = REPO / "tests" / "fixtures"
    model = fixtures / json.loads((fixtures / "golden.json").read_text())["checkpoint"]

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\n...")

    monkeypatch.setattr(Transformer, "decode", out_of_memory)
    with pytest.raises(AttnError, match=r"out of GPU memory with batches of 700 tokens \(CUDA "
                       r"out of memory. Tried to allocate 2.00 GiB.\): lower --batch-tokens "
                       r"\(700\)"):
        force_decode([load_model(model)], ["a b"], ["b a"], torch.device("cpu"),
                     "fp32", batch_tokens=700)
