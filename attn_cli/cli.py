"""The `attn` command line: thin commands that parse options, call one library function, and move
bytes. Command and option names are a contract with users' scripts and Makefiles: add, never
rename. Heavy modules (torch, sentencepiece) are imported inside the commands so that `attn
--help` and shell completion stay instant.

Conventions for every command: data on stdout only; logs, progress and summaries on stderr; bad
input is one `error: ...` line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import gc
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from . import __version__
from .config import (
    ALPHA_HIGHEST,
    ARCHITECTURE_CHOICES,
    MAX_LEN_A_HIGHEST,
    PRESETS,
    SERVE_DEFAULTS,
    TRAIN_DEFAULTS,
)
from .errors import AttnError, is_out_of_memory, out_of_memory_line, say
from .formats import (
    BATCH_TOKENS,
    BUFFER_SIZE,
    COMPILE_MODES,
    COMPOUND_SPLIT,
    CUDNN_ATTENTION,
    GPU_BATCH_TOKENS,
    GRAD_SYNC,
    PARSING,
    STEP_MODES,
    TERMINALS,
    TOKENIZERS,
    TRAIN_COMPILE,
    TRANSLATION,
    VALID_METRICS,
    WORD_SCORES,
    Stop,
)

app = typer.Typer(
    name="attn",
    help="The Transformer of 'Attention Is All You Need' (Vaswani et al., 2017), end to end: "
         "vocab → binarize → train → average → decode → score, and parse.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def log(message: str) -> None:
    """A line for the user, on stderr (stdout carries data only)."""
    say(message)


def _version(value: bool) -> None:
    if value:
        print(f"attn {__version__}")
        raise typer.Exit()


# The garbage collector, the whole policy. Python's full collections walk every live object,
# and importing torch and loading a model make only objects that live on: so `main` starts
# every command with the collector off, and the command turns it on (`_collector_on`) once it
# holds what it keeps. Most do at once; the commands that load a model and then decode with it
# until the process ends do once the model is loaded, freezing it out of later full collections
# (which would otherwise walk all of torch's and the model's objects again and again).
_LOAD_THEN_DECODE = ("decode", "parse", "serve")  # `parse linearize` loads no model


def _collector_on(loaded: bool = False) -> None:
    """The collector on; with `loaded`, what is alive now is frozen out of full collections."""
    if loaded:
        gc.freeze()
    gc.enable()


@app.callback()
def _root(context: typer.Context,
          version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """The Transformer, end to end."""
    if context.invoked_subcommand not in _LOAD_THEN_DECODE:
        _collector_on()


def _preset_names(incomplete: str = "") -> list[str]:
    return [name for name in PRESETS if name.startswith(incomplete)]


STRICT_HELP = ("Invalid UTF-8 in an input line is an error (the lines before it are still "
               "written). Default: its bytes become U+FFFD, the line is processed, and stderr "
               "names it.")
REPLACE_INVALID_HELP = ("Replace invalid UTF-8 bytes by U+FFFD (stderr names the lines) "
                        "instead of stopping with an error: training data should be clean.")


def _choices(name: str, values) -> type[Enum]:
    """A str Enum whose members are `values`: choices that click checks and `--help` lists."""
    return Enum(name, [(value, value) for value in values], type=str)


Device = _choices("Device", ("auto", "cpu", "cuda"))
Precision = _choices("Precision", ("auto", "fp32", "bf16", "fp16"))
VocabType = _choices("VocabType", ("bpe", "unigram"))
TreeTerminals = _choices("TreeTerminals", TERMINALS)
ModelTerminals = _choices("ModelTerminals", ("auto", *TERMINALS))
WordScores = _choices("WordScores", WORD_SCORES)
OutputFormat = _choices("OutputFormat", ("text", "json"))
Tokenizer = _choices("Tokenizer", (*TOKENIZERS, COMPOUND_SPLIT))
ValidMetric = _choices("ValidMetric", VALID_METRICS)
GradSync = _choices("GradSync", GRAD_SYNC)
CudnnAttention = _choices("CudnnAttention", CUDNN_ATTENTION)
TrainCompile = _choices("TrainCompile", TRAIN_COMPILE)
NormPlace = _choices("NormPlace", ARCHITECTURE_CHOICES["norm"])
PositionKind = _choices("PositionKind", ARCHITECTURE_CHOICES["positions"])
WandbMode = _choices("WandbMode", ("offline", "online"))  # train --wandb-mode


# Options that decode, parse and score share, declared once.
DeviceOption = Annotated[Device, typer.Option(
    "--device", help="auto (a GPU when torch sees one), cpu or cuda.")]
PrecisionOption = Annotated[Precision, typer.Option(
    "--dtype", help="auto (bf16 on CUDA, fp32 on a CPU, where the output then does not depend "
    "on the batching), fp32, bf16 (faster on CPUs with native bf16) or fp16 (CUDA).")]
Int8Option = Annotated[bool, typer.Option(
    "--int8", help="int8 linear layers (torch's dynamic quantization, CPU only): faster "
    "(benchmarks/README.md has the figures); outputs then depend on the batching, and BLEU "
    "moves a little. Never the default.")]
CompileMode = _choices("CompileMode", COMPILE_MODES)
CompileOption = Annotated[CompileMode, typer.Option(
    "--compile", help="on: every decoder step through a preallocated cache, compiled by torch's "
    "compiler (a CPU, one float model; else one line and the eager step): the same outputs, "
    "but on the CPUs measured no faster once compiled and 6-30 s to compile in every run "
    "(benchmarks/README.md), so off, and auto, decode with the eager step.")]
StepMode = _choices("StepMode", STEP_MODES)
StepOption = Annotated[StepMode, typer.Option(
    "--step", help="What runs each decoder step on a CPU. auto: attn's C++ step (one call a "
    "step; built once per torch version and CPU at first use, ~1 minute) where it covers the "
    "model (one model on a CPU, --int8 too; not an ensemble yet), else the eager one; in "
    "float32 with fused kernels, equal to the eager step to float rounding (a line may differ "
    "where two hypotheses tie). native: the same, with one line where it cannot. aten: the C++ "
    "step calling torch's own ops, the eager step's outputs bit for bit. eager: torch's ops "
    "from Python.")]
ThreadsOption = Annotated[int, typer.Option("--threads", min=0,
                                            help="CPU threads (0: all cores).")]
WorkersOption = Annotated[int, typer.Option(
    "--workers", min=0, help="Batches searched side by side, sharing the threads (0: one per "
    "thread on a CPU, 1 for a model over 1 GiB or on a GPU).")]
BatchTokensOption = Annotated[Optional[int], typer.Option(
    "--batch-tokens", min=1, show_default=False, help="Source tokens × beam per search batch "
    f"[default: {BATCH_TOKENS} on a CPU, {GPU_BATCH_TOKENS} on a GPU].")]
ScoreBatchTokensOption = Annotated[int, typer.Option(
    "--batch-tokens", min=1, help="Tokens per batch of -m's scoring.")]
BufferSizeOption = Annotated[int, typer.Option(
    "--buffer-size", min=1, help="Lines read ahead and sorted by length (1: interactive, line "
    "by line).")]
MaxLenAOption = Annotated[float, typer.Option(
    "--max-len-a", min=0.0, max=MAX_LEN_A_HIGHEST,
    help="Output length limit a·|x| + b: a (paper: 1).")]
# The search settings `decode` uses and `serve` takes as its requests' defaults.
BeamOption = Annotated[int, typer.Option(
    "--beam", min=1, help=f"Beam size (paper: {TRANSLATION.beam}); 1 is greedy.")]
AlphaOption = Annotated[float, typer.Option(
    "--alpha", min=0.0, max=ALPHA_HIGHEST, help=f"Length penalty α (paper: "
    f"{TRANSLATION.alpha}).")]
MaxLenBOption = Annotated[int, typer.Option(
    "--max-len-b", min=0, help=f"... and b (paper: {TRANSLATION.max_len_b}).")]
StopOption = Annotated[Stop, typer.Option(
    "--stop", help="When a sentence's search ends. bound (the paper's tensor2tensor; default): "
    "once no live hypothesis can beat the best finished, exactly the result of a search to the "
    "length limit. patience (fairseq; CTranslate2 at --alpha above 0): once beam-many "
    "hypotheses have ended; fewer steps, inexact. best-ends (OpenNMT-py; CTranslate2 at --alpha "
    "0): once the step's best candidate ends; fewer still, inexact. limit: every sentence to "
    "its length limit.")]
InputOption = Annotated[str, typer.Option("-i", "--input", help="Read this file, not stdin.")]
StatsJsonOption = Annotated[Optional[Path], typer.Option(
    "--stats-json", help="Also write the summary (sentences, output tokens, seconds, rates, the "
    "model's load time) to this file, as one JSON object: for scripts and benchmarks.")]
StrictOption = Annotated[bool, typer.Option("--strict", help=STRICT_HELP)]


def _utf8_policy(strict: bool):
    from .files import Utf8Policy

    return Utf8Policy(strict=strict, warn=log)


# ---------------------------------------------------------------------------------------- vocab


@app.command()
def vocab(
    files: List[str] = typer.Argument(..., metavar="FILE",
                                      help="Text files, one sentence per line ('-' is stdin)."),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the model "
                                "(a .vocab listing is written beside it)."),
    size: int = typer.Option(37000, "--size", min=8, help="Vocabulary size (paper: 37000 "
                             "shared BPE for en-de, 32000 for en-fr)."),
    model_type: VocabType = typer.Option(VocabType.bpe, "--type", help="The SentencePiece "
                                         "model: bpe (the paper's) or unigram."),
    coverage: float = typer.Option(1.0, "--coverage", min=0.9, max=1.0,
                                   help="Share of characters the vocabulary must cover."),
    sample: int = typer.Option(10_000_000, "--sample", min=1,
                               help="Learn from at most this many lines, a uniform sample."),
    seed: int = typer.Option(1, "--seed", help="Seed for the sample and the learner."),
    threads: int = typer.Option(0, "--threads", help="Worker threads (0: all cores)."),
    verbose: bool = typer.Option(False, "--verbose", help="Show SentencePiece's own log."),
    symbols_path: Optional[Path] = typer.Option(
        None, "--symbols", help="A file of tokens to keep whole, one per line (`attn parse "
        "linearize` writes PREFIX.symbols with the tree brackets)."),
    tags: Optional[str] = typer.Option(
        None, "--tags", metavar="fr,de,...,bt", help="Reserve a tag piece for each target "
        "language (<2fr>, Johnson et al. 2017) and, for bt, one for back-translated sources "
        "(<bt>, Caswell et al. 2019): one model, many target languages (`binarize "
        "--target-tag`, `decode --target-lang`)."),
    replace_invalid: bool = typer.Option(False, "--replace-invalid", help=REPLACE_INVALID_HELP),
) -> None:
    """Learn a shared subword vocabulary (SentencePiece) from text files."""
    from . import vocab as vocabulary_module

    if files.count("-") > 1:
        raise AttnError("stdin ('-') can be read only once")
    from .tags import symbols as tag_symbols

    tag_pieces = tag_symbols(tags) if tags is not None else []  # checked before reading
    started = time.perf_counter()
    policy = _utf8_policy(strict=not replace_invalid)
    lines, total = vocabulary_module.sample_lines(files, sample, seed, policy)
    policy.finish()
    note = f" (a sample of {len(lines)})" if total > len(lines) else ""
    log(f"vocab: learning a {size}-piece {model_type.value} vocabulary from {total} lines"
        f"{note}")
    symbols = None
    if symbols_path is not None:
        from .files import read_lines

        symbols = [line.strip() for line in read_lines(symbols_path) if line.strip()]
    if tag_pieces:
        symbols = [*(symbols or []), *tag_pieces]
    learned = vocabulary_module.learn(lines, size, model_type.value, coverage, seed, threads,
                                      verbose, symbols)
    listing = vocabulary_module.write(learned, output)
    log(f"vocab: wrote {output} and {listing} ({len(learned)} pieces, "
        f"sha256 {learned.checksum[:12]}) in {time.perf_counter() - started:.1f}s")


# ------------------------------------------------------------------------------------- binarize


@app.command()
def binarize(
    src: str = typer.Argument(..., help="Source-language text, one sentence per line."),
    tgt: str = typer.Argument(..., help="Target-language text, line N translating SRC's line N."),
    vocab_path: Path = typer.Option(..., "--vocab", help="SentencePiece model from `attn vocab`, "
                                    "or a model file (its vocabularies: to fine-tune it)."),
    output: Path = typer.Option(..., "-o", "--output", help="The data file to write (.st)."),
    tgt_vocab_path: Optional[Path] = typer.Option(None, "--tgt-vocab",
                                                  help="A separate target vocabulary."),
    max_len: int = typer.Option(1024, "--max-len", min=1,
                                help="Drop pairs with a side longer than this (subwords)."),
    threads: int = typer.Option(0, "--threads", help="Encoder threads (0: all cores)."),
    replace_invalid: bool = typer.Option(False, "--replace-invalid", help=REPLACE_INVALID_HELP),
    alignments: Optional[str] = typer.Option(
        None, "--alignments", metavar="FILE", help="Word alignments for `attn train "
        "--guided-alignment`: a line per pair of SRC and TGT, in Pharaoh format (0-0 1-2 2-1: "
        "source word - target word, whitespace words from 0; fast_align, eflomal), kept in "
        "the data file in subword pieces."),
    langs: Optional[str] = typer.Option(
        None, "--langs", metavar="SRC-TGT", help="The language pair (en-de), recorded in the "
        "data file (`attn train` refuses to mix pairs), and what --langid expects."),
    clean: bool = typer.Option(False, "--clean", help="All the cleaning filters below but "
                               "--langid, with --max-ratio 3 unless given."),
    max_ratio: Optional[float] = typer.Option(
        None, "--max-ratio", metavar="R", min=1.0, help="Drop pairs whose longer side has more "
        "than R times the subword pieces of the shorter (pieces, as --max-len counts)."),
    dedup: bool = typer.Option(False, "--dedup", help="Drop pairs seen before (the same "
                               "subwords on both sides: whitespace runs are one space)."),
    drop_copies: bool = typer.Option(False, "--drop-copies", help="Drop pairs whose target is "
                                     "the source, whitespace and case aside."),
    drop_control: bool = typer.Option(
        False, "--drop-control", help="Drop pairs with control or invisible characters: "
        "Unicode Cc (TAB aside), Cf (zero-width, bidi marks, soft hyphens; ZWNJ and ZWJ aside), "
        "Co, Cn."),
    drop_digit_mismatch: bool = typer.Option(
        False, "--drop-digit-mismatch", help="Drop pairs whose sides hold different digit "
        "sequences (as multisets: order may differ)."),
    langid: bool = typer.Option(False, "--langid", help="Drop pairs with a side not in its "
                                "--langs language, by py3langid over all its languages (pip "
                                "install 'attn[clean]'; ~30,000 sentences/s a core, two a "
                                "pair)."),
    dropped: Optional[str] = typer.Option(
        None, "--dropped", metavar="FILE", help="Write each dropped pair, a line each: "
        "filter<TAB>line number<TAB>source<TAB>target (a TAB in a sentence as a space)."),
    target_tag: Optional[str] = typer.Option(
        None, "--target-tag", metavar="CODE", help="Start every source with the tag of this "
        "target language (<2fr>, reserved by `attn vocab --tags`; an OPUS-MT model's "
        ">>fra<<), recorded in the data file: corpora of several target languages, each with "
        "its tag, train one model (Johnson et al. 2017)."),
    tag: Optional[str] = typer.Option(
        None, "--tag", metavar="bt", help="Start every source with this tag too, after "
        "--target-tag's: bt marks back-translated sources (<bt>, Caswell et al. 2019)."),
) -> None:
    """Encode a parallel corpus into a training data file (safetensors), cleaning it on the way
    if told (each filter's drops counted in the summary)."""
    from .cleaning import clean_options
    from .config import parse_langs
    from .data import binarize as binarize_corpus
    from .vocab import Vocabulary

    pair = parse_langs(langs)
    cleaning = clean_options(clean=clean, max_ratio=max_ratio, dedup=dedup,
                             drop_copies=drop_copies, drop_control=drop_control,
                             drop_digit_mismatch=drop_digit_mismatch, langid=langid, langs=pair)

    special_ids = target_tags = None
    if vocab_path.suffix == ".st" and not tgt_vocab_path:  # a model file: its vocabularies
        from .data import SpecialIds
        from .modelfile import load_model

        loaded = load_model(vocab_path)
        src_vocab = loaded.src_vocab
        tgt_vocab = None if loaded.tgt_vocab is loaded.src_vocab else loaded.tgt_vocab
        special_ids = SpecialIds.of_config(loaded.config)
        if loaded.metadata.get("lang_codes"):  # NLLB-200, M2M-100: languages are tokens
            source_tags, target_tags = _language_token_tags(loaded, vocab_path, pair,
                                                            target_tag, tag, alignments)
    else:
        src_vocab = Vocabulary.from_file(vocab_path)
        tgt_vocab = Vocabulary.from_file(tgt_vocab_path) if tgt_vocab_path else None
    from .tags import binarize_tags

    if target_tags is None:
        source_tags = binarize_tags(src_vocab, target_tag, [tag] if tag else [],
                                    str(vocab_path))
    policy = _utf8_policy(strict=not replace_invalid)
    stats = binarize_corpus(src, tgt, output, src_vocab, tgt_vocab, max_len=max_len,
                            threads=threads, policy=policy, alignments_path=alignments,
                            cleaning=cleaning, dropped_path=dropped, langs=pair,
                            source_tags=source_tags, target_tags=target_tags,
                            special_ids=special_ids)
    policy.finish()
    log(f"binarize: {stats.summary()}")
    log(f"binarize: wrote {output}" + (f" and {dropped}" if dropped and dropped != "-" else ""))


def _language_token_tags(loaded, vocab_path: Path, pair, target_tag, tag, alignments):
    """`attn binarize --vocab nllb.st --langs en-fr`: with a model whose languages are tokens
    (NLLB-200, M2M-100), every source starts with the source's code and every target with the
    target's, as the model was trained (its decoder writes the code first)."""
    from .decode.translator import language_options
    from .tags import SourceTags

    if pair is None:
        raise AttnError(f"{vocab_path} names its languages by tokens (NLLB-200, M2M-100): say "
                        "the pair with --langs (en-fr, or eng_Latn-fra_Latn)")
    if target_tag or tag or alignments:
        raise AttnError("--target-tag, --tag and --alignments are not for a model whose "
                        "languages are tokens: --langs puts each side's code first")
    ids = language_options(loaded.metadata, loaded.src_vocab, pair[0], pair[1],
                           f"model file {vocab_path}", "--langs")
    vocabulary = loaded.src_vocab
    pieces = {side: " ".join(vocabulary.piece(index) for index in ids[key])
              for side, key in (("source", "source_tags"), ("target", "target_start"))}
    return (SourceTags(ids["source_tags"], {"source_tags": pieces["source"]}),
            SourceTags(ids["target_start"], {"target_tags": pieces["target"]}))


# ---------------------------------------------------------------------------------------- train


@app.command()
def train(
    context: typer.Context,
    data: Optional[Path] = typer.Argument(None, metavar="TRAIN.st",
                                          help="Training data from `attn binarize`."),
    more_data: Optional[List[Path]] = typer.Argument(
        None, metavar="MORE.st", show_default=False, help="More training data files (the same "
        "vocabulary), drawn from by --weights."),
    output: Optional[Path] = typer.Option(None, "-o", "--output",
                                          help="The run directory (checkpoints, metrics)."),
    weights: Optional[str] = typer.Option(
        None, "--weights", metavar="W1,W2,...", help="Several data files: one positive weight "
        "a file, in their order (normalised). An epoch holds as many pairs as the files "
        "together, file i's share in proportion to its weight: a small file is repeated, a big "
        "one subsampled, every pair of it seen before any again. Default: each file's size "
        "(the files concatenated). An option, not a config file: composable in a Makefile, no "
        "new format."),
    valid: Optional[Path] = typer.Option(None, "--valid", help="Validation data (binarized "
                                         "with the same vocabulary); scored at each save."),
    valid_metric: ValidMetric = typer.Option(
        ValidMetric.loss, "--valid-metric", help="What each save is scored by: loss (and "
        "perplexity), or bleu / chrf (sacreBLEU) / f1 (EVALB, parsers) of the validation "
        "sources decoded by the model; in metrics.jsonl as valid_<metric>."),
    valid_beam: int = typer.Option(TRAIN_DEFAULTS["valid_beam"], "--valid-beam", min=1,
                                   help="Beam of that decoding (1: greedy)."),
    valid_ref: Optional[Path] = typer.Option(
        None, "--valid-ref", help="References for --valid-metric: raw text, one line per "
        "validation pair (bleu, chrf), or gold trees (f1). Default: the validation data's "
        "targets, detokenized."),
    preset: str = typer.Option(TRAIN_DEFAULTS["preset"], "--preset", autocompletion=_preset_names,
                               help="Architecture and recipe: " + ", ".join(PRESETS) + " "
                               "(base-A1 to base-E: Table 3's rows; `attn train --preset NAME "
                               "--dry-run` shows one)."),
    init: Optional[Path] = typer.Option(
        None, "--init", metavar="MODEL.st", help="Fine-tune: start from this model file's "
        "weights and architecture, with a fresh optimizer and schedule from step 0 (--warmup, "
        "--lr-scale and --dropout apply); --preset then gives only the recipe, and must not "
        "contradict the model's architecture. The data must be binarized with the model's "
        "vocabulary. With --resume, a run directory that has checkpoints goes on from them "
        "instead (--init seeds new runs only)."),
    batch_tokens: Optional[int] = typer.Option(
        None, "--batch-tokens", min=1, help="Tokens per side per optimizer step, summed over "
        "all processes (paper: 25000). Default: the preset's."),
    max_tokens: Optional[int] = typer.Option(
        None, "--max-tokens", min=1, help="Cap on tokens per forward pass per process; "
        "gradient accumulation makes up the batch."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=0,
                                            help="Stop after this many steps (preset's)."),
    max_time: Optional[str] = typer.Option(None, "--max-time",
                                           help="Stop after this much training time (30m, 12h)."),
    save_every: Optional[str] = typer.Option(None, "--save-every",
                                             help="Checkpoint interval: a time (10m) or steps "
                                             "(5000). Default: the preset's."),
    keep: int = typer.Option(TRAIN_DEFAULTS["keep"], "--keep", min=1,
                             help="Checkpoints kept (the newest)."),
    keep_state: int = typer.Option(TRAIN_DEFAULTS["keep_state"], "--keep-state", min=1,
                                   help="Training states (Adam's moments: twice a model's "
                                   "size) kept: the newest N checkpoints'. A run resumes from "
                                   "its newest whole one."),
    keep_best: int = typer.Option(TRAIN_DEFAULTS["keep_best"], "--keep-best", min=0,
                                  help="Also keep the N best checkpoints by --valid-metric "
                                  "(`attn average --best N`)."),
    patience: int = typer.Option(TRAIN_DEFAULTS["patience"], "--patience", min=0,
                                 help="Stop early, saving as at the end, after N validations "
                                 "in a row that do not beat the best so far by --valid-metric "
                                 "(a tie does not beat it); counted from metrics.jsonl, so a "
                                 "resumed run counts on. 0: never."),
    seed: int = typer.Option(TRAIN_DEFAULTS["seed"], "--seed",
                             help="Seed for initialisation, batches and dropout."),
    device: DeviceOption = Device.auto,
    dtype: Precision = typer.Option(Precision.auto, "--dtype", help="auto (bf16 on a GPU with "
                                    "bf16 tensor cores, A100 and later; else fp32), fp32, bf16 "
                                    "(autocast; for CUDA: on a CPU no "
                                    "faster than fp32, and much slower without native bf16, "
                                    "with a warning) or fp16 (CUDA, with loss scaling)."),
    lr_scale: Optional[float] = typer.Option(None, "--lr-scale", min=0.0,
                                             help="Multiplies the paper's learning rate."),
    warmup: Optional[int] = typer.Option(None, "--warmup", min=1, help="Warmup steps "
                                         "(paper: 4000)."),
    label_smoothing: Optional[float] = typer.Option(None, "--label-smoothing", min=0.0,
                                                    max=1.0, help="ε_ls (paper: 0.1)."),
    dropout: Optional[float] = typer.Option(None, "--dropout", min=0.0, max=1.0,
                                            help="P_drop (paper: 0.1 base, 0.3 big)."),
    log_every: int = typer.Option(TRAIN_DEFAULTS["log_every"], "--log-every", min=1,
                                  help="Steps per metrics row."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in -o from its "
                                "last checkpoint, exactly."),
    reset_optimizer: bool = typer.Option(False, "--reset-optimizer",
                                         help="On resume, start Adam's moments from zero."),
    reset_schedule: bool = typer.Option(False, "--reset-schedule",
                                        help="On resume, restart the warmup schedule."),
    dist_timeout_minutes: float = typer.Option(TRAIN_DEFAULTS["dist_timeout_minutes"],
                                               "--dist-timeout", min=0.1,
                                               help="Minutes a process waits for the others "
                                               "(longer than a validation and a save)."),
    start_timeout_minutes: float = typer.Option(
        TRAIN_DEFAULTS["start_timeout_minutes"], "--start-timeout", min=0.01,
        help="Minutes the processes may take to start their group and meet (torchrun's "
        "store, NCCL's connections, a first all-reduce); past them each stops with one line "
        "naming the network settings to check, instead of waiting --dist-timeout."),
    grad_sync: GradSync = typer.Option(GradSync.auto, "--grad-sync", help="Precision of the "
                                       "gradients' all-reduce: auto (bf16 between nodes on "
                                       "GPUs, fp32 within one), fp32, bf16 (CUDA)."),
    cudnn_attention: CudnnAttention = typer.Option(
        CudnnAttention.off, "--cudnn-attention", help="off: attention never on cuDNN's "
        "kernels, which build a graph for every new batch shape (on an H100 with torch 2.11, "
        "base on WMT-shaped batches trained 4.4x slower with them); auto: torch chooses. CUDA "
        "only: no effect on a CPU."),
    encoder_layers: Optional[int] = typer.Option(
        None, "--encoder-layers", min=1, help="Encoder layers (N), over the preset's: with the "
        "options below, any network of the preset's family; the model file names what changed "
        "(\"small + decoder_layers=1\"), and a resume must keep it."),
    decoder_layers: Optional[int] = typer.Option(None, "--decoder-layers", min=1,
                                                 help="Decoder layers, over the preset's."),
    d_model: Optional[int] = typer.Option(
        None, "--d-model", min=1, help="d_model, over the preset's (d_k = d_v = d_model / "
        "heads unless --d-k/--d-v are given)."),
    d_ff: Optional[int] = typer.Option(None, "--d-ff", min=1, help="The feed-forward's inner "
                                       "width, over the preset's."),
    heads: Optional[int] = typer.Option(None, "--heads", min=1, help="Attention heads (h), "
                                        "over the preset's."),
    d_k: Optional[int] = typer.Option(None, "--d-k", min=1, help="Query and key width per "
                                      "head, over the preset's."),
    d_v: Optional[int] = typer.Option(None, "--d-v", min=1, help="Value width per head, over "
                                      "the preset's."),
    norm: Optional[NormPlace] = typer.Option(
        None, "--norm", help="post: LayerNorm after each residual (the paper's); pre: before "
        "each sub-layer, with a final norm (steadier for deep stacks)."),
    positions: Optional[PositionKind] = typer.Option(
        None, "--positions", help="sinusoidal (the paper's) or learned (Table 3 row E)."),
    compile: TrainCompile = typer.Option(
        TrainCompile.auto, "--compile", help="Each encoder and decoder layer through torch's "
        "compiler (inductor; dynamic shapes, so one graph serves every batch): on, off, or "
        "auto: on a GPU when a forward pass holds >= 12,500 tokens (measured on an H200: "
        "1.09x eager at 25,000, slower at 3,125; benchmarks/README.md), else off. 10-60 s to "
        "compile at the start; where the compiler fails, one line and the eager layers. "
        "Dropout masks differ from an eager run's on a GPU: resume with the same choice."),
    guided_alignment: bool = typer.Option(
        False, "--guided-alignment", help="Not in the paper (Garg et al. 2019): train one "
        "encoder-decoder attention head to follow the data file's word alignments (`attn "
        "binarize --alignments`), adding --alignment-lambda x the cross-entropy of its "
        "attention with them to the loss; the model file names the head, which `attn decode "
        "--alignment` then reads."),
    alignment_lambda: float = typer.Option(
        TRAIN_DEFAULTS["alignment_lambda"], "--alignment-lambda", min=0.0,
        help="Weight of the alignment loss (Garg et al.: 0.05)."),
    alignment_layer: int = typer.Option(
        TRAIN_DEFAULTS["alignment_layer"], "--alignment-layer", help="The decoder layer of the "
        "supervised head, from 0, or from the last as -1 (default: the penultimate)."),
    alignment_head: int = typer.Option(TRAIN_DEFAULTS["alignment_head"], "--alignment-head",
                                       min=0, help="The supervised head of that layer."),
    tensorboard: Optional[Path] = typer.Option(
        None, "--tensorboard", metavar="DIR", help="Also write each metrics.jsonl row to this "
        "TensorBoard directory as it is written (its numbers against the step), flushed at each "
        "row (pip install 'attn[tensorboard]'). A resumed run goes on in it, each step once."),
    wandb_project: Optional[str] = typer.Option(
        None, "--wandb", metavar="PROJECT", help="Also log each metrics.jsonl row to this "
        "Weights & Biases project (pip install 'attn[wandb]'), in one W&B run that a resumed "
        "run goes on with (its id in RUN_DIR/live-logs.json), each step once."),
    wandb_mode: Optional[WandbMode] = typer.Option(
        None, "--wandb-mode", help="offline: W&B's files in RUN_DIR/wandb, no network needed "
        "(`wandb sync RUN_DIR/wandb/offline-run-*` uploads them); online: sent as it trains "
        "(`wandb login` first). Default: WANDB_MODE where set, else offline."),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", min=8,
                                             help="Vocabulary size for --dry-run without data."),
    nproc: Optional[int] = typer.Option(None, "--nproc", min=1, help="Processes to plan the "
                                        "batch for in --dry-run (default: WORLD_SIZE or 1)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the model summary, batch plan "
                                 "and parameter count, then exit."),
) -> None:
    """Train a model (paper §5). Data parallel: torchrun --nproc-per-node N -m attn_cli train."""
    import os

    from .config import TrainOptions, get_preset

    # The parameters named as TrainOptions' fields are its values (a test keeps them in step).
    options = TrainOptions(**{name: value.value if isinstance(value, Enum) else value
                              for name, value in locals().items() if name in TRAIN_DEFAULTS})
    try:
        get_preset(preset)
    except KeyError as error:
        raise AttnError(error.args[0]) from None
    if (valid_metric != ValidMetric.loss or valid_ref or keep_best or patience) and valid is None:
        raise AttnError("--valid-metric, --valid-ref, --keep-best and --patience need --valid "
                        "data")
    from .train import loop as training
    from .train import report as train_report
    from .train.guided import check_options as check_guidance_options
    from .train.start import check_data_options, check_init_preset

    check_guidance_options(options)
    check_data_options(options)
    architecture = options.architecture()  # one error line where they make no network
    if init is not None and architecture:
        raise AttnError(f"--init {init} brings its own network: leave out "
                        + ", ".join(f"--{name.replace('_', '-')}" for name in architecture
                                    if getattr(options, name) is not None))
    if init is not None:
        # A --preset typed beside --init must match the model's architecture; its default
        # only lends the recipe. (By name: Typer may bring its own copy of click's enum.)
        if context.get_parameter_source("preset").name == "COMMANDLINE":
            check_init_preset(init, preset)
    if dry_run:
        world_size = nproc or int(os.environ.get("WORLD_SIZE", "1"))
        print(train_report.dry_run_report(options, vocab_size, world_size))
        return
    if data is None or output is None:
        raise AttnError("train needs a data file and -o RUN_DIR (or --dry-run)")
    from .train.live_logs import LiveLogs

    # A missing extra is refused here, before the run starts.
    live_logs = LiveLogs(output, tensorboard, wandb_project,
                         wandb_mode.value if wandb_mode else None, options.record())
    with train_report.TrainingDisplay(live_logs) as display:
        training.train(options, display=display)


@app.command()
def average(
    inputs: List[str] = typer.Argument(..., metavar="RUN_DIR | MODEL.st...",
                                       help="A run directory, or checkpoint files."),
    output: Path = typer.Option(..., "-o", "--output", help="The averaged model file."),
    last: Optional[int] = typer.Option(None, "--last", min=1, help="Average the last N "
                                       "checkpoints of the run directory (paper: 5 base, "
                                       "20 big)."),
    best: Optional[int] = typer.Option(None, "--best", min=1, help="Average the N best "
                                       "checkpoints of the run directory by validation score "
                                       "(train with --valid-metric and --keep-best N)."),
    metric: Optional[ValidMetric] = typer.Option(None, "--metric", help="The score --best "
                                                 "ranks by (default: the run's "
                                                 "--valid-metric)."),
) -> None:
    """Average the parameters of checkpoints (paper §6.1): element-wise mean in float32."""
    from .checkpoints import average_models, select_for_average, write_average

    chosen = select_for_average(inputs, last, best, metric.value if metric else None)
    for label, path in chosen:
        log(f"average: {path} ({label})")
    first, mean = average_models([path for _, path in chosen])
    write_average(output, first, mean, [str(path) for _, path in chosen])
    log(f"average: wrote {output}, the mean of {len(chosen)} checkpoint(s)")


@app.command()
def shortlist(
    data_path: Path = typer.Argument(..., metavar="DATA.st", help="Training data from `attn "
                                     "binarize` (the model's vocabularies)."),
    output: Path = typer.Option(..., "-o", "--output", help="The shortlist file (.st)."),
    best: int = typer.Option(20, "--best", min=1, help="Target pieces kept per source piece: "
                             "its most probable translations."),
    frequent: int = typer.Option(100, "--frequent", min=0, help="The most frequent target "
                                 "pieces, kept for every batch (with </s> and <unk>)."),
    threshold: float = typer.Option(0.01, "--threshold", min=0.0, max=1.0, help="Keep a "
                                    "translation only this probable or more."),
    iterations: int = typer.Option(5, "--iterations", min=1, help="EM rounds of IBM model 1."),
    max_pairs: int = typer.Option(1_000_000, "--max-pairs", min=1, help="Learn from at most "
                                  "this many pairs, a uniform sample."),
    seed: int = typer.Option(1, "--seed", help="Seed of that sample."),
    vmap: Optional[Path] = typer.Option(
        None, "--vmap", help="Also write the shortlist as CTranslate2's vocabulary map "
        "(`ct2-*-converter --vocab_mapping`, `translate_batch(use_vmap=True)`)."),
) -> None:
    """A vocabulary shortlist for `attn decode --shortlist` (Marian's lexical shortlist): each
    source piece's most probable target pieces by IBM model 1, learned from a data file."""
    from .data import ParallelData
    from .decode.shortlist import build, ibm_model1
    from .files import atomic_output

    started = time.perf_counter()
    data = ParallelData(data_path)
    log(f"shortlist: IBM model 1 over {min(len(data), max_pairs)} of {len(data)} pairs of "
        f"{data_path}")
    table = ibm_model1(data, iterations, max_pairs, seed,
                       progress=lambda message: log(f"shortlist: {message}"))
    made = build(table, data, best, frequent, threshold)
    made.save(output)
    kept = made.candidates >= 0
    log(f"shortlist: wrote {output}: {int(kept.any(axis=1).sum())} source pieces with "
        f"{kept.sum(axis=1)[kept.any(axis=1)].mean():.1f} candidates each, {len(made.always)} "
        f"always kept, in {time.perf_counter() - started:.1f}s")
    if vmap is not None:
        tgt_vocab = data.tgt_vocab or data.src_vocab
        with atomic_output(vmap, "w") as handle:
            for line in made.vmap_lines(data.src_vocab, tgt_vocab):
                handle.write(line + "\n")
        log(f"shortlist: wrote {vmap} (CTranslate2's vocabulary map)")


def _text_stdout():
    """stdout as UTF-8 text with "\n" line ends, whatever the locale."""
    import io

    return io.TextIOWrapper(sys.stdout.buffer, encoding="utf-8", newline="\n",
                            write_through=False)


@app.command()
def decode(
    model_path: List[Path] = typer.Option(..., "-m", "--model", help="A model file (.st); "
                                          "-m again for an ensemble (the models' "
                                          "log-probabilities averaged at each step)."),
    beam: BeamOption = TRANSLATION.beam,
    alpha: AlphaOption = TRANSLATION.alpha,
    max_len_a: MaxLenAOption = TRANSLATION.max_len_a,
    max_len_b: MaxLenBOption = TRANSLATION.max_len_b,
    nbest: int = typer.Option(1, "--nbest", min=1, help="Print the K best as "
                              "`index<TAB>score<TAB>hypothesis` lines (index from 0)."),
    stop: StopOption = Stop.bound,
    sample: bool = typer.Option(False, "--sample", help="Sample each token from the model's "
                                "distribution instead of searching (back-translation); "
                                "--beam, --alpha and --stop then do not apply."),
    topk: int = typer.Option(0, "--topk", min=0, help="--sample from the K most probable "
                             "tokens only (0: all)."),
    topp: float = typer.Option(1.0, "--topp", max=1.0,
                               help="--sample from the smallest set of tokens holding this "
                               "much probability (nucleus sampling; 1: all)."),
    temperature: float = typer.Option(1.0, "--temperature",
                                      help="--sample from p^(1/T), renormalised: below 1 "
                                      "sharper, above 1 flatter."),
    seed: int = typer.Option(1, "--seed", help="--sample's seed: with the same seed each "
                             "input line gets the same output, however lines are batched."),
    batch_tokens: BatchTokensOption = None,
    buffer_size: BufferSizeOption = BUFFER_SIZE,
    device: DeviceOption = Device.auto,
    dtype: PrecisionOption = Precision.auto,
    int8: Int8Option = False,
    compile: CompileOption = CompileMode.off,
    step: StepOption = StepMode.auto,
    threads: ThreadsOption = 0,
    workers: WorkersOption = 0,
    raw: bool = typer.Option(False, "--raw", help="Print subword pieces, not detokenized "
                             "text."),
    attention: Optional[Path] = typer.Option(None, "--attention", help="Also save each line's "
                                             "attention weights (encoder, decoder, "
                                             "encoder-decoder: layers × heads) with its pieces "
                                             "to this .st file, for `attn plot attention`."),
    split_sentences: bool = typer.Option(
        False, "--split-sentences", help="Cut each line into sentences (Wikimedia's sentencex: "
        "\"Dr.\", \"e.g.\", \"z.B.\" stay whole), search the sentences of all lines in shared "
        "batches and join each line's translations with its own spaces, tabs, \\r and U+2028: "
        "still one line out per line in (a blank line as it is), for a model trained on "
        "sentences given paragraphs. --nbest 1 only, no --attention; --sample numbers the "
        "sentences in order (sentence k draws what line k of a file of one sentence per line "
        "draws); ensembles and --int8 as without it; the summary counts sentences."),
    source_lang: Optional[str] = typer.Option(
        None, "--source-lang", metavar="CODE", help="The language whose rules "
        "--split-sentences cuts by (en, de, ja, pt-BR: its region ignored) [default: the "
        "model file's source language, if it names one; else English's rules]; with a model "
        "imported from NLLB-200 or M2M-100, also the language code every source starts with "
        "(eng_Latn, or en)."),
    target_lang: Optional[str] = typer.Option(
        None, "--target-lang", metavar="CODE", help="Translate into this language, with a "
        "model of several target languages: every line's source starts with the language's "
        "tag, as the model was trained (<2fr>, from `attn vocab --tags` and `binarize "
        "--target-tag`; >>fra<< in a model imported from OPUS-MT); with one imported from "
        "NLLB-200 or M2M-100 (fra_Latn, __fr__, or the ISO 639-1 fr) every output starts "
        "with the language's token, forced, as generate(forced_bos_token_id=...) does. A "
        "code the model has no tag for is an error listing those it has."),
    prefix: bool = typer.Option(
        False, "--prefix", help="Each line is `source<TAB>prefix` (a line without a tab has "
        "no prefix): its outputs start with the prefix, as the target vocabulary's pieces of "
        "its text, forced exactly (one ending mid-word may be continued or not), the search "
        "going on from there; with --nbest N, the N best continuations (the beam's N best, "
        "each through the prefix). A prefix with characters outside the vocabulary is an "
        "error naming its line. --sample draws the tokens after the prefix. Not with "
        "--split-sentences or --attention."),
    constraints: bool = typer.Option(
        False, "--constraints", help="Each line is `source<TAB>c1<TAB>c2…` (with --prefix: "
        "`source<TAB>prefix<TAB>c1…`; a line without a tab has none): every output holds each "
        "phrase c, as the target vocabulary's pieces of its text (\"Haus\" is \"▁Haus\": "
        "\"Krankenhaus\" does not hold it), searched with dynamic beam allocation (Post & "
        "Vilar 2018, Hu et al. 2019: fairseq's --constraints); an output that cannot hold them "
        "within its length limit is warned about. Beam search only (--beam 1: greedy); not "
        "with --split-sentences or --attention. An empty phrase, or one with characters "
        "outside the vocabulary, is an error naming its line."),
    constraint_search: str = typer.Option(
        "misses", "--constraint-search", metavar="misses|all", help="With --constraints or "
        "--glossary, which lines are searched with their phrases: `misses`, those whose output "
        "without them misses one (the others keep it: a phrase the model writes anyway "
        "changes nothing; the free search of every line first, then the misses again); `all`, "
        "every line with phrases (dynamic beam allocation alone, as fairseq)."),
    glossary: Optional[Path] = typer.Option(
        None, "--glossary", help="A TSV of `source term<TAB>target term` lines (`#` lines "
        "and blank ones skipped): each source term found in a line (whole words; a term in "
        "lower case in any casing, one with a capital as written; overlapping terms longest "
        "first) makes its target term a phrase the output must hold, as --constraints does. "
        "With --split-sentences, each sentence's terms."),
    ban: Optional[Path] = typer.Option(
        None, "--ban", help="A file of phrases no output may hold, one per line (target "
        "text, as its vocabulary pieces: CTranslate2's suppress_sequences); `#` lines and "
        "blank ones skipped."),
    shortlist_path: Optional[Path] = typer.Option(
        None, "--shortlist", help="A vocabulary shortlist from `attn shortlist`: each "
        "batch's output projection and softmax over its source pieces' likely translations "
        "and the frequent pieces only (faster; outputs may differ). Prefix and constraint "
        "pieces are always kept."),
    alignment: bool = typer.Option(
        False, "--alignment", help="After each output a TAB and its word alignment as Pharaoh "
        "pairs `i-j` (source word i, output word j, from 0, over the whitespace words of the "
        "line and of the output; sorted; an empty line gives a lone TAB), read off the "
        "encoder-decoder attention in one teacher-forced pass per batch of outputs (an "
        "ensemble's first model; with --nbest each line's own; with --split-sentences the "
        "words of the whole line). Not with --raw."),
    alignment_layer: Optional[int] = typer.Option(
        None, "--alignment-layer", help="The decoder layer --alignment reads, its heads "
        "averaged (a Python index, -1 the last, clamped to the layers there are) [default: the "
        "penultimate of a decoder over three layers deep, else the last, as alignment error "
        "rate against eflomal chose (benchmarks/README.md); a model trained with "
        "--guided-alignment: its supervised head]."),
    input_path: InputOption = "-",
    strict: StrictOption = False,
    stats_json: StatsJsonOption = None,
) -> None:
    """Translate stdin to stdout with beam search (paper §6.1), or by sampling: one line out
    per line in."""
    from .decode.pipe import (
        check_alignment,
        check_controls,
        check_split_sentences,
        sentence_language,
    )
    from .decode.translator import load_translator

    language_tokens = _language_tokens(model_path[0])
    if language_tokens and target_lang is None:
        raise AttnError(f"{model_path[0]} translates between many languages (NLLB-200 or "
                        "M2M-100): say which with --target-lang (fra_Latn, or the ISO 639-1 "
                        "fr) and, if not English, --source-lang")
    check_split_sentences(split_sentences, source_lang, nbest, attention is not None,
                          language_tokens)
    check_controls(prefix, constraints, split_sentences, attention is not None, sample,
                   glossary is not None)
    check_alignment(alignment, alignment_layer, raw)
    started = time.perf_counter()
    translator = load_translator(model_path, beam, device=device.value, dtype=dtype.value,
                                 threads=threads, workers=workers, warn=log, alpha=alpha,
                                 max_len_a=max_len_a, max_len_b=max_len_b, nbest=nbest,
                                 stop=stop, sample=sample, topk=topk, topp=topp,
                                 temperature=temperature, seed=seed,
                                 batch_tokens=batch_tokens, buffer_size=buffer_size, raw=raw,
                                 int8=int8, constraint_search=constraint_search,
                                 target_lang=target_lang, source_lang=source_lang,
                                 compile=compile.value,
                                 step=step.value,
                                 glossary=glossary, bans=ban, shortlist=shortlist_path)
    if target_lang is None:
        from .tags import untagged_note

        note = untagged_note(translator.src_vocab, str(model_path[0]))
        if note:
            log(f"decode: warning: {note}")
    loaded_in = time.perf_counter() - started
    log(f"decode: model loaded in {loaded_in:.2f}s")
    render = None
    if attention is not None:
        from .attention_maps import AttentionWriter, recording_render

        writer = AttentionWriter(attention)
        render = recording_render(translator, writer)
    lang = None
    if split_sentences:
        lang, origin = sentence_language(source_lang, translator.langs)
        log(f"decode: lines cut into sentences by the rules of {lang!r} ({origin})")
    stats = _stream(translator, input_path, strict, render, split_sentences, lang, alignment,
                    alignment_layer, prefix=prefix, constraints=constraints)
    if attention is not None:
        writer.write()
        log(f"decode: attention maps of {len(writer.pieces)} lines in {attention}")
    log(f"decode: {stats.summary()}")
    _write_stats(stats_json, stats, loaded_in)


def _language_tokens(model_path: Path) -> bool:
    """Whether a model file's languages are tokens of its vocabulary (NLLB-200, M2M-100: its
    metadata `lang_codes`), read from its header; a file that cannot be read: False (the load
    names its problem)."""
    from .modelfile import read_model_header

    try:
        return "lang_codes" in read_model_header(model_path)[0].metadata
    except AttnError:
        return False


@app.command()
def serve(
    model_path: List[str] = typer.Option(
        ..., "-m", "--model", metavar="[SOURCE-TARGET=]FILE",
        help="A model file (.st), or SOURCE-TARGET=FILE to serve it for "
        "that language pair: -m en-de=a.st -m de-en=b.st is one server of two pairs, and a "
        "request picks its model by source and target. -m again with the same pair (or, "
        "without pairs, any -m again) adds a model to that pair's ensemble, as in `attn "
        "decode`: an ensemble is of one pair's models, so repeating the pair says which files "
        "it joins, without a separator a file name could hold. (A file whose name looks like a "
        "pair: ./en-de=x.st.) A model of several target languages (`attn vocab --tags`, an "
        "OPUS-MT import) is served per pair, -m en-fr,en-de=multi.st: loaded once, each "
        "request's sources start with its target's tag."),
    host: str = typer.Option(SERVE_DEFAULTS["host"], "--host", help="Address to listen on "
                             "(0.0.0.0: every interface; only with --api-key on a shared "
                             "network)."),
    port: int = typer.Option(SERVE_DEFAULTS["port"], "--port", min=0, max=65535,
                             help="Port (0: a free one, named in the first log line)."),
    name: Optional[str] = typer.Option(None, "--name", help="The model's id in requests and "
                                       "GET /v1/models, without SOURCE-TARGET= pairs (with "
                                       "them, each model's id is its pair) [default: the file "
                                       "names' stems]."),
    langs: Optional[str] = typer.Option(None, "--langs", help="SOURCE-TARGET language codes "
                                        "(e.g. en-de) of a model given without its pair, for "
                                        "LibreTranslate's /translate and /languages [default: "
                                        "the model file's, if it has them; else any pair is "
                                        "accepted]."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ATTN_API_KEY",
                                          show_envvar=True, help="Answer only requests that "
                                          "carry this key (Authorization: Bearer KEY, "
                                          "X-API-Key, or an api_key field); 401 otherwise."),
    api_keys: Optional[Path] = typer.Option(
        None, "--api-keys", metavar="FILE", help="Answer only requests that carry one of this "
        "file's keys, each with its own limits: a line per key, `NAME KEY REQUESTS/MINUTE "
        "CHARS/REQUEST` (0 requests: no limit; -: --req-limit or --char-limit), # comments. "
        "Read again when it changes and on SIGHUP, no restart; /metrics counts each key's "
        "requests by its name. With --api-key too, both are taken."),
    max_body: int = typer.Option(SERVE_DEFAULTS["max_body"], "--max-body", min=1,
                                 help="Largest request body, in bytes (413 above)."),
    max_lines: int = typer.Option(SERVE_DEFAULTS["max_lines"], "--max-lines", min=1,
                                  help="Most lines searched for one request: its lines, or "
                                  "with sentence splitting (LibreTranslate's endpoints, split: "
                                  "true) its sentences (422 above; 400 on LibreTranslate's)."),
    max_line_chars: int = typer.Option(SERVE_DEFAULTS["max_line_chars"], "--max-line-chars",
                                       min=1, help="Longest line (or sentence), in characters "
                                       "(422 above)."),
    char_limit: int = typer.Option(SERVE_DEFAULTS["char_limit"], "--char-limit", min=-1,
                                   help="LibreTranslate's: most characters in one /translate "
                                   "or /detect request, all its texts together (400 above; "
                                   "GET /frontend/settings tells web pages). -1: no limit."),
    queue_lines: int = typer.Option(SERVE_DEFAULTS["queue_lines"], "--queue-lines", min=1,
                                    help="Lines waiting for a search, all requests together: "
                                    "a request that does not fit gets 503 with Retry-After."),
    max_beam: int = typer.Option(SERVE_DEFAULTS["max_beam"], "--max-beam", min=1,
                                 help="Largest beam (and nbest) a request may ask for; --beam "
                                 "must be within it."),
    gather_ms: float = typer.Option(SERVE_DEFAULTS["gather_ms"], "--gather-ms", min=0.0,
                                    help="How long an idle search worker waits for more "
                                    "requests to batch with the first, in milliseconds."),
    max_connections: int = typer.Option(
        SERVE_DEFAULTS["max_connections"], "--max-connections", min=1,
        help="Open connections at once: one more closes the one idle, or without a complete "
        "request, the longest (503 to the latter); those being answered are kept (a burst may "
        "pass the cap for a moment, up to twice it: 503 beyond)."),
    header_timeout: float = typer.Option(
        SERVE_DEFAULTS["header_timeout"], "--header-timeout", min=0.0,
        help="Seconds a request's line and headers may take to arrive, from their first byte "
        "(408 past them, and closed)."),
    body_timeout: float = typer.Option(
        SERVE_DEFAULTS["body_timeout"], "--body-timeout", min=0.0,
        help="Seconds a request's body may take to arrive after its headers (408 past them, "
        "and closed)."),
    idle_timeout: float = typer.Option(
        SERVE_DEFAULTS["idle_timeout"], "--idle-timeout", min=0.0,
        help="Seconds a connection may send nothing, new or between requests, before it is "
        "closed."),
    max_header_bytes: int = typer.Option(
        SERVE_DEFAULTS["max_header_bytes"], "--max-header-bytes", min=1,
        help="Largest request line and headers, in bytes (431 above)."),
    max_request_tokens: int = typer.Option(
        SERVE_DEFAULTS["max_request_tokens"], "--max-request-tokens", min=0,
        help="Most hypothesis steps one request's search may take, every beam counted: the "
        "sum over its lines of beam × (max_len_a × source tokens + max_len_b), the later "
        "positions weighed more (they read a longer cache); 422 above, before any search. "
        "0: what one search worker does in --max-request-seconds here, measured at load."),
    max_request_seconds: float = typer.Option(
        SERVE_DEFAULTS["max_request_seconds"], "--max-request-seconds",
        help="With --max-request-tokens 0 (the default): the seconds of one search worker a "
        "request's search may cost at most, turned into steps by a search timed when the "
        "model loads (the log's ready line says how many)."),
    request_timeout: float = typer.Option(
        SERVE_DEFAULTS["request_timeout"], "--request-timeout", min=0.0,
        help="Seconds a request may wait and be searched (504 past them; its search stops "
        "within a step)."),
    cache_lines: int = typer.Option(
        SERVE_DEFAULTS["cache_lines"], "--cache-lines", min=0,
        help="Lines whose translations are kept (least recently used out; also at most 256 "
        "characters a line on average): a line asked again with the same settings is answered "
        "without a search. 0: no cache."),
    req_limit: int = typer.Option(
        SERVE_DEFAULTS["req_limit"], "--req-limit", min=0,
        help="Requests a minute from each client (the API key it sends in a header, else its "
        "address): a burst of that many, then 429 with Retry-After. /health and /metrics are "
        "not counted. 0: no limit."),
    metrics_auth_token: Optional[str] = typer.Option(
        None, "--metrics-auth-token", envvar="ATTN_METRICS_AUTH_TOKEN", show_envvar=True,
        help="Answer GET /metrics (Prometheus) only with 'Authorization: Bearer TOKEN' "
        "[default: /metrics is open, --api-key or not]."),
    beam: BeamOption = TRANSLATION.beam,
    alpha: AlphaOption = TRANSLATION.alpha,
    max_len_a: MaxLenAOption = TRANSLATION.max_len_a,
    max_len_b: MaxLenBOption = TRANSLATION.max_len_b,
    stop: StopOption = Stop.bound,
    batch_tokens: BatchTokensOption = None,
    device: DeviceOption = Device.auto,
    dtype: PrecisionOption = Precision.auto,
    int8: Int8Option = False,
    step: StepOption = StepMode.auto,
    threads: ThreadsOption = 0,
    workers: WorkersOption = 0,
    glossary: Optional[Path] = typer.Option(
        None, "--glossary", help="`attn decode --glossary`'s TSV for every request (both APIs; "
        "with split, each sentence's terms): its terms found in a line become phrases the "
        "output must hold. A /v1/translate request may add its own (`glossary`). With "
        "several language pairs, every model takes it: give one of their common target "
        "language."),
    ban: Optional[Path] = typer.Option(
        None, "--ban", help="`attn decode --ban`'s phrases, kept out of every output."),
    shortlist_path: Optional[Path] = typer.Option(
        None, "--shortlist", help="`attn decode --shortlist`'s vocabulary shortlist, for every "
        "model (each must have the vocabularies it was made with)."),
) -> None:
    """Translate over HTTP with the models kept loaded (pip install 'attn[serve]'): POST
    /v1/translate, GET /v1/models, GET /health, and LibreTranslate's POST /translate (texts cut
    into sentences), /detect, /translate_file and GET /languages, for one language pair or
    several. Requests arriving together are searched in shared batches; the answers are
    `attn decode`'s. --beam, --alpha, --max-len-a/b and --stop are the defaults a request may
    override. Logs one line per request on stderr; SIGTERM finishes open requests, then
    exits 0."""
    from .config import ServeOptions, parse_langs
    from .serve.server import serve as run_server

    options = ServeOptions(host=host, port=port, name=name, langs=parse_langs(langs),
                           api_key=api_key or None, api_keys=api_keys, max_body=max_body,
                           max_lines=max_lines,
                           max_line_chars=max_line_chars, char_limit=char_limit,
                           queue_lines=queue_lines,
                           max_beam=max_beam, gather_ms=gather_ms,
                           max_connections=max_connections, header_timeout=header_timeout,
                           body_timeout=body_timeout, idle_timeout=idle_timeout,
                           max_header_bytes=max_header_bytes,
                           max_request_tokens=max_request_tokens,
                           max_request_seconds=max_request_seconds,
                           request_timeout=request_timeout, cache_lines=cache_lines,
                           req_limit=req_limit,
                           metrics_auth_token=metrics_auth_token or None)
    options.check_defaults(beam, max_len_b)
    # Read once, now: a bad file is an error before the server starts, not at a model's load.
    from .decode.controls import read_controls

    terms, bans, shortlist = read_controls(glossary, ban, shortlist_path)

    def load(files: list[Path]):
        from .decode.translator import load_translator

        translator = load_translator(files, beam, device=device.value, dtype=dtype.value,
                                     threads=threads, workers=workers, warn=log, alpha=alpha,
                                     max_len_a=max_len_a, max_len_b=max_len_b, stop=stop,
                                     batch_tokens=batch_tokens, int8=int8, glossary=terms,
                                     bans=bans, shortlist=shortlist, step=step.value)
        _collector_on(loaded=True)
        return translator

    run_server(model_path, options, load, log)


def _write_stats(path: Path | None, stats, load_seconds: float) -> None:
    """--stats-json: the summary line's figures, and the model's load time, as JSON."""
    if path is not None:
        from .files import atomic_output

        with atomic_output(path, "w") as handle:
            handle.write(_json_line({**stats.record(), "load_seconds": load_seconds}) + "\n")


def _stream(translator, input_path: str, strict: bool, render=None,
            split_sentences: bool = False, lang: str | None = None,
            alignment: bool = False, alignment_layer: int | None = None,
            prefix: bool = False, constraints: bool = False):
    """Lines of `input_path` through the translator to stdout, one (or nbest) out per line in
    (`decode.pipe.run`)."""
    from .decode.pipe import run
    from .files import display_name, open_binary

    _collector_on(loaded=True)
    out = _text_stdout()
    with open_binary(input_path) as stream:
        try:
            return run(translator, stream, out, display_name(input_path), render=render,
                       policy=_utf8_policy(strict), split_sentences=split_sentences, lang=lang,
                       alignment=alignment, alignment_layer=alignment_layer, prefix=prefix,
                       constraints=constraints)
        finally:
            out.flush()


@app.command()
def score(
    files: Optional[List[str]] = typer.Argument(None, metavar="[HYP | SRC TGT]",
                                                help="Hypotheses ('-' or nothing: stdin); with "
                                                "-m, the source and target files."),
    ref: Optional[str] = typer.Option(None, "--ref", "-r", help="Reference translations (with "
                                      "--trees: the gold treebank)."),
    model_path: Optional[List[Path]] = typer.Option(None, "-m", "--model", help="Force-decode "
                                                    "SRC TGT with this model: per-line "
                                                    "log-probs (-m again: an ensemble)."),
    target_lang: Optional[str] = typer.Option(
        None, "--target-lang", metavar="CODE", help="With -m and a model of several target "
        "languages: each source starts with this language's tag, as `attn decode "
        "--target-lang` translates."),
    metrics: str = typer.Option("bleu,chrf", "--metrics", help="Comma-separated: bleu, chrf, "
                                "ter."),
    tokenize: Tokenizer = typer.Option(Tokenizer("13a"), "--tokenize", help="BLEU tokenizer: "
                                       "sacreBLEU's 13a (its default), intl (international "
                                       "tokenization) and others, or compound-split: the "
                                       "paper's tokenized BLEU (Moses-style words, hyphenated "
                                       "compounds split as ##AT##-##AT##, tensor2tensor's "
                                       "get_ende_bleu), comparable with its Table 2."),
    lowercase: bool = typer.Option(False, "--lowercase", help="Case-insensitive scores."),
    sentence_level: bool = typer.Option(False, "--sentence-level",
                                        help="One score per line (the first metric)."),
    trees: bool = typer.Option(False, "--trees", help="EVALB (COLLINS.prm) bracketing "
                               "precision, recall, F1, complete match and crossing brackets of "
                               "trees, one per line, against --ref GOLD."),
    output_format: OutputFormat = typer.Option(OutputFormat.text, "--format", help="text (one "
                                               "line per metric, sacreBLEU's and EVALB's way) "
                                               "or json (one object; with --sentence-level or "
                                               "-m, one per line)."),
    device: DeviceOption = Device.auto,
    dtype: PrecisionOption = Precision.auto,
    batch_tokens: ScoreBatchTokensOption = BATCH_TOKENS,
    threads: ThreadsOption = 0,
    max_errors: int = typer.Option(10, "--max-errors", min=0, help="With --trees: error "
                                   "sentences (words that differ from the gold tree's) "
                                   "reported and left out before it is an error (EVALB's "
                                   "MAX_ERROR)."),
    by_length: Optional[str] = typer.Option(None, "--by-length", metavar="EDGES",
                                            help="With --trees: also a summary per length "
                                            "bucket, cut at these words (10,20,30,40: len1-10 "
                                            "... len>40)."),
    strict: StrictOption = False,
) -> None:
    """Evaluate: sacreBLEU BLEU/chrF/TER with signatures, force-decoding perplexity, or EVALB
    F1 of trees."""
    files = files or []
    as_json = output_format == OutputFormat.json
    if target_lang is not None and (not model_path or trees):
        raise AttnError("--target-lang goes with -m MODEL SRC TGT")
    if trees:
        if ref is None or len(files) > 1:
            raise AttnError("score --trees takes --ref GOLD and one file of trees (or stdin)")
        from .parse.evalb import parse_length_edges, report_lines

        _write_lines(report_lines(ref, files[0] if files else "-", sentence_level, max_errors,
                                  _utf8_policy(strict), log, as_json,
                                  parse_length_edges(by_length)))
    elif by_length is not None:
        raise AttnError("--by-length goes with --trees")
    elif model_path:
        if len(files) != 2:
            raise AttnError("score -m MODEL takes two files: SRC TGT")
        from .scoring import score_files_with_model

        forced = score_files_with_model(model_path, files[0], files[1], device.value,
                                        dtype.value, batch_tokens, threads, _utf8_policy(strict),
                                        target_lang, log)
        _write_lines(forced.lines(as_json))
        log(forced.summary())
    else:
        if ref is None:
            raise AttnError("score needs --ref REF (or -m MODEL SRC TGT)")
        if len(files) > 1:
            raise AttnError("score --ref REF takes one hypothesis file (or stdin)")
        from .scoring import text_score_lines

        names = [name.strip().lower() for name in metrics.split(",") if name.strip()]
        _write_lines(text_score_lines(files[0] if files else "-", ref, names, tokenize.value,
                                      lowercase, sentence_level, _utf8_policy(strict), as_json))


def _write_lines(lines) -> None:
    """Lines to stdout as they come (what came before an error is still written)."""
    out = _text_stdout()
    try:
        for line in lines:
            out.write(line + "\n")
    finally:
        out.flush()


def _json_line(value) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)


parse_app = typer.Typer(invoke_without_command=True, no_args_is_help=False,
                        context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(parse_app, name="parse")


@parse_app.callback()
def parse(
    context: typer.Context,
    model_path: Optional[Path] = typer.Option(None, "-m", "--model",
                                              help="A parser model file (.st)."),
    beam: int = typer.Option(PARSING.beam, "--beam", min=1,
                             help=f"Beam size (paper: {PARSING.beam})."),
    alpha: float = typer.Option(PARSING.alpha, "--alpha", min=0.0,
                                help=f"Length penalty α (paper: {PARSING.alpha})."),
    max_len_a: MaxLenAOption = PARSING.max_len_a,
    max_len_b: int = typer.Option(PARSING.max_len_b, "--max-len-b", min=0,
                                  help=f"... and b (paper: {PARSING.max_len_b})."),
    batch_tokens: BatchTokensOption = None,
    buffer_size: BufferSizeOption = BUFFER_SIZE,
    device: DeviceOption = Device.auto,
    dtype: PrecisionOption = Precision.auto,
    int8: Int8Option = False,
    step: StepOption = StepMode.auto,
    threads: ThreadsOption = 0,
    workers: WorkersOption = 0,
    input_path: InputOption = "-",
    constrain: bool = typer.Option(False, "--constrain", help="Constrain the search to "
                                   "well-formed trees over exactly the input's words (not in "
                                   "the paper, which repairs the output afterwards)."),
    terminals: ModelTerminals = typer.Option(ModelTerminals.auto, "--terminals", help="How "
                                             "the model spells terminals: placeholders, "
                                             "words, or auto (from its vocabulary)."),
    score_words: WordScores = typer.Option(WordScores.given, "--score-words", help="With "
                                           "--constrain and word "
                                    "terminals: given (a word scores the model's probability "
                                    "of any word there: only the brackets are searched) or "
                                    "joint (the probability of the input's own pieces)."),
    strict: StrictOption = False,
    stats_json: StatsJsonOption = None,
) -> None:
    """Constituency parsing with the same model (paper §6.3): one tokenized sentence per line in,
    one well-formed bracketed tree per line out, always (an empty line for an empty line).
    `attn parse linearize` makes the training pairs from a treebank."""
    if context.invoked_subcommand is not None:  # linearize: text work, no model kept loaded
        _collector_on()
        return
    if model_path is None:
        raise AttnError("parse needs -m PARSER.st (or the subcommand `linearize`)")
    from .decode.translator import load_translator
    from .parse.constraint import tree_constraints
    from .parse.parsing import tree_line

    started = time.perf_counter()
    translator = load_translator(model_path, beam, device=device.value, dtype=dtype.value,
                                 threads=threads, workers=workers, warn=log, alpha=alpha,
                                 max_len_a=max_len_a, max_len_b=max_len_b,
                                 batch_tokens=batch_tokens, buffer_size=buffer_size,
                                 int8=int8, step=step.value,
                                 constraint_for=tree_constraints(terminals.value,
                                                                 score_words.value)
                                 if constrain else None)
    loaded_in = time.perf_counter() - started
    stats = _stream(translator, input_path, strict, render=lambda index, line, hypotheses: [
        tree_line(translator, line, hypotheses)])
    log(f"parse: {stats.summary()}")
    _write_stats(stats_json, stats, loaded_in)


@parse_app.command("linearize")
def parse_linearize(
    treebank: List[str] = typer.Argument(..., metavar="TREEBANK_FILE",
                                         help="Penn Treebank .mrg files (or one-line trees)."),
    prefix: str = typer.Option(..., "-o", "--output", help="Writes PREFIX.src and PREFIX.tgt."),
    terminals: TreeTerminals = typer.Option(TreeTerminals.placeholders, "--terminals",
                                            help="Terminals of the linearized trees: "
                                            "placeholders (XX, the paper's setup) or words (the "
                                            "words themselves; learns faster from small "
                                            "treebanks)."),
    subtrees: bool = typer.Option(False, "--subtrees", help="Also write every constituent of "
                                  "two words or more as a training pair of its own (not in the "
                                  "paper: more, shorter examples for a small treebank)."),
) -> None:
    """Treebank files → training pairs: words (PREFIX.src) and linearized trees (PREFIX.tgt),
    after the standard clean-up (no -NONE-, no function tags)."""
    from .parse.parsing import write_training_pairs

    written, skipped, extra = write_training_pairs(treebank, prefix, terminals.value, subtrees)
    log(f"parse linearize: {written} trees to {prefix}.src and {prefix}.tgt, their brackets "
        f"to {prefix}.symbols"
        + (f", and {extra} constituents" if subtrees else "")
        + (f" ({skipped} empty after clean-up, skipped)" if skipped else ""))


AttentionKind = _choices("AttentionKind", ("encoder", "decoder", "cross"))
XAxis = _choices("XAxis", ("step", "time", "both"))


@app.command()
def plot(
    targets: List[str] = typer.Argument(..., metavar="RUN_DIR... | attention FILE.st",
                                        help="Run directories (their metrics.jsonl, overlaid), "
                                        "or `attention` and a file from `attn decode "
                                        "--attention`."),
    output: Path = typer.Option(..., "-o", "--output", help="The figure (.png, .pdf, .svg)."),
    x_axis: XAxis = typer.Option(XAxis.both, "--x", help="Curves against steps, training "
                                 "time, or both side by side."),
    line: Optional[int] = typer.Option(None, "--line", min=1, help="attention: the input line "
                                       "(from 1)."),
    kind: AttentionKind = typer.Option(AttentionKind.encoder, "--kind", help="attention: "
                                       "encoder or decoder self-attention, or cross "
                                       "(encoder-decoder)."),
    layer: Optional[int] = typer.Option(None, "--layer", min=1, help="attention: the layer "
                                        "(from 1; default the last)."),
    head: Optional[int] = typer.Option(None, "--head", min=1, help="attention: one head "
                                       "(from 1; default every head side by side, as the "
                                       "paper's Figure 3)."),
) -> None:
    """Draw training curves (loss, perplexity, validation metric, learning rate, tokens/s) of
    runs, or attention maps like the paper's Figures 3-5 (pip install 'attn[plot]')."""
    from . import plots

    # `attention` is a word, not a sub-command (as `parse linearize` is): a click group cannot
    # take run directories as positional arguments beside its sub-commands.
    if targets[0] == "attention" and not (len(targets) == 1 and Path("attention").is_dir()):
        if len(targets) != 2 or line is None:
            raise AttnError("plot attention takes one file from `attn decode --attention` "
                            "and --line N")
        drawn_layer, heads = plots.plot_attention(targets[1], line, output, kind.value, layer,
                                                  head)
        log(f"plot: {output}: line {line}, {kind.value}, layer {drawn_layer}, "
            f"head{'s' if len(heads) > 1 else ''} {', '.join(map(str, heads))}")
        return
    panels = plots.plot_runs(targets, output, x_axis.value)
    log(f"plot: {output}: {', '.join(panels)} of {len(targets)} run(s)")


export_app = typer.Typer(no_args_is_help=True, help="Models in other engines' formats.",
                         context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(export_app, name="export")
Quantization = _choices("Quantization", ("float32", "float16", "bfloat16", "int8",
                                         "int8_float32", "int8_float16", "int8_bfloat16",
                                         "int16"))


@export_app.command("ct2")
def export_ct2(
    model_path: Path = typer.Argument(..., metavar="MODEL.st", help="An attn model file."),
    output: Path = typer.Option(..., "-o", "--output", help="The CTranslate2 model directory "
                                "to write (with source.spm and target.spm beside)."),
    quantization: Quantization = typer.Option(Quantization.float32, "--quantization",
                                              help="Weight type of the exported model."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory."),
) -> None:
    """A CTranslate2 model of an attn model (pip install 'attn[ct2]'): greedy decoding there
    gives `attn decode --beam 1`'s output."""
    from .interop.ct2 import export_ct2 as export

    export(model_path, output, quantization.value, force=force)
    log(f"export: wrote {output} (CTranslate2, {quantization.value}; source EOS added by "
        "CTranslate2; tokenize with its source.spm)")


@export_app.command("hf")
def export_hf(
    model_path: Path = typer.Argument(..., metavar="MODEL.st", help="An attn model file."),
    output: Path = typer.Option(..., "-o", "--output", help="The Hugging Face model directory "
                                "to write (MarianMTModel and MarianTokenizer load it; an "
                                "NLLB-200 or M2M-100 model's, M2M100ForConditionalGeneration "
                                "and its tokenizer)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory."),
) -> None:
    """A Hugging Face `transformers` Marian model of an attn model (pip install 'attn[hf]'):
    greedy `generate` gives `attn decode --beam 1`'s output. An imported NLLB-200 or M2M-100
    model, fine-tuned or not, goes back as M2M100ForConditionalGeneration with its tokenizer."""
    from .interop.hf import export_hf as export
    from .interop.m2m import export_m2m

    m2m = _language_tokens(model_path)  # NLLB-200, M2M-100
    (export_m2m if m2m else export)(model_path, output, force=force)
    kind = "M2M100ForConditionalGeneration" if m2m else "MarianMTModel"
    log(f"export: wrote {output} (transformers {kind}, with its tokenizer and a model card)")


import_app = typer.Typer(no_args_is_help=True, help="Models made elsewhere, as attn models.",
                         context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(import_app, name="import")


@import_app.command("hf")
def import_hf(
    directory: Path = typer.Argument(..., metavar="DIR", help="A local MarianMTModel directory "
                                     "(what save_pretrained writes, with MarianTokenizer's "
                                     "files: an OPUS-MT model, say), or an "
                                     "M2M100ForConditionalGeneration one (NLLB-200, M2M-100, "
                                     "with the tokenizer's sentencepiece.bpe.model)."),
    output: Path = typer.Option(..., "-o", "--output", help="The attn model file to write."),
) -> None:
    """An attn model file from a Hugging Face Marian, NLLB-200 or M2M-100 model (pip install
    'attn[hf]'), for decode, serve, score, ensembles and `train --init`. Reads local files
    only."""
    from .interop.hf import import_hf
    from .interop.m2m import import_m2m, is_m2m

    (import_m2m if is_m2m(directory) else import_hf)(directory, output)  # NLLB-200, M2M-100
    log(f"import: wrote {output}")


# ----------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    """Entry point of `attn` and `python -m attn_cli`: maps every failure to one stderr line.
    The command starts with the garbage collector off (`_collector_on`), and a program calling
    `main` gets it back on."""
    gc.disable()
    try:
        _run(argv)
    finally:
        gc.enable()


def _run(argv: list[str] | None) -> None:
    try:
        status = app(args=argv, prog_name="attn", standalone_mode=False)
    except AttnError as error:
        log(f"error: {error}")
        sys.exit(2)
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
    except BrokenPipeError:
        _quiet_broken_pipe()
    except Exception as error:
        if is_out_of_memory(error):  # where no batch is to blame (those raise AttnError)
            log(f"error: out of GPU memory ({out_of_memory_line(error)})")
            sys.exit(2)
        if type(error).__name__ == "Abort":  # Ctrl-C inside a prompt (click or typer's own)
            log("interrupted")
            sys.exit(130)
        if not hasattr(error, "format_message"):  # not a usage error: a bug, show it whole
            raise
        if type(error).__name__ == "NoArgsIsHelpError":  # bare `attn`: the help, on stderr
            log(error.format_message())
            sys.exit(2)
        # A usage error (click's, or typer's vendored click's): one line, exit 2.
        context = getattr(error, "ctx", None)
        hint = f" (see `{context.command_path} --help`)" if context is not None else ""
        log(f"error: {error.format_message()}{hint}")
        sys.exit(2)
    sys.exit(status if isinstance(status, int) else 0)


def _quiet_broken_pipe() -> None:
    """The reader went away (`attn ... | head`): stop quietly, as text tools do."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(0)
