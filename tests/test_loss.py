"""§5.4's label-smoothed loss (loss.py), by hand, and fused with the output projection."""

from __future__ import annotations

import math
import os

import pytest
import torch

from attn_cli.loss import label_smoothed_loss, projected_label_smoothed_loss

from .peak_memory import loss_peak_growth


def test_label_smoothing_by_hand():
    """Loss = -Σ_k q(k) log p(k) with q = (1-ε)·onehot + ε/V; padding targets ignored."""
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 0.4], [5.0, 5.0, 5.0, 5.0]])
    target = torch.tensor([1, 3, 0])  # the last one is padding (pad id 0)
    epsilon = 0.1
    expected_loss = expected_nll = 0.0
    for row, gold in ((0, 1), (1, 3)):
        exp = [math.exp(v) for v in logits[row].tolist()]
        log_p = [math.log(e / sum(exp)) for e in exp]
        q = [epsilon / 4 + (1 - epsilon) * (k == gold) for k in range(4)]
        expected_loss -= sum(qk * lp for qk, lp in zip(q, log_p))
        expected_nll -= log_p[gold]
    loss, nll = label_smoothed_loss(logits, target, epsilon, pad_id=0)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert nll.item() == pytest.approx(expected_nll, rel=1e-6)


@pytest.mark.parametrize("block_rows", [1, 7, 64, 1000])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_projected_loss_equals_the_loss_of_the_logits(block_rows, epsilon):
    """The fused projection + loss (forward, and the gradients it works out itself) against
    autograd through `label_smoothed_loss` of the full logits, in float64."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(50, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(30, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    target = torch.randint(1, 30, (50,), generator=generator)
    loss, nll = label_smoothed_loss(hidden @ weight.T, target, epsilon, pad_id=0)
    (loss * 0.37).backward()
    expected = loss.item(), nll.item(), hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss, nll = projected_label_smoothed_loss(hidden, weight, target, epsilon, block_rows)
    (loss * 0.37).backward()
    assert (loss.item(), nll.item()) == pytest.approx(expected[:2], rel=1e-12)
    assert not nll.requires_grad
    torch.testing.assert_close(hidden.grad, expected[2], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight.grad, expected[3], rtol=1e-10, atol=1e-12)


def test_projected_loss_under_bf16_autocast_matches_the_autocast_logits():
    """Mixed precision: projections in bf16, softmax in float32, as the unfused path did."""
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 32, generator=generator)
    weight = torch.randn(50, 32, generator=generator) * 0.3
    target = torch.randint(1, 50, (40,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = hidden @ weight.T
        fused, _ = projected_label_smoothed_loss(hidden, weight, target, 0.1, block_rows=16)
    reference, _ = label_smoothed_loss(logits, target, 0.1, pad_id=0)
    assert fused.item() == pytest.approx(reference.item(), rel=2e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_projected_loss_under_fp16_autocast_keeps_the_gradients_of_rare_tokens(device,
                                                                               monkeypatch):
    """fp16 (on a GPU, with loss scaling): the gradient w.r.t. the output matrix has a row per
    vocabulary piece, (p - q)ᵀ h; for the pieces a peaked softmax gives p < 1e-6, fp16 would
    round p to zero or to a few bits before the loss scale reaches it (in backward). They are
    computed in float32: equal, to float32's error, to (p - q)ᵀ h in float64 for the p of the
    same fp16 logits. (CPU autocast in fp16 makes the same casts as CUDA's.) On CUDA, TF32 off:
    a training process turns it on (10-bit mantissas: 6e-4 here, measured on an H100), and an
    earlier test in this process may have. cuBLAS sums the fp16 logits in another order than the
    CPU reference, so a few round to the neighbouring fp16 value (1.3e-4 in the worst of the
    rare rows, measured on an H200): 1e-3 there, still 30x under what fp16's p would lose (a
    p < 1e-6 keeps 4 bits or none)."""
    if device == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    generator = torch.Generator().manual_seed(5)
    vocab, width, rows = 8000, 64, 256
    weight = torch.randn(vocab, width, generator=generator) * 0.05
    weight[:20] *= 60  # a few frequent pieces hold nearly all the mass: p < 1e-6 elsewhere
    hidden = torch.randn(rows, width, generator=generator)
    target = torch.randint(0, 20, (rows,), generator=generator)
    leaf = weight.clone().to(device).requires_grad_()
    with torch.autocast(device, dtype=torch.float16):
        loss, _ = projected_label_smoothed_loss(hidden.to(device), leaf, target.to(device), 0.0)
    loss.backward()
    logits = torch.nn.functional.linear(hidden.half(), weight.half()).double()
    p_minus_q = torch.softmax(logits, dim=-1) - torch.nn.functional.one_hot(target, vocab)
    expected = p_minus_q.T @ hidden.double()
    rare = torch.softmax(logits, dim=-1).max(dim=0).values < 1e-6  # no row gives them 1e-6
    assert rare.sum() > 1000 and (expected[rare] != 0).all()
    found = leaf.grad.double().cpu()[rare]
    error = (found - expected[rare]).norm(dim=1) / expected[rare].norm(dim=1)
    assert error.max() < (1e-4 if device == "cpu" else 1e-3), float(error.max())


@pytest.mark.slow
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux's /proc/self/clear_refs to reset the peak")
def test_the_fused_loss_peaks_far_below_the_whole_batchs_logits():
    """Forward and backward of 2,048 targets over 16,000 pieces, each in a fresh process: the
    formula's peak grows by ~3x the batch's fp32 logits (125 MiB: the logits, the log-softmax,
    their gradient), the fused loss's by its blocks and the weight's gradient (measured 385
    against 99-107 MiB; benchmarks/loss_memory.py: 3,481 against 204 MiB at 8,192 x 37,000)."""
    grown = {kind: loss_peak_growth(2048, 16000, 256, kind)[0] / 1024
             for kind in ("formula", "fused")}  # KiB
    logits_kib = 2048 * 16000 * 4 / 1024
    assert grown["formula"] > 2 * logits_kib, grown
    assert grown["fused"] < 0.5 * grown["formula"], grown
