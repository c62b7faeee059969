"""A decoder step with a preallocated cache, compiled by torch's compiler (`--compile`).

`Transformer.decode_step` grows each layer's self-attention keys and values by one position a
step (a new buffer, the past copied in) and runs ~100 eager ops, each a trip through Python and
the dispatcher. `StepDecoder` decodes with the same model and the same search, differently:

- the keys and values live in buffers of a fixed capacity (16 positions, grown by 16 when
  full), each step writing its position in place (`index_copy`) and attending over the whole
  capacity, the positions not yet written masked out (-inf): the step's shapes repeat from one
  step to the next, so that a compiled graph serves every step;
- the beam's reordering is the step's first op, a gather of the rows each hypothesis extends
  (`index_select`), done inside the graph and fused with the write;
- `torch.compile` (inductor, dynamic shapes: a graph for a batch's first step, one for the
  later ones, one for a lone sentence, whatever the batch, beam and source length) compiles it
  once per process; oneDNN's packed linear layers, which inductor cannot lower,
  are called as an opaque custom op (`attn::packed_linear`) around which it fuses the rest.
  Inductor keeps what it compiled on disk (`TORCHINDUCTOR_CACHE_DIR`, by default
  `~/.cache/attn/inductor`; keyed by the graph, torch's version and the CPU's vector ISA,
  written atomically), so a later process compiles faster.

The output projection and the search stay as they are (eager): a projection is one large
matmul, and every search option (constraints, prefixes, shortlists, cancellation) works
unchanged on the logits. The compiled step's logits differ from the eager step's by
rounding only (the attention sums over more, masked, positions: ~1e-6), so a hypothesis can
differ where two candidates nearly tie. Where torch's compiler fails (no C++ compiler, an
unsupported build), the same step runs uncompiled, with one line on stderr, never a failure.

Measured (benchmarks/README.md, a 2-core AVX-512 CPU): exact, 1000/1000 test lines as the eager
step's, but no faster once compiled (a step at 128 rows 1.00x, at one row 0.96x; a whole decode
0.95-1.00x) and 6-30 s to compile in every process, torch's compiler tracing the step again
each time (inductor's cache keeps only the generated code). Hence `--compile` is opt-in. The
static shapes are also what CUDA graphs need; a GPU is not covered yet.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from ..devices import PackedLinear
from ..files import attn_cache
from ..model import Transformer, attention_written_out, reordered

CAPACITY_STEP = 16  # positions a cache grows by: a graph's shapes change this seldom

# The packed layers the custom op calls, by key: the op takes an int, a graph constant, where
# the packed weight (an opaque oneDNN tensor) could not be a graph input.
_PACKED: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@functools.cache
def packed_linear_op():
    """`attn::packed_linear(x, key)`: `PackedLinear` number `key` applied to x, opaque to the
    compiler. Registered on first use: `import torch.library`'s machinery is start-up time
    that decoding without `--compile` would pay for nothing."""

    @torch.library.custom_op("attn::packed_linear", mutates_args=())
    def packed_linear(x: Tensor, key: int) -> Tensor:
        layer = _PACKED[key]
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias,
                                                  layer.activation, [], "")

    @packed_linear.register_fake
    def _(x: Tensor, key: int) -> Tensor:
        return x.new_empty(*x.shape[:-1], _PACKED[key].packed.size(0))

    return torch.ops.attn.packed_linear


def through_custom_op(layer: PackedLinear) -> None:
    """Make `layer` call itself through `attn::packed_linear` (the same computation). Keys
    are numbered in order, not ids: the same model's graph in the next process is the same
    graph, found in inductor's cache."""
    op, key = packed_linear_op(), next(_KEYS)
    _PACKED[key] = layer
    layer.forward = lambda x: op(x, key)


def inductor_cache_dir() -> None:
    """Inductor's on-disk cache in attn's cache directory, unless the user chose one."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(attn_cache("inductor"))


@dataclass(frozen=True)
class StepCache:
    """`model.DecoderCache`'s counterpart for `StepDecoder`: per layer the self-attention
    keys and values in buffers of `capacity` positions (N', H, C, d), the first `step`
    written; `self_rows`, which of those N' rows the next step continues (None: all, in
    order), applied by that step. The source side (src_mask, memory_kv) and `output` as in
    `DecoderCache`."""

    src_mask: Tensor
    memory_kv: tuple[tuple[Tensor, Tensor], ...]
    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    step: int = 0
    self_rows: Tensor | None = None
    output: object = None

    def reorder(self, rows: Tensor, sources: Tensor | None = None) -> "StepCache":
        """As `DecoderCache.reorder`: continue hypothesis rows `rows` of the sentences
        `sources` (None: the same ones); the self-attention rows are gathered by the next step."""
        return reordered(self, rows, sources)


def static_step(model: Transformer, tokens: Tensor, position_row: Tensor, rows: Tensor,
                position: Tensor, mask: Tensor, keys: tuple[Tensor, ...],
                values: tuple[Tensor, ...], memory_kv: tuple[tuple[Tensor, Tensor], ...],
                src_mask: Tensor) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...]]:
    """One decoder step of N hypotheses (what `Transformer.decode_step` computes, before the
    output projection): tokens (N,) at `position` (a (1,) tensor; its embedding row
    `position_row` (1, D)); hypothesis n extends row rows[n] of the cache buffers (N', H, C,
    d). Returns the decoder's output (N, D) and the new buffers (N, H, C, d), position written.
    Every size is a tensor's, no Python number changes from step to step: a graph serves
    every step."""
    x = (model.tgt_embed(tokens) * model.embed_scale + position_row)[:, None]  # (N, 1, D)
    count = x.shape[0]
    new_keys, new_values = [], []
    for layer, key_buffer, value_buffer, layer_memory in zip(model.decoder_layers, keys, values,
                                                             memory_kv):
        attention = layer.self_attn
        queries, key, value = attention.project_self(layer.sub.before(0, x))
        key_buffer = key_buffer.index_select(0, rows).index_copy_(2, position, key)
        value_buffer = value_buffer.index_select(0, rows).index_copy_(2, position, value)
        context = attention_written_out(queries, key_buffer.transpose(-1, -2), value_buffer,
                                        mask)
        x = layer.sub.after(0, x, attention.out_proj(context.transpose(1, 2).reshape(
            count, 1, -1)))
        x = layer.sub.after(1, x, layer.cross_attn.attend_memory(layer.sub.before(1, x),
                                                                 layer_memory, src_mask))
        x = layer.sub.after(2, x, layer.ffn(layer.sub.before(2, x)))
        new_keys.append(key_buffer)
        new_values.append(value_buffer)
    if model.config.norm == "pre":
        x = model.decoder_norm(x)
    return x[:, 0], tuple(new_keys), tuple(new_values)


class StepDecoder:
    """A model's incremental decoding through `static_step`, compiled or not: what the search
    takes (`search.SearchModel`) in place of the model. `warn(line)` says, once, that the
    compiler failed and the step runs uncompiled."""

    def __init__(self, model: Transformer, compiled: bool = True, warn=None):
        self.model, self.config = model, model.config
        self.warn = warn or (lambda line: None)
        self._step = None
        if compiled:
            inductor_cache_dir()
            for layer in model.decoder_layers.modules():
                if isinstance(layer, PackedLinear):
                    through_custom_op(layer)
            # (torch's duck sizing stays on: a graph whose sizes are all distinct symbols
            # took 1.6x as long a call, where the few recompiles it saves cost seconds once.)
            self._step = torch.compile(static_step, dynamic=True)

    def encode(self, src_tokens: Tensor) -> tuple[Tensor, Tensor]:
        return self.model.encode(src_tokens)

    def start_decoding(self, memory: Tensor, src_mask: Tensor,
                       output_ids: Tensor | None = None) -> StepCache:
        start = self.model.start_decoding(memory, src_mask, output_ids)
        config = self.config
        batch = memory.shape[0]
        keys = tuple(memory.new_zeros(batch, config.heads, CAPACITY_STEP, config.d_k)
                     for _ in self.model.decoder_layers)
        values = tuple(memory.new_zeros(batch, config.heads, CAPACITY_STEP, config.d_v)
                       for _ in self.model.decoder_layers)
        # src_mask contiguous: as padding_mask makes it, a slice of an aligned buffer, its
        # stride would be one more size for the graph to guard on
        return StepCache(start.src_mask.contiguous(), start.memory_kv, keys, values,
                         output=start.output)

    def decode_step(self, tokens: Tensor, cache: StepCache) -> tuple[Tensor, StepCache]:
        """`Transformer.decode_step`'s contract, through `static_step`."""
        if cache.step == cache.keys[0].shape[2]:
            cache = grown(cache)
        step, capacity = cache.step, cache.keys[0].shape[2]
        # 0 at the positions written (this step's included), -inf at those not yet
        mask = torch.full((capacity,), -math.inf, device=tokens.device, dtype=cache.src_mask.dtype)
        mask[:step + 1] = 0.0
        rows = cache.self_rows if cache.self_rows is not None else \
            torch.arange(cache.keys[0].shape[0], device=tokens.device)
        position = torch.tensor([step], device=tokens.device)
        position_row = self.model.positions(step, 1).clone()  # a view's offset: one more guard
        arguments = (self.model, tokens, position_row, rows, position, mask, cache.keys,
                     cache.values, cache.memory_kv, cache.src_mask)
        hidden, keys, values = self._run(arguments)
        logits = self.model.step_logits(hidden) if cache.output is None else \
            cache.output(hidden)
        return logits, dataclasses.replace(cache, keys=keys, values=values, step=step + 1,
                                           self_rows=None)

    def _run(self, arguments):
        if self._step is not None:
            try:
                return self._step(*arguments)
            except Exception as error:  # the compiler's failures are many; the step is not
                self._step = None
                self.warn(f"decode: the compiled step failed ({one_line(error)}); decoding "
                          "with the same step uncompiled")
        return static_step(*arguments)


def grown(cache: StepCache) -> StepCache:
    """`cache` with CAPACITY_STEP more positions in every buffer."""
    def pad(buffer: Tensor) -> Tensor:
        return torch.cat([buffer, buffer.new_zeros(*buffer.shape[:2], CAPACITY_STEP,
                                                   buffer.shape[3])], dim=2)

    return dataclasses.replace(cache, keys=tuple(map(pad, cache.keys)),
                               values=tuple(map(pad, cache.values)))


def one_line(error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."
