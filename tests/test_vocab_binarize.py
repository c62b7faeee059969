"""`attn vocab`, `attn binarize` and the data module, through the real entry point."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from attn_cli.data import ParallelData
from attn_cli.errors import AttnError
from attn_cli.vocab import Vocabulary

from .conftest import assert_clean_error, run_attn


def test_vocab_writes_model_and_listing_with_fixed_special_ids(spm_model):
    vocabulary = Vocabulary.from_file(spm_model)
    assert len(vocabulary) == 400
    listing = spm_model.with_suffix(".vocab").read_text(encoding="utf-8").splitlines()
    assert len(listing) == 400
    assert [line.split("\t")[0] for line in listing[:4]] == ["<pad>", "<unk>", "<s>", "</s>"]


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_vocab_is_deterministic(corpus, tmp_path, model_type):
    outputs = []
    for attempt in range(2):
        out = tmp_path / f"{attempt}.model"
        result = run_attn("vocab", corpus["train.en"], corpus["train.de"], "-o", out,
                          "--size", "300", "--type", model_type, "--seed", "7")
        assert result.returncode == 0, result.stderr
        assert result.stdout == ""  # logs go to stderr
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]


def test_vocab_sample_is_a_seeded_subset(corpus, tmp_path):
    out = tmp_path / "sampled.model"
    result = run_attn("vocab", corpus["train.en"], "-o", out, "--size", "200", "--sample", "100")
    assert result.returncode == 0, result.stderr
    assert "a sample of 100" in result.stderr


def test_vocab_reads_stdin(corpus, tmp_path):
    out = tmp_path / "stdin.model"
    result = run_attn("vocab", "-", "-o", out, "--size", "200",
                      stdin=corpus["train.en"].read_text(encoding="utf-8"))
    assert result.returncode == 0, result.stderr
    assert len(Vocabulary.from_file(out)) == 200


def test_vocab_too_large_for_corpus_is_a_clean_error(corpus, tmp_path):
    result = run_attn("vocab", corpus["val.en"], "-o", tmp_path / "x.model", "--size", "37000")
    assert_clean_error(result, "37000")
    assert not (tmp_path / "x.model").exists()


def test_binarize_round_trip(corpus, spm_model, tmp_path):
    out = tmp_path / "train.st"
    result = run_attn("binarize", "--vocab", spm_model, corpus["train.en"], corpus["train.de"],
                      "-o", out)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert "300 pairs kept" in result.stderr
    data = ParallelData(out)
    assert len(data) == 300
    vocabulary = Vocabulary.from_file(spm_model)
    assert data.metadata["src_vocab_sha256"] == vocabulary.checksum
    assert data.src_vocab.model_bytes == vocabulary.model_bytes and data.shared_vocab
    english = corpus["train.en"].read_text(encoding="utf-8").splitlines()
    german = corpus["train.de"].read_text(encoding="utf-8").splitlines()
    for index in (0, 17, 299):
        src, tgt = data.pair(index)
        assert src.tolist() == vocabulary.encode([english[index]])[0]
        assert vocabulary.decode([tgt.tolist()])[0] == vocabulary.decode(
            vocabulary.encode([german[index]]))[0]
    # The file is plain safetensors: the reference reader sees the same arrays.
    tensors = load_file(str(out))
    assert tensors["src.ids"].dtype == np.int32 and tensors["src.offsets"].dtype == np.int64
    np.testing.assert_array_equal(tensors["tgt.ids"], data.ids["tgt"])
    assert int(data.metadata["src_tokens"]) == len(tensors["src.ids"])


def test_binarize_drops_empty_and_long_pairs_and_counts_them(spm_model, tmp_path):
    src = tmp_path / "s.txt"
    tgt = tmp_path / "t.txt"
    src.write_text("a man\n\na dog runs\n" + "word " * 50 + "\nthe end\n", encoding="utf-8")
    tgt.write_text("ein Mann\nleer\n   \nlang\ndas Ende\n", encoding="utf-8")
    out = tmp_path / "d.st"
    result = run_attn("binarize", "--vocab", spm_model, src, tgt, "-o", out, "--max-len", "20")
    assert result.returncode == 0, result.stderr
    assert "2 dropped (empty side)" in result.stderr and "1 dropped (too long)" in result.stderr
    data = ParallelData(out)
    assert len(data) == 2
    assert data.metadata["dropped_empty"] == "2" and data.metadata["dropped_too_long"] == "1"


def test_binarize_separate_target_vocab(corpus, spm_model, tmp_path):
    tgt_model = tmp_path / "de.model"
    assert run_attn("vocab", corpus["train.de"], "-o", tgt_model, "--size", "300").returncode == 0
    out = tmp_path / "sep.st"
    result = run_attn("binarize", "--vocab", spm_model, "--tgt-vocab", tgt_model,
                      corpus["val.en"], corpus["val.de"], "-o", out)
    assert result.returncode == 0, result.stderr
    data = ParallelData(out)
    assert not data.shared_vocab and len(data.tgt_vocab) == 300
    assert data.metadata["tgt_vocab_sha256"] != data.metadata["src_vocab_sha256"]


def test_binarize_mismatched_line_counts(corpus, spm_model, tmp_path):
    out = tmp_path / "bad.st"
    result = run_attn("binarize", "--vocab", spm_model, corpus["train.en"], corpus["val.de"],
                      "-o", out)
    assert_clean_error(result, "train.en", "300", "val.de", "50")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary files left behind


def test_binarize_invalid_utf8_names_file_and_line(spm_model, tmp_path):
    src = tmp_path / "src.txt"
    tgt = tmp_path / "tgt.txt"
    src.write_bytes(b"fine\nstill fine\n")
    tgt.write_bytes(b"gut\nkaputt \xff\xfe hier\n")
    result = run_attn("binarize", "--vocab", spm_model, src, tgt, "-o", tmp_path / "o.st")
    assert_clean_error(result, f"{tgt}:2", "UTF-8")


def test_vocab_invalid_utf8_names_file_and_line(tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(b"one\ntwo\nthree \xc3\x28\n")
    result = run_attn("vocab", text, "-o", tmp_path / "v.model", "--size", "20")
    assert_clean_error(result, f"{text}:3", "UTF-8")


@pytest.mark.parametrize("command", ["vocab", "binarize"])
def test_missing_input_file(command, spm_model, tmp_path):
    missing = tmp_path / "nope.txt"
    if command == "vocab":
        result = run_attn("vocab", missing, "-o", tmp_path / "v.model")
    else:
        result = run_attn("binarize", "--vocab", spm_model, missing, missing, "-o",
                          tmp_path / "o.st")
    assert_clean_error(result, str(missing), "does not exist")


def test_empty_corpus(spm_model, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert_clean_error(run_attn("binarize", "--vocab", spm_model, empty, empty, "-o",
                                tmp_path / "o.st"), "empty")
    assert_clean_error(run_attn("vocab", empty, "-o", tmp_path / "v.model"), "empty")


def test_binarize_rejects_a_vocab_that_is_not_sentencepiece(corpus, tmp_path):
    fake = tmp_path / "fake.model"
    fake.write_bytes(b"not a model at all")
    result = run_attn("binarize", "--vocab", fake, corpus["val.en"], corpus["val.de"],
                      "-o", tmp_path / "o.st")
    assert_clean_error(result, str(fake), "SentencePiece")


def test_data_reader_rejects_non_data_files(tmp_path, spm_model):
    with pytest.raises(AttnError, match="empty"):
        (tmp_path / "e.st").write_bytes(b"")
        ParallelData(tmp_path / "e.st")
    with pytest.raises(AttnError, match="not a safetensors"):
        ParallelData(spm_model)
