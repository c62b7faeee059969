"""`attn export ct2`: the CTranslate2 model decodes greedily as `attn decode --beam 1` does."""

from __future__ import annotations

import sys

import pytest
import sentencepiece as spm

from ..conftest import assert_clean_error, run_attn


def test_ct2_greedy_output_equals_attn_decode(trained, corpus, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2", reason="pip install 'attn[ct2]'")

    model, _ = trained
    result = run_attn("export", "ct2", model, "-o", tmp_path / "ct2")
    assert result.returncode == 0, result.stderr
    assert {"model.bin", "config.json", "source.spm", "target.spm"} <= {
        path.name for path in (tmp_path / "ct2").iterdir()}
    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:30]
    decoded = run_attn("decode", "-m", model, "--beam", "1", "--dtype", "fp32",
                       stdin="\n".join(lines) + "\n")
    assert decoded.returncode == 0, decoded.stderr
    source = spm.SentencePieceProcessor(model_file=str(tmp_path / "ct2" / "source.spm"))
    target = spm.SentencePieceProcessor(model_file=str(tmp_path / "ct2" / "target.spm"))
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    outputs = []
    for line in lines:  # one call per line: attn's output limit is per sentence, |x| + 50
        pieces = source.encode(line, out_type=str)
        found = translator.translate_batch([pieces], beam_size=1,
                                           max_decoding_length=len(pieces) + 49)
        outputs.append(target.decode_pieces(found[0].hypotheses[0]))
    assert outputs == decoded.stdout.splitlines()


def test_export_refuses_without_ctranslate2_or_over_a_directory(trained, tmp_path, monkeypatch):
    model, _ = trained
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 fails
    assert_clean_error(run_attn("export", "ct2", model, "-o", tmp_path / "x"), "attn[ct2]")
    monkeypatch.undo()
    pytest.importorskip("ctranslate2", reason="pip install 'attn[ct2]'")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine\n")
    assert_clean_error(run_attn("export", "ct2", model, "-o", tmp_path / "taken"), "--force")
    assert (tmp_path / "taken" / "notes.txt").exists()
    assert_clean_error(run_attn("export", "ct2", tmp_path / "none.st", "-o", tmp_path / "y"),
                       "none.st")
