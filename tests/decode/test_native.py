"""`--step` (decode/native.py, decode/native/step.cpp): the decoder step in C++, held to the
eager step bit for bit in every search (`--step aten`), its fused kernels (stage B,
native/kernels.h) to float rounding, and the eager step where it cannot run."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import attn_cli.decode.native as native_module
from attn_cli.config import PRESETS
from attn_cli.decode.constraints import search_constraint
from attn_cli.decode.controls import Controls
from attn_cli.decode.native import NativeDecoder, covers, extension, native_decoder
from attn_cli.devices import cpu_has_native_bf16, inference_model
from attn_cli.ensemble import Ensemble
from attn_cli.model import Transformer
from attn_cli.search import beam_search, sample, sentence_uniforms

from ..conftest import run_attn
from ..toys import random_model

# Sources of three lengths (one padded): the batch loses sentences as they reach their limits.
SOURCES = torch.tensor([[5, 9, 12, 7, 3], [8, 30, 3, 0, 0], [21, 22, 23, 24, 3]])


@pytest.fixture(scope="module")
def built():
    """The extension, built (once per machine and source; `make install` builds it first). A
    machine of this project has a compiler: a failure here is a failure, not a skip."""
    native = extension()
    assert not isinstance(native, str), native
    return native


def pre_norm_model() -> Transformer:
    """Pre-norm, learned positions, biases on the attention and the logits: the step's other
    branches."""
    torch.manual_seed(5)
    config = PRESETS["tiny"].model_config(40, dropout=0.0, norm="pre", positions="learned",
                                          attention_bias=True, output_bias=True)
    model = Transformer(config).eval()
    with torch.no_grad():
        model.output_bias.normal_()
        for layer in model.decoder_layers:
            layer.self_attn.qkv_proj.bias.normal_(std=0.1)
    return model


def swish_model() -> Transformer:
    torch.manual_seed(6)
    return Transformer(PRESETS["tiny"].model_config(40, dropout=0.0, activation="swish")).eval()


class Recorded:
    """A stepper whose every step's logits are kept."""

    def __init__(self, stepper):
        self.stepper, self.config, self.logits = stepper, stepper.config, []

    def encode(self, src_tokens):
        return self.stepper.encode(src_tokens)

    def start_decoding(self, *arguments):
        return self.stepper.start_decoding(*arguments)

    def decode_step(self, tokens, cache):
        logits, cache = self.stepper.decode_step(tokens, cache)
        self.logits.append(logits.clone())
        return logits, cache


def searches(model) -> tuple[list, list]:
    """Every kind of search of SOURCES (beam with n-best, greedy, a shortlist, sampling, a
    prefix and a phrase to hold, a sentence called off midway), and every step's logits."""
    recorded = Recorded(model)
    allowed = torch.tensor([3, 5, 6, 9, 12, 13, 17, 21, 30, 31, 39])
    controls = [Controls(prefix=(9, 12)), Controls(phrases=((17, 21),)), Controls()]
    steps = iter(range(1000))
    with torch.inference_mode():
        found = [
            beam_search(recorded, SOURCES, beam=4, nbest=2, max_len_b=20),
            beam_search(recorded, SOURCES, beam=1, max_len_b=20),
            beam_search(recorded, SOURCES, beam=3, max_len_b=20, output_ids=allowed),
            sample(recorded, SOURCES, sentence_uniforms(1, [0, 1, 2], 40), max_len_b=20),
            beam_search(recorded, SOURCES, beam=4, max_len_b=12,
                        constraint=search_constraint(controls, [[30]], 3)),
            beam_search(recorded, SOURCES, beam=4, max_len_b=20,
                        cancelled=lambda: [1] if next(steps) > 3 else []),
        ]
    return found, recorded.logits


@pytest.mark.parametrize("linears", ["packed", "dense", "int8"])
@pytest.mark.parametrize("make", [lambda: random_model(vocab=40, seed=4), pre_norm_model,
                                  swish_model], ids=["post-norm", "pre-norm", "swish"])
def test_the_cpp_step_gives_the_eager_logits_bit_for_bit(built, make, linears):
    """Each step's logits equal the eager step's exactly (the same ATen ops, in the same
    order), so every search finds the same hypotheses with the same scores; --int8's layers
    too (whose rows depend on the batch: the same batches here)."""
    model = inference_model(make(), torch.device("cpu"), linears=linears)
    expected, eager_logits = searches(model)
    found, native_logits = searches(NativeDecoder(model, built, fused=False))
    assert found == expected
    assert len(native_logits) == len(eager_logits) > 100
    assert all(torch.equal(a, b) for a, b in zip(native_logits, eager_logits))


def python_loop_taken(tokens, cache):
    raise AssertionError("the free search ran the Python loop, not the C++ one")


FREE_SEARCHES = [{"beam": 4, "nbest": 2}, {"beam": 1}, {"beam": 4, "stop": "patience"},
                 {"beam": 4, "stop": "best-ends"}, {"beam": 5, "nbest": 5, "stop": "limit"},
                 {"beam": 3, "output_ids": torch.tensor([3, 5, 6, 9, 12, 13, 17, 21, 30, 31])},
                 {"beam": 2, "banned": (0, 2, 5, 9)}]


@pytest.mark.parametrize("linears", ["packed", "dense", "int8"])
@pytest.mark.parametrize("make", [lambda: random_model(vocab=40, seed=4), pre_norm_model],
                         ids=["post-norm", "pre-norm"])
def test_the_cpp_free_search_finds_what_the_python_search_finds(built, make, linears):
    """A free search (no constraint) runs whole in C++ (`NativeDecoder.free_search`): every
    stopping rule, n-best, greedy, a shortlist's columns and banned tokens, the same
    hypotheses with the same scores, bit for bit, as the Python search over the eager step."""
    model = inference_model(make(), torch.device("cpu"), linears=linears)
    native = NativeDecoder(model, built, fused=False)
    native.decode_step = python_loop_taken  # the search is whole in C++: no step from Python
    with torch.inference_mode():
        for options in FREE_SEARCHES:
            expected = beam_search(model, SOURCES, max_len_b=20, **options)
            assert beam_search(native, SOURCES, max_len_b=20, **options) == expected, options


@pytest.mark.parametrize("linears", ["packed", "dense", "int8"])
@pytest.mark.parametrize("make", [lambda: random_model(vocab=40, seed=4), pre_norm_model,
                                  swish_model], ids=["post-norm", "pre-norm", "swish"])
def test_the_fused_step_equals_the_eager_step_to_float_rounding(built, make, linears):
    """Stage B's step (its own cache read through each hypothesis's origin rows, the
    attentions, residuals and norms as loops): the eager step's logits within float rounding,
    step after step, through beam reorders and sentences leaving the batch. (--int8's layers
    quantize each call's input by the batch's range: a rounding difference that moves an input
    across a quantization step moves the logits by more, and the keys cached then carry it on;
    there, within 5% of the largest logit: a hypothesis read from a wrong row is off by tens.)"""
    model = inference_model(make(), torch.device("cpu"), linears=linears)
    native = NativeDecoder(model, built)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        memory, src_mask = model.encode(SOURCES)
        cache = model.start_decoding(memory, src_mask)
        by_position = native.position_cache(memory, src_mask, 12, 12)
        tokens, differences = torch.tensor([1, 1, 1]), []
        for step in range(10):
            expected, cache = model.decode_step(tokens, cache)
            found = native.fused_step(tokens, by_position)
            assert found.shape == expected.shape
            scale = 1e-4 if linears != "int8" else 5e-2 * expected.abs().max().item()
            differences.append((found - expected).abs().max().item() / scale)
            sentences = cache.src_mask.shape[0]
            if step == 5:  # the middle sentence leaves: each row of the others continues
                sources = torch.tensor([0, 2])
                rows = torch.cat([torch.arange(4), torch.arange(8, 12)])
            else:  # 4 beams per sentence, each continuing some beam of its sentence
                sources = None
                per = tokens.numel() // sentences
                rows = (torch.arange(sentences).repeat_interleave(4) * per
                        + torch.randint(0, per, (sentences * 4,), generator=generator))
            cache = cache.reorder(rows, sources)
            by_position.reorder(rows, sources)
            tokens = torch.randint(4, 40, (rows.numel(),), generator=generator)
    assert 0 < max(differences) < 1, differences  # > 0: the fused kernels ran, not ATen's


@pytest.mark.parametrize("linears", ["packed", "dense"])
@pytest.mark.parametrize("make", [lambda: random_model(vocab=40, seed=4), pre_norm_model,
                                  swish_model], ids=["post-norm", "pre-norm", "swish"])
def test_the_fused_search_finds_what_the_python_search_finds(built, make, linears):
    """The free search with stage B's kernels (the fused step; log-softmax, bans, the length
    limit and the top 2K of each sentence's beams in one pass over the logits): the Python
    search's hypotheses, their scores within float rounding. (--int8 is left out: each call
    quantizes its input by the whole batch's range, so a rounding difference can move every
    row's scale, and its scores then differ by more than rounding, as they do between
    batchings: docs/decode.md.)"""
    model = inference_model(make(), torch.device("cpu"), linears=linears)
    native = NativeDecoder(model, built)
    native.decode_step = python_loop_taken
    with torch.inference_mode():
        for options in FREE_SEARCHES:
            expected = beam_search(model, SOURCES, max_len_b=20, **options)
            found = beam_search(native, SOURCES, max_len_b=20, **options)
            assert [[h.tokens for h in each] for each in found] == \
                [[h.tokens for h in each] for each in expected], options
            for ours, theirs in zip(found, expected):
                for a, b in zip(ours, theirs):
                    assert a.score == pytest.approx(b.score, abs=1e-4)
                    assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)


def wide_heads_model() -> Transformer:
    """Heads of 64 and 80 values (the kernels' 64-wide blocks and their tails), 96-wide keys
    (a dot's 16-lane body and tail), a vocabulary of 300."""
    torch.manual_seed(8)
    config = PRESETS["tiny"].model_config(300, dropout=0.0, d_model=128, heads=2, d_k=48,
                                          d_v=80)
    model = Transformer(config).eval()
    with torch.no_grad():
        model.tgt_embed.weight.mul_(4)
    return model


def test_the_fused_kernels_hold_for_long_sources_wide_heads_and_many_rows(built):
    """The fused step's vector paths: sources of 23, 12 and 5 pieces (the encoder-decoder
    scores in blocks of 16, of 8, and row by row, the last block overlapping the one before),
    heads of 48 keys and 80 values, and 11 sentences × 4 beams = 44 rows, which the linear
    layers run padded to 48: the eager step's logits within float rounding, and the Python
    search's hypotheses."""
    model = inference_model(wide_heads_model(), torch.device("cpu"), linears="packed")
    native = NativeDecoder(model, built)
    generator = torch.Generator().manual_seed(1)
    lengths = [23, 12, 5, 23, 12, 5, 23, 12, 5, 23, 12]
    sources = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        sources[row, :length] = torch.randint(4, 300, (length,), generator=generator)
        sources[row, length - 1] = model.config.eos_id
    with torch.inference_mode():
        memory, src_mask = model.encode(sources)
        rows = torch.arange(len(lengths)).repeat_interleave(4)
        cache = model.start_decoding(memory, src_mask).reorder(rows)
        by_position = native.position_cache(memory, src_mask, 8, len(rows))
        by_position.reorder(rows, None)
        differences = []
        for _ in range(6):
            tokens = torch.randint(4, 300, (len(rows),), generator=generator)
            expected, cache = model.decode_step(tokens, cache)
            found = native.fused_step(tokens, by_position)
            assert found.shape == expected.shape
            differences.append((found - expected).abs().max().item() / 1e-4)
        assert 0 < max(differences) < 1, differences
        native.decode_step = python_loop_taken
        expected = beam_search(model, sources, beam=4, max_len_b=12)
        found = beam_search(native, sources, beam=4, max_len_b=12)
    assert [[h.tokens for h in each] for each in found] == \
        [[h.tokens for h in each] for each in expected]


def search_calling_off_sentence_1(stepper) -> tuple[list, int]:
    """A beam search of SOURCES whose sentence 1 is called off from the fifth ask of
    `cancelled()` on: its hypotheses, and how many times it asked."""
    asked = []

    def cancelled():
        asked.append(len(asked))
        return [1] if len(asked) > 3 else []

    with torch.inference_mode():
        found = beam_search(stepper, SOURCES, beam=4, max_len_b=20, cancelled=cancelled)
    return found, len(asked)


def test_a_sentence_called_off_leaves_the_cpp_search_as_the_python_one(built):
    """`cancelled()` is asked before each step's read, in C++ as in Python: the sentence named
    leaves at the same step, the others find what they would have found."""
    model = inference_model(random_model(vocab=40, seed=4), torch.device("cpu"),
                            linears="packed")
    native = NativeDecoder(model, built, fused=False)
    native.decode_step = python_loop_taken
    found = {}
    for name, stepper in (("eager", model), ("native", native)):
        found[name], found[name + " asked"] = search_calling_off_sentence_1(stepper)
    assert found["native"] == found["eager"]
    assert found["native asked"] == found["eager asked"] > 4
    with torch.inference_mode():
        alone = beam_search(model, SOURCES[[0, 2]], beam=4, max_len_b=20)
    assert [[h.tokens for h in found["native"][i]] for i in (0, 2)] == \
        [[h.tokens for h in hypotheses] for hypotheses in alone]


def test_a_sentence_called_off_leaves_the_fused_search_as_the_python_one(built):
    model = inference_model(random_model(vocab=40, seed=4), torch.device("cpu"),
                            linears="packed")
    native = NativeDecoder(model, built)
    native.decode_step = python_loop_taken
    found = {}
    for name, stepper in (("eager", model), ("fused", native)):
        hypotheses, found[name + " asked"] = search_calling_off_sentence_1(stepper)
        found[name] = [[h.tokens for h in each] for each in hypotheses]
    assert found["fused"] == found["eager"]
    assert found["fused asked"] == found["eager asked"] > 4


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="bf16 decoding needs a CPU with native "
                    "bf16 (AVX-512 BF16 or AMX); `attn decode --dtype bf16` refuses it here")
def test_the_cpp_step_in_bf16_too(built):
    model = inference_model(random_model(vocab=40, seed=4), torch.device("cpu"), "bf16",
                            linears="packed")
    expected, eager_logits = searches(model)
    found, native_logits = searches(NativeDecoder(model, built))
    assert found == expected
    assert all(torch.equal(a, b) for a, b in zip(native_logits, eager_logits))


def test_what_the_cpp_step_covers():
    """One model on a CPU made for decoding, its linear layers packed, dense or int8; not an
    ensemble or a model in training (dropout)."""
    model = random_model(vocab=40, seed=4)
    cpu = torch.device("cpu")
    for linears in ("packed", "dense", "int8"):
        assert covers(inference_model(model, cpu, linears=linears))
    assert not covers(Ensemble([inference_model(model, cpu), inference_model(model, cpu)]))
    assert not covers(model.train())


def test_no_compiler_means_the_eager_step_and_one_line(monkeypatch):
    monkeypatch.setattr(native_module, "extension", lambda: "error: g++: not found")
    monkeypatch.setattr(native_module, "is_built", lambda: True)
    said = []
    model = inference_model(random_model(vocab=40, seed=4), torch.device("cpu"))
    assert native_decoder(model, said.append) is None
    assert said == ["decode: the C++ decoder step could not be built (error: g++: not found); "
                    "decoding with the eager step (a C++ compiler and ninja build it)"]


def test_the_first_use_says_it_builds(monkeypatch, built):
    monkeypatch.setattr(native_module, "is_built", lambda: False)
    said = []
    model = inference_model(random_model(vocab=40, seed=4), torch.device("cpu"))
    assert isinstance(native_decoder(model, said.append), NativeDecoder)
    assert len(said) == 1 and said[0].startswith("decode: building attn's C++ decoder step")


def test_native_asked_where_it_does_not_cover_says_so_once(built):
    said = []
    cpu = torch.device("cpu")
    model = Ensemble([inference_model(random_model(vocab=40, seed=seed), cpu)
                      for seed in (4, 5)])
    assert native_decoder(model, said.append) is None and said == []  # auto: quietly eager
    assert native_decoder(model, said.append, asked=True) is None
    assert said == ["decode: the C++ decoder step covers one model on a CPU, not an ensemble "
                    "or a GPU yet; decoding with the eager step"]


def test_the_cache_directory_is_one_per_torch_cpu_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTN_NATIVE_DIR", str(tmp_path))
    directory = native_module.cache_directory()
    assert directory.parent == tmp_path
    assert torch.__version__.replace("+", "-") in directory.name
    assert torch.backends.cpu.get_cpu_capability().lower() in directory.name


def test_a_build_killed_midway_does_not_hold_later_ones(built):
    """cpp_extension's lock file, left behind by a build killed before it removed it, made
    every later process wait forever; now a process loads the extension past it."""
    stale = native_module.cache_directory() / "lock"
    stale.touch()
    try:
        loaded = subprocess.run(
            [sys.executable, "-c", "from attn_cli.decode.native import extension\n"
             "assert not isinstance(extension(), str)"], timeout=120, capture_output=True,
            text=True)
        assert loaded.returncode == 0, loaded.stderr
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


@pytest.mark.slow
def test_decode_native_and_eager_write_the_same_bytes(trained, corpus, built):
    """The command, every line: the C++ step calling ATen's ops (`--step aten`) against the
    eager one, beam and n-best, greedy, sampling, --int8, with several search threads, the
    same bytes; the default (the fused kernels) the same lines but where hypotheses tie."""
    model, _ = trained
    stdin = corpus["val.en"].read_text(encoding="utf-8")
    common = ["decode", "-m", model, "--max-len-b", "8", "--threads", "2"]
    for options in (["--nbest", "2"], ["--beam", "1"], ["--sample", "--seed", "3"],
                    ["--int8"]):
        aten = run_attn(*common, *options, "--step", "aten", stdin=stdin)
        eager = run_attn(*common, *options, "--step", "eager", stdin=stdin)
        assert aten.returncode == eager.returncode == 0, aten.stderr
        assert aten.stdout == eager.stdout and aten.stdout.count("\n") >= stdin.count("\n")
        assert "C++" not in aten.stderr  # built: nothing to say
    for options in (["--nbest", "2"], ["--beam", "1"]):
        fused = run_attn(*common, *options, stdin=stdin)
        eager = run_attn(*common, *options, "--step", "eager", stdin=stdin)
        assert fused.returncode == 0 and "C++" not in fused.stderr, fused.stderr
        lines, expected = fused.stdout.splitlines(), eager.stdout.splitlines()
        assert len(lines) == len(expected)
        assert sum(a == b for a, b in zip(lines, expected)) >= 0.99 * len(expected)
    asked = run_attn(*common, "-m", model, "--step", "native", stdin="a man\n")  # an ensemble
    assert asked.returncode == 0 and "not an ensemble" in asked.stderr
