"""Shell completions: the committed scripts match the app, and completing really works."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# completions/generate.py is a script, not a module on the path: its definitions, loaded by path
# (runpy leaves its `__main__` block unrun).
GENERATE = runpy.run_path(str(REPO / "completions" / "generate.py"))


def test_committed_scripts_are_current():
    for shell, name in GENERATE["SCRIPTS"].items():
        committed = (REPO / "completions" / name).read_text(encoding="utf-8")
        assert committed == GENERATE["script"](shell), (
            f"completions/{name} is stale: run `python completions/generate.py`")


def complete(words: str, index: int) -> list[str]:
    environment = {**os.environ, "_ATTN_COMPLETE": "complete_bash", "COMP_WORDS": words,
                   "COMP_CWORD": str(index)}
    result = subprocess.run([sys.executable, "-m", "attn_cli"], env=environment,
                            capture_output=True, text=True, timeout=60)
    return result.stdout.split()


def test_completes_subcommands_options_and_presets():
    assert complete("attn tr", 1) == ["train"]
    assert "--beam" in complete("attn decode --be", 2)
    assert complete("attn se", 1) == ["serve"]
    assert {"--api-key", "--max-lines", "--max-line-chars"} <= set(complete("attn serve --", 2))
    assert {"big", "big-enfr"} <= set(complete("attn train --preset bi", 3))
