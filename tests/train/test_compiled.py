"""`attn train --compile` (train/compiled.py): each layer through torch's compiler trains as the
eager layers do, through the real entry point, stopped and resumed; a compiler that fails costs
one line and the eager layers; auto compiles on a GPU for large batches only."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from attn_cli.config import get_preset
from attn_cli.model import Transformer
from attn_cli.train import compiled
from attn_cli.train.compiled import compile_layers, compile_wanted, layers_of
from attn_cli.train.start import adam

from ..conftest import (
    REPO,
    assert_same_weights,
    final_weights,
    run_attn,
    run_attn_process,
    train_args,
)

DATA = REPO / "tests" / "fixtures" / "data.st"


def losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


@pytest.mark.long
def test_the_compiled_layers_train_as_the_eager_ones_and_resume(tmp_path):
    """12 steps of the tiny preset, compiled and eager, from the same seed: the same losses
    and weights to float32 rounding (on a CPU the dropout masks are eager's own: the mask's
    random_ is left outside the graphs); a compiled run stopped at step 6 and resumed ends
    where the uninterrupted one does; the graphs compiled are counted, and bounded."""
    eager, on, halves = tmp_path / "eager", tmp_path / "on", tmp_path / "halves"
    assert run_attn(*train_args(DATA, eager, "--max-steps", 12, "--compile", "off")
                    ).returncode == 0
    # in a process of its own: the graphs it counts are its own
    result = run_attn_process(*train_args(DATA, on, "--max-steps", 12, "--compile", "on"))
    assert result.returncode == 0, result.stderr
    assert "each encoder and decoder layer compiled" in result.stderr
    graphs = next(int(line.split()[1]) for line in result.stderr.splitlines()
                  if "graphs compiled in this run" in line)
    assert 0 < graphs <= 40  # the batches' 12 shapes did not each compile anew
    torch.testing.assert_close(losses(on), losses(eager), rtol=1e-5, atol=1e-6)
    assert_same_weights(final_weights(on), final_weights(eager), atol=1e-5)
    for extra in (["--max-steps", 6], ["--max-steps", 12, "--resume"]):
        result = run_attn_process(*train_args(DATA, halves, *extra, "--compile", "on"))
        assert result.returncode == 0, result.stderr
    torch.testing.assert_close(losses(halves), losses(on), rtol=1e-5, atol=1e-6)
    assert_same_weights(final_weights(halves), final_weights(on), atol=1e-5)


def test_a_compiler_that_fails_is_one_line_and_the_eager_layers(monkeypatch):
    def broken(model, dtype):
        raise RuntimeError("InductorError: no C++ compiler found\n  (a long traceback)")

    monkeypatch.setattr(compiled, "probe", broken)
    model = Transformer(get_preset("tiny").model_config(40, dropout=0.0))
    said = []
    assert not compile_layers(model, "fp32", log=said.append)
    assert said == ["--compile: torch's compiler failed (InductorError: no C++ compiler found);"
                    " training with the eager layers"]
    assert all(layer._compiled_call_impl is None for layer in layers_of(model))


def test_every_process_goes_eager_when_another_one_failed(monkeypatch):
    monkeypatch.setattr(compiled, "probe", lambda model, dtype: None)
    model = Transformer(get_preset("tiny").model_config(40, dropout=0.0))
    said = []
    assert not compile_layers(model, "fp32", agree=lambda failed: True, log=said.append)
    assert "on another process" in said[0]
    assert all(layer._compiled_call_impl is None for layer in layers_of(model))


def test_the_trial_pass_leaves_no_gradient_and_the_random_state_as_it_was(monkeypatch):
    """compile_layers' trial batch must not change the run: its gradients dropped, torch's
    generator where it was (the run's batches and dropout draw from it). The compiler itself
    is replaced by the eager layers here: what is tested is the trial's bookkeeping."""
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: None)
    model = Transformer(get_preset("tiny").model_config(40, dropout=0.1)).train()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert compile_layers(model, "fp32", log=lambda line: None)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(parameter.grad is None for parameter in model.parameters())


@pytest.mark.parametrize("option, device, tokens, wanted", [
    ("auto", "cuda", 25_000, True), ("auto", "cuda", 3_125, False),
    ("auto", "cpu", 25_000, False), ("on", "cpu", 100, True), ("off", "cuda", 25_000, False)])
def test_auto_compiles_on_a_gpu_for_large_batches_only(option, device, tokens, wanted):
    assert compile_wanted(option, torch.device(device), tokens) == wanted


@pytest.mark.gpu
def test_the_compiled_layers_train_as_the_eager_ones_on_cuda_in_bf16(monkeypatch):
    """On CUDA inductor draws dropout masks with its own generator: told to use torch's
    (fallback_random), a compiled step's losses and weights after 6 steps equal eager's within
    bf16's tolerance, under the bf16 autocast training uses."""
    import torch._inductor.config as inductor

    from attn_cli.devices import autocast

    monkeypatch.setattr(inductor, "fallback_random", True)
    torch.manual_seed(0)
    eager = Transformer(get_preset("tiny").model_config(300, dropout=0.1)).cuda().train()
    built = copy.deepcopy(eager)
    assert compile_layers(built, "bf16", log=lambda line: None)
    optimizers = adam(eager), adam(built)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = 1e-3
    for step in range(6):
        batch, source, target = 8 + step, 9 + step % 5, 7 + step % 4
        generator = torch.Generator().manual_seed(step)
        src = torch.randint(4, 300, (batch, source), generator=generator).cuda()
        tgt = torch.randint(4, 300, (batch, target), generator=generator).cuda()
        found = []
        for model, optimizer in zip((eager, built), optimizers):
            torch.manual_seed(100 + step)
            with autocast(torch.device("cuda"), "bf16"):
                loss, _ = model(src, tgt, output_positions=torch.arange(tgt.numel()).cuda(),
                                targets=tgt.flatten(), label_smoothing=0.1)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            found.append(loss.item())
        assert found[1] == pytest.approx(found[0], rel=2e-2)
    for a, b in zip(eager.parameters(), built.parameters()):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
