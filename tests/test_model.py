"""The core model against the paper's formulas (§3)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attn_cli.config import PRESETS, ModelConfig
from attn_cli.model import (
    MultiHeadAttention,
    Transformer,
    cpu_dropout_scale,
    fairseq_positions,
    sinusoidal_positions,
)


@pytest.fixture(autouse=True)
def seeded():
    """Each test draws its random weights and tokens from the same seed, whatever ran before."""
    torch.manual_seed(0)


def tiny_config(**changes) -> ModelConfig:
    return dataclasses.replace(PRESETS["tiny"].model_config(50), **{"dropout": 0.0, **changes})


def random_tokens(batch: int, length: int, vocab: int = 50) -> torch.Tensor:
    return torch.randint(4, vocab, (batch, length))


def test_attention_is_softmax_of_scaled_dot_products():
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, computed by hand per head."""
    config = tiny_config(heads=2, d_k=8, d_v=6, d_model=16)
    attention = MultiHeadAttention(config, cross=False).eval()
    x = torch.randn(3, 5, 16)
    keep = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    keep[1, ..., 3:] = False
    mask = torch.zeros(3, 1, 1, 5).masked_fill(~keep, -math.inf)  # added to the scores
    got = attention(x, mask=mask)

    w_q, w_k, w_v = attention.qkv_proj.weight.split([16, 16, 12])
    heads = []
    for head in range(2):
        q = x @ w_q[head * 8:(head + 1) * 8].T
        k = x @ w_k[head * 8:(head + 1) * 8].T
        v = x @ w_v[head * 6:(head + 1) * 6].T
        scores = q @ k.transpose(1, 2) / math.sqrt(8)
        scores = scores.masked_fill(~keep[:, 0], float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)
    expected = attention.out_proj(torch.cat(heads, dim=-1))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The parts decoding uses give the same, and so does encoder-decoder attention taken whole
    # or with the memory projected once.
    torch.testing.assert_close(attention.attend(*attention.project_self(x), mask=mask), got)
    cross = MultiHeadAttention(config, cross=True).eval()
    memory = torch.randn(3, 5, 16)
    torch.testing.assert_close(cross.attend_memory(x, cross.memory_for_steps(memory), mask),
                               cross(x, memory, mask=mask), atol=1e-6, rtol=1e-5)


def test_the_padding_mask_is_made_once_per_batch_in_the_attentions_dtype():
    """0 at real tokens, -inf at padding, in the dtype the attention computes in (the weights',
    or autocast's), its rows 8-aligned for CUDA's memory-efficient kernel; a forward pass makes
    it once: no attention call converts a mask (torch turns a boolean one into this one inside
    every call)."""
    model = Transformer(tiny_config()).eval()
    src, tgt = random_tokens(2, 5), random_tokens(2, 4)
    src[1, 3:] = 0
    mask = model.padding_mask(src)
    assert mask.shape == (2, 1, 1, 5) and mask.dtype == torch.float32
    assert mask[:, 0, 0].tolist() == [[0.0] * 5, [0.0] * 3 + [-math.inf] * 2]
    assert all(stride % 8 == 0 for stride in mask.stride()[:-1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.padding_mask(src).dtype == torch.bfloat16
    assert Transformer(tiny_config()).to(torch.bfloat16).padding_mask(src).dtype == \
        torch.bfloat16

    ops = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Ops():
        model(src, tgt)
    assert ops.count("masked_fill_") == 1 and "where" not in ops and "logical_not" not in ops


def test_bf16_autocast_trains_close_to_float32():
    """Under bf16 autocast (the mask then bf16) the loss and its gradient stay near float32's."""
    model = Transformer(tiny_config(attention_dropout=0.0)).train()
    src, tgt, targets = random_tokens(3, 6), random_tokens(3, 5), random_tokens(15, 1)[:, 0]
    src[0, 4:] = 0
    positions = torch.arange(15)
    losses = []
    for dtype in (None, torch.bfloat16):
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss, _ = model(src, tgt, output_positions=positions, targets=targets)
        loss.backward()
        losses.append((loss.item(), model.tgt_embed.weight.grad.clone()))
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-2)
    assert torch.cosine_similarity(losses[1][1].flatten(), losses[0][1].flatten(), dim=0) > 0.99


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_bf16_search_step_projects_in_float32_on_a_gpu(device):
    """bf16 logits are rounded to steps of 1/16 near |z| = 16: ties that decide beams. On a
    GPU a search step's output projection runs in float32; on a CPU in the model's dtype."""
    model = Transformer(tiny_config()).eval().to(device, torch.bfloat16)
    hidden = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    logits = model.step_logits(hidden)
    if device == "cpu":
        assert torch.equal(logits, model.output_logits(hidden))
    else:
        assert logits.dtype == torch.float32
        assert torch.equal(logits, torch.nn.functional.linear(hidden.float(),
                                                             model.tgt_embed.weight.float()))


def test_positional_encoding_matches_formula():
    table = sinusoidal_positions(60, 32)
    for pos in (0, 1, 7, 59):
        for i in range(16):
            angle = pos / 10000 ** (2 * i / 32)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


@pytest.mark.parametrize("d_model", [32, 512])
def test_positions_are_the_same_in_any_table(d_model):
    """A position's encoding is the same bits in a table of any length and computed alone: a
    model's positions past its table equal those a longer table would give."""
    longest = sinusoidal_positions(5000, d_model)
    for length in (1, 100, 1024, 1073, 2048, 4096):
        assert torch.equal(sinusoidal_positions(length, d_model), longest[:length]), length
    for start, length in ((0, 7), (1023, 1), (1024, 50), (3001, 1), (2500, 2500)):
        assert torch.equal(sinusoidal_positions(length, d_model, start),
                           longest[start:start + length]), (start, length)


def test_positions_past_the_table_are_computed_and_not_stored():
    model = Transformer(tiny_config(max_positions=16)).eval()
    table = model.sinusoids.clone()
    assert torch.equal(model.positions(10, 20), sinusoidal_positions(30, 64)[10:])
    assert torch.equal(model.positions(3, 5), table[3:8])
    assert torch.equal(model.sinusoids, table)  # a forward pass changes nothing in the model
    src, tgt = random_tokens(1, 20), random_tokens(1, 25)
    with torch.no_grad():
        model(src, tgt)
    assert torch.equal(model.sinusoids, table)


def test_embeddings_are_shared_and_scaled():
    model = Transformer(tiny_config()).eval()
    assert model.src_embed is model.tgt_embed
    tokens = random_tokens(2, 4)
    expected = model.tgt_embed.weight[tokens] * math.sqrt(64) + sinusoidal_positions(4, 64)
    torch.testing.assert_close(model.embed(model.src_embed, tokens), expected)
    hidden = torch.randn(2, 3, 64)
    torch.testing.assert_close(model.output_logits(hidden), hidden @ model.tgt_embed.weight.T)


def test_future_target_tokens_cannot_change_earlier_outputs():
    model = Transformer(tiny_config()).eval()
    src, tgt = random_tokens(2, 6), random_tokens(2, 7)
    before = model(src, tgt)
    perturbed = tgt.clone()
    perturbed[:, 4:] = random_tokens(2, 3)
    after = model(src, perturbed)
    torch.testing.assert_close(after[:, :4], before[:, :4])
    assert not torch.allclose(after[:, 4:], before[:, 4:])


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_padding_cannot_change_outputs(norm):
    """A sentence gives the same result alone and padded in a batch with a longer one, and
    whatever the padded positions hold does not matter."""
    model = Transformer(tiny_config(norm=norm)).eval()
    short, long = random_tokens(1, 4), random_tokens(1, 9)
    tgt = random_tokens(2, 5)
    batch = torch.zeros(2, 9, dtype=torch.long)  # pad_id 0
    batch[0, :4], batch[1] = short[0], long[0]
    with torch.no_grad():
        alone = model(short, tgt[:1])
        torch.testing.assert_close(model(batch, tgt)[:1], alone, atol=1e-5, rtol=1e-5)
        model.src_embed.weight[0] = torch.randn(64)  # perturb what padding positions carry
        # (the shared matrix is also the output projection: skip the pad logit itself)
        torch.testing.assert_close(model(batch, tgt)[:1, :, 1:], alone[..., 1:],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("changes", [{}, {"norm": "pre"}, {"positions": "learned"},
                                     {"heads": 1, "d_k": 8, "d_v": 32}])
def test_incremental_decoding_equals_full_sequence(changes):
    model = Transformer(tiny_config(**changes)).eval()
    src = random_tokens(3, 8)
    src[1, 5:] = 0
    tgt = random_tokens(3, 10)
    with torch.no_grad():
        full = model(src, tgt)
        memory, src_mask = model.encode(src)
        cache = model.start_decoding(memory, src_mask)
        steps = []
        for position in range(tgt.shape[1]):
            logits, cache = model.decode_step(tgt[:, position], cache)
            steps.append(logits)
    torch.testing.assert_close(torch.stack(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_incremental_decoding_writes_its_cache_into_two_buffers_in_turn():
    """Each step writes the grown cache into the buffers the step before last held (reusing
    memory instead of faulting in fresh pages), and the result stays the full sequence's, also
    when the rows are reordered every step."""
    model = Transformer(tiny_config()).eval()
    src, tgt = random_tokens(2, 6), random_tokens(2, 40)
    order = torch.tensor([1, 0])  # the rows swap places at every step
    with torch.no_grad():
        full = model(src, tgt)
        memory, src_mask = model.encode(src)
        cache = model.start_decoding(memory, src_mask)
        rows, steps, reused = torch.arange(2), [], 0
        for position in range(tgt.shape[1]):
            spare = cache.spare
            logits, cache = model.decode_step(tgt[rows, position], cache)
            steps.append(logits[rows.argsort()])  # back in the order of the sentences
            reused += spare is not None and all(
                new is old for layer, old_layer in zip(cache.buffers, spare)
                for new, old in zip(layer, old_layer))
            cache, rows = cache.reorder(order, sources=order), rows[order]
    torch.testing.assert_close(torch.stack(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    # A buffer a quarter larger than needed serves again from the 10th step on, until the
    # cache outgrows it: 21 of the 40 steps reuse one (sizes alone decide: no allocator in it).
    assert reused == 21


def test_cache_reorder_selects_rows():
    model = Transformer(tiny_config()).eval()
    src, tgt = random_tokens(2, 5), random_tokens(2, 3)
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        cache = model.start_decoding(memory, src_mask)
        for position in range(2):
            _, cache = model.decode_step(tgt[:, position], cache)
        swapped = cache.reorder(torch.tensor([1, 0, 0]), sources=torch.tensor([1, 0, 0]))
        logits, _ = model.decode_step(tgt[[1, 0, 0], 2], swapped)
        full = model(src, tgt)
    torch.testing.assert_close(logits, full[[1, 0, 0], 2], atol=1e-5, rtol=1e-5)


def test_hypotheses_grouped_by_source_share_its_memory():
    """Beam search keeps G hypotheses per source sentence: the cache holds each source's
    encoder keys/values once, and every row attends to its own source."""
    model = Transformer(tiny_config()).eval()
    src, tgt = random_tokens(2, 5), random_tokens(2, 4)
    src[0, 3:] = 0
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        cache = model.start_decoding(memory, src_mask)
        _, cache = model.decode_step(tgt[:, 0], cache)
        # three hypotheses per source; source 1's rows first continue row 1, then source 0's
        cache = cache.reorder(torch.tensor([1, 1, 1, 0, 0, 0]), sources=torch.tensor([1, 0]))
        assert cache.memory_kv[0][0].shape[0] == 2
        logits, cache = model.decode_step(tgt[[1, 1, 1, 0, 0, 0], 1], cache)
        # beams permuted within their source: the memory stays, only self-attention rows move
        permuted = cache.reorder(torch.tensor([2, 0, 1, 5, 3, 4]))
        assert permuted.memory_kv is cache.memory_kv
        later, _ = model.decode_step(tgt[[1, 1, 1, 0, 0, 0], 2], permuted)
        full = model(src, tgt)
    torch.testing.assert_close(logits, full[[1, 1, 1, 0, 0, 0], 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(later, full[[1, 1, 1, 0, 0, 0], 2], atol=1e-5, rtol=1e-5)


def test_dropout_only_in_training():
    model = Transformer(tiny_config(dropout=0.3, attention_dropout=0.2))
    src, tgt = random_tokens(2, 6), random_tokens(2, 5)
    model.eval()
    torch.testing.assert_close(model(src, tgt), model(src, tgt))
    model.train()
    assert not torch.allclose(model(src, tgt), model(src, tgt))


def test_cpu_dropout_keeps_one_minus_p_and_rescales_exactly():
    torch.manual_seed(0)
    x = torch.ones(200_000)
    scale = cpu_dropout_scale(x, 0.1)
    kept = scale != 0
    assert kept.float().mean().item() == pytest.approx(0.9, abs=0.003)
    assert torch.all(scale[kept] == scale[kept][0])
    assert scale[kept][0].item() == pytest.approx(1 / 0.9, rel=1e-5)  # E[x · scale] = x
    torch.manual_seed(0)
    assert torch.equal(cpu_dropout_scale(x, 0.1), scale)  # the seed decides
    assert not torch.equal(cpu_dropout_scale(x, 0.1), scale)
    assert torch.all(cpu_dropout_scale(x, 1.0) == 0)


def test_fairseq_positions_are_fairseqs_formula_from_the_padding_id_on():
    """NLLB-200's and M2M-100's positions: sin | cos halves, 10000^(-i/(d/2-1)), position p at
    fairseq's row p + padding + 1; rows computed alone equal the table's; a model with them
    reads them (`positions` "fairseq")."""
    d_model, padding = 8, 1
    table = fairseq_positions(6, d_model, padding_id=padding)
    for position in range(6):
        for i in range(d_model // 2):
            angle = (position + padding + 1) * 10000 ** (-i / (d_model // 2 - 1))
            assert table[position, i] == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[position, d_model // 2 + i] == pytest.approx(math.cos(angle), abs=1e-6)
    assert torch.equal(fairseq_positions(2, d_model, start=3, padding_id=padding), table[3:5])
    config = ModelConfig(src_vocab_size=20, tgt_vocab_size=20, d_model=d_model, heads=2, d_k=4,
                         d_v=4, d_ff=16, encoder_layers=1, decoder_layers=1, positions="fairseq",
                         pad_id=padding, max_positions=4)
    model = Transformer(config)
    assert torch.equal(model.positions(0, 6), table)  # past the table: computed alike
    assert not torch.equal(model.positions(0, 6), sinusoidal_positions(6, d_model))
