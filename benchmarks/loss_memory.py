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
import subprocess
import sys

from benchmarks._harness import log

# The peak is the kernel's VmHWM, reset first (writing 5 to /proc/self/clear_refs, Linux 4.0 on):
# ru_maxrss would carry the parent's peak into a child started by vfork and exec.
MEASURE = """
import sys, time, torch
from attn_cli.loss import label_smoothed_loss, projected_label_smoothed_loss
rows, vocab, width, kind = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
generator = torch.Generator().manual_seed(0)
hidden = torch.randn(rows, width, generator=generator, requires_grad=True)
weight = (torch.randn(vocab, width, generator=generator) * 0.05).requires_grad_()
target = torch.randint(4, vocab, (rows,), generator=generator)
def loss():
    if kind == "fused":
        return projected_label_smoothed_loss(hidden, weight, target, 0.1)[0]
    return label_smoothed_loss(hidden @ weight.T, target, 0.1, pad_id=0)[0]
hidden.grad = torch.zeros_like(hidden); weight.grad = torch.zeros_like(weight)
def status(key):
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) for line in lines if line.startswith(key))
with open("/proc/self/clear_refs", "w") as reset:
    reset.write("5")
before = status("VmRSS:")
started = time.perf_counter()
loss().backward()
seconds = time.perf_counter() - started
print((status("VmHWM:") - before) * 1024, seconds)
"""


def peak_growth(rows: int, vocab: int, width: int, kind: str) -> tuple[int, float]:
    """(bytes the peak grew by, seconds) of one forward and backward of `kind`'s loss."""
    completed = subprocess.run([sys.executable, "-c", MEASURE, str(rows), str(vocab),
                                str(width), kind], capture_output=True, text=True, check=True)
    grown, seconds = completed.stdout.split()
    return int(grown), float(seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192, help="target tokens of the batch")
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--width", type=int, default=512, help="d_model")
    args = parser.parse_args(argv)
    found = {"rows": args.rows, "vocab": args.vocab, "width": args.width,
             "logits_fp32_bytes": args.rows * args.vocab * 4}
    for kind in ("formula", "fused"):
        grown, seconds = peak_growth(args.rows, args.vocab, args.width, kind)
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
