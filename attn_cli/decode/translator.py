"""Models made for decoding (one, or an ensemble) and the search settings: lines in, hypotheses
out. What `attn decode`, `attn parse` and each of `attn serve`'s model pairs run, and the library's
`load_translator`."""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from ..alignment import pharaoh
from ..batching import balanced_batches, pad_sequences
from ..config import parse_langs
from ..devices import (
    LARGE_MODEL_BYTES,
    inference_dtype,
    inference_model,
    pick_device,
    search_batch_tokens,
    weight_bytes,
)
from ..ensemble import Ensemble, load_models
from ..errors import AttnError, batch_must_fit, say
from ..formats import COMPILE_MODES, MAX_SOURCE_TOKENS, STEP_MODES, TRANSLATION
from ..modelfile import LoadedModel
from ..search import (
    Hypothesis,
    beam_search,
    max_output_length,
    output_limits,
    sample,
    sentence_uniforms,
)
from ..tags import target_tags
from .alignment import align_lines
from .constraints import free_controls, holds_phrases, search_constraint
from .controls import NONE, Controls, DecodeControls, read_controls
from .lexical import UNMET_PENALTY, WordPieces
from .options import DecodeOptions, DecodeStats
from .sentences import split_texts
from .stream import Stream
from .stream import supported as stream_supported

# An empty (or blank) line's output, without a search: one empty hypothesis of score 0.
# search_work's span, in units of d_model: the demo model (d_model 256, 3+3 layers) at beam 32
# on one thread (2-core Zen 4) searched to 256, 1,024 and 4,096 positions in 1.5, 12.0 and
# 157 s (1 : 7.8 : 102); weights 1 + t / 230 count them 1 : 8.3 : 102 (230 = 0.9 × d_model:
# the cache's keys and values grow with d_model). One unit is then ~0.12 ms of that thread.
ATTENTION_SPAN = 0.9
EMPTY_LINE = Hypothesis([], 0.0, 0.0)
# What fills a line's nbest outputs past those the search found.
NOT_FOUND = Hypothesis([], -math.inf, -math.inf)


class Translator:
    """Models made for decoding (one, or several: an ensemble) plus the search settings: lines
    in, hypotheses out."""

    def __init__(self, loaded: LoadedModel, options: DecodeOptions, device: torch.device,
                 dtype: str = "fp32", warn=None, constraint_for=None,
                 ensemble: list[LoadedModel] = (), int8: bool = False, compile: str = "off",
                 controls: DecodeControls = DecodeControls(), step: str = "auto",
                 release: bool = False):
        self.options, self.device = options, device
        # Of the loaded models the translator keeps what lines in and out need (the first
        # one's config, for the special ids, and vocabularies: an ensemble shares them) and a
        # copy of each made for decoding (devices.inference_model), not the models themselves:
        # those stay as they were, and their weights are freed when the caller drops them.
        self.config, self.src_vocab, self.tgt_vocab = (loaded.config, loaded.src_vocab,
                                                       loaded.tgt_vocab)
        self.langs = model_langs(loaded.metadata)
        self.metadata = dict(loaded.metadata)
        # `--int8`: int8 linear layers; else oneDNN's packed ones on a CPU, torch's on a GPU
        linears = "int8" if int8 else "packed" if device.type == "cpu" else "dense"
        # `release`: the caller gives the loaded models up (`load_translator`): each weight is
        # then held once, not twice while its packed copy is made (`inference_model`)
        models = [inference_model(member.model, device, dtype, linears, release)
                  for member in (loaded, *ensemble)]
        self.model = models[0] if len(models) == 1 else Ensemble(models)
        self.warn = warn or say
        # What the search steps: the model, its step in C++ (`--step`, `native.NativeDecoder`),
        # or its step with a preallocated cache, compiled (`--compile`, `compiled.StepDecoder`)
        self.stepped = self._stepped(compile, int8, step)
        # Longest source the models take: their positions (learned) or any sane length, EOS
        # included; the target side also needs max_len_a·|x| + b positions.
        learned = [member.config.max_positions - 1 for member in (loaded, *ensemble)
                   if member.config.positions == "learned"]
        self.max_source = min(learned, default=MAX_SOURCE_TOKENS)
        self.longest_output = min(learned, default=None)
        self.stats = DecodeStats()
        # constraint_for(lines of a batch) → a search constraint for them (parsing), or None
        self.constraint_for = constraint_for
        # What every line is held to (decode's and a server's --glossary, --ban, --shortlist):
        # parsing's tree constraint forces pieces of its own, so a parser takes none.
        if constraint_for is not None and controls != DecodeControls():
            raise AttnError("a glossary, banned phrases and a vocabulary shortlist are for "
                            "translation, not parsing")
        self.controls = controls
        self._word_pieces: WordPieces | None = None
        self._special_outputs: frozenset[int] | None = None  # `without_start`'s, made once
        self._pool: ThreadPoolExecutor | None = None

    def _stepped(self, compile: str, int8: bool, step: str):
        """The model the search steps with `compile` (`formats.COMPILE_MODES`): "on", a
        compiled step where it covers the model (one model on a CPU, not --int8), else the
        model with one stderr line; "auto" as "off". Else as `step` says
        (`formats.STEP_MODES`): the C++ step where it covers the model and builds (a line
        where it does not build, or where `native` was asked and it does not cover the model),
        or the model's own eager step."""
        if compile not in COMPILE_MODES:
            raise AttnError(f"--compile must be one of {', '.join(COMPILE_MODES)}, not "
                            f"{compile!r}")
        if step not in STEP_MODES:
            raise AttnError(f"--step must be one of {', '.join(STEP_MODES)}, not {step!r}")
        if compile != "on":
            if step == "eager":
                return self.model
            from .native import native_decoder

            return native_decoder(self.model, self.warn, asked=step in ("native", "aten"),
                                  fused=step != "aten") or self.model
        if isinstance(self.model, Ensemble) or int8 or self.device.type != "cpu":
            self.warn("decode: --compile covers one model on a CPU, not an ensemble, --int8 "
                      "or a GPU yet; decoding eagerly")
            return self.model
        from .compiled import StepDecoder

        return StepDecoder(self.model, warn=self.warn)

    def _workers(self) -> ThreadPoolExecutor:
        """Threads that each search one batch at a time. On a CPU, W batches side by side with
        T/W torch threads each beat one batch at a time with T threads: a step's small matmuls
        and its Python bookkeeping leave a multi-threaded op's helper threads idle. Torch ops
        release the GIL, so threads suffice."""
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

    def with_target(self, lang: str, where: str = "the model",
                    option: str = "--target-lang", source: str | None = None) -> "Translator":
        """The same models translating into `lang`: every source starts with its target tag
        (tags.py: `<2fr>`, an OPUS-MT model's `>>fra<<`); one the vocabulary lacks is an
        AttnError naming `where` (the model's file), `option` and the tags it has. A model
        whose languages are tokens (NLLB-200, M2M-100: `language_options`) starts every
        source with the code of `source` (None: the model's own source, else English) and
        every output with the code of `lang`."""
        if self.metadata.get("lang_codes"):
            return self.with_options(**language_options(self.metadata, self.src_vocab, source,
                                                        lang, where, option))
        return self.with_options(source_tags=target_tags(self.src_vocab, lang, where, option))

    def encode(self, lines: list[str], first_line: int, where: str = "decode",
               unit: str = "line") -> list[list[int]]:
        """Source ids of each line, after the options' `source_tags`, EOS appended, cut to the
        models' limit (`where` names the lines' origin in the warning, `unit` what they are:
        lines, or sentences cut from them)."""
        ids = self.src_vocab.encode(lines)
        eos, tags = self.config.eos_id, self.options.source_tags
        for offset, sequence in enumerate(ids):
            if tags:
                sequence[:0] = tags
            if len(sequence) > self.max_source:
                self.warn(f"{where}: {unit} {first_line + offset}: {len(sequence)} tokens, "
                          f"truncated to the model's limit of {self.max_source}")
                self.stats.truncated += 1
                del sequence[self.max_source:]
            sequence.append(eos)
        return ids

    def search_work(self, ids: list[list[int]]) -> int:
        """What a search of the sentences `ids` may cost at most, in steps of one hypothesis:
        each sentence's beam (1 sampling) × its longest allowed output (EOS included), each
        position t weighed 1 + t / span, since its step reads the t keys and values cached
        before it (span: `ATTENTION_SPAN` × d_model positions, where that reading costs what the
        rest of the step does). What a server bounds per request, before any search: the
        weight makes a few very long outputs cost what they take (beam 32 to 4,096 positions:
        157 s on one thread with the demo model, where 256 positions took 1.5 s)."""
        width = 1 if self.options.sample else self.options.beam
        longest = self.longest_output or math.inf
        span = ATTENTION_SPAN * self.config.d_model
        total = 0.0
        for sentence in ids:
            length = min(max_output_length(len(sentence) - 1, self.options.max_len_a,
                                           self.options.max_len_b), longest)
            total += width * (length + length * (length + 1) / (2 * span))
        return math.ceil(total)

    def search(self, ids: list[list[int]], constraint=None,
               line_numbers: list[int] | None = None, cancelled=None,
               controls: list[Controls] | None = None) -> list[list[Hypothesis]]:
        """Hypotheses of each sentence `ids`; sampling draws a sentence's random numbers from
        the seed and its `line_numbers` entry (default: its place in `ids`). `cancelled()`, if
        given, names the sentences (places in `ids`) whose search is called off: asked before
        each step, each named one leaves the batch then (`search.beam_search`), its hypotheses
        meaningless. With a shortlist, the batch writes only its candidates and the pieces of
        its `controls` (prefixes, phrases)."""
        src = pad_sequences(ids, self.config.pad_id).to(self.device)
        options = self.options
        output_ids = None
        if self.controls.shortlist is not None:
            keep = {self.config.eos_id, self.config.unk_id}
            for line in controls or ():
                keep.update(line.prefix, *line.phrases)
            output_ids = self.controls.shortlist.ids_for(src, keep)
            self.stats.shortlist_batches += 1
            self.stats.shortlist_pieces += len(output_ids)
        with batch_must_fit(f"search batches of {options.batch_tokens} source tokens × beam",
                            f"lower --batch-tokens ({options.batch_tokens})"):
            if options.sample:
                limits = output_limits(src, self.config.pad_id, options.max_len_a,
                                       options.max_len_b, self.longest_output)
                uniforms = sentence_uniforms(options.seed,
                                             line_numbers or list(range(len(ids))),
                                             int(limits.max()))
                return sample(self.stepped, src, uniforms, options.temperature, options.topk,
                              options.topp, options.max_len_a, options.max_len_b,
                              longest=self.longest_output, cancelled=cancelled,
                              constraint=constraint, output_ids=output_ids)
            return beam_search(self.stepped, src, beam=options.beam, alpha=options.alpha,
                               max_len_a=options.max_len_a, max_len_b=options.max_len_b,
                               nbest=options.nbest, longest=self.longest_output,
                               constraint=constraint, stop=options.stop, cancelled=cancelled,
                               output_ids=output_ids)

    def translate_window(self, lines: list[str], first_line: int, unit: str = "line",
                         controls: list[Controls] | None = None) -> list[list[Hypothesis]]:
        """Hypotheses for every line, in input order; an empty line gets [EMPTY_LINE]. Line i
        is number first_line + i (warnings name it, sampling draws from it) of its `unit`.
        `controls[i]`: what line i's outputs start with and hold (`controls.Controls`; None:
        nothing), to which the translator's glossary adds its terms found in the line and its
        bans apply to every line."""
        results: list[list[Hypothesis] | None] = [None] * len(lines)
        todo = [i for i, line in enumerate(lines) if line.strip()]
        for i in set(range(len(lines))) - set(todo):
            results[i] = [EMPTY_LINE]
        if todo:
            ids = self.encode([lines[i] for i in todo], first_line, unit=unit)
            lengths = [len(sequence) for sequence in ids]
            batches = balanced_batches(lengths, self.options.source_budget,
                                       self.options.workers)
            line_controls = [self.controls_of(lines[i], controls[i] if controls else NONE)
                             for i in todo]
            # A stream at beam search only: greedy's rows are whole sentences, hundreds in
            # flight, and the stream's per-sentence bookkeeping then costs more than batches
            # do (measured: benchmarks/README.md, stage B and iteration-level batching).
            # A prefix flies too (a model's target-language token is one); phrases to hold
            # need the constrained search.
            if self.options.beam > 1 and not self.constraint_for and \
                    not any(line.phrases for line in line_controls) and stream_supported(self):
                with batch_must_fit(f"search batches of {self.options.batch_tokens} source "
                                    "tokens × beam",
                                    f"lower --batch-tokens ({self.options.batch_tokens})"):
                    found = self.without_start(self.stream_search(
                        ids, [line.prefix for line in line_controls]))
                for index, hypotheses in enumerate(found):
                    results[todo[index]] = hypotheses
                return results

            def search_batch(batch: list[int]) -> list[list[Hypothesis]]:
                numbers = [first_line + todo[i] for i in batch]
                if self.constraint_for:
                    return self.search([ids[i] for i in batch],
                                       self.constraint_for([lines[todo[i]] for i in batch]),
                                       numbers)
                return self.search_controlled([ids[i] for i in batch],
                                              [line_controls[i] for i in batch], numbers)

            parallel = self.options.workers > 1 and len(batches) > 1
            found = (self._workers().map if parallel else map)(search_batch, batches)
            for batch, hypotheses_of_batch in zip(batches, found):
                for index, hypotheses in zip(batch, hypotheses_of_batch):
                    results[todo[index]] = hypotheses
                    if line_controls[index].phrases and \
                            hypotheses[0].log_prob < -UNMET_PENALTY / 2:
                        self.warn(f"decode: {unit} {first_line + todo[index]}: its output "
                                  f"could not hold every constraint within its length limit")
        return results

    def stream_search(self, ids: list[list[int]],
                      prefixes: list[tuple[int, ...]] | None = None) -> list[list[Hypothesis]]:
        """`search` of the sentences `ids` (their outputs starting with `prefixes`, forced as
        `search_controlled` forces them) with iteration-level batching (`stream.Stream`):
        each worker flies a stream, longest sentences first, as many in flight as the source
        budget holds (their tokens summed: a stream pads nothing) and its share of the lines
        allows (a few lines split over the workers, not all in the first); as sentences leave, the
        next ones join, encoded together once a third of the budget is free, so that every
        step runs a full stream, not a batch's thinning tail. What a sentence finds is what
        `search` finds for it."""
        waiting = deque(sorted(range(len(ids)), key=lambda index: -len(ids[index])))
        budget = self.options.source_budget
        workers = min(self.options.workers, len(ids))
        share = math.ceil(len(ids) / workers)
        lock = threading.Lock()

        def fly(_) -> dict[int, list[Hypothesis]]:
            stream, found, held = Stream(self), {}, {}
            while True:
                with lock:
                    room, joining = budget - sum(held.values()), []
                    if room >= budget // 3 or not held:
                        while waiting and len(held) + len(joining) < share and \
                                (len(ids[waiting[0]]) <= room or not held and not joining):
                            index = waiting.popleft()
                            joining.append(index)
                            room -= len(ids[index])
                if joining:
                    stream.add(joining, [ids[index] for index in joining],
                               [prefixes[index] for index in joining] if prefixes else None)
                    held.update((index, len(ids[index])) for index in joining)
                if not held:
                    return found
                for index, hypotheses in stream.step():
                    found[index] = hypotheses
                    del held[index]

        parts = self._workers().map(fly, range(workers)) if workers > 1 else [fly(0)]
        found = {index: hypotheses for part in parts for index, hypotheses in part.items()}
        return [found[index] for index in range(len(ids))]

    def search_controlled(self, ids: list[list[int]], controls: list[Controls],
                          line_numbers: list[int] | None = None,
                          cancelled=None) -> list[list[Hypothesis]]:
        """`search` of sentences each with its controls (`controls.Controls`; the translator's
        bans on all). With `constraint_search` "misses" (the default), the sentences with
        phrases to hold are first searched without them (their prefixes and the bans kept), and
        only those whose best output misses a phrase are searched again with them: a phrase
        the model writes anyway changes nothing, and dynamic beam allocation, which deals a
        beam's slots over hypotheses by the phrases they have met, spends them where needed.
        "all": every one searched with its phrases."""
        eos, bans = self.config.eos_id, self.controls.bans
        words = self.word_pieces() if any(line.phrases for line in controls) else None
        if words is None or self.options.constraint_search == "all":
            return self.without_start(self.search(ids, search_constraint(controls, bans, eos,
                                                                         words),
                                                  line_numbers, cancelled, controls=controls))
        found = self.search(ids, search_constraint(free_controls(controls), bans, eos),
                            line_numbers, cancelled, controls=controls)
        misses = [place for place, (line, hypotheses) in enumerate(zip(controls, found))
                  if line.phrases and not holds_phrases(hypotheses[0].tokens, line, words)]
        if misses:
            numbers = line_numbers or list(range(len(ids)))

            def cancelled_misses():
                named = set(cancelled())
                return [place for place, miss in enumerate(misses) if miss in named]
            again = self.search([ids[place] for place in misses],
                                search_constraint([controls[place] for place in misses],
                                                  bans, eos, words),
                                [numbers[place] for place in misses],
                                cancelled_misses if cancelled else None,
                                controls=[controls[place] for place in misses])
            for place, hypotheses in zip(misses, again):
                found[place] = hypotheses
        return self.without_start(found)

    def word_pieces(self) -> WordPieces:
        """The target vocabulary's `lexical.WordPieces`, made once."""
        if self._word_pieces is None:
            vocab, config = self.tgt_vocab, self.config
            specials = {config.pad_id, config.unk_id, config.bos_id, config.eos_id}
            self._word_pieces = WordPieces.of([vocab.piece(i) for i in range(len(vocab))],
                                              specials)
        return self._word_pieces

    def controls_of(self, line: str, controls: Controls) -> Controls:
        """A line's controls and the glossary's terms found in it, its output starting with the
        options' `target_start` (forced as a prefix is, taken off by `search_controlled`)."""
        if self.options.target_start:
            controls = Controls(self.options.target_start + controls.prefix, controls.phrases)
        if self.controls.glossary is None:
            return controls
        return controls.with_phrases(self.controls.glossary.phrases(line))

    def without_start(self, found: list[list[Hypothesis]]) -> list[list[Hypothesis]]:
        """The hypotheses with the options' `target_start` taken off their tokens, and any
        other language token or special piece they hold (a model whose languages are tokens
        may write one), as `transformers` decodes with skip_special_tokens."""
        starts = len(self.options.target_start)
        if not starts:
            return found
        if self._special_outputs is None:
            from ..tags import forced_language_codes

            pieces = self.tgt_vocab.pieces or ()
            self._special_outputs = frozenset(
                forced_language_codes(self.tgt_vocab, self.metadata["lang_codes"]).values()) | {
                index for index, piece in enumerate(pieces) if piece in ("<s>", "<mask>")}
        special = self._special_outputs
        return [[dataclasses.replace(h, tokens=[token for token in h.tokens[starts:]
                                                if token not in special])
                 for h in hypotheses] for hypotheses in found]

    def translate(self, lines: list[str]) -> list[str]:
        """The best translation of each line, in order (an empty line for an empty line); with
        nbest K, K `index<TAB>score<TAB>text` lines per line, as `attn decode` prints them."""
        results = self.translate_window(list(lines), 1)
        return [text for index, hypotheses in enumerate(results)
                for text in self.format(index, hypotheses)]

    def translate_paragraphs(self, texts: list[str], lang: str | None = None) -> list[str]:
        """The best translation of each text, cut into sentences by the rules of `lang` (an ISO
        639 code, else ValueError; None: English's) and put back together: the sentences of all
        the texts are searched in the same batches, each text's translations joined with its
        own spaces and line breaks (`sentences.split_texts`). One string per text, in order; a
        text of whitespace alone comes back as it is. Sampling numbers the sentences from 1, in
        order. `attn decode --split-sentences` does this window by window."""
        split = split_texts(texts, lang)
        results = self.translate_window(split.sentences, 1, unit="sentence")
        return split.join(self.detokenize([hypotheses[0] for hypotheses in results]))

    def detokenize(self, hypotheses: list[Hypothesis]) -> list[str]:
        vocab = self.tgt_vocab
        if self.options.raw:
            return [" ".join(vocab.piece(t) for t in h.tokens)
                    for h in hypotheses]
        return vocab.decode([h.tokens for h in hypotheses])

    def outputs(self, hypotheses: list[Hypothesis]) -> list[tuple[Hypothesis, str]]:
        """A line's outputs, each hypothesis with its text: the best, or with nbest K always K,
        those the search did not find empty with score -inf (`attn decode --nbest K` prints K
        lines per line, and `attn serve` answers K texts)."""
        found = list(zip(hypotheses, self.detokenize(hypotheses)))
        return found + [(NOT_FOUND, "")] * (self.options.nbest - len(found))

    def format(self, index: int, hypotheses: list[Hypothesis]) -> Iterable[str]:
        outputs = self.outputs(hypotheses)
        if self.options.nbest == 1:
            return [outputs[0][1]]
        return [f"{index}\t{h.score:.4f}\t{text}" for h, text in outputs]

    def align(self, lines: list[str], outputs: list[list[int]], layer: int | None = None,
              heads: list[int] | None = None) -> list[list[tuple[int, int]]]:
        """Word alignments of each line with its output `outputs[i]` (a hypothesis's tokens):
        (source word, output word) pairs over whitespace words, read off the cross-attention
        of one teacher-forced pass (`alignment.py`; `layer` and `heads` by default the model's
        own, `alignment.chosen_heads`). An ensemble's first model aligns."""
        model = self.model.models[0] if isinstance(self.model, Ensemble) else self.model
        return align_lines(model, self.src_vocab, self.tgt_vocab, lines, outputs,
                           self.max_source, layer, heads, self.options.source_tags,
                           self.options.target_start)

    def translate_aligned(self, lines: list[str]) -> tuple[list[str], list[list[tuple[int, int]]]]:
        """The best translation of each line (detokenized: `--raw` does not apply) and its
        word alignment (`align`): what `markup.translate_html` asks of a translator."""
        best = [hypotheses[0] for hypotheses in self.translate_window(list(lines), 1)]
        outputs = [hypothesis.tokens for hypothesis in best]
        return self.tgt_vocab.decode(outputs), self.align(list(lines), outputs)

    def alignment_columns(self, lines: list[str], results: list[list[Hypothesis]],
                          layer: int | None = None) -> list[list[str]]:
        """`attn decode --alignment`: for each line, the Pharaoh pairs (`alignment.pharaoh`) of
        each output it prints (the best; with nbest K its K, those not found aligning nothing),
        all of the window's aligned in one `align` call: in batches, not line by line."""
        nbest = self.options.nbest
        printed = [hypotheses[:1] if nbest == 1
                   else hypotheses + [NOT_FOUND] * (nbest - len(hypotheses))
                   for hypotheses in results]
        aligned = iter(self.align([line for line, outputs in zip(lines, printed)
                                   for _ in outputs],
                                  [hypothesis.tokens for outputs in printed
                                   for hypothesis in outputs], layer))
        return [[pharaoh(next(aligned)) for _ in outputs] for outputs in printed]


def model_langs(metadata: dict[str, str]) -> tuple[str, str] | None:
    """The model file's (source, target) language codes (its metadata's `langs`, "en-de"), or
    None where it names none, or not as SOURCE-TARGET."""
    try:
        return parse_langs(metadata.get("langs"))
    except AttnError:  # written by hand or by another tool: no language rather than no decode
        return None


def language_options(metadata: dict[str, str], vocabulary, source: str | None, target: str,
                     where: str, option: str = "--target-lang") -> dict:
    """`DecodeOptions`' `source_tags` and `target_start` for a model whose languages are tokens
    (NLLB-200, M2M-100: metadata `lang_codes`, interop/m2m.py): the source's code first in
    every source (None: the model's own source language, else English, as their tokenizers
    default), and the target's forced as every output's first token."""
    from ..tags import forced_language_code, forced_language_codes

    style = metadata["lang_codes"]
    codes = forced_language_codes(vocabulary, style)
    if source is None:
        source = (model_langs(metadata) or ("en",))[0]
    source_option = "--source-lang" if option == "--target-lang" else option
    return {"source_tags": (forced_language_code(source, codes, style, source_option, where),),
            "target_start": (forced_language_code(target, codes, style, option, where),)}


def search_workers(threads: int, workers: int, device: torch.device,
                   model_bytes: int = 0) -> tuple[int, int]:
    """(batches searched side by side, torch threads of each). 0 (auto): on a CPU one batch
    per thread with one torch thread each (measured fastest: benchmarks/), but one batch of
    every thread for a model of over `devices.LARGE_MODEL_BYTES` (`model_bytes`: the weights
    of the models searched together); on a GPU one batch at a time."""
    if workers == 0:
        one = device.type != "cpu" or model_bytes > LARGE_MODEL_BYTES
        workers = 1 if one else threads
    return workers, max(1, threads // workers)


def load_translator(model_path, beam: int = TRANSLATION.beam, *, device: str = "auto",
                    dtype: str = "auto", threads: int = 0, workers: int = 0, warn=None,
                    constraint_for=None, int8: bool = False, target_lang: str | None = None,
                    source_lang: str | None = None,
                    compile: str = "off", glossary=None, bans=None, shortlist=None,
                    step: str = "auto", **options) -> Translator:
    """A model file (a list of them: an ensemble) made ready to decode: the device (auto: a GPU
    when torch sees one), the precision (auto: bf16 on CUDA, fp32 on a CPU), the CPU threads (0:
    every core), how many batches are searched side by side (0: auto) and, with `int8`, the
    linear layers as int8 ones (a CPU only: `devices.int8_linears`), with the
    search settings of `DecodeOptions` (beam, alpha, max_len_a, max_len_b, nbest, batch_tokens,
    ...).
    `constraint_for(loaded model)`, if given, makes the search constraint's factory for that
    model (`tree_search.tree_constraints`: parsing). `target_lang`: translate into that
    language, every source starting with its tag (`Translator.with_target`); a model whose
    languages are tokens (NLLB-200, M2M-100) also reads `source_lang`. What every line
    is held to (`controls.DecodeControls`, `controls.read_controls`): `glossary`, a TSV's path,
    a `glossary.Glossary` or source-to-target pairs, whose terms found in a line become phrases
    its outputs must hold; `bans`, a file's path or a list of phrases no output may hold;
    `shortlist`, a path or a `shortlist.Shortlist`: each batch's output projection over its
    candidates. `step`: what runs a decoder step (`formats.STEP_MODES`; auto: the C++ step,
    `native.NativeDecoder`, where it covers the model). This is what `attn decode`, `attn
    parse` and `attn serve` run; from Python:

        translator = load_translator("model.st")
        translator.translate(["A man is riding a bike."])  # ["Ein Mann fährt Fahrrad."]
        load_translator("model.st", glossary={"man": "Herr"}, bans=["Mann"])
    """
    settings = DecodeOptions(beam=beam, **options)  # checked before the models load
    paths = list(model_path) if isinstance(model_path, (list, tuple)) else [model_path]
    int8_refused = AttnError("--int8 is torch's dynamic int8 quantization of the linear "
                             "layers, for float32 on a CPU (--device cpu, --dtype auto or "
                             "fp32); on a GPU use --dtype bf16")
    # Refused before anything loads (a GPU's `--device auto` would load every model first).
    if int8 and (dtype not in ("auto", "fp32") or pick_device(device).type != "cpu"):
        raise int8_refused
    read = read_controls(glossary, bans, shortlist)  # a bad file: an error before any load
    (loaded, *ensemble), chosen, threads = load_models(paths, device, threads)
    workers, worker_threads = search_workers(
        threads, workers, chosen, sum(weight_bytes(each.model) for each in [loaded, *ensemble]))
    where = f"model file {paths[0]}"
    if not loaded.metadata.get("lang_codes"):
        languages = {"source_tags": target_tags(loaded.src_vocab, target_lang, where)}
    else:  # without a target: a server's, which picks each pair's (`Translator.with_target`)
        languages = {} if target_lang is None else \
            language_options(loaded.metadata, loaded.src_vocab, source_lang, target_lang, where)
    settings = dataclasses.replace(settings, workers=workers, worker_threads=worker_threads,
                                   batch_tokens=settings.batch_tokens or
                                   search_batch_tokens(chosen), **languages)
    return Translator(loaded, settings, chosen, inference_dtype(dtype, chosen), warn=warn,
                      constraint_for=constraint_for(loaded) if constraint_for else None,
                      ensemble=ensemble, int8=int8, compile=compile, step=step,
                      controls=DecodeControls.made_for(loaded, *read), release=True)
