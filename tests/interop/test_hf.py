"""Hugging Face both ways (`attn export hf`, `attn import hf`): transformers' MarianMTModel and
attn compute the same logits and greedy outputs, for attn's models exported and for OPUS-MT-shaped
Marian models imported (ReLU without biases, and swish with attention and output biases)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from attn_cli.config import ModelConfig
from attn_cli.model import Transformer
from attn_cli.modelfile import load_model, save_model
from attn_cli.search import beam_search
from attn_cli.vocab import Vocabulary, learn

from ..conftest import assert_clean_error, run_attn
from ..toys import marian_greedy

transformers = pytest.importorskip("transformers", reason="pip install 'attn[hf]'")


def largest_logit_difference(loaded, marian, tokenizer, lines, outputs) -> float:
    config, worst = loaded.config, 0.0
    loaded.model.eval()
    for line, output in zip(lines, outputs):
        src = torch.tensor([tokenizer(line)["input_ids"]])
        decoder_input = torch.tensor([[config.bos_id] + loaded.tgt_vocab.encode([output])[0]])
        with torch.inference_mode():
            ours = loaded.model(src, decoder_input)
            theirs = marian(input_ids=src, decoder_input_ids=decoder_input).logits
        worst = max(worst, float((ours - theirs).abs().max()))
    return worst


def test_export_loads_in_transformers_and_decodes_as_attn(trained, corpus, tmp_path):
    model, _ = trained
    result = run_attn("export", "hf", model, "-o", tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    names = {path.name for path in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "source.spm",
            "target.spm", "vocab.json", "tokenizer_config.json", "README.md"} <= names
    marian = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(tmp_path / "hf")
    assert marian.config.activation_function == "relu" and marian.config.scale_embedding
    assert not marian.final_logits_bias.any()
    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:20]
    decoded = run_attn("decode", "-m", model, "--beam", "1", stdin="\n".join(lines) + "\n")
    assert decoded.returncode == 0, decoded.stderr
    ours = decoded.stdout.splitlines()
    assert marian_greedy(marian, tokenizer, lines) == ours
    loaded = load_model(model)
    assert largest_logit_difference(loaded, marian, tokenizer, lines, ours) < 1e-4
    # The permutation of d_model is exact: with attn's epsilon, only float rounding is left.
    for module in marian.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = loaded.config.layer_norm_eps
    assert largest_logit_difference(loaded, marian, tokenizer, lines, ours) < 2e-5
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "MarianMTModel" in card and "tiny" in card


def test_export_then_import_round_trips_bit_exactly(trained, tmp_path):
    model, _ = trained
    assert run_attn("export", "hf", model, "-o", tmp_path / "hf").returncode == 0
    back = tmp_path / "back.st"
    result = run_attn("import", "hf", tmp_path / "hf", "-o", back)
    assert result.returncode == 0, result.stderr
    original, imported = load_model(model), load_model(back)
    assert imported.config == original.config
    assert imported.src_vocab.model_bytes == original.src_vocab.model_bytes
    ours, theirs = original.model.state_dict(), imported.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_separate_embeddings_and_biases_round_trip_bit_exactly(spm_model, corpus, tmp_path):
    """The mapping's other rows: a source embedding of its own (Marian then has no shared
    matrix), attention and output biases, swish; biases and norms drawn at random, so that a
    vector permuted wrongly shows."""
    vocabulary = Vocabulary(spm_model.read_bytes())
    config = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64, heads=2,
                         d_k=16, d_v=16, dropout=0.0, src_vocab_size=len(vocabulary),
                         tgt_vocab_size=len(vocabulary), share_embeddings=False,
                         activation="swish", attention_bias=True, output_bias=True)
    torch.manual_seed(5)
    model = Transformer(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.normal_(std=0.5)
    path = tmp_path / "model.st"
    save_model(path, model, vocabulary, vocabulary)
    assert run_attn("export", "hf", path, "-o", tmp_path / "hf").returncode == 0
    marian = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    assert not marian.config.share_encoder_decoder_embeddings
    for module in marian.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = config.layer_norm_eps
    tokenizer = transformers.MarianTokenizer.from_pretrained(tmp_path / "hf")
    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:5]
    outputs = corpus["val.de"].read_text(encoding="utf-8").splitlines()[:5]
    original = load_model(path)
    assert largest_logit_difference(original, marian, tokenizer, lines, outputs) < 1e-4
    assert run_attn("import", "hf", tmp_path / "hf", "-o", tmp_path / "back.st").returncode == 0
    imported = load_model(tmp_path / "back.st")
    assert imported.config == original.config
    ours, theirs = original.model.state_dict(), imported.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


# ------------------------------------------------------------------ OPUS-MT-shaped Marian models


@pytest.fixture(scope="module")
def opus_directory_maker(corpus, tmp_path_factory):
    """A function writing a random Marian model with OPUS-MT's conventions to a directory: ids
    from a vocab.json (</s> 0, <unk> 1, the pieces in another order than the SentencePiece
    model's, <pad> last and the decoder's start), two SentencePiece models, d_model 64."""
    lines = corpus["train.en"].read_text(encoding="utf-8").splitlines() + \
        corpus["train.de"].read_text(encoding="utf-8").splitlines()
    spm = learn(lines, 300)
    pieces = [spm.piece(i) for i in range(4, len(spm))]
    pieces = ["</s>", "<unk>"] + pieces[::-1] + ["<pad>"]

    def make(name: str, activation: str, biased: bool):
        directory = tmp_path_factory.mktemp(name)
        config = transformers.MarianConfig(
            vocab_size=len(pieces), decoder_vocab_size=len(pieces), d_model=64,
            encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
            activation_function=activation, scale_embedding=True, max_position_embeddings=256,
            pad_token_id=len(pieces) - 1, eos_token_id=0, decoder_start_token_id=len(pieces) - 1,
            forced_eos_token_id=0, share_encoder_decoder_embeddings=True)
        torch.manual_seed(11)
        marian = transformers.MarianMTModel(config).eval()
        with torch.no_grad():
            for parameter_name, parameter in marian.named_parameters():
                if parameter.dim() > 1:  # a sharper model than init_std's: outputs vary
                    parameter.normal_(std=0.3 if "embed" in parameter_name else 0.15)
                elif "_proj.bias" in parameter_name:
                    parameter.normal_(std=0.5) if biased else parameter.zero_()
            if biased:
                marian.final_logits_bias.normal_(std=1.0)
        marian.save_pretrained(directory)
        (directory / "source.spm").write_bytes(spm.model_bytes)
        (directory / "target.spm").write_bytes(spm.model_bytes)
        (directory / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {"source_lang": "en", "target_lang": "de", "separate_vocabs": False}))
        return directory

    return make


@pytest.mark.parametrize("activation,biased", [("relu", False), ("swish", True)])
def test_imported_marian_model_computes_what_transformers_computes(
        opus_directory_maker, corpus, tmp_path, activation, biased):
    directory = opus_directory_maker(f"opus-{activation}", activation, biased)
    output = tmp_path / "imported.st"
    result = run_attn("import", "hf", directory, "-o", output)
    assert result.returncode == 0, result.stderr
    loaded = load_model(output)
    config = loaded.config
    assert (config.activation, config.attention_bias, config.output_bias) == (
        activation, biased, biased)
    last = len(loaded.tgt_vocab) - 1  # <pad>, the decoder's start
    assert (config.eos_id, config.unk_id, config.pad_id, config.bos_id) == (0, 1, last, last)
    assert config.layer_norm_eps == 1e-5 and loaded.metadata["langs"] == "en-de"
    marian = transformers.MarianMTModel.from_pretrained(directory).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:12]
    # the same ids for the same text, through the vocab.json map
    assert [ids + [config.eos_id] for ids in loaded.src_vocab.encode(lines)] == \
        [tokenizer(line)["input_ids"] for line in lines]
    theirs = marian_greedy(marian, tokenizer, lines)
    assert len(set(theirs)) > 3  # the outputs differ from line to line: a real comparison
    decoded = run_attn("decode", "-m", output, "--beam", "1", stdin="\n".join(lines) + "\n")
    assert decoded.returncode == 0, decoded.stderr
    assert decoded.stdout.splitlines() == theirs
    assert largest_logit_difference(loaded, marian, tokenizer, lines, theirs) < 1e-4
    # score -m and beam search take it like any model
    scored = run_attn("score", "-m", output, corpus["val.en"], corpus["val.de"])
    assert scored.returncode == 0, scored.stderr
    assert len(scored.stdout.splitlines()) == 50
    src = torch.tensor([tokenizer(lines[0])["input_ids"]])
    assert beam_search(loaded.model.eval(), src, beam=4, nbest=2)[0][0].tokens
    # data for fine-tuning it: binarized with the model's own vocabularies
    data = tmp_path / "data.st"
    binarized = run_attn("binarize", corpus["val.en"], corpus["val.de"], "--vocab", output,
                         "-o", data)
    assert binarized.returncode == 0, binarized.stderr
    from safetensors import safe_open
    with safe_open(str(data), "pt") as handle:
        assert handle.metadata()["src_vocab_sha256"] == loaded.src_vocab.checksum


def test_piece_map_vocabulary_survives_the_model_file(opus_directory_maker, tmp_path):
    directory = opus_directory_maker("opus-vocab", "relu", False)
    output = tmp_path / "imported.st"
    assert run_attn("import", "hf", directory, "-o", output).returncode == 0
    vocabulary = load_model(output).src_vocab
    assert vocabulary.pieces is not None and vocabulary.pieces[0] == "</s>"
    again = Vocabulary(vocabulary.model_bytes)
    assert again.pieces == vocabulary.pieces and len(again) == len(vocabulary.pieces)
    assert again.decode(again.encode(["A dog runs."])) == ["A dog runs."]
    assert again.piece(1) == "<unk>"


def test_import_and_export_refuse_cleanly(trained, opus_directory_maker, tmp_path, monkeypatch):
    model, _ = trained
    assert_clean_error(run_attn("import", "hf", tmp_path / "nowhere", "-o", tmp_path / "x.st"),
                       "config.json")
    directory = opus_directory_maker("opus-unscaled", "relu", False)
    settings = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**settings, "scale_embedding": False}))
    assert_clean_error(run_attn("import", "hf", directory, "-o", tmp_path / "x.st"),
                       "scale_embedding")
    (directory / "config.json").write_text(json.dumps(
        {**settings, "activation_function": "gelu"}))
    assert_clean_error(run_attn("import", "hf", directory, "-o", tmp_path / "x.st"),
                       "activation_function")
    (directory / "config.json").write_text(json.dumps(settings))
    (directory / "vocab.json").write_text("{not json")
    assert_clean_error(run_attn("import", "hf", directory, "-o", tmp_path / "x.st"),
                       "vocab.json")
    assert not (tmp_path / "x.st").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine\n")
    assert_clean_error(run_attn("export", "hf", model, "-o", tmp_path / "taken"), "--force")
    assert (tmp_path / "taken" / "notes.txt").exists()
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    assert_clean_error(run_attn("export", "hf", model, "-o", tmp_path / "y"), "attn[hf]")
    assert_clean_error(run_attn("import", "hf", directory, "-o", tmp_path / "y.st"),
                       "attn[hf]")
