"""One decoder step, eager against compiled: does torch's compiler beat attn's eager step?

The question behind issue 44's first part, asked of one step at a fixed shape (`--sentences` ×
`--beam` rows, `--cached` positions already decoded), so that a compiled step sees one shape
and compiles once. Timed, the median of `--calls` calls after 20 untimed ones, in one process:
- eager, the linear layers on oneDNN's packed weights (what `attn decode` runs on a CPU);
- eager, dense weights;
- `torch.compile(dynamic=False)` of the dense model with inductor's freezing (its own weight
  handling), and with `--cpp-wrapper` its C++ wrapper;
- `torch.compile` of the packed model, each packed linear an opaque custom op (torch.library:
  inductor cannot lower oneDNN's packed linear) so that inductor fuses what lies around them;
- `attn decode --compile on`'s step (`attn_cli.decode.compiled.StepDecoder`: the cache in
  preallocated buffers written in place, dynamic shapes), uncompiled and compiled.
Each compiled step's largest difference from the eager packed step's logits is printed, and
with `--profile` torch.profiler's table of each (where the time goes, op by op).

    python -m benchmarks.compiled_step -m model.st [--threads 1] [--sentences 32 --beam 4]

Report on stderr, with the CPU and ISA.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attn_cli.decode.compiled import StepDecoder, through_custom_op
from attn_cli.devices import PackedLinear, inference_model
from attn_cli.modelfile import load_model
from benchmarks._harness import log
from benchmarks.machine import cpu_info


def as_custom_ops(model) -> None:
    """Every PackedLinear of `model` through attn's `attn::packed_linear`, opaque to the
    compiler (`attn_cli.decode.compiled.through_custom_op`, what `--compile on` does)."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            through_custom_op(module)


def prefilled(model, src: torch.Tensor, beam: int, cached: int):
    """The tokens and cache after `cached` greedy steps of every sentence's `beam` rows."""
    rows = torch.arange(src.shape[0]).repeat_interleave(beam)
    with torch.inference_mode():
        memory, mask = model.encode(src)
        cache = model.start_decoding(memory, mask).reorder(rows, None)
        tokens = torch.full((len(rows),), model.config.bos_id)
        for _ in range(cached):
            logits, cache = model.decode_step(tokens, cache)
            tokens = logits.argmax(-1)
    return tokens, cache


def timed(step, tokens, cache, calls: int) -> tuple[float, torch.Tensor]:
    """Median ms of `calls` calls of step(tokens, cache) after 20 untimed ones; the logits."""
    times = []
    with torch.inference_mode():
        for _ in range(20):
            step(tokens, cache)
        for _ in range(calls):
            started = time.perf_counter()
            logits, _ = step(tokens, cache)
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3, logits


def profiled(name: str, step, tokens, cache) -> None:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as trace:
        for _ in range(50):
            step(tokens, cache)
    log(f"{name}, 50 steps:\n"
        + trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--source-length", type=int, default=16)
    parser.add_argument("--cached", type=int, default=10)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cpp-wrapper", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    import torch._inductor.config as inductor

    torch.set_num_threads(args.threads)
    cpu_name, isa = cpu_info()
    log(f"{cpu_name} ({isa}), {args.threads} thread(s), torch {torch.__version__}; "
        f"{args.sentences} x beam {args.beam} rows, {args.cached} cached positions")
    loaded = load_model(args.model)
    cpu = torch.device("cpu")
    packed = inference_model(loaded.model, cpu, linears="packed")
    dense = inference_model(loaded.model, cpu, linears="dense")
    config = packed.config
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, config.src_vocab_size, (args.sentences, args.source_length),
                        generator=generator)
    src[:, -1] = config.eos_id
    tokens, cache = prefilled(packed, src, args.beam, args.cached)
    eager_ms, reference = timed(packed.decode_step, tokens, cache, args.calls)
    log(f"eager, packed weights (attn decode): {eager_ms:.3f} ms a step")
    dense_ms, _ = timed(dense.decode_step, tokens, cache, args.calls)
    log(f"eager, dense weights: {dense_ms:.3f} ms a step")
    inductor.cpp_wrapper = args.cpp_wrapper
    steps = {"eager packed": packed.decode_step}
    for name, model, freezing, opaque in (("compiled dense, freezing", dense, True, False),
                                          ("compiled around the packed linear", packed, False,
                                           True)):
        if opaque:
            as_custom_ops(model)
        inductor.freezing = freezing
        compiled = torch.compile(model.decode_step, dynamic=False)
        started = time.perf_counter()
        with torch.inference_mode():
            compiled(tokens, cache)
        compile_s = time.perf_counter() - started
        ms, logits = timed(compiled, tokens, cache, args.calls)
        log(f"{name}: {ms:.3f} ms a step ({compile_s:.1f} s to compile); eager packed / "
            f"compiled {eager_ms / ms:.2f}x; max |logit difference| "
            f"{(logits - reference).abs().max().item():.2e}")
        steps[name] = compiled
    # attn decode --compile on's step (compiled.StepDecoder): the cache in preallocated
    # buffers written in place, dynamic shapes; its own prefill (the same tokens, greedy)
    for name, compiled in (("preallocated cache, uncompiled", False),
                           ("preallocated cache, compiled (attn decode --compile on)", True)):
        stepper = StepDecoder(inference_model(loaded.model, cpu, linears="packed"), compiled)
        step_tokens, step_cache = prefilled(stepper, src, args.beam, args.cached)
        started = time.perf_counter()
        with torch.inference_mode():
            stepper.decode_step(step_tokens, step_cache)
        first_s = time.perf_counter() - started
        ms, logits = timed(stepper.decode_step, step_tokens, step_cache, args.calls)
        log(f"{name}: {ms:.3f} ms a step ({first_s:.1f} s the first); eager packed / it "
            f"{eager_ms / ms:.2f}x; max |logit difference| "
            f"{(logits - reference).abs().max().item():.2e}")
        steps[name] = stepper.decode_step
    if args.profile:
        for name, step in steps.items():
            profiled(name, step, tokens, cache)


if __name__ == "__main__":
    main()
