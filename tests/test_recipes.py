"""The example Makefiles in DRYRUN mode: every command they would run must exist with the options
it uses, so the recipes cannot rot while the command line changes."""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import typer

from attn_cli.cli import app

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def recipe_environment(**extra: str) -> dict:
    """This process's environment less what the recipes read: make takes an exported MIRROR,
    NPROC or WORK (or an outer make's MAKEFLAGS) as the recipe's own setting, and the tests
    would test the caller's machine instead of the recipe."""
    read = set()
    for path in EXAMPLES.rglob("*"):
        if path.name == "Makefile" or path.suffix == ".mk":
            text = path.read_text(encoding="utf-8")
            read |= set(re.findall(r"^(\w+)\s*[?:]?=", text, re.M))
            read |= set(re.findall(r"\$[({](\w+)[)}]", text))
    read |= {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEFILES", "GNUMAKEFLAGS"}
    return {**{key: value for key, value in os.environ.items() if key not in read}, **extra}


def dry_run(recipe: str, *targets: str, **variables: str) -> list[str]:
    settings = [f"{key}={value}" for key, value in {"DRYRUN": "1", "WORK": "/nonexistent-work",
                                                    **variables}.items()]
    result = subprocess.run(["make", "-C", str(EXAMPLES / recipe), *settings, *targets],
                            capture_output=True, text=True, timeout=60,
                            env=recipe_environment())
    assert result.returncode == 0, result.stderr
    return result.stdout.replace("\\\n", " ").splitlines()


def attn_commands(lines: list[str]) -> list[list[str]]:
    """The attn invocations in the printed commands (plain or under torchrun), as argv lists."""
    commands = []
    for line in lines:
        for part in line.split("&&"):
            if part.split()[:1] not in (["attn"], ["torchrun"]):
                continue  # not a command of ours (shell around it: awk, printf, ...)
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
    ("multi30k-multi", ["compare"], ["vocab", "binarize", "train", "average", "decode",
                                     "score"]),
    ("wmt14-en-de", ["base", "big"], ["vocab", "binarize", "train", "average", "decode", "score"]),
    ("wmt14-en-fr", ["base", "big"], ["vocab", "binarize", "train", "average", "decode", "score"]),
    ("wsj-parse", [], ["parse", "vocab", "binarize", "train", "average", "score"]),
    ("multi30k-student", ["all", "compare"], ["decode", "vocab", "binarize", "train",
                                              "average", "score"]),
])
def test_recipe_commands_exist(recipe, targets, expected, sample_treebank):
    commands = attn_commands(dry_run(recipe, *targets, SAMPLE=str(sample_treebank)))
    assert [c for c in expected if not any(cmd[0] == c for cmd in commands)] == []
    for argv in commands:
        check_options(argv)


def test_wmt_recipes_follow_the_paper():
    text = " ".join(dry_run("wmt14-en-de", "base", "big"))
    assert "--size 37000" in text and "--batch-tokens 25000" in text
    assert "--sample 4000000" in text  # the vocabulary learned from a sample of lines
    assert "--preset base" in text and "--max-steps 100000" in text
    assert "--preset big" in text and "--max-steps 300000" in text
    # the paper's checkpoint every 10 minutes, as steps: 0.4 s a base step, 1.0 s a big one
    assert "--save-every 1500 --keep 5" in text and "--save-every 600 --keep 20" in text
    assert "--last 5" in text and "--last 20" in text
    assert "--beam 4 --alpha 0.6 --max-len-a 1 --max-len-b 50" in text
    assert "sacrebleu -t wmt14/full -l en-de" in text
    for score in ("--metrics bleu,chrf >", "--metrics bleu --tokenize intl >>",
                  "--metrics bleu --tokenize compound-split >>"):  # 13a, intl, the paper's
        assert text.count(score) == 2, score  # base and big
    assert "torchrun" in text and "--nproc-per-node 8" in text
    # a step's 25000 tokens in one pass per GPU unless MAX_TOKENS caps it (review R1: on one
    # GPU a 4096 cap made 7 passes of the same kernels for a seventh of the work each)
    assert "--max-tokens" not in text
    assert "--max-tokens" not in " ".join(dry_run("wmt14-en-de", "base", NPROC="1"))
    assert "--max-tokens 4096" in " ".join(dry_run("wmt14-en-de", "base", MAX_TOKENS="4096"))
    french = " ".join(dry_run("wmt14-en-fr", "big"))
    assert "--size 32000" in french and "--preset big-enfr" in french
    assert "--tokenize compound-split" in french


def test_student_recipe_distils_the_demos_teacher_into_a_deep_shallow_student():
    text = [re.sub(r"\s+", " ", line) for line in dry_run("multi30k-student", "compare")]
    joined = " ".join(text)
    # the teacher's beam-4 translations of the training sources are the student's targets
    assert "decode -m ../multi30k/work/model.st --beam 4 < /nonexistent-work/distil.en" \
        in joined
    assert "vocab /nonexistent-work/distil.en /nonexistent-work/distil.de" in joined
    assert "--size 4000" in joined
    # (the demo's own train command too, where the checkout has no teacher yet)
    train = [line for line in text if line.startswith("attn train") and "distil" not in line
             and "--encoder-layers" in line]
    assert len(train) == 1
    assert "--preset small --encoder-layers 3 --decoder-layers 1 --norm pre --d-model 192 " \
        "--d-ff 768" in train[0]
    assert "--valid-ref /nonexistent-work/val.de" in train[0]  # the human references
    # both models and the student's --int8, timed in turns in the same run
    assert "-m benchmarks.decode_models" in joined and "--rounds 3" in joined
    assert '--run "student --int8=' in joined and "--beams 4,1" in joined
    # a teacher the demo has not made yet is made by the demo's own recipe
    quick = " ".join(dry_run("multi30k-student", "compare", QUICK="1",
                             TEACHER_WORK="nonexistent-teacher"))
    assert "head -n 5000" in quick and "--max-time 3m" in quick
    assert "make -C ../multi30k WORK=nonexistent-teacher QUICK=1 nonexistent-teacher/model.st" \
        in re.sub(r"\s+", " ", quick).replace("make[1]: ", "")
    assert "-o nonexistent-teacher/run --preset small" in quick  # the demo's own commands


def test_multilingual_recipe_tags_each_pair_and_compares_with_single_pairs():
    text = [re.sub(r"\s+", " ", line) for line in dry_run("multi30k-multi", "compare")]
    joined = " ".join(text)
    assert "--tags de,fr,cs" in joined and "--weights 1,1,1" in joined
    for lang in ("de", "fr", "cs"):
        assert f"--langs en-{lang} --target-tag {lang}" in joined
        assert f"decode -m /nonexistent-work/model.st --target-lang {lang}" in joined
        # the single-pair model: the demo's own recipe, into its own directory
        assert f"TGT={lang}" in joined and f"/single/{lang}/test_2016_flickr.bleu" in joined
    train = [line for line in text if line.startswith("attn train")]
    assert len(train) == 4  # the one model of three pairs, and one per pair, 20 minutes each
    assert "train.de.st /nonexistent-work/train.fr.st /nonexistent-work/train.cs.st" in train[0]
    assert all("--max-time 20m" in line for line in train)
    for name in ("train", "val", "test_2016_flickr"):  # a fresh clone has every language
        for lang in ("en", "de", "fr", "cs"):
            assert (BUNDLED / f"{name}.{lang}.gz").is_file()


# The WMT archives fairseq's prepare-wmt14en2{de,fr}.sh and tensor2tensor fetch: their size and
# SHA-256 (as tensorflow-datasets records them), and the corpora inside them (without the
# .LANG suffix).
WMT_ARCHIVES = {
    "http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz": (
        657632379, "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7",
        {"training/europarl-v7.de-en", "training/europarl-v7.fr-en"}),
    "http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz": (
        918311367, "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5",
        {"commoncrawl.de-en", "commoncrawl.fr-en"}),
    "http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz": (
        80418416, "cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485",
        {"training/news-commentary-v9.de-en", "training/news-commentary-v9.fr-en"}),
    "http://www.statmt.org/wmt13/training-parallel-un.tgz": (
        2365634246, "29141b5c1eba149a94f7a59d3b1a834b2e47fe0f8758d68dcd77a3d3f497ee47",
        {"un/undoc.2000.fr-en"}),
    "http://www.statmt.org/wmt10/training-giga-fren.tar": (
        2595102720, "3ff8319f6919393520559bfbc7ad6a747ec81b3abc7be9993b338d4b017b4d9a",
        {"giga-fren.release2.fixed"}),
}


@pytest.mark.parametrize("recipe,src,tgt,corpora", [
    ("wmt14-en-de", "en", "de", 3),
    ("wmt14-en-fr", "en", "fr", 5),
])
def test_wmt_recipes_read_what_they_download(recipe, src, tgt, corpora):
    """Every archive is fetched resumably, checked by size and SHA-256, and extracted; every
    training file read comes out of an archive fetched (the europarl-v7 text is the WMT13
    repackage's training/ layout, not the Europarl site's de-en.tgz), and the two sides list
    the same corpora in the same order."""
    lines = dry_run(recipe, "base")
    download = "/nonexistent-work/download"
    fetched = {}
    for line in lines:
        match = re.search(r"curl (.*) -o (\S+) (http\S+)$", line)
        if match:
            assert "-C -" in match.group(1), line  # a cut download resumes
            fetched[match.group(3)] = match.group(2)
            assert match.group(2) == f"{download}/{match.group(3).rsplit('/', 1)[1]}"
    assert len(fetched) == corpora and set(fetched) <= set(WMT_ARCHIVES)
    text = "\n".join(lines)
    members = set()
    for url, archive in fetched.items():
        size, sha256, inside = WMT_ARCHIVES[url]
        assert f'test "$(stat -c %s {archive})" = "{size}"' in text
        assert f'echo "{sha256}  {archive}" | sha256sum -c' in text
        assert f"tar -xf {archive} -C {download}" in text
        members |= inside
    read = {}
    for side in (src, tgt):
        (cat,) = [line for line in lines
                  if line.startswith("cat ") and line.endswith(f"> /nonexistent-work/train.{side}")]
        files = cat.split(">")[0].split()[1:]
        assert all(path.startswith(f"{download}/") and path.endswith(f".{side}")
                   for path in files), files
        read[side] = [path[len(download) + 1:-len(side) - 1] for path in files]
        for path in files:
            assert f"test -s {path}" in text  # looked for once extracted
    assert read[src] == read[tgt] and len(read[src]) == corpora
    assert set(read[src]) <= members, set(read[src]) - members


def test_parse_recipe_splits_the_sample(sample_treebank):
    text = " ".join(dry_run("wsj-parse", SAMPLE=str(sample_treebank)))
    train = text.split("-o /nonexistent-work/train")[0]
    assert "wsj_0001.mrg" in train and "wsj_0159.mrg" in train and "wsj_0160" not in train
    assert "--preset parse-small" in text


def test_parse_recipe_without_a_treebank_is_a_clear_error(tmp_path):
    result = subprocess.run(["make", "-C", str(EXAMPLES / "wsj-parse"), "DRYRUN=1",
                             f"SAMPLE={tmp_path}"], capture_output=True, text=True, timeout=60,
                            env=recipe_environment())
    assert result.returncode != 0 and "no treebank files found" in result.stderr


def test_parse_recipe_uses_the_full_treebank_split_when_given(tmp_path):
    for section in ("02", "21", "22", "23"):
        (tmp_path / section).mkdir()
        (tmp_path / section / f"wsj_{section}01.mrg").write_text("")
    text = " ".join(dry_run("wsj-parse", PTB=str(tmp_path)))
    assert "--preset parse-wsj" in text and "--beam 21 --alpha 0.3" in text
    assert "02/wsj_0201.mrg" in text and "21/wsj_2101.mrg" in text and "23/wsj_2301.mrg" in text


# ------------------------------------------------------------------ a WMT recipe, end to end

BUNDLED = EXAMPLES / "multi30k" / "data"


def bundled_lines(name: str, start: int, count: int) -> list[str]:
    with gzip.open(BUNDLED / f"{name}.gz", "rt", encoding="utf-8") as handle:
        return handle.read().splitlines()[start:start + count]


def stand_in_mirror(directory: Path) -> Path:
    """The en-de archives with the releases' layout (training/europarl-v7.de-en.en, ...; one
    text gzipped inside, as giga-fren's is), a hundred Multi30k pairs in each, and their
    SHA-256s in `sha256sum`'s format: what a mirror on a machine without the internet holds."""
    directory.mkdir()
    layout = {"training-parallel-europarl-v7.tgz": "training/europarl-v7.de-en",
              "training-parallel-commoncrawl.tgz": "commoncrawl.de-en",
              "training-parallel-nc-v9.tgz": "training/news-commentary-v9.de-en"}
    sums = []
    for number, (archive, inside) in enumerate(layout.items()):
        staging = directory / f"staging-{number}"
        for side in ("en", "de"):
            path = staging / f"{inside}.{side}"
            path.parent.mkdir(parents=True, exist_ok=True)
            text = "\n".join(bundled_lines(f"train.{side}", 100 * number, 100)) + "\n"
            if number == 1 and side == "de":
                path = path.with_name(path.name + ".gz")
                path.write_bytes(gzip.compress(text.encode("utf-8")))
            else:
                path.write_text(text, encoding="utf-8")
        with tarfile.open(directory / archive, "w:gz") as tar:
            for path in sorted(staging.rglob("*")):
                if path.is_file():
                    tar.add(path, arcname=str(path.relative_to(staging)))
        digest = hashlib.sha256((directory / archive).read_bytes()).hexdigest()
        sums.append(f"{digest}  {archive}")
    (directory / "SHA256SUMS").write_text("\n".join(sums) + "\n", encoding="utf-8")
    return directory


@pytest.mark.long  # a whole recipe, ~14 s on 2 cores: CI runs it after make test
@pytest.mark.skipif(shutil.which("curl") is None, reason="the recipes download with curl")
def test_wmt_recipe_runs_end_to_end_from_a_mirror(tmp_path):
    """`make base` of the en-de recipe on a stand-in mirror (file://), through every target:
    the downloads checked against the mirror's SHA-256s and extracted, a vocabulary from a
    sample of the lines, binarized data, a few training steps under torchrun, the average,
    the decoded test set and the three BLEU scores. A second `make` finds it all done; a
    corrupted archive is deleted with one message."""
    mirror = stand_in_mirror(tmp_path / "mirror")
    for split, name in (("dev", "val"), ("test", "test_2016_flickr")):
        for side in ("en", "de"):
            (tmp_path / f"{split}.{side}").write_text(
                "\n".join(bundled_lines(f"{name}.{side}", 0, 30)) + "\n", encoding="utf-8")
    work = tmp_path / "work"
    settings = {
        "WORK": work, "MIRROR": f"file://{mirror}", "CHECKSUMS": mirror / "SHA256SUMS",
        "DEV_SRC": tmp_path / "dev.en", "DEV_REF": tmp_path / "dev.de",
        "TEST_SRC": tmp_path / "test.en", "TEST_REF": tmp_path / "test.de",
        "ATTN": f"{sys.executable} -m attn_cli", "PYTHON": sys.executable,
        "TORCHRUN_COMMAND": f"{sys.executable} -m torch.distributed.run", "NPROC": 1,
        "VOCAB_SIZE": 300, "VOCAB_SAMPLE": 250, "PRESET_base": "tiny", "STEPS_base": 4,
        "SAVE_base": 2, "AVERAGE_base": 2, "MAX_TOKENS": 1000, "DTYPE": "fp32"}

    def make(*targets):
        return subprocess.run(["make", "-C", str(EXAMPLES / "wmt14-en-de"), *targets,
                               *(f"{key}={value}" for key, value in settings.items())],
                              capture_output=True, text=True, timeout=300,
                              env=recipe_environment(OMP_NUM_THREADS="1"))

    result = make("base")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (work / "train.en").read_text(encoding="utf-8").count("\n") == 300
    assert [path.name for path in sorted((work / "base").glob("checkpoint-*.st"))
            if ".state" not in path.name] == ["checkpoint-2.st", "checkpoint-4.st"]
    assert len((work / "base.test.de").read_text(encoding="utf-8").splitlines()) == 30
    scores = (work / "base.bleu").read_text(encoding="utf-8").splitlines()
    assert len(scores) == 4 and scores[0].startswith("BLEU") and "chrF" in scores[1]
    assert "intl" in scores[2] and "compound-split" in scores[3]
    again = make("base")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout

    # A corrupt archive: deleted, with a message, and the make fails.
    (work / "download" / "commoncrawl.extracted").unlink()
    archive = work / "download" / "training-parallel-commoncrawl.tgz"
    archive.write_bytes(archive.read_bytes()[:-10] + b"0123456789")
    (mirror / archive.name).write_bytes(archive.read_bytes())
    broken = make(str(work / "download" / "commoncrawl.extracted"))
    assert broken.returncode != 0 and "is corrupt (SHA-256): deleted" in broken.stderr
    assert not archive.exists()
