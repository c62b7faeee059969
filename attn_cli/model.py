"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), §3.

The one model module every subcommand shares. It imports only torch and does no I/O. Shapes in
comments: B batch, S source length, T target length, D d_model, H heads, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .loss import (
    alignment_loss,
    autocast_dtype,
    label_smoothed_loss,
    projected_label_smoothed_loss,
)


def sinusoidal_positions(length: int, d_model: int, start: int = 0) -> Tensor:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),
    PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)), for the `length` positions from `start`. A
    constant, always computed on the CPU (also for a model built on the meta device to be
    loaded: files do not hold it). Each value depends on its position only: rows computed alone
    equal those of a longer table."""
    cpu = torch.device("cpu")
    position = torch.arange(start, start + length, dtype=torch.float64,
                            device=cpu).unsqueeze(1)  # (L, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=cpu)  # (D/2,)
    angle = position / torch.pow(10000.0, two_i / d_model)  # (L, D/2)
    table = torch.empty(length, d_model, dtype=torch.float64, device=cpu)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


def fairseq_positions(length: int, d_model: int, start: int = 0, padding_id: int = 1) -> Tensor:
    """fairseq's sinusoids (`SinusoidalPositionalEmbedding`), which NLLB-200 and M2M-100 were
    trained with, for the `length` positions from `start` (0: a sequence's first token): the
    sines in the first half of d_model and the cosines in the second (not interleaved), the
    frequencies 10000^(-i / (d_model/2 - 1)) (not §3.5's 10000^(-2i/d_model)), and position p
    read from row p + padding_id + 1 of fairseq's table (its rows up to the padding id are for
    padding). Not a permutation of §3.5's table: a model trained with one needs that one."""
    cpu = torch.device("cpu")
    half = d_model // 2
    frequency = torch.exp(torch.arange(half, dtype=torch.float64, device=cpu)
                          * -(math.log(10000.0) / (half - 1)))
    position = torch.arange(start, start + length, dtype=torch.float64, device=cpu) \
        + padding_id + 1
    angle = position[:, None] * frequency[None, :]  # (L, D/2)
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).float()


class Dropout(nn.Dropout):
    """§5.4 residual dropout. On a CPU the mask comes from 16-bit slices of the generator's
    64-bit words, compared with round(p · 2^16): four draws per random word instead of the
    float per element torch's Bernoulli sampler draws, a visible share of a small model's
    training step. The drop rate is p to within 2^-17, and the kept values are scaled by the
    exact 1 / (1 - rate). The mask depends on the torch seed only; CUDA keeps torch's fused
    dropout."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0 or x.device.type != "cpu":
            return super().forward(x)
        return x * cpu_dropout_scale(x, self.p)


def cpu_dropout_scale(x: Tensor, p: float) -> Tensor:
    """A tensor like x holding 0 (probability ≈ p) or 1 / (1 - p) elsewhere."""
    if p >= 1.0:
        return torch.zeros_like(x)
    threshold = round(p * 65536)
    words = torch.empty((x.numel() + 3) // 4, dtype=torch.int64)
    words.random_(-2 ** 63, 2 ** 63 - 1)  # the full 64 bits (random_() leaves the sign at 0)
    slices = words.view(torch.int16)[:x.numel()].view(x.shape)
    keep = slices >= threshold - 32768
    return keep.to(x.dtype).mul_(65536 / (65536 - threshold))


class MultiHeadAttention(nn.Module):
    """§3.2.2: MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V), with §3.2.1's scaled dot-product attention,
    Attention = softmax(Q K^T / sqrt(d_k)) V.

    The h per-head projections are stored as one matrix each (h·d_k columns), without biases:
    the paper's projections are matrices W^Q, W^K, W^V, W^O (as in tensor2tensor; a key bias
    would in any case get no gradient, softmax being blind to a shift). `forward` is the
    section as written; the methods below it are the same computation taken apart for
    incremental decoding (keys and values cached and grown, the encoder output projected once
    per source batch, a single query attended with two matmuls).
    """

    def __init__(self, config: ModelConfig, cross: bool):
        super().__init__()
        self.heads, self.d_k, self.d_v = config.heads, config.d_k, config.d_v
        self.cross = cross
        self.attention_dropout = config.attention_dropout
        q_width, v_width = config.heads * config.d_k, config.heads * config.d_v
        bias = config.attention_bias  # an option (imported models); the paper's have none
        if cross:
            self.q_proj = nn.Linear(config.d_model, q_width, bias=bias)
            self.kv_proj = nn.Linear(config.d_model, q_width + v_width, bias=bias)
        else:
            self.qkv_proj = nn.Linear(config.d_model, 2 * q_width + v_width, bias=bias)
        self.out_proj = nn.Linear(v_width, config.d_model, bias=bias)

    def forward(self, x: Tensor, memory: Tensor | None = None, mask: Tensor | None = None,
                causal: bool = False, weights: list[Tensor] | None = None,
                head: HeadAttention | None = None) -> Tensor:
        """§3.2.3's three uses: queries from x (B, L, D); keys and values from the encoder
        output `memory` (B, S, D) in encoder-decoder attention, from x itself in self-attention.
        `mask` is added to Q K^T / sqrt(d_k): 0 where a key may be attended, -inf where not
        (padding; `Transformer.padding_mask`); `causal`: each position attends to itself and
        those before it (the decoder's self-attention). `weights`, if given, gets the
        attention weights (B, H, Lq, Lk) appended (attention maps); `head`, if given, gets
        the log attention weights of its one head (guided alignment), the layer's output
        computed as without it."""
        if self.cross:
            queries = self._split_heads(self.q_proj(x), self.d_k)
            keys, values = self.project_memory(memory)
        else:
            queries, keys, values = self.project_self(x)
        if head is not None:
            head_mask = None if mask is None else mask[:, 0]  # (B, 1, Lk) or (1, Lk)
            head.log_weights = log_attention_weights(
                queries[:, head.head], keys[:, head.head].transpose(-1, -2), head_mask, causal)
        return self.attend(queries, keys, values, mask, causal, weights)

    # ------------------------------------------------------------ the parts, for decoding speed

    def _split_heads(self, x: Tensor, width: int) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.heads, width).transpose(1, 2)  # (B, H, L, width)

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the encoder output for encoder-decoder attention: (B, H, S, d)."""
        keys, values = self.kv_proj(memory).split(
            [self.heads * self.d_k, self.heads * self.d_v], dim=-1)
        return self._split_heads(keys, self.d_k), self._split_heads(values, self.d_v)

    def memory_for_steps(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """`project_memory` for `attend_memory`: the keys transposed, (B, H, d, S), so that each
        decoding step's Q K^T is a plain matmul over contiguous memory rather than one reading
        K^T through strides, when the K beams of a source query it together."""
        keys, values = self.project_memory(memory)
        return keys.transpose(-1, -2).contiguous(), values.contiguous()

    def project_self(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q_width, v_width = self.heads * self.d_k, self.heads * self.d_v
        queries, keys, values = self.qkv_proj(x).split([q_width, q_width, v_width], dim=-1)
        return (self._split_heads(queries, self.d_k), self._split_heads(keys, self.d_k),
                self._split_heads(values, self.d_v))

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor,
               mask: Tensor | None = None, causal: bool = False,
               weights: list[Tensor] | None = None) -> Tensor:
        """Scaled dot-product attention over heads; `mask` is added to the scaled scores (0 or
        -inf, see `forward`). A single query position (a decoding step) takes
        `attention_written_out`: for so few queries two batched matmuls are faster than the
        fused kernels on a CPU. With `weights` (attention maps) the softmax is written out
        too, and appended to it: the fused kernels do not give it."""
        if weights is not None:
            found = attention_weights(queries, keys.transpose(-1, -2), mask, causal)
            weights.append(found)
            context = torch.matmul(found.to(values.dtype), values)
        elif queries.shape[2] == 1 and not causal and not self.training:
            context = attention_written_out(queries, keys.transpose(-1, -2), values, mask)
        else:
            context = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, is_causal=causal,
                dropout_p=self.attention_dropout if self.training else 0.0)  # (B, H, Lq, d_v)
        batch, _, length, _ = context.shape
        return self.out_proj(context.transpose(1, 2).reshape(batch, length, -1))

    def attend_memory(self, x: Tensor, memory_kv: tuple[Tensor, Tensor],
                      src_mask: Tensor) -> Tensor:
        """Encoder-decoder attention for x (N, T, D) whose N rows are G = N/B consecutive rows per
        source sentence of memory_kv, the keys transposed (B, H, d, S) and the values (B, H, S, d)
        (`DecoderCache`): a source's G·T queries attend together, so beam search needs no
        per-hypothesis copy of the memory and reads it once per sentence."""
        rows, length, _ = x.shape
        sources = memory_kv[0].shape[0]
        if rows % sources:
            raise ValueError(f"{rows} decoder rows do not divide into {sources} sources")
        queries = self.q_proj(x).view(sources, -1, self.heads, self.d_k).transpose(1, 2)
        if length == 1 and not self.training:  # a decoding step: G queries per source
            context = attention_written_out(queries, *memory_kv, src_mask)
        else:
            keys_t, values = memory_kv
            context = F.scaled_dot_product_attention(
                queries, keys_t.transpose(-1, -2), values, attn_mask=src_mask,
                dropout_p=self.attention_dropout if self.training else 0.0)  # (B, H, G·T, d_v)
        return self.out_proj(context.transpose(1, 2).reshape(rows, length, -1))


def attention_scores(queries: Tensor, keys_t: Tensor, mask: Tensor | None = None,
                     causal: bool = False) -> Tensor:
    """Q K^T / sqrt(d_k) in float32, (..., Lq, Lk), `mask` added (0 or -inf) and, `causal`,
    each query i's keys after i at -inf: what the softmax of §3.2.1 takes."""
    scores = torch.matmul(queries, keys_t).float() * queries.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, -math.inf)
    return scores


def attention_weights(queries: Tensor, keys_t: Tensor, mask: Tensor | None = None,
                      causal: bool = False) -> Tensor:
    """§3.2.1's softmax(Q K^T / sqrt(d_k)) in float32, (..., Lq, Lk): what each query attends
    to. `mask` is added to the scores (0 or -inf); `causal`: query i sees keys 0..i only."""
    return attention_scores(queries, keys_t, mask, causal).softmax(dim=-1)


def log_attention_weights(queries: Tensor, keys_t: Tensor, mask: Tensor | None = None,
                          causal: bool = False) -> Tensor:
    """log softmax(Q K^T / sqrt(d_k)) in float32, (..., Lq, Lk), as `attention_weights` takes
    its arguments: the log-probabilities a cross-entropy with them needs, without the log of a
    softmax that underflowed."""
    return attention_scores(queries, keys_t, mask, causal).log_softmax(dim=-1)


def attention_written_out(queries: Tensor, keys_t: Tensor, values: Tensor,
                          mask: Tensor | None = None) -> Tensor:
    """§3.2.1's softmax(Q K^T / sqrt(d_k)) V as two batched matmuls, the softmax in float32
    whatever the weights' precision; `keys_t` is K^T (..., d_k, Lk). `mask` (broadcast to
    (B, H, Lq, Lk)) is added to the scores: 0 where a key may be attended, -inf where not;
    every query must have one it may attend."""
    weights = torch.matmul(queries, keys_t).float()
    weights.mul_(queries.shape[-1] ** -0.5)
    if mask is not None:
        weights.add_(mask)
    return torch.matmul(weights.softmax(dim=-1).to(values.dtype), values)


class FeedForward(nn.Module):
    """§3.3: FFN(x) = max(0, x W1 + b1) W2 + b2 (or swish(x W1 + b1) W2 + b2, an option)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.inner = nn.Linear(config.d_model, config.d_ff)
        self.outer = nn.Linear(config.d_ff, config.d_model)
        self.activation = config.activation

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.inner(x)
        return self.outer(F.relu(hidden) if self.activation == "relu" else F.silu(hidden))


class Sublayers(nn.Module):
    """§3.1 / §5.4: each sub-layer's output is LayerNorm(x + Dropout(Sublayer(x))) (post-norm, as
    published). The pre-norm variant x + Dropout(Sublayer(LayerNorm(x))) is an option."""

    def __init__(self, config: ModelConfig, count: int):
        super().__init__()
        self.pre_norm = config.norm == "pre"
        self.norms = nn.ModuleList(nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
                                   for _ in range(count))
        self.dropout = Dropout(config.dropout)

    def before(self, index: int, x: Tensor) -> Tensor:
        """The sub-layer's input."""
        return self.norms[index](x) if self.pre_norm else x

    def after(self, index: int, x: Tensor, sublayer_output: Tensor) -> Tensor:
        """The block's output: residual add, with the norm after it in post-norm."""
        y = x + self.dropout(sublayer_output)
        return y if self.pre_norm else self.norms[index](y)


@dataclass
class AttentionWeights:
    """Attention maps: each layer's softmax(Q K^T / sqrt(d_k)), (B, H, Lq, Lk), appended in
    layer order by the teacher-forced `encode` and `decode` it is given to."""

    encoder: list[Tensor] = field(default_factory=list)  # the encoder's self-attention
    decoder: list[Tensor] = field(default_factory=list)  # the decoder's masked self-attention
    cross: list[Tensor] = field(default_factory=list)  # encoder-decoder attention


@dataclass
class HeadAttention:
    """Guided alignment (Garg et al. 2019; not in the paper): the teacher-forced `decode` given
    it sets `log_weights`, log softmax(Q K^T / sqrt(d_k)) (B, T, S) of encoder-decoder head
    `head` of decoder layer `layer` (from 0), the one head whose attention is supervised. Only
    that head's weights are written out: every attention keeps its fused kernel."""

    layer: int
    head: int
    log_weights: Tensor | None = None


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(config, cross=False)
        self.ffn = FeedForward(config)
        self.sub = Sublayers(config, 2)

    def forward(self, x: Tensor, src_mask: Tensor,
                weights: AttentionWeights | None = None) -> Tensor:  # (B, S, D)
        x = self.sub.after(0, x, self.self_attn(self.sub.before(0, x), mask=src_mask,
                                                weights=weights and weights.encoder))
        return self.sub.after(1, x, self.ffn(self.sub.before(1, x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(config, cross=False)
        self.cross_attn = MultiHeadAttention(config, cross=True)
        self.ffn = FeedForward(config)
        self.sub = Sublayers(config, 3)

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor,
                weights: AttentionWeights | None = None,
                head: HeadAttention | None = None) -> Tensor:
        """Teacher forcing: x (B, T, D) attends causally to itself, then to the encoder output
        `memory` (B, S, D); `head`, if given, gets one encoder-decoder head's log weights."""
        x = self.sub.after(0, x, self.self_attn(self.sub.before(0, x), causal=True,
                                                weights=weights and weights.decoder))
        x = self.sub.after(1, x, self.cross_attn(self.sub.before(1, x), memory, mask=src_mask,
                                                 weights=weights and weights.cross, head=head))
        return self.sub.after(2, x, self.ffn(self.sub.before(2, x)))

    def step(self, x: Tensor, memory_kv: tuple[Tensor, Tensor], src_mask: Tensor,
             past_kv: tuple[Tensor, Tensor], past_rows: Tensor | None = None,
             spare: tuple[Tensor | None, Tensor | None] = (None, None)
             ) -> tuple[Tensor, tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """Incremental decoding: x (N, 1, D) is the one next position of N hypotheses, N a
        multiple of the B source sentences of `memory_kv` (B, H, S, d): row n decodes source
        n // (N / B), so the hypotheses of a beam share their source's keys/values instead of
        copies. x attends to every cached position (the rows `past_rows` of the cache, when
        given: see `DecoderCache.reorder`) and to itself. Returns the output, the grown
        self-attention keys/values, and the buffers holding them (written into `spare`, two
        flat buffers, where they are large enough: see `grow_cache`)."""
        if x.shape[1] != 1:
            raise ValueError("incremental decoding takes one position at a time")
        q, k, v = self.self_attn.project_self(self.sub.before(0, x))
        (k, k_buffer), (v, v_buffer) = (grow_cache(past_kv[0], k, past_rows, spare[0]),
                                        grow_cache(past_kv[1], v, past_rows, spare[1]))
        # The one new position has every cached key in its past: no mask needed.
        x = self.sub.after(0, x, self.self_attn.attend(q, k, v))
        x = self.sub.after(1, x, self.cross_attn.attend_memory(self.sub.before(1, x), memory_kv,
                                                               src_mask))
        x = self.sub.after(2, x, self.ffn(self.sub.before(2, x)))
        return x, (k, v), (k_buffer, v_buffer)


def grow_cache(past: Tensor, new: Tensor, rows: Tensor | None = None,
               spare: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """past (N, H, t, d) (its `rows` if given), then new (B, H, 1, d) → (B, H, t+1, d), in one
    copy: selecting the rows and appending the new position write straight into the result
    (index_select then cat would copy the whole cache twice per step). The result is a
    contiguous view of the flat buffer `spare` when that is large enough, else of a new one a
    quarter larger than needed; returns it and its buffer. Fresh memory each step would be
    slow for a large cache (a long parse's with a wide beam): past glibc's mmap threshold (at
    most 32 MB) every step maps new memory, its pages faulted in one by one, where copying into
    memory already used touches no new page."""
    batch, heads, length, width = past.shape
    shape = (new.shape[0], heads, length + 1, width)
    size = math.prod(shape)
    buffer = spare if spare is not None and spare.numel() >= size \
        else new.new_empty(size + size // 4)
    grown = buffer[:size].view(shape)
    if rows is None:
        grown[:, :, :length] = past
    else:
        torch.index_select(past, 0, rows, out=grown[:, :, :length])
    grown[:, :, length:] = new
    return grown, buffer


@dataclass(frozen=True)
class DecoderCache:
    """State of incremental decoding, passed in and returned (no state hides in the modules).

    Per source sentence (B rows): src_mask (B, 1, 1, S), `Transformer.padding_mask`, and
    memory_kv, per decoder layer the encoder-decoder keys, transposed (B, H, d, S), and values
    (B, H, S, d), computed once.
    Per hypothesis (N = B·G rows, G consecutive rows per source: a sentence's beams): self_kv,
    per layer the self-attention keys/values of every position decoded so far, (N', H, t, d);
    self_rows, which of those N' rows the next step continues, in order (None: all of them);
    reordering is lazy, done by the next step as it appends its position. step: t.
    buffers: per layer, the two flat buffers self_kv's keys and values are views of; spare:
    the two a step before held, which the next step writes into (each step reads one pair and
    writes the other, in memory already touched). output: the projection over a vocabulary
    shortlist of the batch (`OutputSubset`; None: the whole vocabulary).
    """

    src_mask: Tensor
    memory_kv: tuple[tuple[Tensor, Tensor], ...]
    self_kv: tuple[tuple[Tensor, Tensor], ...]
    step: int = 0
    self_rows: Tensor | None = None
    buffers: tuple[tuple[Tensor, Tensor], ...] | None = None
    spare: tuple[tuple[Tensor, Tensor], ...] | None = None
    output: "OutputSubset | None" = None

    def reorder(self, rows: Tensor, sources: Tensor | None = None) -> "DecoderCache":
        """Continue hypothesis rows `rows` (N',) (beam reordering, expanding to beams) of the
        source sentences `sources` (B',) (dropping finished ones; None: the same sources). The
        new rows must come in G = N'/B' consecutive rows per source, in the order of `sources`.
        Only source-side tensors are copied now, and only when `sources` is given."""
        return reordered(self, rows, sources)


def reordered(cache, rows: Tensor, sources: Tensor | None):
    """`DecoderCache.reorder` of any cache with its fields src_mask, memory_kv and self_rows
    (`compiled.StepCache` too): the rows to continue composed with those still pending, the
    source side selected now."""
    rows = rows if cache.self_rows is None else cache.self_rows.index_select(0, rows)
    if sources is None:
        return dataclasses.replace(cache, self_rows=rows)
    memory_kv = tuple((k.index_select(0, sources), v.index_select(0, sources))
                      for k, v in cache.memory_kv)
    return dataclasses.replace(cache, src_mask=cache.src_mask.index_select(0, sources),
                               memory_kv=memory_kv, self_rows=rows)


class OutputSubset:
    """The output projection over some target ids only, a vocabulary shortlist (Marian's
    lexical shortlist, CTranslate2's vocabulary map; not in the paper): the logits of those
    ids alone, column c for id ids[c], so that the softmax normalises over the shortlist and
    the search never picks outside it. The rows of the projection are taken once per batch,
    and the step multiplies by those alone: for a small model the output projection is the
    largest matmul of a decoder step (V x D against ~12 D^2 for the layers)."""

    def __init__(self, ids: Tensor, weight: Tensor, bias: Tensor | None,
                 projection: nn.Module | None = None):
        self.ids = ids
        self.weight, self.bias, self.projection = weight, bias, projection

    def __call__(self, hidden: Tensor) -> Tensor:
        """hidden (N, D) → logits (N, len(ids))."""
        if self.projection is not None:
            return self.projection(hidden)
        return F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding that draws no weights on the meta device. A model to be loaded from a file is
    built there (modelfile.load_model: no memory, nothing drawn that the file replaces), and
    normal_ on a meta tensor runs torch's Python reference kernel, whose first call imports
    torch._dynamo: slower than all the rest of the load together."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Transformer(nn.Module):
    """§3.1 encoder-decoder. `forward` is teacher-forced; `encode` + `start_decoding` +
    `decode_step` are the incremental path used by search."""

    def __init__(self, config: ModelConfig, output_projection: nn.Module | None = None):
        super().__init__()
        self.config = config
        d_model = config.d_model
        # §3.4: one embedding matrix for source, target and the pre-softmax projection (with a
        # separate target vocabulary, share_embeddings False, the source has its own).
        self.tgt_embed = Embedding(config.tgt_vocab_size, d_model, padding_idx=config.pad_id)
        self.src_embed = (self.tgt_embed if config.share_embeddings
                          else Embedding(config.src_vocab_size, d_model,
                                         padding_idx=config.pad_id))
        self.embed_scale = math.sqrt(d_model)
        if config.positions == "learned":
            self.learned_positions = Embedding(config.max_positions, d_model)
        self.register_buffer("sinusoids", self.position_table(config.max_positions),
                             persistent=False)
        self.embed_dropout = Dropout(config.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(config)
                                            for _ in range(config.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(config)
                                            for _ in range(config.decoder_layers))
        if config.norm == "pre":  # pre-norm stacks end with a norm; post-norm already did
            self.encoder_norm = nn.LayerNorm(d_model, eps=config.layer_norm_eps)
            self.decoder_norm = nn.LayerNorm(d_model, eps=config.layer_norm_eps)
        # An option (imported models): a bias added to the logits.
        self.output_bias = nn.Parameter(torch.zeros(config.tgt_vocab_size)) \
            if config.output_bias else None
        # §3.4's pre-softmax projection is the target embedding matrix (`output_logits`); a
        # model built for decoding may be given that matrix (and the bias) in the form its other
        # linear layers take, packed or int8 (devices.inference_model).
        self.output_projection = output_projection
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.tgt_embed.weight.is_meta:  # built to be loaded: see Embedding
            return
        # The layers' linear maps (a given output projection is the embedding matrix, loaded)
        for module in [*self.encoder_layers.modules(), *self.decoder_layers.modules()]:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # Embeddings ~ N(0, d_model^-1): scaled by sqrt(d_model) they start at unit variance,
        # the scale of the sinusoids they are added to.
        for embedding in dict.fromkeys([self.src_embed, self.tgt_embed]):  # in order, once
            nn.init.normal_(embedding.weight, std=self.config.d_model ** -0.5)
            with torch.no_grad():
                embedding.weight[self.config.pad_id].zero_()
        if self.config.positions == "learned":
            nn.init.normal_(self.learned_positions.weight, std=self.config.d_model ** -0.5)

    def positions(self, start: int, length: int) -> Tensor:  # (length, D)
        end = start + length
        if self.config.positions == "learned":
            if end > self.config.max_positions:
                raise ValueError(f"sequence of {end} positions is longer than the "
                                 f"{self.config.max_positions} learned positions")
            return self.learned_positions.weight[start:end]
        if end <= self.sinusoids.shape[0]:
            return self.sinusoids[start:end]
        # Past the table (a long search): these rows computed, in the table's device and dtype
        # (a bf16 model's positions stay bf16), and not stored: a forward pass changes no state
        # of the model, which several searches may run at once.
        return self.position_table(length, start).to(self.sinusoids)

    def position_table(self, length: int, start: int = 0) -> Tensor:
        """The fixed positions' rows from `start` (§3.5's sinusoids, or fairseq's)."""
        if self.config.positions == "fairseq":
            return fairseq_positions(length, self.config.d_model, start, self.config.pad_id)
        return sinusoidal_positions(length, self.config.d_model, start)

    def embed(self, embedding: nn.Embedding, tokens: Tensor, start: int = 0) -> Tensor:
        """§3.4-3.5: Dropout(sqrt(d_model) · E[tokens] + PE)."""
        x = embedding(tokens) * self.embed_scale + self.positions(start, tokens.shape[1])
        return self.embed_dropout(x)

    def padding_mask(self, src_tokens: Tensor) -> Tensor:
        """(B, 1, 1, S): 0 at real source tokens, -inf at padding, added to every attention's
        scores over the source: padding is masked out as §3.2.3 masks illegal connections,
        "setting to -inf" the input of the softmax. Made once per batch, in the dtype the
        attention computes in, for every layer (12 calls in `base`; a boolean mask would be
        turned into this one inside each call). Its rows are 8-aligned slices of a wider
        buffer: CUDA's memory-efficient attention would otherwise copy an unaligned mask into
        an aligned one at each call."""
        batch, length = src_tokens.shape
        aligned = -(-length // 8) * 8
        mask = torch.zeros(batch, 1, 1, aligned, dtype=self.attention_dtype(src_tokens.device),
                           device=src_tokens.device)[..., :length]
        return mask.masked_fill_((src_tokens == self.config.pad_id)[:, None, None, :],
                                 -math.inf)

    def attention_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the attention's queries: autocast's where it is on (the projections
        before it run in it), else the weights'."""
        if device.type not in ("cpu", "cuda"):  # the meta device (checks of shapes) has none
            return self.tgt_embed.weight.dtype
        return autocast_dtype(device.type) or self.tgt_embed.weight.dtype

    def encode(self, src_tokens: Tensor, weights: AttentionWeights | None = None
               ) -> tuple[Tensor, Tensor]:
        """src_tokens (B, S) → memory (B, S, D) and the source mask (B, 1, 1, S,
        `padding_mask`); `weights`, if given, gets each layer's attention weights."""
        src_mask = self.padding_mask(src_tokens)
        x = self.embed(self.src_embed, src_tokens)
        for layer in self.encoder_layers:
            x = layer(x, src_mask, weights)
        if self.config.norm == "pre":
            x = self.encoder_norm(x)
        return x, src_mask

    def output_logits(self, hidden: Tensor) -> Tensor:
        """Pre-softmax projection, sharing the target embedding matrix: (..., D) → (..., V)."""
        if self.output_projection is not None:  # the same matrix, given in another form
            return self.output_projection(hidden)
        return F.linear(hidden, self.tgt_embed.weight, self.output_bias)

    def step_logits(self, hidden: Tensor) -> Tensor:
        """`output_logits` for a search step. On a GPU in float32, whatever the precision of
        the weights or of autocast: logits rounded to bf16 (steps of 1/16 at |z| ≈ 16) would
        let the rounding rank hypotheses whose scores nearly tie, and one projection per step
        costs little there. On a CPU in the model's precision (a bf16 model's in bf16)."""
        if hidden.device.type != "cuda" or self.output_projection is not None:
            return self.output_logits(hidden)
        bias = None if self.output_bias is None else self.output_bias.float()
        with torch.autocast("cuda", enabled=False):
            return F.linear(hidden.float(), self.tgt_embed.weight.float(), bias)

    def decode(self, tgt_input: Tensor, memory: Tensor, src_mask: Tensor,
               weights: AttentionWeights | None = None,
               head: HeadAttention | None = None) -> Tensor:
        """Teacher-forced decoder: tgt_input (B, T) → hidden states (B, T, D); `weights`, if
        given, gets each layer's attention weights, `head` its head's log weights."""
        x = self.embed(self.tgt_embed, tgt_input)
        for index, layer in enumerate(self.decoder_layers):
            x = layer(x, memory, src_mask, weights,
                      head if head is not None and head.layer == index else None)
        return self.decoder_norm(x) if self.config.norm == "pre" else x

    def forward(self, src_tokens: Tensor, tgt_input: Tensor,
                output_positions: Tensor | None = None, targets: Tensor | None = None,
                label_smoothing: float = 0.0,
                alignment: tuple[Tensor, Tensor] | None = None):
        """src (B, S), tgt_input = BOS + y (B, T) → logits (B, T, V) for y + EOS; with
        `output_positions` (N,), flat indices into the B × T positions (batching.Batch's
        target_positions), only the logits there, (N, V): training skips the output projection
        of padding, the largest matmul of a small model, with no op whose size depends on the
        data (a GPU would wait to learn it). With `targets` (N,), the tokens at those
        positions, the §5.4 loss instead: (label-smoothed loss sum, NLL sum), computed with the
        projection a block at a time (loss.py).

        Guided alignment (not in the paper; with `targets`): `alignment` is (positions (M,),
        weights (M,)), flat indices into the B × T × S attention of the config's supervised
        head (`alignment_layer`, `alignment_head`) and the reference probability there
        (train/guided.py); a third sum is returned, the cross-entropy of that head's attention
        with the reference (loss.alignment_loss)."""
        memory, src_mask = self.encode(src_tokens)
        head = None
        if alignment is not None:
            if targets is None or self.config.alignment_layer is None:
                raise ValueError("guided alignment needs targets and a model config naming "
                                 "the supervised head (alignment_layer, alignment_head)")
            head = HeadAttention(self.config.alignment_layer, self.config.alignment_head)
        hidden = self.decode(tgt_input, memory, src_mask, head=head)
        if output_positions is not None:
            hidden = hidden.flatten(0, 1).index_select(0, output_positions)
        if targets is not None:
            if self.output_bias is not None:  # the fused loss knows no bias: the formula
                sums = label_smoothed_loss(self.output_logits(hidden), targets,
                                           label_smoothing, self.config.pad_id)
            else:
                sums = projected_label_smoothed_loss(hidden, self.tgt_embed.weight, targets,
                                                     label_smoothing)
            if head is None:
                return sums
            return (*sums, alignment_loss(head.log_weights, *alignment))
        return self.output_logits(hidden)

    def start_decoding(self, memory: Tensor, src_mask: Tensor,
                       output_ids: Tensor | None = None) -> DecoderCache:
        """Encoder-decoder keys/values for every decoder layer, computed once per source batch,
        and empty self-attention caches; with `output_ids` (sorted target ids, a vocabulary
        shortlist), every step's logits are those of these ids alone, (N, len(output_ids))
        (`output_subset`)."""
        batch, heads = memory.shape[0], self.config.heads
        empty_k = memory.new_zeros(batch, heads, 0, self.config.d_k)
        empty_v = memory.new_zeros(batch, heads, 0, self.config.d_v)
        return DecoderCache(
            src_mask=src_mask,
            memory_kv=tuple(layer.cross_attn.memory_for_steps(memory)
                            for layer in self.decoder_layers),
            self_kv=tuple((empty_k, empty_v) for _ in self.decoder_layers),
            output=None if output_ids is None else self.output_subset(output_ids))

    def output_subset(self, ids: Tensor) -> OutputSubset:
        """The output projection's rows `ids`, as `step_logits` computes them: in float32 on a
        GPU; on a CPU in the model's precision, through the same kind of layer as the whole
        projection (`for_rows`: oneDNN's packed layout, int8's rows) or dense."""
        weight = self.tgt_embed.weight.index_select(0, ids)
        bias = None if self.output_bias is None else self.output_bias.index_select(0, ids)
        if weight.device.type == "cuda":
            weight, bias = weight.float(), None if bias is None else bias.float()
        for_rows = getattr(self.output_projection, "for_rows", None)
        return OutputSubset(ids, weight, bias,
                            for_rows(weight, bias) if for_rows is not None else None)

    def decode_step(self, tokens: Tensor, cache: DecoderCache) -> tuple[Tensor, DecoderCache]:
        """One incremental step: tokens (N,) at position cache.step → logits (N, V) (with a
        shortlist, (N, len(its ids))), new cache. N is a multiple of the cache's source
        sentences (see `DecoderCache`)."""
        x = self.embed(self.tgt_embed, tokens[:, None], start=cache.step)  # (B, 1, D)
        grown, buffers = [], []
        spares = cache.spare or [(None, None)] * len(self.decoder_layers)
        for layer, memory_kv, past_kv, spare in zip(self.decoder_layers, cache.memory_kv,
                                                    cache.self_kv, spares):
            x, kv, buffer = layer.step(x, memory_kv, cache.src_mask, past_kv, cache.self_rows,
                                       spare)
            grown.append(kv)
            buffers.append(buffer)
        if self.config.norm == "pre":
            x = self.decoder_norm(x)
        logits = self.step_logits(x[:, 0]) if cache.output is None else cache.output(x[:, 0])
        return logits, DecoderCache(
            cache.src_mask, cache.memory_kv, tuple(grown), cache.step + 1,
            buffers=tuple(buffers), spare=cache.buffers, output=cache.output)

