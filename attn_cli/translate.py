"""`attn decode`: text in, translations out, one line per line, in order, as soon as ready.

A reader thread pulls stdin lazily; the main loop takes whatever lines have arrived (at least
one, at most `buffer_size`), sorts them by length into token-budget batches, searches, and writes
the window's results in input order. A user typing sees each translation after pressing enter; a
file streams through in windows of `buffer_size` lines.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .batching import pad_sequences, source_budget, token_budget_batches
from .devices import (
    inference_dtype,
    pack_for_cpu_inference,
    quantize_for_cpu_inference,
    search_batch_tokens,
)
from .ensemble import Ensemble, load_models
from .errors import AttnError
from .files import STRICT, Utf8Policy
from .formats import BUFFER_SIZE, MAX_SOURCE_TOKENS, TRANSLATION, Stop
from .modelfile import LoadedModel
from .search import Hypothesis, beam_search, output_limits, sample, sentence_uniforms


@dataclass(frozen=True)
class DecodeOptions:
    """How `attn decode` and `attn parse` search (or sample), checked as they are made."""

    beam: int = TRANSLATION.beam
    alpha: float = TRANSLATION.alpha
    max_len_a: float = TRANSLATION.max_len_a
    max_len_b: int = TRANSLATION.max_len_b
    nbest: int = 1
    stop: Stop = Stop.bound
    # Sampling instead of search (`search.sample`): for back-translation.
    sample: bool = False
    topk: int = 0  # 0: every token
    topp: float = 1.0
    temperature: float = 1.0
    seed: int = 1
    # source tokens × beam held by one search batch; None: devices.search_batch_tokens
    batch_tokens: int | None = None
    buffer_size: int = BUFFER_SIZE
    raw: bool = False
    workers: int = 1  # batches searched at once, each by its own thread
    worker_threads: int = 1  # torch threads of each of those

    def __post_init__(self) -> None:
        if self.sample and self.nbest > 1:
            raise AttnError("--nbest needs beam search, not --sample (sample again with "
                            "another --seed for more outputs)")
        if self.topp <= 0.0 or self.temperature <= 0.0:
            raise AttnError("--topp and --temperature must be above 0")
        if (self.topk or self.topp < 1.0 or self.temperature != 1.0) and not self.sample:
            raise AttnError("--topk, --topp and --temperature apply to --sample only")

    @property
    def source_budget(self) -> int:
        """Source tokens of one search batch, padding included (batching's one rule)."""
        return source_budget(self.batch_tokens, 1 if self.sample else self.beam)


@dataclass
class DecodeStats:
    sentences: int = 0
    output_tokens: int = 0  # EOS included
    seconds: float = 0.0
    truncated: int = 0
    replaced: int = 0  # lines whose invalid UTF-8 was replaced by U+FFFD

    def record(self) -> dict:
        """The summary as one JSON object (`--stats-json`)."""
        return {"sentences": self.sentences, "output_tokens": self.output_tokens,
                "seconds": self.seconds,
                "sentences_per_s": self.sentences / max(self.seconds, 1e-9),
                "tokens_per_s": self.output_tokens / self.seconds if self.seconds else 0.0,
                "truncated": self.truncated, "replaced": self.replaced}

    def summary(self) -> str:
        rate = self.output_tokens / self.seconds if self.seconds else 0.0
        notes = [f"{self.truncated} truncated"] if self.truncated else []
        notes += [f"{self.replaced} with invalid UTF-8 replaced"] if self.replaced else []
        return (f"{self.sentences} sentences, {self.output_tokens} output tokens (EOS "
                f"included) in {self.seconds:.2f}s: {self.sentences / max(self.seconds, 1e-9):.1f}"
                f" sentences/s, {rate:.0f} tokens/s"
                + (f" ({', '.join(notes)})" if notes else ""))


_END = object()


def read_windows(stream, buffer_size: int, name: str = "<stdin>",
                 policy: Utf8Policy = STRICT) -> Iterator[list[str]]:
    """Lines of a binary stream in windows: block for one line, then take what else has already
    arrived, up to `buffer_size`. Invalid UTF-8 is replaced or an error, as `policy` says; an
    error comes after the window of the lines before it, so that those are still written."""
    arrived: queue.Queue = queue.Queue(maxsize=max(2 * buffer_size, 2))

    def pump():
        try:
            for raw in _unlocked_lines(stream):
                arrived.put(raw)
        except BaseException as error:  # surfaced in the main thread
            arrived.put(error)
        arrived.put(_END)

    threading.Thread(target=pump, daemon=True).start()
    line_number = 0
    while True:
        window = []
        item = arrived.get()
        while True:
            if item is _END:
                if window:
                    yield window
                return
            if isinstance(item, BaseException):
                raise item
            line_number += 1
            try:
                window.append(policy.decode(item, name, line_number))
            except AttnError:
                if window:
                    yield window
                raise
            if len(window) >= buffer_size:
                break
            try:
                item = arrived.get_nowait()
            except queue.Empty:
                break
        yield window


def _unlocked_lines(stream) -> Iterator[bytes]:
    """The stream's lines, read from its file descriptor when it has one. The reader thread must
    not sit in a buffered reader's read: that holds the reader's lock, and an interpreter exiting
    meanwhile (an error, `| head`) aborts ("could not acquire lock ... at interpreter
    shutdown"). os.read holds no lock, and returns what a terminal has, line by line."""
    try:
        descriptor = stream.fileno()
    except (AttributeError, OSError, ValueError):  # an in-memory stream: nothing to wait on
        yield from stream
        return
    pending: list[bytes] = []  # the start of a line longer than a chunk
    while chunk := os.read(descriptor, 1 << 16):
        first, *lines = chunk.split(b"\n")
        if not lines:
            pending.append(first)
            continue
        yield b"".join(pending) + first + b"\n"
        for line in lines[:-1]:
            yield line + b"\n"
        pending = [lines[-1]] if lines[-1] else []
    if pending:
        yield b"".join(pending)


class Translator:
    """A loaded model (or several: an ensemble) plus the search settings: lines in,
    hypotheses out."""

    def __init__(self, loaded: LoadedModel, options: DecodeOptions, device: torch.device,
                 dtype: str = "fp32", warn=None, constraint_for=None,
                 ensemble: list[LoadedModel] = (), int8: bool = False):
        self.loaded, self.options, self.device = loaded, options, device
        # Inference in bf16/fp16 converts the weights once (no per-call autocast casts): on a
        # CPU with native bf16 (AMX, AVX512-BF16) beam search runs 1.1-1.3x faster
        # (devices.inference_dtype).
        precision = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        models = []
        for member in (loaded, *ensemble):
            model = member.model.to(device=device, dtype=precision[dtype]).eval()
            if int8:  # `--int8`: int8 linear layers instead of the packed float32 ones
                quantize_for_cpu_inference(model)
            elif device.type == "cpu":
                pack_for_cpu_inference(model)
            models.append(model)
        self.model = models[0] if len(models) == 1 else Ensemble(models)
        # Longest source the models take: their positions (learned) or any sane length, EOS
        # included; the target side also needs max_len_a·|x| + b positions.
        learned = [member.config.max_positions - 1 for member in (loaded, *ensemble)
                   if member.config.positions == "learned"]
        self.max_source = min(learned, default=MAX_SOURCE_TOKENS)
        self.longest_output = min(learned, default=None)
        self.warn = warn or (lambda message: print(message, file=sys.stderr, flush=True))
        self.stats = DecodeStats()
        # constraint_for(lines of a batch) → a search constraint for them (parsing), or None
        self.constraint_for = constraint_for
        self._pool: ThreadPoolExecutor | None = None

    def _workers(self) -> ThreadPoolExecutor:
        """Threads that each search one batch at a time. On a CPU, W batches side by side with
        T/W torch threads each beat one batch at a time with T threads (1.4-1.7x on 2 cores:
        a step's small matmuls and its Python bookkeeping leave a multi-threaded op's helper
        threads idle). Torch ops release the GIL, so threads suffice."""
        if self._pool is None:
            threads = self.options.worker_threads
            self._pool = ThreadPoolExecutor(self.options.workers, "attn-search",
                                            initializer=lambda: torch.set_num_threads(threads))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def with_options(self, **changes) -> "Translator":
        """The same models searching with other settings (`DecodeOptions` fields, checked):
        what a server does for a request that asks for its own beam, nbest, ..."""
        view = copy.copy(self)
        view.options = dataclasses.replace(self.options, **changes)
        view.stats, view._pool = DecodeStats(), None
        return view

    def encode(self, lines: list[str], first_line: int, where: str = "decode"
               ) -> list[list[int]]:
        """Source ids of each line, EOS appended, cut to the models' limit (`where` names the
        lines' origin in the warning)."""
        ids = self.loaded.src_vocab.encode(lines)
        eos = self.loaded.config.eos_id
        for offset, sequence in enumerate(ids):
            if len(sequence) > self.max_source:
                self.warn(f"{where}: line {first_line + offset}: {len(sequence)} tokens, "
                          f"truncated to the model's limit of {self.max_source}")
                self.stats.truncated += 1
                del sequence[self.max_source:]
            sequence.append(eos)
        return ids

    def search(self, ids: list[list[int]], constraint=None,
               line_numbers: list[int] | None = None) -> list[list[Hypothesis]]:
        """Hypotheses of each sentence `ids`; sampling draws a sentence's random numbers from
        the seed and its `line_numbers` entry (default: its place in `ids`)."""
        src = pad_sequences(ids, self.loaded.config.pad_id).to(self.device)
        options = self.options
        if options.sample:
            limits = output_limits(src, self.loaded.config.pad_id, options.max_len_a,
                                   options.max_len_b, self.longest_output)
            uniforms = sentence_uniforms(options.seed, line_numbers or list(range(len(ids))),
                                         int(limits.max()))
            return sample(self.model, src, uniforms, options.temperature, options.topk,
                          options.topp, options.max_len_a, options.max_len_b,
                          longest=self.longest_output)
        return beam_search(self.model, src, beam=options.beam, alpha=options.alpha,
                           max_len_a=options.max_len_a, max_len_b=options.max_len_b,
                           nbest=options.nbest, longest=self.longest_output,
                           constraint=constraint, stop=options.stop)

    def translate_window(self, lines: list[str], first_line: int) -> list[list[Hypothesis]]:
        """Hypotheses for every line, in input order; an empty line gets one empty hypothesis."""
        results: list[list[Hypothesis] | None] = [None] * len(lines)
        todo = [i for i, line in enumerate(lines) if line.strip()]
        for i in set(range(len(lines))) - set(todo):
            results[i] = [Hypothesis([], 0.0, 0.0)]
        if todo:
            ids = self.encode([lines[i] for i in todo], first_line)
            lengths = [len(sequence) for sequence in ids]
            batches = token_budget_batches(lengths, self.options.source_budget)

            def search_batch(batch: list[int]) -> list[list[Hypothesis]]:
                constraint = self.constraint_for([lines[todo[i]] for i in batch]) \
                    if self.constraint_for else None
                return self.search([ids[i] for i in batch], constraint,
                                   [first_line + todo[i] for i in batch])

            parallel = self.options.workers > 1 and len(batches) > 1
            found = (self._workers().map if parallel else map)(search_batch, batches)
            for batch, hypotheses_of_batch in zip(batches, found):
                for index, hypotheses in zip(batch, hypotheses_of_batch):
                    results[todo[index]] = hypotheses
        return results

    def translate(self, lines: list[str]) -> list[str]:
        """The best translation of each line, in order (an empty line for an empty line); with
        nbest K, K `index<TAB>score<TAB>text` lines per line, as `attn decode` prints them."""
        results = self.translate_window(list(lines), 1)
        return [text for index, hypotheses in enumerate(results)
                for text in self.format(index, hypotheses)]

    def detokenize(self, hypotheses: list[Hypothesis]) -> list[str]:
        vocab = self.loaded.tgt_vocab
        if self.options.raw:
            return [" ".join(vocab.piece(t) for t in h.tokens)
                    for h in hypotheses]
        return vocab.decode([h.tokens for h in hypotheses])

    def format(self, index: int, hypotheses: list[Hypothesis]) -> Iterable[str]:
        texts = self.detokenize(hypotheses)
        if self.options.nbest == 1:
            return [texts[0]]
        padded = list(zip(hypotheses, texts))
        while len(padded) < self.options.nbest:  # always K lines per input
            padded.append((Hypothesis([], -math.inf, -math.inf), ""))
        return [f"{index}\t{h.score:.4f}\t{text}" for h, text in padded]


def search_workers(threads: int, workers: int, device: torch.device) -> tuple[int, int]:
    """(batches searched side by side, torch threads of each). 0 (auto): on a CPU one batch
    per thread with one torch thread each (measured fastest: benchmarks/), on a GPU one batch
    at a time."""
    if workers == 0:
        workers = threads if device.type == "cpu" else 1
    return workers, max(1, threads // workers)


def load_translator(model_path, beam: int = TRANSLATION.beam, *, device: str = "auto",
                    dtype: str = "auto", threads: int = 0, workers: int = 0, warn=None,
                    constraint_for=None, int8: bool = False, **options) -> Translator:
    """A model file (a list of them: an ensemble) made ready to decode: the device (auto: a GPU
    when torch sees one), the precision (auto: bf16 on CUDA, fp32 on a CPU), the CPU threads (0:
    every core), how many batches are searched side by side (0: auto) and, with `int8`, the
    linear layers as int8 ones (a CPU only: `devices.quantize_for_cpu_inference`), with the
    search settings of `DecodeOptions` (beam, alpha, max_len_a, max_len_b, nbest, batch_tokens,
    ...).
    `constraint_for(loaded model)`, if given, makes the search constraint's factory for that
    model (`tree_search.tree_constraints`: parsing). This is what `attn decode` and `attn parse`
    run; from Python:

        translator = load_translator("model.st")
        translator.translate(["A man is riding a bike."])  # ["Ein Mann fährt Fahrrad."]
    """
    settings = DecodeOptions(beam=beam, **options)  # checked before the models load
    paths = list(model_path) if isinstance(model_path, (list, tuple)) else [model_path]
    int8_refused = AttnError("--int8 is torch's dynamic int8 quantization of the linear "
                             "layers, for float32 on a CPU (--device cpu, --dtype auto or "
                             "fp32); on a GPU use --dtype bf16")
    if int8 and dtype not in ("auto", "fp32"):
        raise int8_refused
    (loaded, *ensemble), chosen, threads = load_models(paths, device, threads)
    if int8 and chosen.type != "cpu":
        raise int8_refused
    workers, worker_threads = search_workers(threads, workers, chosen)
    settings = dataclasses.replace(settings, workers=workers, worker_threads=worker_threads,
                                   batch_tokens=settings.batch_tokens or
                                   search_batch_tokens(chosen))
    return Translator(loaded, settings, chosen, inference_dtype(dtype, chosen), warn=warn,
                      constraint_for=constraint_for(loaded) if constraint_for else None,
                      ensemble=ensemble, int8=int8)


def keep_loaded() -> None:
    """For a process that decodes with what it has loaded until it ends (`attn decode`,
    `parse`, `serve`): every object alive now out of the garbage collector's full collections,
    which otherwise walk all of torch's and the model's objects, ~90 ms each, once or more per
    1000-line file (measured: 4% of a greedy decode); then the collector on (`cli.main` starts
    these commands without it). Not done by `load_translator` itself: a program loading and
    dropping models would keep their cyclic garbage."""
    gc.freeze()
    gc.enable()


def run(translator: Translator, stream, out, name: str = "<stdin>", render=None,
        policy: Utf8Policy = STRICT) -> DecodeStats:
    """The pipe: windows of lines in, one line (or nbest lines) out per line in, in order.
    `render(index, line, hypotheses)` makes the output lines (default: translations); `policy`
    says what invalid UTF-8 does."""
    render = render or (lambda index, line, hypotheses: translator.format(index, hypotheses))
    started = time.perf_counter()
    stats = translator.stats
    line_number = 0
    try:
        for window in read_windows(stream, translator.options.buffer_size, name, policy):
            results = translator.translate_window(window, line_number + 1)
            for offset, hypotheses in enumerate(results):
                for text in render(line_number + offset, window[offset], hypotheses):
                    out.write(text + "\n")
                if window[offset].strip():
                    stats.sentences += 1
                    stats.output_tokens += len(hypotheses[0].tokens) + 1
            out.flush()
            line_number += len(window)
    finally:
        translator.close()
        policy.finish()
    stats.seconds = time.perf_counter() - started
    stats.replaced = policy.count
    return stats
