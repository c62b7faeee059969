"""One decoder step at 4, 32, 128 and 512 rows: the eager step against the C++ one, and how much
of each is the linear layers (the part no step can do without) and how much the rest.

    python -m benchmarks.decode_steps -m model.st [--rows 4,32,128,512] [--cached 10]

For each row count (rows = sentences × beam 4, each sentence's source 20 tokens), with `--cached`
positions already in the self-attention cache, on one torch thread, the median of `--repeats`
rounds of `--steps` steps each (the eager and C++ steps alternated round by round, both on the
same cache each time, so that neither grows it): the whole step (the embedding, every layer,
the output projection), the same step's linear layers alone (each layer's packed or dense
linear on inputs of the step's shapes: QKV, the self-attention's output, the cross-attention's
query and output, the feed-forward's two, per layer, then the output projection), and the rest,
the step less its linears: what the C++ step is there to cut (the review's targets at 4, 32,
128, 512 rows: 0.2, 0.3, 0.8, 3.5 ms on a 2-core AMD EPYC with AVX-512).

Report on stderr (with the CPU model and ISA), one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.machine import cpu_info

TARGETS_MS = {4: 0.2, 32: 0.3, 128: 0.8, 512: 3.5}  # the rest, the review of af00cba


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--rows", default="4,32,128,512")
    parser.add_argument("--cached", type=int, default=10, help="Positions already decoded.")
    parser.add_argument("--steps", type=int, default=20, help="Steps timed in each round.")
    parser.add_argument("--repeats", type=int, default=5, help="Rounds; medians reported.")
    args = parser.parse_args()

    from attn_cli.decode.native import native_decoder
    from attn_cli.devices import inference_model
    from attn_cli.modelfile import load_model

    torch.set_num_threads(1)
    loaded = load_model(args.model)
    model = inference_model(loaded.model, torch.device("cpu"), "fp32", "packed")
    native = native_decoder(model, lambda line: print(line, file=sys.stderr, flush=True))
    if native is None:
        raise SystemExit("the C++ step is not at hand (see the line above)")
    cpu_name, isa = cpu_info()
    print(f"{cpu_name} ({isa}), 1 thread, {args.cached} positions cached", file=sys.stderr,
          flush=True)
    report = {"model": args.model, "cpu": cpu_name, "isa": isa, "cached": args.cached,
              "rows": {}}
    config = model.config
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            sentences = max(1, rows // 4)
            src = torch.randint(4, config.src_vocab_size, (sentences, 20))
            src[:, -1] = config.eos_id
            memory, src_mask = model.encode(src)
            start = model.start_decoding(memory, src_mask)
            cache = start.reorder(torch.arange(sentences).repeat_interleave(rows // sentences))
            tokens = torch.randint(4, config.tgt_vocab_size, (rows,))
            by_position = native.position_cache(memory, src_mask, args.cached + 1, rows)
            for _ in range(args.cached):
                _, cache = model.decode_step(tokens, cache)
                native.fused_step(tokens, by_position)
            timings = {"eager": [], "native": [], "fused": [], "linears": []}
            for _ in range(args.repeats):
                for name, stepper in (("eager", model), ("native", native)):
                    timings[name].append(time_steps(stepper, tokens, cache, args.steps))
                timings["fused"].append(time_fused(native, tokens, by_position, args.steps))
                timings["linears"].append(time_linears(model, rows, sentences, args.steps))
            medians = {name: statistics.median(values) for name, values in timings.items()}
            row = {**{f"{name}_ms": value for name, value in medians.items()},
                   **{f"{name}_rest_ms": medians[name] - medians["linears"]
                      for name in ("eager", "native", "fused")}}
            report["rows"][rows] = row
            target = TARGETS_MS.get(rows)
            print(f"{rows:>4} rows: step eager {medians['eager']:.2f} ms, C++ (ATen) "
                  f"{medians['native']:.2f} ms, C++ fused {medians['fused']:.2f} ms "
                  f"({medians['eager'] / medians['fused']:.2f}x eager); linears "
                  f"{medians['linears']:.2f} ms; the rest: eager {row['eager_rest_ms']:.2f}, "
                  f"ATen {row['native_rest_ms']:.2f}, fused {row['fused_rest_ms']:.2f} ms"
                  + (f" (review's target <= {target} ms)" if target else ""), file=sys.stderr,
                  flush=True)
    print(json.dumps(report, indent=2))


def time_steps(stepper, tokens, cache, steps: int) -> float:
    """Milliseconds a step, each from the same cache (no growth from one to the next)."""
    stepper.decode_step(tokens, cache)  # warm
    started = time.perf_counter()
    for _ in range(steps):
        stepper.decode_step(tokens, cache)
    return (time.perf_counter() - started) / steps * 1000


def time_fused(native, tokens, by_position, steps: int) -> float:
    """Milliseconds a fused step (stage B), each at the same position of the same cache."""
    cached = by_position.length - 1
    by_position.length = cached
    native.fused_step(tokens, by_position)  # warm
    started = time.perf_counter()
    for _ in range(steps):
        by_position.length = cached
        native.fused_step(tokens, by_position)
    return (time.perf_counter() - started) / steps * 1000


def time_linears(model, rows: int, sentences: int, steps: int) -> float:
    """Milliseconds of a step's linear layers alone, on inputs of the step's shapes."""
    config = model.config
    x = torch.randn(rows, 1, config.d_model)
    calls = []
    for layer in model.decoder_layers:
        calls += [(layer.self_attn.qkv_proj, x), (layer.self_attn.out_proj, x),
                  (layer.cross_attn.q_proj, x), (layer.cross_attn.out_proj, x),
                  (layer.ffn, x)]
    calls.append((model.output_logits, x[:, 0]))
    for function, argument in calls:  # warm
        function(argument)
    started = time.perf_counter()
    for _ in range(steps):
        for function, argument in calls:
            function(argument)
    return (time.perf_counter() - started) / steps * 1000


if __name__ == "__main__":
    main()
