"""`load_translator` and the `Translator` from Python (decode/translator.py): what the command
runs, its outputs, its errors, its --int8 layers."""

from __future__ import annotations

import pytest
import torch

import attn_cli
from attn_cli import load_translator
from attn_cli.batching import pad_sequences
from attn_cli.decode.translator import EMPTY_LINE, NOT_FOUND, search_workers
from attn_cli.devices import LARGE_MODEL_BYTES
from attn_cli.errors import AttnError
from attn_cli.search import Hypothesis

from ..conftest import REPO, assert_clean_error, run_attn


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
    """Raised from the encoder, which both a batch's search and a stream run: the same line
    either way."""
    from attn_cli.model import Transformer

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\n...")

    model, _ = trained
    monkeypatch.setattr(Transformer, "encode", out_of_memory)
    for step in ("auto", "eager"):  # a stream (the C++ step's fused kernels), batches
        translator = load_translator(model, 4, threads=1, batch_tokens=640, step=step)
        with pytest.raises(AttnError) as error:
            translator.translate(["a man"])
        assert str(error.value) == ("out of GPU memory with search batches of 640 source "
                                    "tokens × beam (CUDA out of memory. Tried to allocate 2.00 "
                                    "GiB.): lower --batch-tokens (640)")


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

    from attn_cli.decode import translator as translator_module

    model_file = REPO / "tests" / "fixtures" / "run" / "checkpoint-600.st"

    loaded_models, load_models = [], translator_module.load_models

    def remembering(*args, **kwargs):
        models, device, threads = load_models(*args, **kwargs)
        loaded_models.extend(weakref.ref(loaded.model) for loaded in models)
        return models, device, threads

    monkeypatch.setattr(translator_module, "load_models", remembering)
    translator = load_translator([model_file, model_file], device="cpu", int8=int8)
    gc.collect()
    assert len(loaded_models) == 2 and all(model() is None for model in loaded_models)
    assert translator.translate(["g d j c d d"]) == ["d d c j d g"]


def test_auto_workers_are_a_batch_per_thread_but_one_batch_for_a_large_model():
    """A large model's step reads its weights from memory: batches side by side would each
    read them, so one batch of every thread searches it; asked for, workers are as asked."""
    cpu = torch.device("cpu")
    assert search_workers(4, 0, cpu) == (4, 1)
    assert search_workers(4, 0, cpu, LARGE_MODEL_BYTES) == (4, 1)
    assert search_workers(4, 0, cpu, LARGE_MODEL_BYTES + 1) == (1, 4)
    assert search_workers(4, 2, cpu, LARGE_MODEL_BYTES + 1) == (2, 2)
    assert search_workers(4, 0, torch.device("cuda")) == (1, 4)


def test_a_few_lines_are_split_over_the_streams_of_the_workers(trained, monkeypatch):
    """Iteration-level batching with two workers: four lines fly two in each stream, not all
    four in the first one that asks (whose one thread would then search them alone)."""
    from attn_cli.decode.stream import Stream

    model, _ = trained
    translator = load_translator(model, 4, threads=2, workers=2)
    joined, real_add = [], Stream.add
    monkeypatch.setattr(Stream, "add", lambda stream, keys, *rest: (
        joined.append((id(stream), len(keys))), real_add(stream, keys, *rest))[1])
    lines = ["a man is walking", "two dogs play in the snow", "a girl", "a red car"]
    assert translator.translate(lines) == translator.with_options(workers=1).translate(lines)
    # a stream holds its share of two at most (the last call: the one worker's four lines)
    assert [count for _, count in joined[:-1]] == [2, 2] and joined[-1][1] == 4
