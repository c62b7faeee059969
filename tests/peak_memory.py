"""The peak memory a training loss needs, forward and backward, measured in a fresh process: used
by tests/test_loss.py at a small size and by benchmarks/loss_memory.py at WMT's."""

from __future__ import annotations

import subprocess
import sys

# The peak is the kernel's VmHWM, reset first (writing 5 to /proc/self/clear_refs, Linux 4.0
# on): ru_maxrss would carry the parent's peak into a child started by vfork and exec (pytest's,
# ~1.2 GB by the end of the suite, hid the growth).
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


def loss_peak_growth(rows: int, vocab: int, width: int, kind: str) -> tuple[int, float]:
    """(bytes the peak grew by, seconds) of one forward and backward of the loss `kind`
    ("formula": label_smoothed_loss of the whole batch's logits; "fused": the projected loss)
    over `rows` targets, a `vocab` × `width` output matrix."""
    completed = subprocess.run([sys.executable, "-c", MEASURE, str(rows), str(vocab),
                                str(width), kind], capture_output=True, text=True, check=True)
    grown, seconds = completed.stdout.split()
    return int(grown), float(seconds)
