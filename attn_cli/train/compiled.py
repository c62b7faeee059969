"""`attn train --compile`: each encoder and decoder layer through torch's compiler (inductor),
the embeddings, the fused loss (loss.py) and Adam eager.

Why the layers and not the whole model: on an H200 (benchmarks/README.md, "the third GPU run",
`benchmarks/train_step_compiled.py`) the base model's step at 25,000 tokens took 54.4 ms eager
and 49.7 ms with each layer compiled (1.09x), while at 3,125 tokens a compiled step was slower
(0.72x: the GPU waits for the host either way, and the compiled graphs' guards add to it). The
layers are where the elementwise ops that inductor fuses live (dropout, residual, LayerNorm,
ReLU, the softmax); the loss is already fused by hand.

Shapes: every batch has its own (sentences, source length, target length). The layers are
compiled with dynamic shapes from the first call, so one graph serves every batch instead of a
compilation per shape (a size of 1 is still specialised: at most a few graphs a layer kind);
`compilations()` counts them, and the run's last line reports it. Layers of one kind share
their graphs (their parameters are the graph's inputs, not constants).

A compiler that fails (no C++ compiler for the CPU backend, Triton missing, an op it cannot
trace) must not cost the run: `compile_layers` compiles on a small batch of its own before the
first step, on every process, and if any process failed, every one goes on with the eager
layers after one line saying why. The probe runs under a forked random state and leaves no
gradient, so the run is the one it would have been (dropout masks aside: inductor draws them
with its own generator on a GPU, so a compiled run and an eager one differ in their masks; each
is reproducible, and a resumed run should keep the --compile of the run it resumes)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..errors import compiler_error_line

# Tokens a forward pass of a process must hold for `auto` to compile on a GPU: the one measured
# speed-up was at 25,000 (1.09x), the one slow-down at 3,125 (0.72x); between them, this.
AUTO_MIN_TOKENS = 12_500


def compile_wanted(option: str, device: torch.device, tokens_per_pass: int) -> bool:
    """Whether the run compiles its layers: on, off, or auto (on a GPU, for large batches)."""
    if option == "auto":
        return device.type == "cuda" and tokens_per_pass >= AUTO_MIN_TOKENS
    return option == "on"


def layers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [*model.encoder_layers, *model.decoder_layers]


def compile_layers(model: torch.nn.Module, dtype: str,
                   agree: Callable[[bool], bool] = lambda failed: failed,
                   log: Callable[[str], None] = print) -> bool:
    """Compile each layer of `model` in place (`nn.Module.compile`: the state dict's names are
    unchanged, so checkpoints are the eager run's) and try it on a small batch. `agree` tells
    whether any process failed (every process calls it once: a collective); then every layer
    goes back to eager. Returns whether the layers are compiled."""
    layers = layers_of(model)
    for layer in layers:
        layer.compile(dynamic=True)
    started = time.perf_counter()
    failure = None
    try:
        probe(model, dtype)
    except Exception as error:  # noqa: BLE001 (every process must reach `agree`)
        failure = compiler_error_line(error)
    if agree(failure is not None):
        for layer in layers:
            layer._compiled_call_impl = None  # what nn.Module.compile set: eager again
        log(f"--compile: torch's compiler failed ({failure or 'on another process'}); "
            "training with the eager layers")
        return False
    log(f"each encoder and decoder layer compiled (torch.compile, dynamic shapes) in "
        f"{time.perf_counter() - started:.1f} s")
    return True


def probe(model: torch.nn.Module, dtype: str) -> None:
    """A forward and backward pass of 3 sentences (source 7 pieces, target 5: sizes no batch
    dimension is specialised on) through the compiled layers, as training runs them (the same
    autocast, train mode), under a forked random state, leaving no gradient behind."""
    from ..devices import autocast

    device = next(model.parameters()).device
    vocab = model.config.tgt_vocab_size
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        source = torch.randint(4, model.config.src_vocab_size, (3, 7), device=device)
        target = torch.randint(4, vocab, (3, 5), device=device)
        with autocast(device, dtype):
            loss, _ = model(source, target, output_positions=torch.arange(15, device=device),
                            targets=target.flatten(), label_smoothing=0.1)
        loss.backward()
    for parameter in model.parameters():
        parameter.grad = None


def compilations() -> int:
    """Graphs dynamo has compiled in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover (a torch without dynamo compiles nothing)
        return 0
    return int(counters["stats"]["unique_graphs"])
