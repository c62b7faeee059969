"""Shared fixtures: a small slice of the bundled Multi30k data and a vocabulary learned on it."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def run_attn(*args, stdin: str | bytes | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run the real entry point (`python -m attn_cli`) in a subprocess."""
    data = stdin.encode() if isinstance(stdin, str) else stdin
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    completed = subprocess.run([sys.executable, "-m", "attn_cli", *map(str, args)], input=data,
                               capture_output=True, cwd=cwd, env=environment, timeout=300)
    completed.stdout = completed.stdout.decode("utf-8", "replace")
    completed.stderr = completed.stderr.decode("utf-8", "replace")
    return completed


def assert_clean_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit 2, one `error: ...` line on stderr naming what is wrong, no traceback, no stdout."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in error_lines[0], (fragment, error_lines[0])
    assert result.stdout == ""
