"""One training step, eager against torch.compile: what share of the GPU's matmul rate does each
reach, and what does compiling cost? The question behind issue 54's first part, asked before
the compiled step is built, on synthetic WMT-shaped batches (lengths drawn like WMT14's, a
37,000-piece shared vocabulary), so that it runs anywhere without data.

For each batch size (`--tokens`, target tokens a step: 25,000 is the paper's, 3,125 one rank of
eight) and each way of running the step (`--modes`):
- eager: what `attn train` runs today (autocast bf16, the fused loss, fused Adam);
- compile: `torch.compile(model)` (inductor, default mode), graph breaks allowed;
- compile-layers: each encoder and decoder layer compiled on its own (the embeddings and the
  fused loss eager);
- compile-body (-ro): the encoder and decoder compiled as one graph, the fused loss eager;
- compile-ro: `torch.compile(model)` with `mode="reduce-overhead"` (CUDA graphs), for the host-bound
  small batches;
it trains `--steps` steps over `--shapes` distinct batch shapes (lengths rounded up to
multiples of 8, so a compiled step sees a bounded set of shapes), and reports the time of the
first pass over the shapes (the compilations) and ms/step, target tokens/s and model TFLOP/s
(the review's formula: 6 × non-embedding parameters × tokens, plus the attention's
products) over the steps after it, the last loss (eager and compiled take the same batches in
the same order from the same weights, so their losses should agree to bf16's tolerance), and
the recompilations dynamo counted.

    python -m benchmarks.train_step_compiled [--preset base] [--tokens 25000,3125]

Report on stderr; one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from attn_cli.config import get_preset
from attn_cli.loss import projected_label_smoothed_loss
from attn_cli.model import Transformer
from attn_cli.train.start import adam
from benchmarks._harness import log


def batch_shapes(tokens: int, shapes: int, seed: int = 1) -> list[tuple[int, int, int]]:
    """`shapes` (sentences, source length, target length) with about `tokens` target tokens,
    lengths like WMT14's (log-normal around 27 pieces), rounded up to multiples of 8."""
    generator = torch.Generator().manual_seed(seed)
    found = []
    for _ in range(shapes):
        length = float(torch.empty(1).log_normal_(math.log(24), 0.5, generator=generator))
        target = max(8, min(256, 8 * math.ceil(length / 8)))
        source = max(8, min(256, 8 * math.ceil(length * 1.05 / 8)))
        found.append((max(1, tokens // target), source, target))
    return found


def make_batch(shape, vocab: int, config, device, generator):
    """Random ids with a random amount of padding at each row's end (as length-sorted batches
    have a little): (src, tgt_input, target_positions, targets)."""
    sentences, source, target = shape
    src = torch.randint(4, vocab, (sentences, source), generator=generator)
    tgt = torch.randint(4, vocab, (sentences, target + 1), generator=generator)
    src_len = torch.randint(max(1, source - 7), source + 1, (sentences,), generator=generator)
    tgt_len = torch.randint(max(1, target - 7), target + 1, (sentences,), generator=generator)
    src[torch.arange(source)[None, :] >= src_len[:, None]] = config.pad_id
    tgt_input, gold = tgt[:, :-1].clone(), tgt[:, 1:].clone()
    tgt_input[:, 0] = config.bos_id
    real = torch.arange(target)[None, :] < tgt_len[:, None]
    tgt_input[~real] = config.pad_id
    positions = real.flatten().nonzero().squeeze(1)
    targets = gold.flatten()[positions]
    return [t.to(device, non_blocking=True) for t in (src, tgt_input, positions, targets)], \
        int(real.sum())


def step_flops(config, sentences: int, source: int, target: int) -> float:
    """Training FLOPs of one step (forward and backward: 3 × the forward's 2 × MACs)."""
    d, ff = config.d_model, config.d_ff
    encoder = config.encoder_layers * (4 * d * d + 2 * d * ff) * source \
        + config.encoder_layers * 2 * source * source * d
    decoder = config.decoder_layers * (8 * d * d + 2 * d * ff) * target \
        + config.decoder_layers * (2 * target * target * d + 2 * target * source * d)
    output = d * config.tgt_vocab_size * target
    return 6.0 * sentences * (encoder + decoder + output)


def network_body(model):
    """The model's forward up to the output projection: (src, tgt_input, positions) → the
    decoder's hidden states at the target positions."""
    def body(src, tgt_input, positions):
        memory, src_mask = model.encode(src)
        return model.decode(tgt_input, memory, src_mask).flatten(0, 1).index_select(0, positions)
    return body


def run_mode(mode: str, args, config, shapes, device) -> dict:
    torch.manual_seed(0)
    model = Transformer(config).to(device)
    optimizer = adam(model)
    forward = model
    if mode.startswith("compile"):
        torch._dynamo.reset()
        from torch._dynamo.utils import counters as dynamo_counters
        dynamo_counters.clear()
    if mode == "compile-layers":  # each layer compiled on its own (the loss and embeddings eager)
        for layer in [*model.encoder_layers, *model.decoder_layers]:
            layer.compile()
    elif mode.startswith("compile-body"):  # the network compiled, the fused loss eager
        body = torch.compile(network_body(model),
                             mode="reduce-overhead" if mode.endswith("-ro") else None)

        def forward(src, tgt_input, output_positions, targets, label_smoothing):
            hidden = body(src, tgt_input, output_positions)
            return projected_label_smoothed_loss(hidden, model.tgt_embed.weight, targets,
                                                 label_smoothing)
    elif mode.startswith("compile"):
        # dynamo cannot trace the fused loss (an autograd.Function whose forward computes its
        # gradients): kept out of the graph, the model's forward calls it eagerly between two
        # graphs (not in attn_cli itself, where the decorator would import dynamo at start-up)
        import attn_cli.model

        attn_cli.model.projected_label_smoothed_loss = torch.compiler.disable(
            projected_label_smoothed_loss)
        forward = torch.compile(model, mode="reduce-overhead" if mode == "compile-ro" else None)
    generator = torch.Generator().manual_seed(2)
    batches = [make_batch(shape, config.src_vocab_size, config, device, generator)
               for shape in shapes]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16" \
        else torch.autocast(device.type, enabled=False)
    times, losses = [], []
    for step in range(args.steps):
        (src, tgt_input, positions, targets), tokens = batches[step % len(batches)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = 1e-4
        with autocast:
            loss, nll = forward(src, tgt_input, output_positions=positions, targets=targets,
                                label_smoothing=0.1)
        (loss / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    first = sum(times[:len(shapes)])
    steady = times[len(shapes):] or times
    tokens = [batches[s % len(batches)][1] for s in range(len(shapes), args.steps)] or \
        [batches[0][1]]
    flops = [step_flops(config, *shapes[s % len(shapes)])
             for s in range(len(shapes), args.steps)] or [step_flops(config, *shapes[0])]
    seconds = sum(steady)
    counters = {}
    if mode.startswith("compile"):
        from torch._dynamo.utils import counters as dynamo_counters
        counters = {"graph_breaks": sum(dynamo_counters["graph_break"].values()),
                    "unique_graphs": dynamo_counters["stats"].get("unique_graphs", 0)}
    return {"mode": mode, "first_pass_s": round(first, 2),
            "ms_per_step": round(1000 * seconds / len(steady), 2),
            "tgt_tokens_per_s": round(sum(tokens) / seconds),
            "model_tflops": round(sum(flops) / seconds / 1e12, 1),
            "last_loss_per_token": round(float(losses[-1]) / batches[(args.steps - 1)
                                                                   % len(batches)][1], 4),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if device.type == "cuda" else None, **counters}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--tokens", default="25000,3125")
    parser.add_argument("--modes", default="eager,compile,compile-ro")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--shapes", type=int, default=6)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--deadline", type=float, default=420.0,
                        help="seconds after which no further run starts")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)  # what every attn command does (devices.py)
    config = get_preset(args.preset).model_config(args.vocab, dropout=0.1)
    began = time.perf_counter()
    found = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        shapes = batch_shapes(tokens, args.shapes)
        for mode in args.modes.split(","):
            if time.perf_counter() - began > args.deadline:
                log(f"deadline: {mode} at {tokens} tokens not run")
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                row = run_mode(mode, args, config, shapes, device)
            except Exception as error:  # a probe: report and go on to the next mode
                row = {"mode": mode, "error": f"{type(error).__name__}: {error}"[:400]}
            row["tokens"] = tokens
            found.append(row)
            log(json.dumps(row))
    print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else
                      "cpu", "torch": torch.__version__, "preset": args.preset,
                      "rows": found}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
