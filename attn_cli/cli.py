"""The `attn` command line: thin commands that parse options, call one library function, and move
bytes. Contract: shared/CLI.md. Heavy modules (torch, sentencepiece) are imported inside the
commands so that `attn --help` and shell completion stay instant.

Conventions for every command: data on stdout only; logs, progress and summaries on stderr; bad
input is one `error: ...` line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from . import __version__
from .config import PRESETS
from .files import AttnError

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
    print(message, file=sys.stderr, flush=True)


def _version(value: bool) -> None:
    if value:
        print(f"attn {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """The Transformer, end to end."""


def _preset_names(incomplete: str = "") -> list[str]:
    return [name for name in PRESETS if name.startswith(incomplete)]


# ---------------------------------------------------------------------------------------- vocab


@app.command()
def vocab(
    files: List[str] = typer.Argument(..., metavar="FILE",
                                      help="Text files, one sentence per line ('-' is stdin)."),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the model "
                                "(a .vocab listing is written beside it)."),
    size: int = typer.Option(37000, "--size", min=8, help="Vocabulary size (paper: 37000 "
                             "shared BPE for en-de, 32000 for en-fr)."),
    model_type: str = typer.Option("bpe", "--type", help="bpe or unigram."),
    coverage: float = typer.Option(1.0, "--coverage", min=0.9, max=1.0,
                                   help="Share of characters the vocabulary must cover."),
    sample: int = typer.Option(10_000_000, "--sample", min=1,
                               help="Learn from at most this many lines, a uniform sample."),
    seed: int = typer.Option(1, "--seed", help="Seed for the sample and the learner."),
    threads: int = typer.Option(0, "--threads", help="Worker threads (0: all cores)."),
    verbose: bool = typer.Option(False, "--verbose", help="Show SentencePiece's own log."),
) -> None:
    """Learn a shared subword vocabulary (SentencePiece) from text files."""
    from . import vocab as vocabulary_module

    if model_type not in ("bpe", "unigram"):
        raise AttnError(f"--type must be bpe or unigram, not {model_type!r}")
    if files.count("-") > 1:
        raise AttnError("stdin ('-') can be read only once")
    started = time.perf_counter()
    lines, total = vocabulary_module.sample_lines(files, sample, seed)
    note = f" (a sample of {len(lines)})" if total > len(lines) else ""
    log(f"vocab: learning a {size}-piece {model_type} vocabulary from {total} lines{note}")
    learned = vocabulary_module.learn(lines, size, model_type, coverage, seed, threads, verbose)
    listing = vocabulary_module.write(learned, output)
    log(f"vocab: wrote {output} and {listing} ({len(learned)} pieces, "
        f"sha256 {learned.checksum[:12]}) in {time.perf_counter() - started:.1f}s")


# ------------------------------------------------------------------------------------- binarize


@app.command()
def binarize(
    src: str = typer.Argument(..., help="Source-language text, one sentence per line."),
    tgt: str = typer.Argument(..., help="Target-language text, line N translating SRC's line N."),
    vocab_path: Path = typer.Option(..., "--vocab", help="SentencePiece model from `attn vocab`."),
    output: Path = typer.Option(..., "-o", "--output", help="The data file to write (.st)."),
    tgt_vocab_path: Optional[Path] = typer.Option(None, "--tgt-vocab",
                                                  help="A separate target vocabulary."),
    max_len: int = typer.Option(1024, "--max-len", min=1,
                                help="Drop pairs with a side longer than this (subwords)."),
    threads: int = typer.Option(0, "--threads", help="Encoder threads (0: all cores)."),
) -> None:
    """Encode a parallel corpus into a training data file (safetensors)."""
    from .data import binarize as binarize_corpus
    from .vocab import Vocabulary

    src_vocab = Vocabulary.from_file(vocab_path)
    tgt_vocab = Vocabulary.from_file(tgt_vocab_path) if tgt_vocab_path else None
    stats = binarize_corpus(src, tgt, output, src_vocab, tgt_vocab, max_len=max_len,
                            threads=threads)
    log(f"binarize: {stats.summary()}")
    log(f"binarize: wrote {output}")


# ---------------------------------------------------------------------------------------- train


@app.command()
def train(
    data: Optional[Path] = typer.Argument(None, metavar="TRAIN.st",
                                          help="Training data from `attn binarize`."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="The run directory."),
    preset: str = typer.Option("base", "--preset", autocompletion=_preset_names,
                               help="Architecture and recipe: base, big, base-A1..base-E "
                               "(Table 3), parse-wsj, small, tiny."),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", min=8,
                                             help="Vocabulary size for --dry-run without data."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="Print the model summary and parameter count, then exit."),
) -> None:
    """Train a model (paper §5). `--dry-run` shows what would be trained."""
    from .config import get_preset

    try:
        chosen = get_preset(preset)
    except KeyError as error:
        raise AttnError(error.args[0]) from None
    if dry_run:
        from .training import describe_model

        if data is not None:
            from .data import ParallelData

            dataset = ParallelData(data)
            src_size = len(dataset.src_vocab)
            tgt_size = None if dataset.shared_vocab else len(dataset.tgt_vocab)
        elif vocab_size is not None:
            src_size, tgt_size = vocab_size, None
        else:
            raise AttnError("--dry-run needs a data file or --vocab-size")
        print(describe_model(chosen, chosen.model_config(src_size, tgt_size)))
        return
    _not_built("train", 3)


def _not_built(command: str, issue: int) -> None:
    log(f"error: `attn {command}` is not built yet (tracked in issue {issue})")
    raise typer.Exit(2)


@app.command()
def average() -> None:
    """Average the parameters of checkpoints (paper §6.1)."""
    _not_built("average", 3)


@app.command()
def decode() -> None:
    """Translate stdin to stdout with beam search (paper §6.1)."""
    _not_built("decode", 4)


@app.command()
def score() -> None:
    """Evaluate: BLEU/chrF, force-decoding perplexity, or EVALB bracketing F1."""
    _not_built("score", 4)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def parse() -> None:
    """Constituency parsing with the same model (paper §6.3)."""
    _not_built("parse", 5)


# ----------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    """Entry point of `attn` and `python -m attn_cli`: maps every failure to one stderr line."""
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
