"""`--compile` (compiled.py): the decoder step through a preallocated cache, compiled or not."""

from __future__ import annotations

import pytest
import torch

import attn_cli.decode.compiled
from attn_cli.config import PRESETS
from attn_cli.decode.compiled import CAPACITY_STEP, StepDecoder
from attn_cli.devices import inference_model
from attn_cli.model import Transformer
from attn_cli.search import beam_search, sample, sentence_uniforms

from ..conftest import run_attn, run_attn_process
from ..toys import random_model

# Sources of three lengths: their sentences reach their length limits at different steps, so
# the batch loses sentences as it goes (the cache's source side reordered), and a limit of
# max_len_b = 20 past the source runs past the first CAPACITY_STEP positions (the buffers grow).
SOURCES = torch.tensor([[5, 9, 12, 7, 3], [8, 30, 3, 0, 0], [21, 22, 23, 24, 3]])
MAX_LEN_B = 20
assert SOURCES.shape[1] + MAX_LEN_B > CAPACITY_STEP


def pre_norm_model() -> Transformer:
    """A pre-norm model with learned positions: the step's other branches."""
    torch.manual_seed(5)
    config = PRESETS["tiny"].model_config(40, dropout=0.0, norm="pre", positions="learned")
    return Transformer(config).eval()


def searches(model) -> list:
    """Beam search (nbest 2), greedy, over a shortlist, and sampling, of SOURCES."""
    allowed = torch.tensor([3, 5, 6, 9, 12, 13, 17, 21, 30, 31, 39])
    with torch.inference_mode():
        return [beam_search(model, SOURCES, beam=4, nbest=2, max_len_b=MAX_LEN_B),
                beam_search(model, SOURCES, beam=1, max_len_b=MAX_LEN_B),
                beam_search(model, SOURCES, beam=3, max_len_b=MAX_LEN_B, output_ids=allowed),
                sample(model, SOURCES, sentence_uniforms(1, [0, 1, 2], 40),
                       max_len_b=MAX_LEN_B)]


def assert_same_searches(found: list, expected: list) -> None:
    for got, wanted in zip(found, expected, strict=True):
        assert [[h.tokens for h in hs] for hs in got] == \
            [[h.tokens for h in hs] for hs in wanted]
        assert all(abs(x.score - y.score) < 1e-4 for hs, gs in zip(got, wanted)
                   for x, y in zip(hs, gs))


@pytest.mark.parametrize("linears", ["dense", "packed"])
@pytest.mark.parametrize("make", [lambda: random_model(vocab=40, seed=4), pre_norm_model],
                         ids=["post-norm", "pre-norm"])
def test_the_preallocated_step_searches_as_the_model_does(make, linears):
    """The step with fixed-capacity buffers, written in place and masked, uncompiled: every
    search finds what the model's own growing-cache step finds (the scores to rounding)."""
    model = inference_model(make(), torch.device("cpu"), linears=linears)
    expected = searches(model)
    assert max(len(h[0].tokens) for h in expected[1]) > CAPACITY_STEP  # the buffers grew
    assert_same_searches(searches(StepDecoder(model, compiled=False)), expected)


def test_a_compiler_that_fails_leaves_the_same_step_uncompiled_and_one_line(monkeypatch,
                                                                            tmp_path):
    """No C++ compiler, or any failure of torch's compiler: one line said once, and the search
    goes on with the same step uncompiled, finding the same."""
    def broken_compile(function, **options):
        def compiled(*arguments):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        return compiled

    model = inference_model(random_model(vocab=40, seed=4), torch.device("cpu"),
                            linears="packed")
    expected = searches(model)
    monkeypatch.setattr(attn_cli.decode.compiled.torch, "compile", broken_compile)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # not the user's cache
    said: list[str] = []
    stepped = StepDecoder(model, warn=said.append)
    assert_same_searches(searches(stepped), expected)
    assert len(said) == 1 and "No working C++ compiler" in said[0] and "uncompiled" in said[0]
    # the packed layers through the custom op compute what they did (the encoder's too)
    assert_same_searches(searches(model), expected)


def test_compile_through_the_command_line(trained, corpus):
    """--compile auto is off; on, with what it does not cover (an ensemble, --int8), says so in
    one line and decodes eagerly; an unknown mode is refused."""
    model, _ = trained
    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:6]
    stdin = "\n".join(lines) + "\n"
    common = ["decode", "--beam", "2", "--max-len-b", "6", "--dtype", "fp32", "-m", model]
    plain = run_attn(*common, stdin=stdin)
    auto = run_attn(*common, "--compile", "auto", stdin=stdin)
    assert auto.returncode == 0 and auto.stdout == plain.stdout and "compile" not in auto.stderr
    for extra in (["-m", model], ["--int8"]):
        refused = run_attn(*common, *extra, "--compile", "on", stdin=stdin)
        assert refused.returncode == 0, refused.stderr
        assert refused.stdout.count("\n") == 6
        said = [line for line in refused.stderr.splitlines() if "--compile" in line]
        assert len(said) == 1 and "decoding eagerly" in said[0]
    bad = run_attn(*common, "--compile", "maybe", stdin=stdin)
    assert bad.returncode != 0 and "--compile" in bad.stderr


@pytest.mark.long
def test_the_compiled_step_decodes_as_the_eager_one(trained, corpus, tmp_path, monkeypatch):
    """torch's compiler for real (a minute on 2 cores): the compiled step's searches are the
    model's, and `attn decode --compile on` writes what the eager decode writes."""
    model = inference_model(random_model(vocab=40, seed=4), torch.device("cpu"),
                            linears="packed")
    expected = searches(model)
    said: list[str] = []
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "in-process"))
    assert_same_searches(searches(StepDecoder(model, warn=said.append)), expected)
    assert said == []
    trained_model, _ = trained
    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:20]
    stdin = "\n".join(lines) + "\n"
    common = ["decode", "--beam", "4", "-m", trained_model]
    env_cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    compiled = run_attn_process(*common, "--compile", "on", stdin=stdin, env=env_cache)
    assert compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == run_attn(*common, stdin=stdin).stdout
    assert "compiled step failed" not in compiled.stderr
    assert any((tmp_path / "inductor").iterdir())  # its cache where the user said
