"""Regenerate the shell completion scripts from the Typer app: `python completions/generate.py`.

The scripts are thin: at each TAB they ask `attn` itself (with _ATTN_COMPLETE set) for the
candidates, so subcommands, options and preset names stay current with the installed version.
tests/test_completions.py fails when these files are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from typer._completion_shared import get_completion_script

HERE = Path(__file__).resolve().parent
SCRIPTS = {"bash": "attn.bash", "zsh": "_attn", "fish": "attn.fish"}


def script(shell: str) -> str:
    return get_completion_script(prog_name="attn", complete_var="_ATTN_COMPLETE",
                                 shell=shell) + "\n"


def main() -> None:
    for shell, name in SCRIPTS.items():
        (HERE / name).write_text(script(shell), encoding="utf-8")
        print(f"wrote completions/{name}", file=sys.stderr)


if __name__ == "__main__":
    main()
