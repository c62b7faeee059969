"""`attn decode`: text in, translations out, one line per line, in order, as soon as ready.

A reader thread pulls stdin lazily; the main loop takes whatever lines have arrived (at least
one, at most `buffer_size`), sorts them by length into token-budget batches, searches, and writes
the window's results in input order. A user typing sees each translation after pressing enter; a
file streams through in windows of `buffer_size` lines. With `--split-sentences` the window's lines
are cut into sentences first (sentences.py), and all of them are searched in the same batches.
"""

from __future__ import annotations

import bisect
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence

from ..alignment import pharaoh, word_spans
from ..errors import AttnError
from ..files import STRICT, Utf8Policy
from .controls import Controls, encode_checked, split_fields
from .options import DecodeStats
from .sentences import Paragraph, SplitTexts, segmenter_language, split_texts
from .translator import Translator

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


def check_split_sentences(split_sentences: bool, source_lang: str | None, nbest: int,
                          attention: bool, language_tokens: bool = False) -> None:
    """`attn decode --split-sentences` with the options it goes with, refused before a model
    loads. A line becomes several searches: one line of output joins their best translations,
    so there is no line's n-best list to print, nor one line's attention map to save.
    `language_tokens`: the model's languages are tokens (NLLB-200, M2M-100), which
    --source-lang also picks."""
    if not split_sentences:
        if source_lang is not None and not language_tokens:
            raise AttnError("--source-lang is the language --split-sentences cuts sentences "
                            "by: add --split-sentences")
        return
    one_per_line = "put one sentence per line and decode without --split-sentences"
    if nbest > 1:
        raise AttnError(f"--split-sentences prints one translation per line, not --nbest "
                        f"{nbest} lists (a line is several searches): {one_per_line}")
    if attention:
        raise AttnError(f"--attention saves one map per line, and --split-sentences searches "
                        f"a line as several sentences: {one_per_line}")
    sentence_language(source_lang, None)  # what is not a language code: refused now


def check_alignment(alignment: bool, layer: int | None, raw: bool) -> None:
    """`attn decode --alignment` and `--alignment-layer`, refused before a model loads where
    they do not go together."""
    if not alignment:
        if layer is not None:
            raise AttnError("--alignment-layer is the layer --alignment reads: add --alignment")
        return
    if raw:
        # the alignment numbers the words of the detokenized output, which --raw does not print
        raise AttnError("--alignment numbers the words of the detokenized output: drop --raw")


def sentence_language(source_lang: str | None, langs: tuple[str, str] | None
                      ) -> tuple[str, str]:
    """The language whose rules `--split-sentences` cuts by, and where it came from: the code
    the user gave (`--source-lang`), else the model's source language (`langs`, from its file:
    `Translator.langs`), else English."""
    if source_lang is not None:
        try:
            return segmenter_language(source_lang), "--source-lang"
        except ValueError:
            raise AttnError(f"--source-lang takes a language code such as en, de or pt-BR, "
                            f"not {source_lang!r}") from None
    try:
        if langs is not None:
            return segmenter_language(langs[0]), "the model's source language"
    except ValueError:  # a model file's odd code costs the language's rules, not the decode
        pass
    return "en", "no source language known from the model"


def check_controls(prefix: bool, constraints: bool, split_sentences: bool, attention: bool,
                   sample: bool, glossary: bool = False) -> None:
    """`attn decode --prefix`, `--constraints` and `--glossary` with the options they go with,
    refused before a model loads."""
    given = [name for name, on in (("--prefix", prefix), ("--constraints", constraints),
                                   ("--glossary", glossary)) if on]
    if not given:
        return
    refused = [(split_sentences and (prefix or constraints), "--split-sentences",
                "a line is several searches, and its prefix or phrases are the line's"),
               (attention, "--attention", "its maps are of unforced outputs"),
               (sample and (constraints or glossary), "--sample",
                "phrases to hold need beam search: --beam 1 for greedy")]
    for refuse, option, why in refused:
        if refuse:
            raise AttnError(f"{' and '.join(given)} does not go with {option} ({why}): decode "
                            f"without one of them")


def split_controls(translator: Translator, window: list[str], name: str, first_line: int,
                   prefix: bool, constraints: bool
                   ) -> tuple[list[str], list[Controls], AttnError | None]:
    """A window of lines laid out as `--prefix` and `--constraints` say (`controls.split_fields`)
    → (the sources, each line's controls as SentencePiece cuts their texts, the error of the
    first bad line or None): the lines before a bad one come back to be translated and written
    before the error is raised, as bad UTF-8's do. A prefix ending mid-word is forced as those
    pieces exactly: the output may go on with the word or start another."""
    sources, controls, error = [], [], None
    vocab, unk = translator.tgt_vocab, translator.config.unk_id
    for offset, line in enumerate(window):
        where = f"{name}:{first_line + offset}"
        try:
            source, prefix_text, phrases = split_fields(line, prefix, constraints, name,
                                                        first_line + offset)
            ids = encode_checked(vocab, unk, [prefix_text] if prefix_text else [], "prefix",
                                 [where])
            phrase_ids = encode_checked(vocab, unk, phrases, "constraint",
                                        [where] * len(phrases))
        except AttnError as bad:
            error = bad
            break
        sources.append(source)
        controls.append(Controls(tuple(ids[0]) if ids else (),
                                 tuple(dict.fromkeys(map(tuple, phrase_ids)))))
    return sources, controls, error


def run(translator: Translator, stream, out, name: str = "<stdin>", render=None,
        policy: Utf8Policy = STRICT, split_sentences: bool = False,
        lang: str | None = None, alignment: bool = False, alignment_layer: int | None = None,
        prefix: bool = False, constraints: bool = False) -> DecodeStats:
    """The pipe: windows of lines in, one line (or nbest lines) out per line in, in order.
    `render(index, line, hypotheses)` makes the output lines (default: translations); `policy`
    says what invalid UTF-8 does. `split_sentences`: each line cut into sentences by the rules
    of `lang` and translated as `Translator.translate_paragraphs` does (the best translation
    only: no render, nbest 1). `alignment`: each output line followed by a TAB and its word
    alignment read off decoder layer `alignment_layer` (None: the model's default,
    `alignment.chosen_heads`; `Translator.alignment_columns`); without it no work is spent
    on them. `prefix`, `constraints`: each line is `source<TAB>prefix`,
    `source<TAB>c1<TAB>c2…` or both (`split_controls`), and its outputs start with the prefix
    and hold each phrase."""
    if split_sentences and (render is not None or translator.options.nbest > 1):
        raise ValueError("split sentences are written as one line per line: no render, no nbest")
    render = render or (lambda index, line, hypotheses: translator.format(index, hypotheses))
    started = time.perf_counter()
    stats = translator.stats
    if split_sentences:
        stats.split_lines = 0
    line_number = 0
    try:
        for window in read_windows(stream, translator.options.buffer_size, name, policy):
            if split_sentences:
                _write_split(translator, window, lang, out, alignment, alignment_layer)
            else:
                controls = bad_line = None
                if prefix or constraints:
                    window, controls, bad_line = split_controls(translator, window, name,
                                                                line_number + 1, prefix,
                                                                constraints)
                results = translator.translate_window(window, line_number + 1, "line",
                                                      controls=controls)
                columns = None if not alignment else \
                    translator.alignment_columns(window, results, alignment_layer)
                for offset, hypotheses in enumerate(results):
                    texts = render(line_number + offset, window[offset], hypotheses)
                    if columns is not None:
                        texts = [f"{text}\t{column}"
                                 for text, column in zip(texts, columns[offset], strict=True)]
                    for text in texts:
                        out.write(text + "\n")
                    if window[offset].strip():
                        stats.sentences += 1
                        stats.output_tokens += len(hypotheses[0].tokens) + 1
            out.flush()
            if not split_sentences and bad_line is not None:
                raise bad_line
            line_number += len(window)
    finally:
        translator.close()
        policy.finish()
    stats.seconds = time.perf_counter() - started
    stats.replaced = policy.count
    return stats


def _write_split(translator: Translator, lines: list[str], lang: str | None, out,
                 alignment: bool = False, alignment_layer: int | None = None) -> None:
    """One window of `run(split_sentences=True)`: the lines' sentences searched together, each
    line's translations joined with its spacing, one line out per line in (with `alignment`, a
    TAB and the line's alignment after it, of `alignment_layer`: `split_alignments`)."""
    stats = translator.stats
    split = split_texts(lines, lang)
    # Sentences are numbered on from those of the windows before: sampling then draws for a
    # sentence what it draws for the same sentence on a line of its own (line k of a file of one
    # sentence per line), however the lines fall into windows.
    results = translator.translate_window(split.sentences, stats.sentences + 1, unit="sentence")
    best = [hypotheses[0] for hypotheses in results]
    outputs = translator.detokenize(best)
    texts = split.join(outputs)
    if alignment:
        aligned = translator.align(split.sentences, [hypothesis.tokens for hypothesis in best],
                                   alignment_layer)
        texts = [f"{text}\t{column}"
                 for text, column in zip(texts, split_alignments(split, outputs, aligned))]
    for text in texts:
        out.write(text + "\n")
    stats.sentences += len(best)
    stats.output_tokens += sum(len(hypothesis.tokens) + 1 for hypothesis in best)
    stats.split_lines += sum(1 for paragraph in split.paragraphs if paragraph.sentences)


def split_alignments(split: SplitTexts, outputs: list[str],
                     aligned: list[list[tuple[int, int]]]) -> list[str]:
    """Each line's Pharaoh pairs (`--split-sentences --alignment`) from its sentences' own
    (`aligned[k]`, sentence k's words with those of its translation `outputs[k]`): each word of
    a sentence renumbered as the word of the line holding it, and likewise on the output side,
    by where the word lies in the joined text. Exact even where joining merges two words
    (spacing ""), which then share a number."""
    columns, first = [], 0
    for paragraph in split.paragraphs:
        count = len(paragraph.sentences)
        sources = _line_words(paragraph, paragraph.sentences)
        targets = _line_words(paragraph, outputs[first:first + count])
        columns.append(pharaoh(sorted({(sources[k][i], targets[k][j]) for k in range(count)
                                       for i, j in aligned[first + k]})))
        first += count
    return columns


def _line_words(paragraph: Paragraph, parts: Sequence[str]) -> list[list[int]]:
    """For each of `parts` (a paragraph's sentences or their translations), the word of
    `paragraph.join(parts)` each of its whitespace words lies in."""
    starts = [start for start, _ in word_spans(paragraph.join(parts))]
    places, offset = [], len(paragraph.spacing[0])
    for part, after in zip(parts, paragraph.spacing[1:]):
        places.append([bisect.bisect_right(starts, offset + start) - 1
                       for start, _ in word_spans(part)])
        offset += len(part) + len(after)
    return places
