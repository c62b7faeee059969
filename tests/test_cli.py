"""The command line as users and Makefiles see it: the real entry point, in-process (and in a
real process where that is the point)."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
from typer.main import get_command

from attn_cli import __version__, formats, search
from attn_cli.cli import app
from attn_cli.decode import options as decode_options
from attn_cli.decode import translator as decode_translator

from .conftest import REPO, assert_clean_error, run_attn

COMMANDS = ("vocab", "binarize", "train", "average", "decode", "score", "parse", "serve")


def test_help_lists_every_subcommand():
    result = run_attn("--help")
    assert result.returncode == 0
    for command in COMMANDS:
        assert re.search(rf"^\s+{command}\s", result.stdout, re.MULTILINE), command


def test_version():
    result = run_attn("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"attn {__version__}"


def test_console_script_is_installed():
    # pip puts console scripts next to the interpreter it installs for; the PATH need not have it.
    scripts = sysconfig.get_path("scripts")
    attn = shutil.which("attn", path=scripts)
    assert attn, f"the `attn` console script is not installed in {scripts}"
    result = subprocess.run([attn, "--version"], capture_output=True, text=True)
    assert result.stdout.strip() == f"attn {__version__}"


def test_help_does_not_import_torch():
    """`attn --help` and completion must stay instant: no torch, no sentencepiece."""
    code = ("import sys; from attn_cli.cli import main\n"
            "try:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'sentencepiece' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stderr.strip().splitlines()[-1] == "False False"


@pytest.mark.parametrize("argv", [["parse", "linearize", "{treebank}", "-o", "{prefix}"],
                                  ["score", "--trees", "--ref", "{treebank}", "{treebank}"]])
def test_tree_commands_do_not_import_torch(argv, tmp_path):
    """Linearizing a treebank and scoring trees are text work: instant, torch-free."""
    treebank = tmp_path / "tiny.mrg"
    treebank.write_text("(TOP (S (NP (DT a) (NN cat)) (VP (VBZ sleeps))))\n", encoding="utf-8")
    argv = [arg.format(treebank=treebank, prefix=tmp_path / "pairs") for arg in argv]
    code = ("import sys; from attn_cli.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit as exit_:\n    assert not exit_.code\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stderr.strip().splitlines()[-1] == "False", result.stderr


@pytest.mark.parametrize("command,paper", [
    (("decode",), (4, 0.6, 1.0, 50)),  # §6.1: beam 4, α 0.6, maximum output length |x| + 50
    (("parse",), (21, 0.3, 1.0, 300)),  # §6.3: beam 21, α 0.3, |x| + 300
])
def test_search_defaults_are_the_papers_everywhere(command, paper):
    """The command's defaults, `--help`'s and the library's are the paper's settings, named once
    in attn_cli.formats: none of them may drift from the others."""
    settings = formats.TRANSLATION if command == ("decode",) else formats.PARSING
    assert (settings.beam, settings.alpha, settings.max_len_a, settings.max_len_b) == paper
    click_command = get_command(app)
    for name in command:
        click_command = click_command.commands[name]
    defaults = {param.name: param.default for param in click_command.params}
    assert (defaults["beam"], defaults["alpha"], defaults["max_len_a"],
            defaults["max_len_b"]) == paper
    assert defaults["batch_tokens"] is None  # by device: devices.search_batch_tokens
    help_text = run_attn(*command, "--help").stdout
    assert f"{formats.BATCH_TOKENS} on a CPU, {formats.GPU_BATCH_TOKENS} on a GPU" in \
        " ".join(help_text.replace("│", " ").split())
    for value in paper[::3]:  # beam and b are named in the help as the paper's
        assert f"(paper: {value})" in help_text
    if command == ("decode",):  # the library translates with what the command does
        options = decode_options.DecodeOptions()
        assert (options.beam, options.alpha, options.max_len_a, options.max_len_b) == paper
        signature = inspect.signature(search.beam_search).parameters
        assert tuple(signature[name].default for name in
                     ("beam", "alpha", "max_len_a", "max_len_b")) == paper
        assert inspect.signature(decode_translator.load_translator).parameters["beam"].default == 4


@pytest.mark.parametrize("preset,low,high", [("base", 60e6, 67e6), ("big", 205e6, 220e6)])
def test_dry_run_prints_parameter_count(preset, low, high):
    result = run_attn("train", "--preset", preset, "--vocab-size", "37000", "--dry-run")
    assert result.returncode == 0, result.stderr
    counts = re.findall(r"^params: (\d+)$", result.stdout, re.MULTILINE)
    assert len(counts) == 1 and low <= int(counts[0]) <= high


def test_dry_run_from_a_data_file(corpus, spm_model, tmp_path):
    data = tmp_path / "train.st"
    assert run_attn("binarize", "--vocab", spm_model, corpus["val.en"], corpus["val.de"],
                    "-o", data).returncode == 0
    result = run_attn("train", str(data), "--preset", "tiny", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "400 shared" in result.stdout


def test_unknown_preset():
    result = run_attn("train", "--preset", "huge", "--vocab-size", "100", "--dry-run")
    assert_clean_error(result, "unknown preset 'huge'", "base", "big")


def test_unknown_option_is_a_one_line_usage_error():
    assert_clean_error(run_attn("vocab", "--frobnicate", "x"), "--frobnicate")


def test_missing_required_option():
    assert_clean_error(run_attn("binarize", "a", "b"), "--vocab")


def test_train_help_lists_every_preset():
    from attn_cli.config import PRESETS

    text = "".join(run_attn("train", "--help").stdout.split())  # however the help is wrapped
    listed = text.split("Architectureandrecipe:")[1].split("(base-A1")[0]
    assert listed.split(",") == list(PRESETS)


def test_choices_are_listed_in_help_and_checked():
    decode_help = run_attn("decode", "--help").stdout
    assert "<auto|cpu|cuda>" in decode_help and "<auto|fp32|bf16|fp16>" in decode_help
    assert_clean_error(run_attn("decode", "-m", "x.st", "--device", "gpu"), "--device", "'gpu'")
    assert_clean_error(run_attn("vocab", "x.txt", "-o", "v.model", "--type", "wordpiece"),
                       "--type")




@pytest.mark.slow
def test_the_garbage_collector_is_off_only_while_a_decoding_command_loads(trained, tmp_path):
    """`main` starts commands with the collector off (start-up makes only objects that live
    on); `decode` turns it on, with what it loaded frozen out of full collections, before
    searching; any other command at once; and it is on again after `main`, for a program that
    calls it."""
    model, _ = trained
    text = tmp_path / "a.txt"
    text.write_text("a b c\n", encoding="utf-8")

    def states(argv: list[str]) -> str:
        code = f"""
import gc, io, sys
from attn_cli.parse import parsing
from attn_cli import scoring
from attn_cli.decode import translator
from attn_cli.cli import main
seen = {{}}
pairs = parsing.write_training_pairs
def linearizing(*args, **kwargs):
    seen["linearizing"] = gc.isenabled()
    return pairs(*args, **kwargs)
parsing.write_training_pairs = linearizing
load, window, scores = (translator.load_translator, translator.Translator.translate_window,
                        scoring.text_scores)
def loading(*args, **kwargs):
    seen["loading"] = gc.isenabled()
    return load(*args, **kwargs)
def searching(self, *args, **kwargs):
    seen["searching"] = (gc.isenabled(), gc.get_freeze_count() > 0)
    return window(self, *args, **kwargs)
def scoring_text(*args):
    seen["scoring"] = gc.isenabled()
    return scores(*args)
translator.load_translator, translator.Translator.translate_window = loading, searching
scoring.text_scores = scoring_text
sys.stdin = io.TextIOWrapper(io.BytesIO(b"a b\\n"))
try:
    main({argv!r})
except SystemExit as exit_:
    assert not exit_.code, exit_.code
seen["after"] = gc.isenabled()
print(seen, file=sys.stderr)
"""
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return result.stderr.strip().splitlines()[-1]

    assert states(["decode", "-m", str(model), "--beam", "1"]) == str(
        {"loading": False, "searching": (True, True), "after": True})
    assert states(["score", "--ref", str(text), str(text)]) == str(
        {"scoring": True, "after": True})
    treebank = tmp_path / "tiny.mrg"
    treebank.write_text("(TOP (S (NP (DT a) (NN cat)) (VP (VBZ sleeps))))\n", encoding="utf-8")
    assert states(["parse", "linearize", str(treebank), "-o", str(tmp_path / "pairs")]) == str(
        {"linearizing": True, "after": True})



def test_processes_sharing_stderr_never_run_their_lines_together():
    """The ranks of one torchrun job share a stderr pipe: each line is one write (errors.say),
    where print() wrote the text and its newline apart and 3 ranks' refusals arrived as one
    line "error: ...error: ...error: ..." (the CI failure of stop 60)."""
    writer = ("import sys\nfrom attn_cli.errors import say\n"
              "line = 'error: rank ' + sys.argv[1] + ' ' + 'x' * 300\n"
              "for _ in range(200):\n    say(line)\n")
    four = " & ".join(f'"{sys.executable}" -c "$0" {rank}' for rank in range(4)) + "; wait"
    shared = subprocess.run(["bash", "-c", four, writer], cwd=REPO, capture_output=True,
                            text=True, check=True)
    lines = shared.stderr.splitlines()
    assert len(lines) == 4 * 200
    assert all(re.fullmatch(r"error: rank \d x{300}", line) for line in lines)
