"""`attn import hf` of a multi-target OPUS-MT model (issue 43): its `>>xxx<<` language tokens
are pieces of the imported vocabulary, a line starting with one is cut as MarianTokenizer cuts
it, `--target-lang fra` puts `>>fra<<` first, and the model computes transformers' log-probs
for tagged inputs (and greedy outputs): a random OPUS-MT-shaped Marian model built offline."""

from __future__ import annotations

import json

import pytest
import torch

from attn_cli.decode.translator import load_translator
from attn_cli.modelfile import load_model
from attn_cli.tags import vocabulary_tags
from attn_cli.vocab import learn

from ..conftest import assert_clean_error, run_attn
from ..toys import marian_greedy

transformers = pytest.importorskip("transformers", reason="pip install 'attn[hf]'")

CODES = (">>fra<<", ">>deu<<", ">>por<<")


@pytest.fixture(scope="module")
def multi_target(corpus, tmp_path_factory):
    """A random Marian model with OPUS-MT's conventions (ids from vocab.json: </s> 0, <unk> 1,
    the language tokens next, <pad> last and the decoder's start; swish, biases), imported."""
    lines = corpus["train.en"].read_text(encoding="utf-8").splitlines()
    spm = learn(lines, 200)
    pieces = ["</s>", "<unk>", *CODES, *(spm.piece(i) for i in range(4, len(spm))), "<pad>"]
    directory = tmp_path_factory.mktemp("opus-mul")
    config = transformers.MarianConfig(
        vocab_size=len(pieces), decoder_vocab_size=len(pieces), d_model=32, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, activation_function="swish",
        scale_embedding=True, max_position_embeddings=128, pad_token_id=len(pieces) - 1,
        eos_token_id=0, decoder_start_token_id=len(pieces) - 1, forced_eos_token_id=0,
        share_encoder_decoder_embeddings=True)
    torch.manual_seed(7)
    marian = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        for name, parameter in marian.named_parameters():
            if parameter.dim() > 1:  # sharper than init_std's: outputs vary with the input
                parameter.normal_(std=0.5 if "embed" in name else 0.2)
            elif "_proj.bias" in name:
                parameter.normal_(std=0.5)
        marian.final_logits_bias.normal_(std=1.0)
    marian.save_pretrained(directory)
    for name in ("source.spm", "target.spm"):
        (directory / name).write_bytes(spm.model_bytes)
    (directory / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"source_lang": "en", "target_lang": "mul", "separate_vocabs": False}))
    output = directory / "imported.st"
    result = run_attn("import", "hf", directory, "-o", output)
    assert result.returncode == 0, result.stderr
    tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    # as saved: the position table is Marian's sinusoids again (the loop above drew over it)
    marian = transformers.MarianMTModel.from_pretrained(directory).eval()
    return marian, tokenizer, output, lines[:8]


def test_tagged_inputs_get_transformers_ids_and_log_probs(multi_target):
    marian, tokenizer, output, lines = multi_target
    loaded = load_model(output)
    vocabulary, eos = loaded.src_vocab, loaded.config.eos_id
    assert vocabulary_tags(vocabulary).targets == {"fra": 2, "deu": 3, "por": 4}
    assert sorted(tokenizer.supported_language_codes) == sorted(CODES)
    french = load_translator(output, 1, device="cpu", threads=1, target_lang="fra")
    for line in lines:
        theirs = tokenizer(f">>fra<< {line}")["input_ids"]
        assert theirs[0] == 2
        # typed, as MarianTokenizer cuts it, and put first by --target-lang: the same ids
        assert vocabulary.encode([f">>fra<< {line}"])[0] + [eos] == theirs
        assert french.encode([line], 1)[0] == theirs
    worst = 0.0
    for code in (">>fra<<", ">>deu<<"):
        for line, output_line in zip(lines, reversed(lines)):  # any target text will do
            src = torch.tensor([tokenizer(f"{code} {line}")["input_ids"]])
            tgt = torch.tensor([[loaded.config.bos_id, *loaded.tgt_vocab.encode([output_line])[0]]])
            with torch.inference_mode():
                ours = torch.log_softmax(loaded.model(src, tgt).float(), dim=-1)
                theirs = torch.log_softmax(marian(input_ids=src, decoder_input_ids=tgt).logits,
                                           dim=-1)
            worst = max(worst, float((ours - theirs).abs().max()))
    assert worst < 1e-4


def test_decode_target_lang_writes_what_transformers_generates(multi_target):
    marian, tokenizer, output, lines = multi_target
    outputs = {}
    for code in ("fra", "deu"):
        decoded = run_attn("decode", "-m", output, "--target-lang", code, "--beam", "1",
                           "--threads", "1", stdin="\n".join(lines) + "\n")
        assert decoded.returncode == 0, decoded.stderr
        outputs[code] = decoded.stdout.splitlines()
        assert outputs[code] == marian_greedy(marian, tokenizer,
                                              [f">>{code}<< {line}" for line in lines])
    assert outputs["fra"] != outputs["deu"]  # the tag steers this random model
    untagged = run_attn("decode", "-m", output, "--beam", "1", "--threads", "1",
                        stdin=">>fra<< " + lines[0] + "\n")
    assert untagged.stdout.splitlines() == outputs["fra"][:1]  # typed: the same
    assert "target tags: deu, fra, por" in untagged.stderr  # told that it can be asked for
    assert_clean_error(run_attn("decode", "-m", output, "--target-lang", "fr",
                                stdin=lines[0] + "\n"),
                       "--target-lang fr", "its target tags: deu, fra, por")
