"""`attn decode` and the decoding pipe (translate.py): one line out per line in, in order, as soon
as ready; its options, checked; `load_translator` from Python."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import attn_cli
from attn_cli import load_translator
from attn_cli.batching import pad_sequences
from attn_cli.errors import AttnError
from attn_cli.search import Hypothesis
from attn_cli.translate import EMPTY_LINE, NOT_FOUND, DecodeOptions, OutOfRange

from .conftest import REPO, assert_clean_error, run_attn

# ---------------------------------------------------------------------------------- the command


def test_decode_keeps_one_line_per_line_in_order(trained, corpus):
    model, _ = trained
    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:6]
    lines.insert(2, "")
    lines.insert(5, "   ")
    lines.append("word " * 3000)  # longer than the model takes: truncated, not dropped
    stdin = "\n".join(lines) + "\n"
    result = run_attn("decode", "-m", model, "--beam", "2", "--max-len-b", "5", "--dtype", "fp32",
                      stdin=stdin)
    assert result.returncode == 0, result.stderr
    out = result.stdout.split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines)
    assert out[2] == "" and out[5] == ""
    assert "truncated" in result.stderr
    assert "sentences/s" in result.stderr.splitlines()[-1]
    # Each line translates as it would alone: order kept, batching invisible.
    alone = run_attn("decode", "-m", model, "--beam", "2", "--max-len-b", "5", "--dtype", "fp32",
                     stdin=lines[3] + "\n")
    assert alone.stdout == out[3] + "\n"


@pytest.mark.slow
def test_decode_batches_searched_side_by_side_change_nothing(trained, corpus):
    """Worker threads searching several batches at once (small batches: many of them) give
    the output of one batch at a time, and of one line at a time."""
    model, _ = trained
    stdin = corpus["val.en"].read_text(encoding="utf-8")
    common = ["decode", "-m", model, "--beam", "3", "--max-len-b", "6", "--dtype", "fp32"]
    parallel = run_attn(*common, "--workers", "3", "--threads", "3", "--batch-tokens", "60",
                        stdin=stdin)
    serial = run_attn(*common, "--workers", "1", stdin=stdin)
    alone = run_attn(*common, "--buffer-size", "1", stdin=stdin)
    assert parallel.returncode == serial.returncode == alone.returncode == 0, parallel.stderr
    assert parallel.stdout.count("\n") == stdin.count("\n")
    assert parallel.stdout == serial.stdout == alone.stdout


@pytest.mark.slow
def test_decode_stop_rule_option(trained, corpus):
    model, _ = trained
    stdin = corpus["val.en"].read_text(encoding="utf-8")
    common = ["decode", "-m", model, "--beam", "3", "--max-len-b", "6", "--dtype", "fp32"]
    quick = run_attn(*common, "--stop", "best-ends", stdin=stdin)
    assert quick.returncode == 0, quick.stderr
    assert quick.stdout.count("\n") == stdin.count("\n")
    alone = run_attn(*common, "--stop", "best-ends", "--buffer-size", "1", stdin=stdin)
    assert alone.stdout == quick.stdout  # a per-sentence rule: batching changes nothing
    assert_clean_error(run_attn(*common, "--stop", "soon", stdin=stdin), "--stop", "'soon'")


@pytest.mark.slow
def test_decode_sample_option(trained, corpus):
    model, _ = trained
    stdin = "\n".join(corpus["val.en"].read_text(encoding="utf-8").splitlines()[:20]) + "\n"
    common = ["decode", "-m", model, "--max-len-b", "6", "--dtype", "fp32", "--sample"]
    first = run_attn(*common, "--seed", "5", "--topp", "0.95", stdin=stdin)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("\n") == 20
    again = run_attn(*common, "--seed", "5", "--topp", "0.95", "--buffer-size", "1",
                     stdin=stdin)
    assert again.stdout == first.stdout  # same seed, other batches: same output
    other = run_attn(*common, "--seed", "6", "--topp", "0.95", stdin=stdin)
    assert other.stdout != first.stdout
    top1 = run_attn(*common, "--topk", "1", stdin=stdin)
    greedy = run_attn("decode", "-m", model, "--max-len-b", "6", "--dtype", "fp32", "--beam",
                      "1", stdin=stdin)
    assert top1.stdout == greedy.stdout
    assert_clean_error(run_attn(*common, "--nbest", "2", stdin=stdin), "--nbest", "--sample")
    assert_clean_error(run_attn("decode", "-m", model, "--topk", "5", stdin=stdin), "--sample")
    assert_clean_error(run_attn(*common, "--topp", "0", stdin=stdin), "--topp must be above 0")
    assert_clean_error(run_attn(*common, "--temperature", "0", stdin=stdin),
                       "--temperature must be at least 0.001")
    for beyond in ("inf", "100000"):  # the search's work bound: Typer's, before anything loads
        assert_clean_error(run_attn(*common, "--max-len-a", beyond, stdin=stdin),
                           "--max-len-a", "less than or equal to 10")


def test_decode_nbest_format(trained):
    model, _ = trained
    result = run_attn("decode", "-m", model, "--nbest", "3", "--beam", "4", "--max-len-b", "4",
                      stdin="a man\n\na dog\n")
    assert result.returncode == 0, result.stderr
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert len(rows) == 9 and all(len(row) == 3 for row in rows)
    assert [row[0] for row in rows] == ["0"] * 3 + ["1"] * 3 + ["2"] * 3
    scores = [float(row[1]) for row in rows[:3]]
    assert scores == sorted(scores, reverse=True)


def test_decode_streams_before_stdin_ends(trained):
    model, _ = trained
    process = subprocess.Popen([sys.executable, "-m", "attn_cli", "decode", "-m", str(model),
                                "--max-len-b", "4"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    process.stdin.write(b"a man is walking\n")
    process.stdin.flush()
    first = process.stdout.readline()  # arrives while stdin is still open
    process.stdin.write(b"two dogs\n")
    process.stdin.close()
    rest = process.stdout.read()
    assert process.wait(timeout=60) == 0
    assert first.endswith(b"\n") and rest.count(b"\n") == 1


def test_decode_closed_stdout_ends_quietly(trained):
    model, _ = trained
    command = (f"yes 'a man on a bike' | head -n 400 | {sys.executable} -m attn_cli decode "
               f"-m {model} --max-len-b 3 --buffer-size 10 | head -n 1")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.count("\n") == 1
    assert "Traceback" not in result.stderr and "Broken pipe" not in result.stderr


def test_decode_bad_inputs(trained, tmp_path):
    model, _ = trained
    assert_clean_error(run_attn("decode", "-m", tmp_path / "none.st", stdin="x\n"),
                       "does not exist")
    broken = tmp_path / "broken.st"
    broken.write_bytes(model.read_bytes()[:1000])
    assert_clean_error(run_attn("decode", "-m", broken, stdin="x\n"), str(broken))
    assert_clean_error(run_attn("decode", "-m", model, "-i", tmp_path / "none.txt"),
                       "none.txt", "does not exist")


def test_decode_stats_json_writes_the_summary(trained, corpus, tmp_path):
    """--stats-json: the summary as one JSON object. Its output tokens are the pieces written
    (--raw) and an EOS per sentence; empty lines are no sentences."""
    model, _ = trained
    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:5]
    lines.insert(2, "")
    stats_path = tmp_path / "stats.json"
    result = run_attn("decode", "-m", model, "--beam", "2", "--max-len-b", "5", "--dtype", "fp32",
                      "--raw", "--stats-json", stats_path, stdin="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    text = stats_path.read_text(encoding="utf-8")
    assert text.count("\n") == 1 and text.endswith("\n")  # one object, one line
    stats = json.loads(text)
    outputs = result.stdout.split("\n")[:-1]
    assert len(outputs) == len(lines)
    assert stats["sentences"] == 5
    assert stats["output_tokens"] == sum(len(output.split()) + 1
                                         for line, output in zip(lines, outputs) if line)
    assert stats["seconds"] > 0 and stats["load_seconds"] > 0
    assert stats["truncated"] == stats["replaced"] == 0


# ---------------------------------------------------------------------------------- from Python


def test_library_translates_a_list_of_strings_as_the_command_does(trained):
    model, _ = trained
    lines = ["a man is walking", "", "two dogs play in the snow"]
    translator = load_translator(model, beam=2, max_len_b=5, threads=1)
    assert isinstance(translator, attn_cli.Translator)
    translations = translator.translate(lines)
    command = run_attn("decode", "-m", model, "--beam", "2", "--max-len-b", "5",
                       stdin="\n".join(lines) + "\n")
    assert translations == command.stdout.split("\n")[:-1] and translations[1] == ""
    with pytest.raises(AttributeError):
        attn_cli.no_such_name  # noqa: B018


def test_decode_options_refuse_sampling_options_without_sample():
    for options in ({"topk": 5}, {"topp": 0.9}, {"temperature": 0.5}):
        with pytest.raises(AttnError, match="--sample"):
            DecodeOptions(**options)
        assert DecodeOptions(**options, sample=True).sample  # with --sample: what they are for
    with pytest.raises(AttnError, match="--nbest"):
        DecodeOptions(sample=True, nbest=2)


@pytest.mark.parametrize("changes, message", [
    ({"beam": 0}, "beam must be at least 1"),
    ({"nbest": 0}, "nbest must be at least 1"),
    ({"alpha": -0.1}, "alpha must be at least 0.0"),
    ({"alpha": math.nan}, "alpha must be a finite number"),
    ({"max_len_a": math.inf}, "max_len_a must be a finite number"),
    ({"max_len_b": -1}, "max_len_b must be at least 0"),
    ({"topk": -1, "sample": True}, "topk must be at least 0"),
    ({"topp": 0.0, "sample": True}, "topp must be above 0"),
    ({"topp": 1.5, "sample": True}, "topp must be at most 1"),
    ({"temperature": 0.0, "sample": True}, "temperature must be at least 0.001"),
    ({"temperature": 5e-324, "sample": True}, "temperature must be at least 0.001"),
    ({"temperature": 1e308, "sample": True}, "temperature must be at most 1000.0"),
    ({"alpha": 1e308}, "alpha must be at most 10.0"),
    ({"max_len_a": 1e20}, "max_len_a must be at most 10.0"),
    ({"batch_tokens": 0}, "batch_tokens must be at least 1"),
    ({"workers": 0}, "workers must be at least 1"),
])
def test_decode_options_check_each_range_naming_the_field(changes, message):
    """The one place the search settings' ranges are checked: for the library, for `attn
    serve`'s requests (answered 422 with the field's name) and for the commands (one line
    with the option's), behind Typer's bounds."""
    with pytest.raises(OutOfRange) as error:
        DecodeOptions(**changes)
    assert f"{error.value.field} {error.value.rule}" == message
    assert str(error.value) == "--" + message.replace("_", "-")
    assert DecodeOptions(topp=1.0, temperature=1.0, max_len_a=0.0, max_len_b=0, seed=-5)
    assert DecodeOptions(alpha=10.0, max_len_a=10.0, sample=True, temperature=1e-3)  # inclusive


def test_a_lines_outputs_are_always_nbest_as_decode_prints_them(trained):
    model, _ = trained
    translator = load_translator(model, 4, threads=1, nbest=3)
    found = [Hypothesis([5, 6], -1.0, -2.0)]
    outputs = translator.outputs(found)
    assert outputs[0][0] is found[0] and outputs[1:] == [(NOT_FOUND, "")] * 2
    assert translator.format(7, found)[1:] == ["7\t-inf\t"] * 2
    assert translator.outputs([EMPTY_LINE])[0] == (EMPTY_LINE, "")
    best = translator.with_options(nbest=1)
    assert best.outputs(found) == outputs[:1] and best.format(0, found) == [outputs[0][1]]


def test_out_of_memory_in_a_search_names_its_batch_and_the_option(trained, monkeypatch):
    from attn_cli import translate

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\n...")

    model, _ = trained
    translator = load_translator(model, 4, threads=1, batch_tokens=640)
    monkeypatch.setattr(translate, "beam_search", out_of_memory)
    with pytest.raises(AttnError) as error:
        translator.translate(["a man"])
    assert str(error.value) == ("out of GPU memory with search batches of 640 source tokens × "
                                "beam (CUDA out of memory. Tried to allocate 2.00 GiB.): lower "
                                "--batch-tokens (640)")


def test_load_translator_checks_its_options_before_loading_the_model(tmp_path):
    missing = tmp_path / "none.st"
    with pytest.raises(AttnError, match="--sample"):
        load_translator(missing, topk=5)
    with pytest.raises(AttnError, match="does not exist"):  # good options: the file is wrong
        load_translator(missing)


# ---------------------------------------------------------------------------------------- --int8


def test_int8_quantizes_every_linear_layer_and_stays_close_to_float32(trained, corpus):
    """--int8: every linear layer and the output projection int8, the embeddings float32;
    the logits of a teacher-forced batch within a few percent of float32's scale, and the
    command's output one line per line, most of them the float32 ones."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    model, _ = trained
    translator = load_translator(model, device="cpu", int8=True)
    reference = load_translator(model, device="cpu")
    quantized = translator.model
    linears = [module for module in quantized.modules()
               if isinstance(module, (torch.nn.Linear, DynamicLinear))]
    assert linears and all(isinstance(module, DynamicLinear) for module in linears)
    assert isinstance(quantized.output_projection, DynamicLinear)
    assert quantized.tgt_embed.weight.dtype == torch.float32

    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:40]
    ids = translator.encode(lines, 1)
    src = pad_sequences(ids, translator.config.pad_id)
    tgt = src[:, :8].clone()
    tgt[:, 0] = translator.config.bos_id
    with torch.inference_mode():
        exact = reference.model(src, tgt)
        approximate = quantized(src, tgt)
    scale = exact.std().item()
    assert (approximate - exact).abs().max().item() < 0.2 * scale, scale
    assert (approximate - exact).abs().mean().item() < 0.03 * scale, scale

    stdin = "\n".join(lines[:20]) + "\n\n"
    int8 = run_attn("decode", "-m", model, "--int8", stdin=stdin)
    fp32 = run_attn("decode", "-m", model, stdin=stdin)
    assert int8.returncode == 0, int8.stderr
    outputs, expected = int8.stdout.split("\n"), fp32.stdout.split("\n")
    assert len(outputs) == len(expected) == 22 and outputs[-2:] == ["", ""]
    assert sum(a == b for a, b in zip(outputs, expected)) >= 11


def test_int8_is_refused_beside_another_precision(trained):
    model, _ = trained
    result = run_attn("decode", "-m", model, "--int8", "--dtype", "bf16", stdin="a\n")
    assert_clean_error(result, "--int8", "float32 on a CPU")


@pytest.mark.gpu
def test_int8_is_refused_on_a_gpu(trained):
    model, _ = trained
    result = run_attn("decode", "-m", model, "--int8", "--device", "cuda", stdin="a\n")
    assert_clean_error(result, "--int8", "on a GPU use --dtype bf16")


def test_int8_with_device_auto_on_a_gpu_machine_is_refused_before_any_model_loads(
        trained, monkeypatch):
    """`--device auto` picks the GPU there: --int8 is refused at once, not after every model
    of the ensemble was read and moved to the GPU (review N12)."""
    import attn_cli.ensemble

    model, _ = trained
    loaded = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(attn_cli.ensemble, "load_model",
                        lambda path, device: loaded.append(path))
    with pytest.raises(AttnError, match="on a GPU use --dtype bf16"):
        load_translator(model, device="auto", int8=True)
    assert loaded == []


@pytest.mark.parametrize("int8", [False, True])
def test_a_translator_keeps_copies_made_for_decoding_not_the_loaded_models(int8, monkeypatch):
    """The loaded models are left as they were and freed once load_translator returns: the
    translator holds the copies made for decoding (devices.inference_model) only."""
    import gc
    import weakref

    from attn_cli import translate

    model_file = REPO / "tests" / "fixtures" / "run" / "checkpoint-600.st"

    loaded_models, load_models = [], translate.load_models

    def remembering(*args, **kwargs):
        models, device, threads = load_models(*args, **kwargs)
        loaded_models.extend(weakref.ref(loaded.model) for loaded in models)
        return models, device, threads

    monkeypatch.setattr(translate, "load_models", remembering)
    translator = load_translator([model_file, model_file], device="cpu", int8=int8)
    gc.collect()
    assert len(loaded_models) == 2 and all(model() is None for model in loaded_models)
    assert translator.translate(["g d j c d d"]) == ["d d c j d g"]
