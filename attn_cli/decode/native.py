"""The decoder step and the free beam search in C++ (`native/step.cpp`).

A step of the eager decoder is ~170 torch ops for a 3-layer model and a step of the search ~100,
each a Python call that parses its arguments, dispatches and takes the GIL back; on a small model
at small batches that is a large share of decoding (benchmarks/README.md, `decode_steps.py`).
`NativeDecoder` runs the same ops, with the same arguments in the same order, from C++, the GIL
released (other search threads run meanwhile): `decode_step` in one call (the logits the eager
step's bit for bit), and a search with no constraint whole in one call (`free_search`: the
hypotheses the Python search's bit for bit). Constrained searches and sampling keep the Python
search over the C++ step; the encoder stays as it is.

The extension is compiled at first use by torch's `cpp_extension` (a C++ compiler and ninja),
once per torch version and CPU instruction set, into attn's cache directory
(`~/.cache/attn/native`, or `$XDG_CACHE_HOME/attn/native`; `ATTN_NATIVE_DIR` chooses another),
and loaded from there by later processes. Where it cannot be built or loaded (no compiler, an
unsupported build), and for what it does not cover (a GPU, an ensemble), the eager step runs, with
one line on stderr saying why.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch
from torch import Tensor

from ..devices import PackedFeedForward, PackedLinear
from ..errors import compiler_error_line, say
from ..files import attn_cache
from ..formats import Stop
from ..model import DecoderCache, FeedForward, Transformer
from ..search import ShortlistColumns

SOURCE = Path(__file__).with_name("native") / "step.cpp"
SOURCES = (SOURCE, SOURCE.with_name("kernels.h"))
NAME = "attn_native_step"

# -O3: GCC vectorises kernels.h's `omp simd` reductions (max, sum, dot) at -O3, not at -O2
CFLAGS = ("-O3", "-fopenmp-simd")
# The instruction set the fused kernels (native/kernels.h) are compiled for: the one torch
# itself runs here (torch.backends.cpu.get_cpu_capability, which ATEN_CPU_CAPABILITY may lower),
# so that the build, cached under that name, runs on any CPU that name runs on.
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512dq", "-mavx512bw",
               "-mavx512vl", "-mprefer-vector-width=512"],
}


def cache_directory() -> Path:
    """Where the built extension lives: one folder per torch version, machine, CPU instruction
    set and source (the compiled code is good for those only; two checkouts of different
    sources never rebuild over each other)."""
    chosen = os.environ.get("ATTN_NATIVE_DIR")
    base = Path(chosen) if chosen else attn_cache("native")
    isa = torch.backends.cpu.get_cpu_capability().lower()
    version = torch.__version__.replace("+", "-")
    built_from = b"".join(path.read_bytes() for path in SOURCES) + " ".join(CFLAGS).encode()
    source = hashlib.sha256(built_from).hexdigest()[:12]
    return base / f"torch-{version}-{platform.machine()}-{isa}-{source}"


def is_built() -> bool:
    """Whether a process may load the extension without compiling it first."""
    return (cache_directory() / f"{NAME}.so").exists()


@functools.cache
def extension():
    """The compiled module (built here the first time), or why it is not at hand: a string,
    for the one line the caller prints."""
    path = os.environ.get("PATH")
    try:
        from torch.utils import cpp_extension

        directory = cache_directory()
        directory.mkdir(parents=True, exist_ok=True)
        # ninja as pip installs it (a dependency) sits beside the interpreter, which a venv's
        # python run by its path does not put on PATH
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path or ""])
        with open(directory / "build.lock", "a") as held:
            # One process builds at a time, under a lock the kernel lets go of when its process
            # ends, however it ends. cpp_extension's own lock is a file made and removed by the
            # builder: one killed midway leaves it, and every later process would wait for it
            # forever. Under this lock no one else builds here, so such a file is stale.
            fcntl.flock(held, fcntl.LOCK_EX)
            (directory / "lock").unlink(missing_ok=True)
            return cpp_extension.load(name=NAME, sources=[str(SOURCE)],
                                      build_directory=str(directory),
                                      extra_cflags=[*CFLAGS, *isa_flags()],
                                      verbose=False)
    except Exception as error:  # no compiler, no ninja, headers missing: the eager step then
        return compiler_error_line(error)
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path


def isa_flags() -> list[str]:
    """The compiler's flags for the instruction set the build is cached under (none for
    torch's "default", a CPU with neither AVX2 nor AVX-512: the compiler's baseline then)."""
    isa = torch.backends.cpu.get_cpu_capability().lower()
    return ISA_FLAGS.get(isa, [])


def native_linear(module, native, activation: str = "none"):
    """The C++ counterpart of one of the model's linear layers."""
    if isinstance(module, PackedLinear):
        return native.Linear(True, module.packed, module.bias, module.activation)
    if type(module) is torch.nn.Linear:
        return native.Linear(False, module.weight, module.bias, activation)
    if is_int8_linear(module):
        # torch.ao's quantized dynamic Linear.forward: reduce_range from its version 4 on
        reduce_range = module.version is not None and module.version >= 4
        weight, bias = module._weight_bias()  # int8 per output channel; the float bias
        return native.Linear.int8(weight, bias, reduce_range, activation)
    raise TypeError(f"no C++ step for a {type(module).__name__} layer")


def is_int8_linear(module) -> bool:
    """Whether `module` is --int8's linear layer (devices.int8_linears): torch's dynamic
    quantized Linear with int8 weights."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    return type(module) is DynamicLinear and module._packed_params.dtype == torch.qint8


def native_ffn(ffn, native) -> tuple:
    if isinstance(ffn, PackedFeedForward):
        return native_linear(ffn.inner, native), native_linear(ffn.outer, native)
    if isinstance(ffn, FeedForward):
        return native_linear(ffn.inner, native, ffn.activation), native_linear(ffn.outer, native)
    raise TypeError(f"no C++ step for a {type(ffn).__name__} block")


def native_norm(norm: torch.nn.LayerNorm, native):
    return native.Norm(norm.weight, norm.bias, norm.eps)


class NativeDecoder:
    """A model's incremental decoding with its decoder step in C++: what the search takes
    (`search.SearchModel`) in place of the model, with the model's own cache
    (`model.DecoderCache`), encoder and shortlist projection."""

    def __init__(self, model: Transformer, native, fused: bool = True):
        self.model, self.config = model, model.config
        # stage B's kernels in the free search (float32 models): equal to float rounding
        self.fused = fused
        self._positions = model.positions(0, 1)
        config = model.config
        linears, norms = [], []
        for layer in model.decoder_layers:
            linears += [native_linear(layer.self_attn.qkv_proj, native),
                        native_linear(layer.self_attn.out_proj, native),
                        native_linear(layer.cross_attn.q_proj, native),
                        native_linear(layer.cross_attn.out_proj, native),
                        *native_ffn(layer.ffn, native)]
            norms += [native_norm(norm, native) for norm in layer.sub.norms]
        if model.output_projection is not None:
            output = native_linear(model.output_projection, native)
        else:
            output = native.Linear(False, model.tgt_embed.weight, model.output_bias, "none")
        final_norm = native_norm(model.decoder_norm, native) if config.norm == "pre" else None
        self._native = native
        self._decoder = native.Decoder(
            config.heads, config.d_k, config.d_v, config.norm == "pre", model.tgt_embed.weight,
            model.embed_scale, config.pad_id, linears, norms, final_norm, output)

    def encode(self, src_tokens: Tensor) -> tuple[Tensor, Tensor]:
        return self.model.encode(src_tokens)

    def start_decoding(self, memory: Tensor, src_mask: Tensor,
                       output_ids: Tensor | None = None) -> DecoderCache:
        return self.model.start_decoding(memory, src_mask, output_ids)

    def decode_step(self, tokens: Tensor, cache: DecoderCache) -> tuple[Tensor, DecoderCache]:
        """`Transformer.decode_step`'s contract, in one C++ call."""
        spare = [buffer for pair in cache.spare for buffer in pair] if cache.spare else []
        logits, grown, buffers = self._decoder.step(
            tokens, self.model.positions(cache.step, 1), cache.src_mask,
            [tensor for pair in cache.memory_kv for tensor in pair],
            [tensor for pair in cache.self_kv for tensor in pair], cache.self_rows, spare,
            cache.output is None)
        if cache.output is not None:
            logits = cache.output(logits)
        return logits, DecoderCache(
            cache.src_mask, cache.memory_kv, tuple(zip(grown[::2], grown[1::2])), cache.step + 1,
            buffers=tuple(zip(buffers[::2], buffers[1::2])), spare=cache.buffers,
            output=cache.output)

    def free_search(self, setup, penalties: Tensor, beam: int, alpha: float, nbest: int,
                    stop: Stop) -> list[Tensor]:
        """`search.beam_search` of a free search (no constraint; the whole vocabulary or a
        shortlist's columns) set up by `search.start_search`, every step in one C++ call:
        the finished hypotheses' rows (`search.finished_rows`), as the Python search keeps
        them, found by the same ops."""
        cache, constraint = setup.cache, setup.constraint
        output = column_ids = None
        if cache.output is not None:  # a shortlist: its projection, and its columns' ids
            subset = cache.output
            output = native_linear(subset.projection, self._native) \
                if subset.projection is not None \
                else self._native.Linear(False, subset.weight, subset.bias, "none")
        if isinstance(constraint, ShortlistColumns):
            column_ids = constraint.ids
        config, longest = self.config, max(setup.limit_lengths)
        return self._decoder.beam_search(
            cache.src_mask, [tensor for pair in cache.memory_kv for tensor in pair],
            [tensor for pair in cache.self_kv for tensor in pair], output, column_ids,
            setup.limits, sorted(setup.limit_lengths), setup.banned, penalties,
            constraint.eos_column, config.eos_id, config.bos_id, beam, nbest,
            STOP_RULES[stop], alpha, self.positions(longest),
            setup.called_off.cancelled, self.fused)

    @property
    def fusable(self) -> bool:
        """Whether the fused kernels compute this model (float32)."""
        return self._decoder.fusable

    def stream(self, beam: int, nbest: int, stop: int, alpha: float, banned: Tensor):
        """A C++ free search sentences join and leave at any step (`stream.Stream` uses it)."""
        config = self.config
        return self._native.Stream(self._decoder, beam, nbest, stop, alpha, config.eos_id,
                                   config.bos_id, config.eos_id, banned, None, None)

    def position_cache(self, memory: Tensor, src_mask: Tensor, positions: int, rows: int):
        """The fused step's cache (`fused_step`) of a batch's encoder output, with room for
        `positions` steps of up to `rows` hypotheses; `.reorder(rows, sources=None)` as
        `DecoderCache.reorder`."""
        start = self.model.start_decoding(memory, src_mask)
        config = self.config
        return self._native.PositionCache(
            src_mask, [tensor for pair in start.memory_kv for tensor in pair],
            len(self.model.decoder_layers), config.heads * config.d_k,
            config.heads * config.d_v, positions, rows)

    def fused_step(self, tokens: Tensor, cache) -> Tensor:
        """One step of stage B's fused decoder into a `position_cache`: the logits (N, V)."""
        return self._decoder.fused_step(tokens, self.positions(cache.capacity), cache)

    def positions(self, length: int) -> Tensor:
        """The position table's first `length` rows (made once, then its slices)."""
        if self._positions.shape[0] < length:
            self._positions = self.model.positions(0, length).contiguous()
        return self._positions[:length]


# formats.Stop's rules as step.cpp numbers them
STOP_RULES = {Stop.bound: 0, Stop.patience: 1, Stop.best_ends: 2, Stop.limit: 3}


def covers(model) -> bool:
    """Whether the C++ step computes this model's step: one model (not an ensemble) on a CPU
    whose decoder's layers are all of the kinds it knows (linear layers packed, dense or
    --int8's)."""
    if not isinstance(model, Transformer) or model.tgt_embed.weight.device.type != "cpu" \
            or model.training:  # (dropout: the step has none)
        return False
    known = (PackedLinear, torch.nn.Linear, torch.nn.LayerNorm)
    layers = list(leaf_layers(model.decoder_layers))
    if model.output_projection is not None:
        layers.append(model.output_projection)
    return all(type(layer) in known or is_int8_linear(layer) or
               isinstance(layer, torch.nn.Dropout) for layer in layers)


def leaf_layers(module):
    """The layers `module` is made of, an int8 linear layer as one (it holds a module of its
    own, its packed weight)."""
    children = list(module.children())
    if not children or is_int8_linear(module):
        yield module
    for child in () if is_int8_linear(module) else children:
        yield from leaf_layers(child)


def native_decoder(model, warn, asked: bool = False,
                   fused: bool = True) -> "NativeDecoder | None":
    """The model's C++ step, or None (the eager step then), with one line to `warn` where the
    extension cannot be built and, `asked` (`--step native`), where it does not cover the
    model. The first use on a machine builds it, saying so."""
    if not covers(model):
        if asked:
            warn("decode: the C++ decoder step covers one model on a CPU, not an ensemble or "
                 "a GPU yet; decoding with the eager step")
        return None
    if not is_built():
        warn("decode: building attn's C++ decoder step, once for this torch and CPU "
             "(about a minute; --step eager skips it)")
    native = extension()
    if isinstance(native, str):
        warn(f"decode: the C++ decoder step could not be built ({native}); decoding with the "
             "eager step (a C++ compiler and ninja build it)")
        return None
    return NativeDecoder(model, native, fused)


def main() -> None:
    """`python -m attn_cli.decode.native`: build the extension now (`make install` does), and
    say where it is or why it cannot be built."""
    native = extension()
    if isinstance(native, str):
        say(f"attn: the C++ decoder step could not be built ({native}); decoding will use "
            "the eager step")
    else:
        say(f"attn: the C++ decoder step is built: {cache_directory()}")


if __name__ == "__main__":
    main()
