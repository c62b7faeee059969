"""Training throughput of `attn train` on a CPU, against the machine's own matmul speed.

What it measures, on the bundled Multi30k en-de training data (8000-piece shared BPE):

1. `attn train` itself (a subprocess, the real command) with the `small` preset: 3+3 layers,
   d_model 256, d_ff 1024, 4 heads. It runs `--steps` optimizer steps and reads source and target
   tokens/s (padding excluded, EOS/BOS included) from `metrics.jsonl`, skipping the first window
   (warm-up). Checkpoint writing is outside the timed windows.
2. The float32 matmul throughput of this machine with the same threads, measured just before and
   just after the training run (this VM's figure varies from run to run, so only a same-run ratio
   counts): the best of several (2048x256)@(256x1024)-shaped and 1024^3 products.
3. Model FLOPs per second: 6 x parameters touched per token (forward 2, backward 4; the encoder's
   for source tokens, the decoder's and the output projection's for target tokens, the
   encoder-decoder key/value projections per source token) plus attention scores and weighted sums
   (4·L·d per query and layer forward, x3 with backward; causal self-attention counted half), with
   the lengths of the data. Reported as a fraction of the matmul figure.

    python benchmarks/train_throughput.py                    # ~2 minutes on 2 cores
    python benchmarks/train_throughput.py --steps 300 --preset small --batch-tokens 3000

Report on stderr, one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "examples" / "multi30k" / "data"
TARGET_TGT, TARGET_SRC = 2000, 1800  # tokens/s: 1.2x OpenNMT-py 3.5.1 on this machine


def log(message: str = "") -> None:
    print(message, file=sys.stderr, flush=True)


def matmul_gflops(threads: int, seconds: float = 3.0) -> float:
    """Best float32 matmul throughput over a few shapes, in GFLOP/s."""
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for m, k, n in ((2048, 256, 1024), (2048, 1024, 256), (1024, 1024, 1024)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        deadline = time.perf_counter() + seconds / 3
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            for _ in range(5):
                torch.mm(a, b)
            elapsed = (time.perf_counter() - start) / 5
            best = max(best, 2 * m * k * n / elapsed / 1e9)
    return best


def flops_per_token(preset_name: str, vocab_size: int, data_path: Path) -> tuple[float, float]:
    """Training FLOPs per source token and per target token (forward + backward)."""
    import numpy as np

    from attn_cli.config import get_preset
    from attn_cli.data import ParallelData

    config = get_preset(preset_name).model_config(vocab_size)
    d, ff = config.d_model, config.d_ff
    hk, hv = config.heads * config.d_k, config.heads * config.d_v
    data = ParallelData(data_path)
    src = data.src_lengths.astype(np.float64) + 1
    tgt = data.tgt_lengths.astype(np.float64) + 1
    attention_width = hk + hv  # scores use d_k per head, weighted sums d_v per head
    # Parameters touched per token (multiply-adds), and attention per token, forward only.
    encoder_layer = d * (2 * hk + hv) + hv * d + 2 * d * ff
    decoder_layer = d * (2 * hk + hv) + hv * d + d * hk + hv * d + 2 * d * ff
    cross_kv_per_source_token = d * (hk + hv)
    per_src = config.encoder_layers * encoder_layer + config.decoder_layers * \
        cross_kv_per_source_token
    per_tgt = config.decoder_layers * decoder_layer + d * config.tgt_vocab_size
    # Attention: encoder self over S keys; decoder self (causal: T/2 keys on average) and cross
    # over S keys; per query, 2·L·width FLOPs forward.
    encoder_attention = config.encoder_layers * 2 * attention_width * (src ** 2).sum() / src.sum()
    decoder_attention = config.decoder_layers * 2 * attention_width * (
        (tgt ** 2).sum() / 2 + (tgt * src).sum()) / tgt.sum()
    src_flops = 3 * (2 * per_src + encoder_attention)  # x3: backward costs twice the forward
    tgt_flops = 3 * (2 * per_tgt + decoder_attention)
    return src_flops, tgt_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--batch-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--extra", default="", help="More `attn train` options, quoted.")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="attn-train-bench.") as scratch:
        work = Path(scratch)
        for split in ("train",):
            for lang in ("en", "de"):
                with gzip.open(DATA_DIR / f"{split}.{lang}.gz", "rb") as source:
                    (work / f"{split}.{lang}").write_bytes(source.read())
        attn = [sys.executable, "-m", "attn_cli"]
        subprocess.run([*attn, "vocab", work / "train.en", work / "train.de", "-o",
                        work / "spm.model", "--size", "8000"], check=True,
                       stderr=subprocess.DEVNULL)
        subprocess.run([*attn, "binarize", "--vocab", work / "spm.model", work / "train.en",
                        work / "train.de", "-o", work / "train.st"], check=True,
                       stderr=subprocess.DEVNULL)

        log(f"matmul: measuring float32 GFLOP/s with {args.threads} threads")
        before = matmul_gflops(args.threads)
        command = [*attn, "train", work / "train.st", "-o", work / "run", "--preset", args.preset,
                   "--max-steps", str(args.steps), "--log-every", str(args.log_every),
                   "--save-every", str(args.steps), "--device", "cpu", *args.extra.split()]
        if args.batch_tokens:
            command += ["--batch-tokens", str(args.batch_tokens)]
        log("train: " + " ".join(map(str, command[2:])))
        started = time.perf_counter()
        subprocess.run(command, check=True, stderr=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        wall = time.perf_counter() - started
        after = matmul_gflops(args.threads)
        rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text()
                .splitlines() if line.strip()]
        timed = [row for row in rows if "tokens_per_s" in row][1:]  # skip the warm-up window
        tgt_per_s = sum(row["tokens_per_s"] for row in timed) / len(timed)
        src_per_s = sum(row["src_tokens_per_s"] for row in timed) / len(timed)
        src_flops, tgt_flops = flops_per_token(args.preset, 8000, work / "train.st")

    model_gflops = (src_per_s * src_flops + tgt_per_s * tgt_flops) / 1e9
    matmul = (before + after) / 2
    result = {
        "preset": args.preset, "steps": args.steps, "threads": args.threads,
        "tgt_tokens_per_s": tgt_per_s, "src_tokens_per_s": src_per_s,
        "model_gflops_per_s": model_gflops, "matmul_gflops_per_s": matmul,
        "matmul_before": before, "matmul_after": after,
        "matmul_fraction": model_gflops / matmul,
        "flops_per_src_token": src_flops, "flops_per_tgt_token": tgt_flops,
        "wall_s": wall, "pass": tgt_per_s >= TARGET_TGT and src_per_s >= TARGET_SRC,
    }
    log(f"\nattn train --preset {args.preset}, {args.steps} steps, {args.threads} threads:")
    log(f"  {tgt_per_s:,.0f} target + {src_per_s:,.0f} source tokens/s "
        f"(target >= {TARGET_TGT} + {TARGET_SRC}: {'PASS' if result['pass'] else 'FAIL'})")
    log(f"  model {model_gflops:.1f} GFLOP/s = {100 * result['matmul_fraction']:.0f}% of this "
        f"run's float32 matmul {matmul:.1f} GFLOP/s (before {before:.1f}, after {after:.1f})")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
