"""What the benchmark scripts share: where this checkout and its bundled data are, the report
line on stderr, how to run a checkout's `attn`, and reading the summary `attn decode` and `attn
parse` write with --stats-json.

The scripts run from the checkout's root as modules (`python -m benchmarks.decode_speed ...`), so
the checkout's own attn_cli comes first on the path, whatever is installed.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_DATA = REPO_ROOT / "examples" / "multi30k" / "data"  # Multi30k en-de, gzipped
# What may not be committed (the Penn Treebank sample is licensed for non-commercial use only)
# and the peers' setup notes: $ATTN_SHARED, or a `shared` directory beside the checkout.
SHARED = Path(os.environ.get("ATTN_SHARED") or REPO_ROOT.parent / "shared")


def log(message: str = "") -> None:
    """A report line: on stderr (stdout carries the JSON result)."""
    print(message, file=sys.stderr, flush=True)


def read_bundled(name: str) -> str:
    """A bundled Multi30k file's text, e.g. `read_bundled("test_2016_flickr.en.gz")`."""
    with gzip.open(BUNDLED_DATA / name, "rt", encoding="utf-8") as handle:
        return handle.read()


def attn_command(checkout: Path | None = None) -> list[str]:
    """The command that runs a checkout's `attn` (this one's by default) with this interpreter:
    a baseline revision in a worktree is run as `python -c` with its root first on the path."""
    if checkout is None or Path(checkout).resolve() == REPO_ROOT:
        return [sys.executable, "-m", "attn_cli"]
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(checkout)!r}); "
            "from attn_cli.cli import main; main(sys.argv[1:])"]


# The summary line of checkouts older than --stats-json (5faf29d .. 14bcb5c), for comparisons
# against them: "N sentences, T output tokens (EOS included) in S.SSs: ...".
_SUMMARY = re.compile(r"(\d+) sentences, (\d+) output tokens .* in ([\d.]+)s")
_LOADED = re.compile(r"model loaded in ([\d.]+)s")


def decode_stats(stats_json: Path, stderr: str) -> dict:
    """What a decode or parse run reported: its --stats-json file ({sentences, output_tokens,
    seconds, sentences_per_s, tokens_per_s, load_seconds, ...}), or, from a checkout that
    predates the option, the same figures read from its summary line on stderr."""
    if stats_json.exists():
        return json.loads(stats_json.read_text())
    sentences, tokens, seconds = _SUMMARY.search(stderr).groups()
    loaded = _LOADED.search(stderr)
    seconds = float(seconds)
    return {"sentences": int(sentences), "output_tokens": int(tokens), "seconds": seconds,
            "sentences_per_s": int(sentences) / seconds, "tokens_per_s": int(tokens) / seconds,
            "load_seconds": float(loaded.group(1)) if loaded else None}


@functools.lru_cache
def supports(checkout: Path | None, command: str, option: str) -> bool:
    """Whether a checkout's `attn COMMAND` has OPTION (an older revision may not)."""
    import subprocess

    result = subprocess.run([*attn_command(checkout), command, "--help"], capture_output=True,
                            text=True)
    return option in result.stdout
