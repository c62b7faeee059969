"""Peak memory of the training loss: §5.4's label-smoothed cross-entropy of the whole batch's
logits (`label_smoothed_loss`, through autograd) against the fused projection and loss that
training runs (`projected_label_smoothed_loss`: a block of rows at a time, its gradients worked
out in the same pass), forward and backward, each in a fresh process, on the CPU.

The figure is the growth of the process's peak resident memory (Linux's VmHWM) over what it
held once its inputs existed: what the loss itself needs at its high-water mark. The whole batch's
fp32 logits alone are rows × vocab × 4 bytes (25,000 targets × 37,000 pieces: 3.7 GB); the
fused loss holds one block of them (2^21 logits on a CPU, 8 MB; 2^26 on a GPU, 256 MB).

    python -m benchmarks.loss_memory [--rows 8192] [--vocab 37000] [--width 512]

Report on stderr; one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks._harness import log
from tests.peak_memory import loss_peak_growth


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192, help="target tokens of the batch")
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--width", type=int, default=512, help="d_model")
    args = parser.parse_args(argv)
    found = {"rows": args.rows, "vocab": args.vocab, "width": args.width,
             "logits_fp32_bytes": args.rows * args.vocab * 4}
    for kind in ("formula", "fused"):
        grown, seconds = loss_peak_growth(args.rows, args.vocab, args.width, kind)
        found[kind] = {"peak_growth_bytes": grown, "seconds": round(seconds, 3)}
        log(f"{kind}: peak +{grown / 2**20:,.0f} MiB ({grown / found['logits_fp32_bytes']:.2f}x "
            f"the batch's fp32 logits), {seconds:.2f} s forward and backward")
    found["saved_fraction"] = 1 - found["fused"]["peak_growth_bytes"] / \
        found["formula"]["peak_growth_bytes"]
    log(f"the fused loss's peak: {1 - found['saved_fraction']:.1%} of the formula's")
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
