"""Shared fixtures and the two ways tests call `attn`.

`run_attn` calls the real entry point, `attn_cli.cli.main`, in this process with stdin, stdout
and stderr of its own: the same parsing, dispatch and error handling as the console script,
without a fresh interpreter's start (0.5-3 s each, depending on the machine). `run_attn_process`
starts a real process, for what only a process shows: the console script, signals, a closed pipe,
streaming, torchrun, and what a command imports.

Tests that need a trained model share session fixtures (below: each is trained once); tests that
need any model at all take a random one (`toys.random_model`, `toys.save_random_model`), and
tests/fixtures/ holds committed files of every format (tests/test_formats.py).

Markers (pyproject.toml): `slow` for learning runs, several processes, kill and signal tests
(`pytest -m "not slow"` leaves them out); `gpu` for tests that need CUDA, skipped without it.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attn_cli.checkpoints import list_checkpoints
from attn_cli.cli import main

from .toys import toy_parser_commands

REPO = Path(__file__).resolve().parent.parent
BUNDLED = REPO / "examples" / "multi30k" / "data"


def bundled_lines(name: str, count: int) -> list[str]:
    with gzip.open(BUNDLED / f"{name}.gz", "rt", encoding="utf-8") as handle:
        return [next(handle).rstrip("\n") for _ in range(count)]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """300 training and 50 validation pairs of Multi30k en-de as plain files."""
    directory = tmp_path_factory.mktemp("corpus")
    paths = {}
    for split, count in (("train", 300), ("val", 50)):
        for lang in ("en", "de"):
            path = directory / f"{split}.{lang}"
            path.write_text("\n".join(bundled_lines(f"{split}.{lang}", count)) + "\n",
                            encoding="utf-8")
            paths[f"{split}.{lang}"] = path
    return paths


@pytest.fixture(scope="session")
def spm_model(corpus, tmp_path_factory) -> Path:
    """A 400-piece shared BPE vocabulary learned through the real command."""
    out = tmp_path_factory.mktemp("vocab") / "spm.model"
    result = run_attn("vocab", corpus["train.en"], corpus["train.de"], "-o", out, "--size", "400")
    assert result.returncode == 0, result.stderr
    return out


@dataclass
class Result:
    """What a command did: its exit status and what it wrote (decoded as UTF-8)."""

    returncode: int
    stdout: str
    stderr: str


class _Sink(io.BytesIO):
    """A byte stream that outlives the text wrappers around it (commands wrap stdout's buffer in
    a TextIOWrapper, which closes its buffer when it is collected)."""

    def close(self) -> None:
        pass


def run_attn(*args, stdin: str | bytes | None = None) -> Result:
    """`attn ARGS` through `attn_cli.cli.main`, in this process. Global state a command sets
    (torch's thread count) is put back afterwards, so that tests stay independent."""
    data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
    out, err = _Sink(), _Sink()
    saved = sys.stdin, sys.stdout, sys.stderr
    threads = torch.get_num_threads()
    sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", write_through=True)
    try:
        main([str(arg) for arg in args])
        returncode = 0
    except SystemExit as exit_:
        code = exit_.code
        returncode = code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdin, sys.stdout, sys.stderr = saved
        torch.set_num_threads(threads)
    return Result(returncode, out.getvalue().decode("utf-8", "replace"),
                  err.getvalue().decode("utf-8", "replace"))


def run_attn_process(*args, stdin: str | bytes | None = None, env: dict | None = None,
                     timeout: float = 300) -> Result:
    """`python -m attn_cli ARGS` in a real process."""
    data = stdin.encode() if isinstance(stdin, str) else stdin
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    completed = subprocess.run([sys.executable, "-m", "attn_cli", *map(str, args)], input=data,
                               capture_output=True, env=environment, timeout=timeout)
    return Result(completed.returncode, completed.stdout.decode("utf-8", "replace"),
                  completed.stderr.decode("utf-8", "replace"))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """What a test computes with torch in this process (tiny models, many small ops) runs on one
    thread; commands choose their own threads, as they do for users (`run_attn` puts this back
    after each). With two threads, OpenMP's waiting at every op makes such tests 10-100x slower
    as soon as another process holds a core (measured on 2 cores beside a busy process:
    tests/test_search.py and test_tree_search.py 262 s on two threads, 2.2 s on one)."""
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped, with the reason, where torch sees no CUDA device."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
        for item in gpu_tests:
            item.add_marker(skip)


def assert_clean_error(result: Result, *fragments: str) -> None:
    """Exit 2, one `error: ...` line on stderr naming what is wrong, no traceback, no stdout."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in error_lines[0], (fragment, error_lines[0])
    assert result.stdout == ""


# ------------------------------------------------------------------- trained once per session


@pytest.fixture(scope="session")
def data_files(corpus, spm_model, tmp_path_factory) -> tuple[Path, Path]:
    """The corpus binarized with the shared vocabulary: (train.st, valid.st)."""
    directory = tmp_path_factory.mktemp("data")
    for name, (src, tgt) in {"train.st": ("train.en", "train.de"),
                             "valid.st": ("val.en", "val.de")}.items():
        result = run_attn("binarize", "--vocab", spm_model, corpus[src], corpus[tgt], "-o",
                          directory / name)
        assert result.returncode == 0, result.stderr
    return directory / "train.st", directory / "valid.st"


@pytest.fixture(scope="session")
def trained(data_files, tmp_path_factory) -> tuple[Path, float]:
    """A tiny model trained for a few steps (its translations are poor; the plumbing is real),
    with the validation perplexity training measured."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    result = run_attn("train", data_files[0], "-o", run_dir, "--preset", "tiny", "--max-steps",
                      "40", "--valid", data_files[1], "--device", "cpu")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir / "checkpoint-40.st", rows[-1]["valid_ppl"]


def _train_parser(terminals: str, directory: Path) -> Path:
    """A tiny parser trained on toy trees (tests/toys.py) through the real commands."""
    for command in toy_parser_commands(directory, terminals, PARSER_STEPS[terminals]):
        result = run_attn(*command)
        assert result.returncode == 0, (command[:2], result.stderr)
    return directory


# Steps each kind of parser trains for: the word parser reaches dev F1 95-100 by step 400, the
# placeholder parser (which must also count the words) 61-73 by step 600 (AVX-512 and AVX2).
PARSER_STEPS = {"words": 400, "placeholders": 600}


@pytest.fixture(scope="session")
def word_parser(tmp_path_factory) -> Path:
    """The directory of a parser whose trees spell their terminals as words."""
    return _train_parser("words", tmp_path_factory.mktemp("parser-words"))


@pytest.fixture(scope="session")
def placeholder_parser(tmp_path_factory) -> Path:
    """The directory of a parser with placeholder terminals (XX), the paper's setup."""
    return _train_parser("placeholders", tmp_path_factory.mktemp("parser-placeholders"))


@pytest.fixture(scope="session")
def other_vocab_data(corpus, tmp_path_factory) -> Path:
    """The validation pairs binarized with another vocabulary (learned on German only)."""
    directory = tmp_path_factory.mktemp("other-vocab")
    other_vocab = directory / "other.model"
    result = run_attn("vocab", corpus["train.de"], "-o", other_vocab, "--size", "300")
    assert result.returncode == 0, result.stderr
    other_data = directory / "other.st"
    result = run_attn("binarize", "--vocab", other_vocab, corpus["val.en"], corpus["val.de"],
                      "-o", other_data)
    assert result.returncode == 0, result.stderr
    return other_data


# ------------------------------------------------------------------------------ training runs


def train_args(train_st, run_dir, *extra) -> list:
    """`attn train` of the tiny preset on the CPU, a metrics row per step, and `extra`."""
    return ["train", train_st, "-o", run_dir, "--preset", "tiny", "--log-every", "1",
            "--device", "cpu", *map(str, extra)]


def final_weights(run_dir: Path) -> dict:
    """The parameters of a run's last checkpoint (its vocabulary left out)."""
    step, path = list_checkpoints(run_dir)[-1]
    weights = load_file(str(path))
    return {name: tensor for name, tensor in weights.items() if not name.startswith("vocab.")}


def assert_same_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0 if atol == 0 else 1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def decode(model, lines: list[str], *options) -> list[str]:
    """`attn decode -m model OPTIONS` of `lines` through the entry point: its output lines."""
    result = run_attn("decode", "-m", model, *options, stdin="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    return result.stdout.split("\n")[:-1]
