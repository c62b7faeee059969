"""§5.4 label smoothing: the training loss, as written and fused with the output projection.

`label_smoothed_loss` is the formula over given logits. Training takes
`projected_label_smoothed_loss`: the same numbers computed a block of rows at a time from the
decoder's hidden states and the (shared) output matrix, with the gradients worked out in the same
pass. The logits of a whole batch (4,096 targets × 8,000 pieces: 131 MB in float32) never exist
at once, and the passes over them that autograd would make (log-softmax forward and backward, a
one-hot fill, the sum of the two losses' gradients) shrink to a log-softmax, an exp and one
subtraction per target: less memory traffic in what is, on a CPU, a large share of a small
model's training step (benchmarks/README.md). `label_smoothed_loss` stays as the formula the
fused one is tested against. `alignment_loss` is guided alignment's term (not in the paper:
train/guided.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

# Logits held at once: ~2M on a CPU (a block of rows that stays in cache between its passes;
# benchmarks/README.md has the sizes tried), ~64M on a GPU (few, large kernels).
CPU_LOGITS_PER_BLOCK = 2 ** 21
GPU_LOGITS_PER_BLOCK = 2 ** 26


def label_smoothed_loss(logits: Tensor, target: Tensor, epsilon: float,
                        pad_id: int) -> tuple[Tensor, Tensor]:
    """§5.4 label smoothing (Szegedy et al. 2016): cross-entropy against (1 - ε)·onehot + ε/V,
    summed over non-padding targets. Returns (smoothed loss sum, negative log-likelihood sum);
    the NLL is what perplexity is made of."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 → float32
    smoothed = F.cross_entropy(logits, target, ignore_index=pad_id, label_smoothing=epsilon,
                               reduction="sum")
    if epsilon == 0.0:
        return smoothed, smoothed.detach()
    with torch.no_grad():
        nll = F.cross_entropy(logits, target, ignore_index=pad_id, reduction="sum")
    return smoothed, nll


def projected_label_smoothed_loss(hidden: Tensor, weight: Tensor, target: Tensor,
                                  epsilon: float, block_rows: int | None = None
                                  ) -> tuple[Tensor, Tensor]:
    """`label_smoothed_loss(hidden @ weightᵀ, target, epsilon)` for hidden (N, D), weight (V, D)
    and target (N,) (every row a real target), a block of rows at a time. Under autocast the
    projections run in its precision and the softmax in float32, as `label_smoothed_loss` of
    autocast logits would. Returns (loss sum, NLL sum); only the first has a gradient."""
    if block_rows is None:
        budget = GPU_LOGITS_PER_BLOCK if hidden.is_cuda else CPU_LOGITS_PER_BLOCK
        block_rows = max(1, budget // weight.shape[0])
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ProjectedLoss.apply(hidden, weight, target, epsilon, block_rows, with_grad)


def alignment_loss(log_attention: Tensor, positions: Tensor, weights: Tensor) -> Tensor:
    """Guided alignment (Garg et al. 2019, §4.2; not in the paper): the cross-entropy
    -Σ_t Σ_s G_{t,s} log A_{t,s} between one head's attention A and the reference alignment G,
    summed over the target positions that have one. `log_attention` (B, T, S) is log A;
    `positions` (M,) flat indices into it of the reference's non-zero entries, `weights` (M,)
    the entries (a row aligned with k source pieces holds 1/k at each: uniform over them)."""
    picked = log_attention.reshape(-1).index_select(0, positions)
    return -(picked * weights.to(picked.dtype)).sum()


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on `device_type` (None: autocast is off)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4: one function per device
        if device_type == "cuda":
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None


class _ProjectedLoss(torch.autograd.Function):
    """With q = (1 - ε)·onehot(y) + ε/V and p = softmax(z), z = h Wᵀ, per row:
    loss = logsumexp(z) - (1 - ε)·z_y - ε·mean(z), NLL = logsumexp(z) - z_y, and
    ∂loss/∂z = p - q, so ∂/∂h = (p - q) W and ∂/∂W = (p - q)ᵀ h. The ε/V part of q is taken out
    of the matmuls (ε/V · ΣW and ε/V · Σh) rather than subtracted from every logit."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, epsilon: float,
                block_rows: int, with_grad: bool) -> tuple[Tensor, Tensor]:
        vocab = weight.shape[0]
        device_type = "cuda" if hidden.is_cuda else "cpu"  # (the meta device: the CPU's rules)
        # Under fp16 autocast, p - q would be cast to fp16 before the loss scale reaches it (in
        # backward): probabilities under 6e-8 would flush to zero, under 6e-5 lose bits. Its
        # two matmuls run in float32 then (TF32 on Ampere and later); bf16 has float32's range.
        exact_gradients = autocast_dtype(device_type) == torch.float16
        hidden, weight = hidden.detach(), weight.detach()
        wide = torch.promote_types(weight.dtype, torch.float32)  # float32, or float64 if given
        with torch.autocast(device_type, enabled=False):
            weight_sum = weight.to(wide).sum(0)  # (D,): Σ_v W_v, for the mean logit and ε/V
        loss = hidden.new_zeros((), dtype=wide)
        nll = hidden.new_zeros((), dtype=wide)
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = torch.zeros_like(weight, dtype=wide) if with_grad else None
        for start in range(0, hidden.shape[0], block_rows):
            rows = hidden[start:start + block_rows]
            with torch.autocast(device_type, enabled=False):
                rows_wide = rows.to(wide)
            gold = target[start:start + block_rows, None]
            logits = F.linear(rows, weight).to(wide)  # (n, V); autocast's precision if enabled
            gold_logit = logits.gather(1, gold).squeeze(1)
            log_p = torch.log_softmax(logits, dim=1)
            del logits
            logsumexp = gold_logit - log_p.gather(1, gold).squeeze(1)
            with torch.autocast(device_type, enabled=False):
                mean_logit = rows_wide @ weight_sum / vocab
            row_nll = logsumexp - gold_logit
            nll += row_nll.sum()
            loss += ((1 - epsilon) * row_nll + epsilon * (logsumexp - mean_logit)).sum()
            if not with_grad:
                continue
            p_minus_onehot = log_p.exp_().scatter_add_(
                1, gold, log_p.new_full(gold.shape, -(1 - epsilon)))
            with torch.autocast(device_type, enabled=False) if exact_gradients else \
                    contextlib.nullcontext():
                grad_hidden[start:start + block_rows] = p_minus_onehot @ weight
                grad_weight += p_minus_onehot.T @ (rows_wide if exact_gradients else rows)
            with torch.autocast(device_type, enabled=False):
                grad_hidden[start:start + block_rows] -= epsilon / vocab * weight_sum
                grad_weight -= epsilon / vocab * rows_wide.sum(0)
        ctx.mark_non_differentiable(nll)
        if with_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None
