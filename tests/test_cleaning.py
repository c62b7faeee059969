"""`attn binarize`'s cleaning filters (attn_cli/cleaning.py): each on hand-made bad pairs, its
drops counted in the summary and listed by --dropped; no filter, the same bytes as ever."""

from __future__ import annotations

import random
import shutil
import sys
import unicodedata

import numpy as np
import pytest

from attn_cli.cleaning import (
    CONTROL_ALLOWED,
    CONTROL_CATEGORIES,
    PairSet,
    digits_differ,
    has_control,
    is_copy,
)
from attn_cli.data import ParallelData
from attn_cli.formats import UNK_ID
from attn_cli.vocab import Vocabulary

from .conftest import REPO, assert_clean_error, run_attn

FIXTURES = REPO / "tests" / "fixtures"

# (source, target, the filter --clean drops it by, or None: kept)
PAIRS = [
    ("A man rides a bike.", "Ein Mann fährt Fahrrad.", None),
    ("Yes.", "Ja, das ist ganz sicher so, und zwar ohne jeden Zweifel an der ganzen Sache.",
     "ratio"),
    ("A dog\u200b runs.", "Ein Hund läuft.", "control"),  # a zero-width space: Cf
    ("A\tdog runs\u200d fast.", "Ein Hund läuft schnell.", None),  # TAB and ZWJ are allowed
    ("Two  dogs play.", "two dogs PLAY.", "copy"),
    ("3 cats and 12 dogs.", "Drei Katzen und 12 Hunde.", "digits"),
    ("It costs 3.50 euros for 2 days.", "Für 2 Tage kostet es 3,50 Euro.", None),  # any order
    (" A  man rides a bike.", "Ein Mann  fährt Fahrrad. ", "duplicate"),  # of line 1
    ("", "Leer.", "empty"),
    ("Page \u0663 of 10.", "Seite 3 von 10.", None),  # an Arabic-Indic 3 is a 3
    ("A snowman \u2603 here.", "Ein Schneemann \u2603 hier.", None),
    ("A snowman \u2602 here.", "Ein Schneemann \u2602 hier.", None),  # <unk> as above, not it
    ("A snowman \u2603 here.", "Ein Schneemann \u2603 hier.", "duplicate"),  # of line 11
]
OPTIONS = {"ratio": ["--max-ratio", "3"], "control": ["--drop-control"],
           "copy": ["--drop-copies"], "digits": ["--drop-digit-mismatch"],
           "duplicate": ["--dedup"]}


@pytest.fixture
def bad_pairs(tmp_path):
    paths = {}
    for side, column in (("en", 0), ("de", 1)):
        paths[side] = tmp_path / f"bad.{side}"
        paths[side].write_text("".join(pair[column] + "\n" for pair in PAIRS), encoding="utf-8")
    return paths


def expected_drops(names: set[str]) -> list[str]:
    """--dropped's lines for the filters `names` (empty sides always go)."""
    return [f"{reason}\t{line}\t{source.replace(chr(9), ' ')}\t{target}"
            for line, (source, target, reason) in enumerate(PAIRS, start=1)
            if reason in names | {"empty"}]


def test_clean_drops_each_bad_pair_by_its_filter_counts_and_lists_it(bad_pairs, spm_model,
                                                                     tmp_path):
    unknown = Vocabulary.from_file(spm_model).encode(["\u2603", "\u2602"])
    assert all(UNK_ID in ids for ids in unknown)  # lines 11-13 test the text behind <unk>
    out, dropped = tmp_path / "clean.st", tmp_path / "dropped.tsv"
    result = run_attn("binarize", "--vocab", spm_model, bad_pairs["en"], bad_pairs["de"],
                      "-o", out, "--clean", "--dropped", dropped)
    assert result.returncode == 0, result.stderr
    assert ("13 lines read, 6 pairs kept, 1 dropped (empty side), 0 dropped (too long), "
            "1 dropped (ratio), 1 dropped (control), 1 dropped (copy), 1 dropped (digits), "
            "2 dropped (duplicate);") in result.stderr
    assert dropped.read_text(encoding="utf-8").splitlines() == expected_drops(set(OPTIONS))
    metadata = ParallelData(out).metadata
    assert metadata["filters"] == "ratio=3,control,copy,digits,duplicate"
    assert (metadata["dropped_ratio"], metadata["dropped_duplicate"]) == ("1", "2")
    assert len(ParallelData(out)) == 6 and "langs" not in metadata


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_filter_alone_drops_only_its_own(name, bad_pairs, spm_model, tmp_path):
    dropped = tmp_path / "dropped.tsv"
    result = run_attn("binarize", "--vocab", spm_model, bad_pairs["en"], bad_pairs["de"],
                      "-o", tmp_path / "one.st", *OPTIONS[name], "--dropped", dropped)
    assert result.returncode == 0, result.stderr
    count = sum(reason == name for _, _, reason in PAIRS)
    assert f"(too long), {count} dropped ({name});" in result.stderr
    assert dropped.read_text(encoding="utf-8").splitlines() == expected_drops({name})


def test_without_filters_the_data_file_is_todays_byte_for_byte(tmp_path):
    for name in ("train.src", "train.tgt"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    dropped = tmp_path / "dropped.tsv"
    result = run_attn("binarize", "--vocab", FIXTURES / "spm.model", tmp_path / "train.src",
                      tmp_path / "train.tgt", "-o", tmp_path / "data.st", "--dropped", dropped)
    assert result.returncode == 0, result.stderr
    assert "0 dropped (too long); " in result.stderr  # the summary as ever
    assert (tmp_path / "data.st").read_bytes() == (FIXTURES / "data.st").read_bytes()
    assert dropped.read_text() == ""


def test_langs_is_recorded(bad_pairs, spm_model, tmp_path):
    out = tmp_path / "langs.st"
    result = run_attn("binarize", "--vocab", spm_model, bad_pairs["en"], bad_pairs["de"],
                      "-o", out, "--langs", "en-fr")
    assert result.returncode == 0, result.stderr
    metadata = ParallelData(out).metadata
    assert metadata["langs"] == "en-fr" and "filters" not in metadata


@pytest.mark.parametrize("options, fragment", [
    (["--max-ratio", "0.5"], "--max-ratio"),
    (["--langid"], "--langs SRC-TGT"),
    (["--langs", "english"], "SOURCE-TARGET"),
    (["--langs", "en-de-fr"], "SOURCE-TARGET"),
])
def test_bad_option_values_are_refused_in_one_line(options, fragment, bad_pairs, spm_model,
                                                   tmp_path):
    out = tmp_path / "bad.st"
    result = run_attn("binarize", "--vocab", spm_model, bad_pairs["en"], bad_pairs["de"],
                      "-o", out, *options)
    assert_clean_error(result, fragment)
    assert not out.exists()


def test_langid_without_py3langid_names_the_extra(bad_pairs, spm_model, tmp_path,
                                                 monkeypatch):
    monkeypatch.setitem(sys.modules, "py3langid", None)
    monkeypatch.setitem(sys.modules, "py3langid.langid", None)
    result = run_attn("binarize", "--vocab", spm_model, bad_pairs["en"], bad_pairs["de"],
                      "-o", tmp_path / "x.st", "--langid", "--langs", "en-de")
    assert_clean_error(result, "py3langid", "pip install 'attn[clean]'")


def test_langid_drops_a_side_in_another_language(spm_model, tmp_path):
    pytest.importorskip("py3langid")
    pairs = [("A man rides his bike down the street with his dog.",
              "Ein Mann fährt mit seinem Hund die Straße entlang."),
             ("Two children are playing in the garden.",
              "Deux enfants jouent dans le jardin avec un ballon rouge."),
             ("Ein Mann steht vor einem großen Gebäude in der Stadt.",
              "Ein Mann steht vor einem großen Gebäude."),
             ("42", "42")]  # no letters: not judged
    paths = {}
    for side, column in (("en", 0), ("de", 1)):
        paths[side] = tmp_path / f"lang.{side}"
        paths[side].write_text("".join(pair[column] + "\n" for pair in pairs), encoding="utf-8")
    dropped = tmp_path / "dropped.tsv"
    result = run_attn("binarize", "--vocab", spm_model, paths["en"], paths["de"], "-o",
                      tmp_path / "lang.st", "--langid", "--langs", "en-de", "--dropped", dropped)
    assert result.returncode == 0, result.stderr
    assert "2 dropped (langid)" in result.stderr
    assert [line.split("\t")[:2] for line in dropped.read_text().splitlines()] == \
        [["langid", "2"], ["langid", "3"]]
    unknown = run_attn("binarize", "--vocab", spm_model, paths["en"], paths["de"], "-o",
                       tmp_path / "x.st", "--langid", "--langs", "en-qq")
    assert_clean_error(unknown, "py3langid does not know qq")


def test_a_failed_binarize_leaves_no_dropped_file(bad_pairs, spm_model, tmp_path):
    short = tmp_path / "short.de"
    short.write_text("Ein Satz.\n", encoding="utf-8")
    dropped = tmp_path / "dropped.tsv"
    result = run_attn("binarize", "--vocab", spm_model, bad_pairs["en"], short, "-o",
                      tmp_path / "x.st", "--clean", "--dropped", dropped)
    assert_clean_error(result, "line counts differ")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bad.de", "bad.en", "short.de"]


def test_pair_set_remembers_across_batches_and_tables():
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2 ** 64, 5000, dtype=np.uint64)
    seen = PairSet(expected=None)
    seen.tables = [np.zeros(1024, dtype=np.uint32)]  # small, so that tables are added
    firsts = [seen.add(np.concatenate([batch, batch[:3]])) for batch in np.split(keys, 10)]
    assert all(first[:500].all() and not first[500:].any() for first in firsts)
    assert len(seen.tables) > 1
    assert not seen.add(keys).any()
    assert seen.add(rng.integers(0, 2 ** 64, 100, dtype=np.uint64)).all()


def test_the_chunk_at_a_time_filters_agree_with_their_definitions():
    """is_copy, digits_differ and has_control take shortcuts over a whole chunk; on random lines
    of spaces, digits (ASCII and not), cases, ß and invisible characters they agree with what
    they stand for, line by line."""
    def numbers(line: str) -> list[int]:
        found, run = [], ""
        for char in line + " ":
            if unicodedata.category(char) == "Nd":
                run += str(unicodedata.decimal(char))
            elif run:
                found, run = found + [run], ""
        return sorted(found)

    rng = random.Random(7)
    alphabet = list("ab AB 12 3\t\u00a0\u0663\u00dfSS\u200b\u200d.,\u2003")
    for _ in range(300):
        sources = ["".join(rng.choices(alphabet, k=rng.randrange(8))) for _ in range(6)]
        targets = [rng.choice([line, line.upper(), line.replace(" ", "  "), line[::-1],
                               "".join(rng.choices(alphabet, k=rng.randrange(8)))])
                   for line in sources]
        pairs = list(zip(sources, targets))
        assert is_copy(sources, targets).tolist() == [
            source.casefold().split() == target.casefold().split() for source, target in pairs]
        assert digits_differ(sources, targets).tolist() == [
            numbers(source) != numbers(target) for source, target in pairs]
        assert has_control(sources, targets).tolist() == [
            any(unicodedata.category(char) in CONTROL_CATEGORIES and char not in CONTROL_ALLOWED
                for char in source + target) for source, target in pairs]
