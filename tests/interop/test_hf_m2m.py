"""`attn import hf` of NLLB-200 and M2M-100 (`M2M100ForConditionalGeneration`): random models of
their shape and conventions built offline with `transformers`, their tokenizers made from a
SentencePiece model learned here (fairseq's ids: <s> 0, <pad> 1, </s> 2, <unk> 3, the pieces
one further on, the language codes after them), imported. attn computes transformers'
log-probabilities, and greedy and beam-4 outputs equal `generate(forced_bos_token_id=...)`."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch

from attn_cli.decode.translator import load_translator
from attn_cli.modelfile import load_model
from attn_cli.tags import forced_language_codes

from ..conftest import assert_clean_error, run_attn

transformers = pytest.importorskip("transformers", reason="pip install 'attn[hf]'")
sentencepiece = pytest.importorskip("sentencepiece")

NLLB_CODES = ["eng_Latn", "fra_Latn", "deu_Latn", "ces_Latn"]


def fairseq_spm(lines: list[str]) -> bytes:
    """A BPE SentencePiece model with fairseq's own special ids (unk 0, bos 1, eos 2, no pad),
    as NLLB-200's and M2M-100's sentencepiece.bpe.model."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=300,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return model.getvalue()


def random_m2m(vocab_size: int, directory, seed: int, quiet_from: int | None = None) -> None:
    """A random M2M100 model of a few dimensions, its weights drawn sharper than its init (so
    that outputs vary with the input) and its LayerNorms away from 1 and 0, saved. The rows
    from `quiet_from` on (language tokens, made-up words) are drawn small: a random model
    would otherwise write little but language tokens, which a trained one never writes."""
    config = transformers.M2M100Config(
        vocab_size=vocab_size, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=256, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2, scale_embedding=True,
        dropout=0.1, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(seed)
    model = transformers.M2M100ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(std=0.5 if "shared" in name or "embed" in name else 0.2)
            elif "layer_norm.weight" in name:
                parameter.normal_(mean=1.0, std=0.2)
            else:
                parameter.normal_(std=0.3)
        # <s> (id 0) is never an output of a trained model; a random one writes it, whose
        # tokens both sides then drop as special (and whose hypotheses tie)
        model.model.shared.weight[0] = 0.0
        if quiet_from is not None:
            model.model.shared.weight[quiet_from:] *= 0.1
    model.save_pretrained(directory)


def spm_directory(corpus, tmp_path_factory, name: str):
    """A new model directory holding a fairseq-style sentencepiece.bpe.model learned on the
    corpus's training text, and that model's bytes."""
    lines = [line for side in ("train.en", "train.de")
             for line in corpus[side].read_text(encoding="utf-8").splitlines()]
    directory = tmp_path_factory.mktemp(name)
    spm = fairseq_spm(lines)
    (directory / "sentencepiece.bpe.model").write_bytes(spm)
    return directory, spm


def imported(directory, name: str, corpus):
    """The saved model imported by `attn import hf` as `name`: (transformers' model, its
    tokenizer, the attn model file, 8 validation sources)."""
    output = directory / name
    result = run_attn("import", "hf", directory, "-o", output)
    assert result.returncode == 0, result.stderr
    model = transformers.M2M100ForConditionalGeneration.from_pretrained(directory).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return model, tokenizer, output, corpus["val.en"].read_text(encoding="utf-8").splitlines()[:8]


@pytest.fixture(scope="module")
def nllb(corpus, tmp_path_factory):
    """An NLLB-200-shaped model: NllbTokenizer's ids (the language codes added tokens), its
    sentencepiece.bpe.model beside it, as facebook/nllb-200-* ship it."""
    directory, spm = spm_directory(corpus, tmp_path_factory, "nllb")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "NllbTokenizer", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn"}))
    tokenizer = transformers.NllbTokenizer.from_pretrained(
        directory, additional_special_tokens=NLLB_CODES, src_lang="eng_Latn")
    tokenizer.save_pretrained(directory)
    random_m2m(len(tokenizer), directory, seed=11)
    return imported(directory, "nllb.st", corpus)


@pytest.fixture(scope="module")
def m2m100(corpus, tmp_path_factory):
    """An M2M-100-shaped model: M2M100Tokenizer's vocab.json and its language tokens (__fr__)."""
    directory, spm = spm_directory(corpus, tmp_path_factory, "m2m100")
    processor = sentencepiece.SentencePieceProcessor(model_proto=spm)
    pieces = ["<s>", "<pad>", "</s>", "<unk>",
              *(processor.id_to_piece(i) for i in range(3, processor.get_piece_size()))]
    (directory / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
    tokenizer = transformers.M2M100Tokenizer(directory / "vocab.json",
                                             directory / "sentencepiece.bpe.model",
                                             src_lang="en", tgt_lang="fr")
    tokenizer.save_pretrained(directory)
    # its language tokens after the pieces, then 8 made-up words: M2M-100's 128,112 embeddings
    random_m2m(max(tokenizer.lang_token_to_id.values()) + 1 + 8, directory, seed=12,
               quiet_from=min(tokenizer.lang_token_to_id.values()))
    return imported(directory, "m2m.st", corpus)


def their_ids(tokenizer, line: str, source: str) -> list[int]:
    """The tokenizer's ids of `line` from language `source` (NLLB's eng_Latn; M2M-100's
    token __en__, which its tokenizer names en)."""
    tokenizer.src_lang = source.strip("_") if source.startswith("__") else source
    return tokenizer(line)["input_ids"]


class EosAtTheLimit(transformers.LogitsProcessor):
    """EOS forced at the last position `generate` may write, its log-probability kept, as
    attn's search forces it at the length limit (transformers' forced_eos_token_id scores it
    0, which ranks a hypothesis cut at the limit above what its model gave it)."""

    def __init__(self, max_length: int, eos: int):
        self.max_length, self.eos = max_length, eos

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] != self.max_length - 1:
            return scores
        forced = torch.full_like(scores, -math.inf)
        forced[:, self.eos] = scores[:, self.eos]
        return forced


def generated(model, tokenizer, lines: list[str], source: str, target: str, beams: int):
    """generate() one line at a time with attn's length limit (|x| + 50 outputs, the forced
    language token one of them), EOS forced last; at beam 4 length_penalty 0 (attn's --alpha
    0) and early_stopping "never" (exact, as attn's stopping rule)."""
    outputs = []
    for line in lines:
        ids = torch.tensor([their_ids(tokenizer, line, source)])
        beam_search = {"length_penalty": 0.0, "early_stopping": "never"} if beams > 1 else {}
        limit = ids.shape[1] + 50
        with torch.inference_mode():
            found = model.generate(input_ids=ids, num_beams=beams, do_sample=False,
                                   forced_bos_token_id=tokenizer.convert_tokens_to_ids(target),
                                   max_length=limit, logits_processor=transformers.
                                   LogitsProcessorList([EosAtTheLimit(limit, 2)]),
                                   **beam_search)
        # language tokens are special (M2M100Tokenizer's decode keeps them: attn drops them)
        languages = {index for token, index in tokenizer.get_vocab().items()
                     if token in NLLB_CODES} | set(getattr(tokenizer, "lang_token_to_id",
                                                           {}).values())
        outputs.append(tokenizer.decode([index for index in found[0].tolist()
                                         if index not in languages], skip_special_tokens=True))
    return outputs


@pytest.mark.parametrize("family,source,target", [("nllb", "eng_Latn", "fra_Latn"),
                                                  ("m2m100", "__en__", "__fr__")])
def test_imported_model_computes_transformers_log_probs(family, source, target, request):
    model, tokenizer, output, lines = request.getfixturevalue(family)
    loaded = load_model(output)
    assert loaded.metadata["lang_codes"] == family
    config = loaded.config
    assert (config.norm, config.positions, config.attention_bias) == ("pre", "fairseq", True)
    assert (config.pad_id, config.eos_id, config.bos_id, config.unk_id) == (1, 2, 2, 3)
    codes = forced_language_codes(loaded.src_vocab, family)
    code = source if family == "nllb" else source.strip("_")
    translator = load_translator(output, 1, device="cpu", threads=1, source_lang=code,
                                 target_lang="fr")
    target_id = tokenizer.convert_tokens_to_ids(target)
    assert translator.options.target_start == (target_id,)
    worst = 0.0
    for line, output_line in zip(lines, reversed(lines)):  # any target text will do
        theirs_ids = their_ids(tokenizer, line, source)
        # the source's code first, the text cut as the tokenizer cuts it, EOS last
        assert translator.encode([line], 1)[0] == theirs_ids
        assert theirs_ids[0] == codes[code]
        tgt = torch.tensor([[config.bos_id, target_id,
                             *loaded.tgt_vocab.encode([output_line])[0]]])
        src = torch.tensor([theirs_ids])
        with torch.inference_mode():
            ours = torch.log_softmax(loaded.model(src, tgt).float(), dim=-1)
            theirs = torch.log_softmax(model(input_ids=src, decoder_input_ids=tgt).logits, -1)
        worst = max(worst, float((ours - theirs).abs().max()))
    assert worst < 1e-4


@pytest.mark.parametrize("family,source,target", [("nllb", "eng_Latn", "fra_Latn"),
                                                  ("m2m100", "__en__", "__fr__")])
def test_decode_writes_what_generate_writes_greedy_and_beam_4(family, source, target, request):
    model, tokenizer, output, lines = request.getfixturevalue(family)
    for beam in (1, 4):
        # at length penalty 0, generate's early_stopping "never" is exact, as attn's rule
        decoded = run_attn("decode", "-m", output, "--source-lang", source, "--target-lang",
                           target, "--beam", str(beam), "--alpha", "0", "--threads", "1",
                           stdin="\n".join(lines) + "\n")
        assert decoded.returncode == 0, decoded.stderr
        assert decoded.stdout.splitlines() == generated(model, tokenizer, lines, source,
                                                        target, beam), beam
    # ISO 639-1 codes name the same languages; another target writes something else
    short = run_attn("decode", "-m", output, "--source-lang", "en", "--target-lang", "fr",
                     "--beam", "1", "--threads", "1", stdin="\n".join(lines) + "\n")
    assert short.stdout.splitlines() == generated(model, tokenizer, lines, source, target, 1)
    german = run_attn("decode", "-m", output, "--target-lang", "de", "--beam", "1",
                      "--threads", "1", stdin="\n".join(lines) + "\n")
    assert german.returncode == 0, german.stderr
    assert german.stdout.splitlines() != short.stdout.splitlines()


def test_a_language_is_required_and_unknown_ones_refused(nllb):
    _, _, output, lines = nllb
    assert_clean_error(run_attn("decode", "-m", output, stdin=lines[0] + "\n"),
                       "translates between many languages", "--target-lang (fra_Latn")
    assert_clean_error(run_attn("decode", "-m", output, "--target-lang", "xx",
                                stdin=lines[0] + "\n"),
                       "--target-lang xx", "no language 'xx'", "eng_Latn")
    assert_clean_error(run_attn("decode", "-m", output, "--source-lang", "ja",
                                "--target-lang", "fr", stdin=lines[0] + "\n"),
                       "--source-lang ja", "no language 'ja'")


def test_empty_lines_nbest_and_alignments_leave_the_language_token_out(nllb):
    _, _, output, lines = nllb
    text = "\n".join([lines[0], "", lines[1]]) + "\n"
    plain = run_attn("decode", "-m", output, "--target-lang", "fr", "--beam", "2",
                     "--threads", "1", stdin=text)
    assert plain.returncode == 0, plain.stderr
    best = plain.stdout.splitlines()
    assert len(best) == 3 and best[1] == ""
    assert not any("fra_Latn" in line for line in best)
    raw = run_attn("decode", "-m", output, "--target-lang", "fr", "--beam", "2", "--raw",
                   "--nbest", "2", "--threads", "1", stdin=text)
    assert raw.returncode == 0, raw.stderr
    assert "fra_Latn" not in raw.stdout and len(raw.stdout.splitlines()) == 6
    aligned = run_attn("decode", "-m", output, "--target-lang", "fr", "--beam", "2",
                       "--alignment", "--threads", "1", stdin=text)
    assert aligned.returncode == 0, aligned.stderr
    rows = [line.split("\t") for line in aligned.stdout.splitlines()]
    assert [row[0] for row in rows] == best
    for (output_line, pairs), line in zip(rows, [lines[0], "", lines[1]]):
        for pair in pairs.split():
            source_word, output_word = map(int, pair.split("-"))
            assert 0 <= source_word < len(line.split())
            assert 0 <= output_word < len(output_line.split())


def test_a_model_without_a_sentencepiece_model_is_refused(nllb, tmp_path):
    _, _, output, _ = nllb
    directory = output.parent
    bare = tmp_path / "bare"
    bare.mkdir()
    for path in directory.iterdir():
        if path.name not in ("sentencepiece.bpe.model", "nllb.st"):
            (bare / path.name).write_bytes(path.read_bytes())
    assert_clean_error(run_attn("import", "hf", bare, "-o", tmp_path / "x.st"),
                       "sentencepiece.bpe.model: missing")


@pytest.mark.parametrize("family,source", [("nllb", "eng_Latn"), ("m2m100", "__en__")])
def test_export_hf_writes_the_m2m100_directory_back(family, source, request, tmp_path):
    """`attn export hf` of an imported model: transformers loads the directory, its weights
    are the original's tensor for tensor and its tokenizer gives the original's ids; `attn
    import hf` of it gives the same model file's weights and pieces again."""

    model, tokenizer, output, lines = request.getfixturevalue(family)
    exported = tmp_path / "back"
    result = run_attn("export", "hf", output, "-o", exported)
    assert result.returncode == 0, result.stderr
    assert "M2M100ForConditionalGeneration" in result.stderr
    back = transformers.M2M100ForConditionalGeneration.from_pretrained(exported).eval()
    theirs, ours = model.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[name], ours[name]) for name in theirs)
    back_tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    for line in lines:
        assert their_ids(back_tokenizer, line, source) == their_ids(tokenizer, line, source)
    again = tmp_path / "again.st"
    assert run_attn("import", "hf", exported, "-o", again).returncode == 0
    first, second = load_model(output), load_model(again)
    assert first.config == second.config and first.metadata["lang_codes"] == family
    assert first.tgt_vocab.pieces == second.tgt_vocab.pieces
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(tensor, second.model.state_dict()[name]), name


def test_export_hf_refuses_what_m2m100_cannot_hold(nllb, tmp_path):
    """A model whose vocabulary's ids are not what the tokenizer makes of its pieces cannot be
    written back exactly: one line, and no directory."""
    from attn_cli.modelfile import save_model

    _, _, output, _ = nllb
    loaded = load_model(output)
    pieces = list(loaded.tgt_vocab.pieces)
    pieces[10], pieces[11] = pieces[11], pieces[10]  # two pieces' ids swapped
    swapped = tmp_path / "swapped.st"
    save_model(swapped, loaded.model, type(loaded.tgt_vocab).with_pieces(
        loaded.tgt_vocab.spm_bytes, pieces), lang_codes="nllb")
    assert_clean_error(run_attn("export", "hf", swapped, "-o", tmp_path / "out"),
                       "NllbTokenizer", "names id 10", "cannot write its vocabulary back")
    assert not (tmp_path / "out").exists()


@pytest.mark.long  # a server of its own
def test_serve_picks_each_pairs_languages(nllb):
    """`attn serve -m en-fr,en-de=nllb.st`: one model, each pair's source and target codes
    from its ISO 639-1 names; each pair answers what `attn decode` writes for it."""
    pytest.importorskip("uvicorn", reason="attn[serve] is not installed")
    from ..serve.client import Server, call

    _, _, output, lines = nllb
    process = Server([sys.executable, "-m", "attn_cli", "serve", "-m",
                      f"en-fr,en-de={output}", "--port", "0", "--threads", "1"])
    try:
        process.wait_ready()
        for target in ("fr", "de"):
            status, answer = call(process, "POST", "/translate",
                                     {"q": lines[:3], "source": "en", "target": target})
            assert status == 200, answer
            decoded = run_attn("decode", "-m", output, "--target-lang", target, "--threads",
                               "1", stdin="\n".join(lines[:3]) + "\n")
            assert answer["translatedText"] == decoded.stdout.splitlines()
    finally:
        assert process.stop() == 0
    unpaired = run_attn("serve", "-m", str(output), "--port", "0")
    assert_clean_error(unpaired, "translates between many languages",
                       f"-m en-fr,en-de={output}")


@pytest.mark.long  # a training run of its own
def test_fine_tuning_data_starts_each_side_with_its_code(nllb, corpus, tmp_path):
    """`attn binarize --vocab nllb.st --langs en-de`: the model's special ids recorded, each
    source and target starting with its language's code, as the tokenizer's `input_ids` and
    `labels` do; `attn train --init` fine-tunes from it (validated with the target's code
    left out of the outputs' text) and the tuned model decodes."""
    from attn_cli.data import ParallelData, SpecialIds

    model, tokenizer, output, _ = nllb
    data = tmp_path / "tune.st"
    result = run_attn("binarize", "--vocab", output, corpus["train.en"], corpus["train.de"],
                      "--langs", "en-de", "-o", data)
    assert result.returncode == 0, result.stderr
    read = ParallelData(data)
    assert read.special_ids == SpecialIds(bos=2, eos=2, pad=1, unk=3)
    tokenizer.src_lang, tokenizer.tgt_lang = "eng_Latn", "deu_Latn"
    sources = corpus["train.en"].read_text(encoding="utf-8").splitlines()
    targets = corpus["train.de"].read_text(encoding="utf-8").splitlines()
    for index in range(5):
        theirs = tokenizer(sources[index], text_target=targets[index])
        src, tgt = read.pair(index)
        assert [*src.tolist(), 2] == theirs["input_ids"]
        assert [*tgt.tolist(), 2] == theirs["labels"]
    assert_clean_error(run_attn("binarize", "--vocab", output, corpus["train.en"],
                                corpus["train.de"], "-o", tmp_path / "x.st"),
                       "names its languages by tokens", "--langs")
    run = tmp_path / "run"
    trained = run_attn("train", data, "--init", output, "-o", run, "--max-steps", "4",
                       "--batch-tokens", "400", "--warmup", "2", "--save-every", "4",
                       "--valid", data, "--valid-metric", "bleu")
    assert trained.returncode == 0, trained.stderr
    decoded = run_attn("decode", "-m", run / "checkpoint-4.st", "--target-lang", "de",
                       "--beam", "1", "--threads", "1", stdin=sources[0] + "\n")
    assert decoded.returncode == 0, decoded.stderr
    assert len(decoded.stdout.splitlines()) == 1 and "deu_Latn" not in decoded.stdout
    # the tuned model back to transformers: its weights moved, its greedy output attn's
    exported = run_attn("export", "hf", run / "checkpoint-4.st", "-o", tmp_path / "tuned-hf")
    assert exported.returncode == 0, exported.stderr
    tuned = transformers.M2M100ForConditionalGeneration.from_pretrained(
        tmp_path / "tuned-hf").eval()
    assert not torch.equal(tuned.model.shared.weight, model.model.shared.weight)
    assert generated(tuned, tokenizer, sources[:1], "eng_Latn", "deu_Latn", 1) == \
        decoded.stdout.splitlines()
