"""The example Makefiles in DRYRUN mode: every command they would run must exist with the options
it uses, so the recipes cannot rot while the command line changes."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
import typer

from attn_cli.cli import app

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def dry_run(recipe: str, *targets: str, **variables: str) -> list[str]:
    settings = [f"{key}={value}" for key, value in {"DRYRUN": "1", "WORK": "/nonexistent-work",
                                                    **variables}.items()]
    result = subprocess.run(["make", "-C", str(EXAMPLES / recipe), *settings, *targets],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.replace("\\\n", " ").splitlines()


def attn_commands(lines: list[str]) -> list[list[str]]:
    """The attn invocations in the printed commands (plain or under torchrun), as argv lists."""
    commands = []
    for line in lines:
        for part in line.split("&&"):
            words = shlex.split(part.split("<")[0].split(">")[0])
            if words[:1] == ["attn"]:
                commands.append(words[1:])
            elif words[:1] == ["torchrun"] and "attn_cli" in words:
                commands.append(words[words.index("attn_cli") + 1:])
    return commands


def check_options(argv: list[str]) -> None:
    """Parse argv with the real command definitions (options, types, ranges), without running."""
    command, name, parent = typer.main.get_command(app), "attn", None
    while True:
        context = command.make_context(name, list(argv), parent=parent)
        protected = getattr(context, "_protected_args", None)  # click >= 8.2 (typer's too)
        if protected is None:
            protected = getattr(context, "protected_args", [])
        rest = list(protected) + list(context.args)
        if not rest or not hasattr(command, "get_command"):
            assert not rest, f"unexpected arguments {rest}"
            return
        sub = command.get_command(context, rest[0])
        assert sub is not None, f"no command {rest[0]!r}"
        command, name, argv, parent = sub, rest[0], rest[1:], context


@pytest.fixture
def sample_treebank(tmp_path) -> Path:
    """Empty stand-ins for the NLTK sample's file names (no treebank data in the tests)."""
    for number in ("0001", "0159", "0160", "0179"):
        (tmp_path / f"wsj_{number}.mrg").write_text("")
    return tmp_path


@pytest.mark.parametrize("recipe,targets,expected", [
    ("multi30k", [], ["vocab", "binarize", "train", "average", "decode", "score"]),
    ("wmt14-en-de", ["base", "big"], ["vocab", "binarize", "train", "average", "decode", "score"]),
    ("wmt14-en-fr", ["base", "big"], ["vocab", "binarize", "train", "average", "decode", "score"]),
    ("wsj-parse", [], ["parse", "vocab", "binarize", "train", "average", "score"]),
])
def test_recipe_commands_exist(recipe, targets, expected, sample_treebank):
    commands = attn_commands(dry_run(recipe, *targets, SAMPLE=str(sample_treebank)))
    assert [c for c in expected if not any(cmd[0] == c for cmd in commands)] == []
    for argv in commands:
        check_options(argv)


def test_wmt_recipes_follow_the_paper():
    text = " ".join(dry_run("wmt14-en-de", "base", "big"))
    assert "--size 37000" in text and "--batch-tokens 25000" in text
    assert "--preset base" in text and "--max-steps 100000" in text
    assert "--preset big" in text and "--max-steps 300000" in text
    assert "--save-every 10m" in text
    assert "--last 5" in text and "--last 20" in text
    assert "--beam 4 --alpha 0.6 --max-len-a 1 --max-len-b 50" in text
    assert "--tokenize intl" in text and "sacrebleu -t wmt14/full -l en-de" in text
    assert "torchrun" in text and "--nproc-per-node 8" in text
    french = " ".join(dry_run("wmt14-en-fr", "big"))
    assert "--size 32000" in french and "--preset big-enfr" in french


def test_parse_recipe_splits_the_sample(sample_treebank):
    text = " ".join(dry_run("wsj-parse", SAMPLE=str(sample_treebank)))
    train = text.split("-o /nonexistent-work/train")[0]
    assert "wsj_0001.mrg" in train and "wsj_0159.mrg" in train and "wsj_0160" not in train
    assert "--preset parse-small" in text


def test_parse_recipe_without_a_treebank_is_a_clear_error(tmp_path):
    result = subprocess.run(["make", "-C", str(EXAMPLES / "wsj-parse"), "DRYRUN=1",
                             f"SAMPLE={tmp_path}"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "no treebank files found" in result.stderr


def test_parse_recipe_uses_the_full_treebank_split_when_given(tmp_path):
    for section in ("02", "21", "22", "23"):
        (tmp_path / section).mkdir()
        (tmp_path / section / f"wsj_{section}01.mrg").write_text("")
    text = " ".join(dry_run("wsj-parse", PTB=str(tmp_path)))
    assert "--preset parse-wsj" in text and "--beam 21 --alpha 0.3" in text
    assert "02/wsj_0201.mrg" in text and "21/wsj_2101.mrg" in text and "23/wsj_2301.mrg" in text
