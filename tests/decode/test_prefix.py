"""`attn decode --prefix` (prefix.py): outputs start with their line's target prefix, the search
goes on from there, and without a prefix nothing changes. On the committed reversal model
(tests/fixtures), whose outputs are its inputs' letters reversed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attn_cli.decode.controls import Controls
from attn_cli.decode.stream import supported as stream_supported
from attn_cli.decode.translator import load_translator

from ..conftest import assert_clean_error, run_attn

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text(encoding="utf-8"))
CHECKPOINT = FIXTURES / GOLDEN["checkpoint"]
ON_CPU = ["--device", "cpu", "--threads", "1"]
# Prefixes the model would not choose (its best outputs start otherwise), one per input, one
# ending inside a word ("d d cj" on the piece "j"), one empty.
PREFIXES = ["j j", "i g e b b", "d d cj", ""]
INPUTS = GOLDEN["inputs"][:len(PREFIXES)]


@pytest.fixture(scope="module")
def translator():
    return load_translator(CHECKPOINT, device="cpu", threads=1, workers=1)


def prefix_ids(translator, texts):
    return translator.tgt_vocab.encode(texts)


def prefixed(ids: list[list[int]]) -> list[Controls]:
    """Each line's controls: its prefix alone."""
    return [Controls(prefix=tuple(prefix)) for prefix in ids]


@pytest.mark.parametrize("beam", [1, 4])
def test_every_output_starts_with_its_prefix(beam):
    lines = "".join(f"{source}\t{prefix}\n" for source, prefix in zip(INPUTS, PREFIXES))
    result = run_attn("decode", "-m", CHECKPOINT, *ON_CPU, "--beam", beam, "--prefix",
                      stdin=lines)
    assert result.returncode == 0, result.stderr
    outputs = result.stdout.splitlines()
    assert len(outputs) == len(INPUTS)
    free = GOLDEN["beam4" if beam == 4 else "greedy"]
    for output, prefix, unforced in zip(outputs, PREFIXES, free):
        assert output.startswith(prefix), (output, prefix)
        assert not prefix or not unforced.startswith(prefix)  # the prefix changed the output
    assert outputs[3] == free[3]  # no prefix: the free search's


def test_an_empty_prefix_or_no_tab_is_no_prefix():
    lines = "".join(f"{source}\t\n" if i % 2 else f"{source}\n"
                    for i, source in enumerate(GOLDEN["inputs"]))
    result = run_attn("decode", "-m", CHECKPOINT, *ON_CPU, "--prefix", stdin=lines)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == GOLDEN["beam4"]


def test_sampling_draws_after_the_prefix():
    """--sample: each output starts with its prefix, and a line without one draws what it
    draws without --prefix (the same seed and line number)."""
    sample = ["--sample", "--seed", "3"]
    lines = "".join(f"{source}\t{prefix}\n" for source, prefix in zip(INPUTS, PREFIXES))
    forced = run_attn("decode", "-m", CHECKPOINT, *ON_CPU, *sample, "--prefix", stdin=lines)
    free = run_attn("decode", "-m", CHECKPOINT, *ON_CPU, *sample,
                    stdin="".join(f"{source}\n" for source in INPUTS))
    assert forced.returncode == 0 and free.returncode == 0, forced.stderr + free.stderr
    outputs = forced.stdout.splitlines()
    assert all(output.startswith(prefix) for output, prefix in zip(outputs, PREFIXES))
    assert outputs[3] == free.stdout.splitlines()[3]


@pytest.mark.parametrize("beam", [1, 4])
def test_the_best_outputs_own_start_as_prefix_changes_nothing(translator, beam):
    """Forcing what the search would choose anyway gives its output and its score: the
    constraint forces without distorting the model's log-probabilities. (The free search runs
    the C++ step's fused kernels, the constrained one the ATen step: the scores agree to float
    rounding.)"""
    view = translator.with_options(beam=beam, nbest=1)
    free = [hypotheses[0] for hypotheses in view.translate_window(INPUTS, 1)]
    for k in (1, 3):
        prefixes = [hypothesis.tokens[:k] for hypothesis in free]
        forced = [hypotheses[0] for hypotheses in view.translate_window(
            INPUTS, 1, controls=prefixed(prefixes))]
        assert [h.tokens for h in forced] == [h.tokens for h in free]
        for ours, theirs in zip(forced, free):
            assert ours.score == pytest.approx(theirs.score, abs=1e-5)
            assert ours.log_prob == pytest.approx(theirs.log_prob, abs=1e-5)


def test_nbest_continuations_are_distinct_and_through_the_prefix(translator):
    view = translator.with_options(beam=4, nbest=4)
    prefixes = prefix_ids(view, PREFIXES)
    for hypotheses, prefix in zip(view.translate_window(INPUTS, 1, controls=prefixed(prefixes)),
                                  prefixes):
        tokens = [tuple(hypothesis.tokens) for hypothesis in hypotheses]
        assert len(tokens) == 4 and len(set(tokens)) == 4
        assert all(list(t[:len(prefix)]) == prefix for t in tokens)
        scores = [hypothesis.score for hypothesis in hypotheses]
        assert scores == sorted(scores, reverse=True)


def test_a_batch_mixing_prefixes_and_none_equals_each_line_alone(translator):
    prefixes = prefix_ids(translator, PREFIXES)
    together = translator.translate_window(INPUTS, 1, controls=prefixed(prefixes))
    alone = [translator.translate_window([source], 1, controls=prefixed([prefix]))[0]
             for source, prefix in zip(INPUTS, prefixes)]
    # The same outputs; their scores as equal as a batch's padding lets float sums be.
    assert [[h.tokens for h in hypotheses] for hypotheses in together] == \
        [[h.tokens for h in hypotheses] for hypotheses in alone]
    assert [h.score for hypotheses in together for h in hypotheses] == \
        pytest.approx([h.score for hypotheses in alone for h in hypotheses], abs=1e-4)


@pytest.mark.parametrize("limit", [None, 2], ids=["free", "prefixes cut at a limit of 2"])
def test_the_stream_forces_prefixes_as_the_batch_search_does(translator, limit):
    """A beam search's lines with prefixes fly in the C++ stream (its fused kernels, each
    sentence's prefix forced at its own steps); the constrained batch search over the same
    prefixes finds the same N best, scores equal to float rounding. At a limit shorter than
    a prefix both cut it there (EOS at the limit)."""
    view = translator.with_options(beam=4, nbest=4)
    if limit is not None:
        view = view.with_options(max_len_a=0.0, max_len_b=limit)
    assert stream_supported(view)
    ids = view.encode(INPUTS, 1)
    prefixes = [tuple(prefix) for prefix in prefix_ids(view, PREFIXES)]
    streamed = view.stream_search(ids, prefixes)
    batched = view.search_controlled(ids, prefixed(prefixes))
    assert [[h.tokens for h in hypotheses] for hypotheses in streamed] == \
        [[h.tokens for h in hypotheses] for hypotheses in batched]
    assert [h.score for hypotheses in streamed for h in hypotheses] == \
        pytest.approx([h.score for hypotheses in batched for h in hypotheses], abs=1e-4)
    best = [hypotheses[0].tokens for hypotheses in streamed]
    if limit is None:
        assert all(tokens[:len(prefix)] == list(prefix) for tokens, prefix in zip(best, prefixes))
    else:  # the limit counts EOS: one piece of each prefix, then EOS
        assert [tokens for tokens, prefix in zip(best, prefixes) if prefix] == \
            [list(prefix[:1]) for prefix in prefixes if prefix]


@pytest.mark.parametrize("stdin, fragments", [
    ("g d j c d d\tj Z\n", ["<stdin>:1:", "'j Z'", "outside the model's target vocabulary"]),
    ("g d j c d d\tj\tc\n", ["<stdin>:1:", "one tab per line"]),
], ids=["unknown piece", "two tabs"])
def test_a_bad_prefix_is_one_line_naming_it(stdin, fragments):
    assert_clean_error(run_attn("decode", "-m", CHECKPOINT, *ON_CPU, "--prefix", stdin=stdin),
                       *fragments)


def test_the_lines_before_a_bad_prefix_are_written():
    result = run_attn("decode", "-m", CHECKPOINT, *ON_CPU, "--prefix",
                      stdin=f"{INPUTS[0]}\n{INPUTS[1]}\tZ\n{INPUTS[2]}\n")
    assert result.returncode == 2
    assert result.stdout.splitlines() == GOLDEN["beam4"][:1]
    assert "<stdin>:2:" in result.stderr


@pytest.mark.parametrize("option", [["--split-sentences"], ["--attention", "maps.st"]])
def test_prefix_refuses_what_it_does_not_go_with(option, tmp_path):
    result = run_attn("decode", "-m", CHECKPOINT, *ON_CPU, "--prefix", *option, stdin="a\n")
    assert_clean_error(result, "--prefix does not go with", option[0])


@pytest.mark.gpu
@pytest.mark.parametrize("options", [["--beam", "4", "--nbest", "2"], ["--sample"]],
                         ids=["beam", "sample"])
def test_a_gpu_forces_the_prefixes_a_cpu_does(options):
    """The constraint's state lives on the search's device: CUDA tensors, the same outputs."""
    lines = "".join(f"{source}\t{prefix}\n" for source, prefix in zip(INPUTS, PREFIXES))
    common = ["decode", "-m", CHECKPOINT, "--dtype", "fp32", "--prefix", *options]
    on_gpu = run_attn(*common, "--device", "cuda", stdin=lines)
    on_cpu = run_attn(*common, *ON_CPU, stdin=lines)
    assert on_gpu.returncode == 0, on_gpu.stderr
    assert [line.rsplit("\t", 1)[-1] for line in on_gpu.stdout.splitlines()] == \
        [line.rsplit("\t", 1)[-1] for line in on_cpu.stdout.splitlines()]
