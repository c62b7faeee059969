"""Several data files, weighted (`attn train A.st B.st C.st --weights 1,1,4`; batching.CorpusMix,
data.Corpora): each corpus's quota an epoch, every pair of a subsampled corpus before any again,
a weighted run resumed bit for bit, one data file drawn from as it always was, and the
refusals."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from attn_cli.batching import MicroBatchStream, corpus_draw, corpus_mix, token_batches
from attn_cli.data import Corpora, ParallelData, binarize
from attn_cli.errors import AttnError
from attn_cli.vocab import Vocabulary

from ..conftest import REPO, assert_clean_error, assert_same_weights, final_weights, run_attn
from ..conftest import train_args as tiny_train_args

FIXTURES = REPO / "tests" / "fixtures"


# ------------------------------------------------------------------------- the draw, by sizes

WEIGHTINGS = [
    ((10, 1000, 37), (1, 1, 4)),  # a tiny corpus upsampled 17x, a big one downsampled 6x
    ((5, 20_000), (1, 1)),  # a 5-pair corpus drawn 2000 times an epoch
    ((300, 7, 50), (0.2, 3, 1e-3)),  # weights as decimals; the last quota 0 or 1
    ((123, 456, 789), None),  # by size: the corpora concatenated
    ((3, 3, 3), (1, 1, 1)),  # even shares, exact
    ((100, 100), (2, 1)),  # remainders to break ties
]


@pytest.mark.parametrize("sizes,weights", WEIGHTINGS)
def test_each_corpus_gives_its_quota_every_epoch_within_one_of_its_share(sizes, weights):
    fractions = None if weights is None else [Fraction(str(weight)) for weight in weights]
    mix = corpus_mix(sizes, fractions)
    total = sum(sizes)
    shares = ([Fraction(size) for size in sizes] if fractions is None else
              [total * weight / sum(fractions) for weight in fractions])
    if fractions is None:
        assert mix.quotas == sizes
    assert sum(mix.quotas) == total
    assert all(abs(quota - share) < 1 for quota, share in zip(mix.quotas, shares))
    for epoch in (0, 1, 2, 7, 1000):
        pairs = mix.epoch_pairs(seed=3, epoch=epoch)
        assert len(pairs) == total and pairs.min() >= 0 and pairs.max() < total
        assert tuple(np.bincount(mix.corpus_of(pairs), minlength=len(sizes))) == mix.quotas


def test_the_default_weights_draw_the_concatenation_pair_for_pair():
    mix = corpus_mix((4, 9, 2))
    for epoch in range(3):
        assert np.array_equal(mix.epoch_pairs(seed=1, epoch=epoch), np.arange(15))


@pytest.mark.parametrize("size,quota", [(100, 30), (100, 99), (7, 3), (10, 25), (5, 2000),
                                        (50, 50)])
def test_every_pair_is_seen_before_any_is_seen_again(size, quota):
    """Through the epochs, the counts of a corpus's pairs never differ by more than one: a
    subsampled corpus shows each pair once before any twice (its passes go on across epochs),
    an upsampled one repeats whole passes. And the draw is the seed's."""
    seen = np.zeros(size, dtype=np.int64)
    for epoch in range(12):
        drawn = corpus_draw(size, quota, seed=5, corpus=1, epoch=epoch)
        assert len(drawn) == quota and np.all(np.diff(drawn) >= 0)
        seen += np.bincount(drawn, minlength=size)
        assert seen.max() - seen.min() <= 1, (epoch, seen)
    again = [corpus_draw(size, quota, seed=5, corpus=1, epoch=epoch) for epoch in range(3)]
    other = [corpus_draw(size, quota, seed=6, corpus=1, epoch=epoch) for epoch in range(3)]
    assert all(np.array_equal(a, corpus_draw(size, quota, 5, 1, e)) for e, a in enumerate(again))
    if quota % size:  # a part-pass is drawn: another seed draws other pairs
        assert any(not np.array_equal(a, b) for a, b in zip(again, other))


def test_a_tiny_corpus_drawn_25000_times_an_epoch_is_counted_not_permuted_each_time():
    """Whole passes inside an epoch's stretch give every pair once whatever their order: only
    the part-passes at its two ends are permuted (here 2 permutations, not 25,000)."""
    mix = corpus_mix((1_000_000, 20), [Fraction(1), Fraction(1)])
    pairs = mix.epoch_pairs(seed=1, epoch=4)
    assert np.bincount(mix.corpus_of(pairs)).tolist() == list(mix.quotas) == [500_010, 500_010]
    tiny = np.bincount(pairs[pairs >= 1_000_000] - 1_000_000)
    assert tiny.max() - tiny.min() <= 2


# --------------------------------------------------------------------------- data files

def _binarize(directory: Path, name: str, lines: slice) -> Path:
    """A data file of the fixture corpus's `lines`, in its toy vocabulary."""
    sources = (FIXTURES / "train.src").read_text().splitlines()[lines]
    targets = (FIXTURES / "train.tgt").read_text().splitlines()[lines]
    (directory / f"{name}.src").write_text("\n".join(sources) + "\n")
    (directory / f"{name}.tgt").write_text("\n".join(targets) + "\n")
    out = directory / f"{name}.st"
    binarize(directory / f"{name}.src", directory / f"{name}.tgt", out,
             Vocabulary((FIXTURES / "spm.model").read_bytes()))
    return out


def _with_metadata(path: Path, out: Path, **changes: str) -> Path:
    """A copy of the data file `path` with its metadata changed (what `binarize --langs`, a
    target tag or another vocabulary would record)."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as handle:
        metadata = handle.metadata()
    save_file(load_file(str(path)), str(out), {**metadata, **changes})
    return out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """small.st: 30 pairs; big.st: 300 others; the pair of them with language pairs recorded."""
    directory = tmp_path_factory.mktemp("corpora")
    files = {"small": _binarize(directory, "small", slice(0, 30)),
             "big": _binarize(directory, "big", slice(30, 330))}
    for name, langs in (("en-de", "en-de"), ("en-fr", "en-fr"), ("fr-de", "fr-de")):
        files[name] = _with_metadata(files["small"], directory / f"{name}.st", langs=langs)
    for name, langs in (("en-de.tagged", "en-de"), ("en-fr.tagged", "en-fr")):
        files[name] = _with_metadata(files["small"], directory / f"{name}.st", langs=langs,
                                     target_tag=f"<2{langs[-2:]}>")
    files["other-vocab"] = _with_metadata(files["small"], directory / "other-vocab.st",
                                          src_vocab_sha256="0" * 64, tgt_vocab_sha256="0" * 64)
    return files


def test_corpora_read_as_one(corpora):
    data = Corpora([corpora["small"], corpora["big"]])
    small, big = ParallelData(corpora["small"]), ParallelData(corpora["big"])
    assert len(data) == 330 and data.sizes == (30, 300) and data.names == ["small", "big"]
    for index, (part, local) in {0: (small, 0), 29: (small, 29), 30: (big, 0),
                                 329: (big, 299)}.items():
        assert all(np.array_equal(a, b) for a, b in zip(data.pair(index), part.pair(local)))
        assert data.tgt_lengths[index] == part.tgt_lengths[local]
    assert Corpora([corpora["small"], corpora["small"]]).names == ["small-1", "small-2"]


def test_a_weighted_epoch_feeds_the_batching_the_pairs_it_draws(corpora):
    """The micro-batches of an epoch hold the mix's draw, no more, no less, whatever the budget
    (and a budget changed in the middle of the epoch, as a resume on other processes does)."""
    data = Corpora([corpora["small"], corpora["big"]])
    mix = corpus_mix(data.sizes, [Fraction(3), Fraction(1)])
    for earlier in ((), ((90, 4),)):
        stream = MicroBatchStream(data, 120, seed=2, epoch=1, earlier_budgets=earlier, mix=mix)
        batches = stream.take(stream.epoch_length)
        assert stream.epoch == 1
        assert np.array_equal(np.sort(np.concatenate(batches)), mix.epoch_pairs(2, 1))


def _epoch_batches_before_corpora(data: ParallelData, max_tokens: int, seed: int, epoch: int,
                                  earlier_budgets: tuple = ()) -> list[np.ndarray]:
    """MicroBatchStream's epoch as it was cut before several data files (commit caaa635)."""
    unused = np.arange(len(data))
    batches = []
    for budget, count in (*earlier_budgets, (max_tokens, None)):
        if len(unused) == 0:
            break
        cut = token_batches(data.src_lengths[unused], data.tgt_lengths[unused], budget, seed,
                            epoch)[:count]
        cut = [unused[indices] for indices in cut]
        batches += cut
        if count is not None:
            unused = np.setdiff1d(unused, np.concatenate(cut))
    return batches


@pytest.mark.parametrize("weights", [None, [Fraction(5)]])
def test_one_data_file_is_batched_as_it_always_was(corpora, weights):
    """One data file, with or without a weight: the same micro-batches, epoch after epoch, as
    before several data files (cut whole, and cut again after a change of budget)."""
    one = ParallelData(corpora["big"])
    data = Corpora([corpora["big"]])
    mix = corpus_mix(data.sizes, weights)
    for epoch in (0, 1, 3):
        for earlier in ((), ((150, 3),), ((150, 3), (60, 5))):
            expected = _epoch_batches_before_corpora(one, 100, 9, epoch, earlier)
            stream = MicroBatchStream(data, 100, 9, epoch, 0, earlier, mix=mix)
            got = stream.take(stream.epoch_length)
            assert len(got) == len(expected)
            assert all(np.array_equal(a, b) for a, b in zip(got, expected))


# --------------------------------------------------------------------------------- training

STEPS = ["--batch-tokens", 400, "--save-every", 4, "--seed", 4]


def train_args(data: list[Path], run_dir: Path, *extra) -> list:
    return tiny_train_args(data[0], run_dir, *data[1:], *STEPS, *extra)


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timing = ("tokens_per_s", "src_tokens_per_s", "elapsed_s")
    return [{key: value for key, value in row.items() if key not in timing} for row in rows]


def test_a_weighted_run_resumed_equals_the_uninterrupted_one_bit_for_bit(corpora, tmp_path):
    """30 pairs drawn 3:1 against 300 (upsampled ~8x, subsampled to ~1/4), an epoch ~5 steps:
    stopped at step 4 and resumed to 9 (across an epoch), the weights and every metrics row
    (the per-corpus counts too) equal those of the run that went straight to 9."""
    data = [corpora["small"], corpora["big"]]
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    result = run_attn(*train_args(data, whole, "--weights", "3,1", "--max-steps", 9))
    assert result.returncode == 0, result.stderr
    assert "330 training pairs in 2 data files" in result.stderr
    assert f"corpus {corpora['small']}: 30 pairs, weight 0.75, 248 pairs an epoch" \
        in result.stderr
    for steps, resume in ((4, ()), (9, ("--resume",))):
        result = run_attn(*train_args(data, parted, "--weights", "3,1", "--max-steps", steps,
                                      *resume))
        assert result.returncode == 0, result.stderr
    assert_same_weights(final_weights(parted), final_weights(whole))
    rows = _rows(whole)
    assert _rows(parted) == rows
    assert rows[-1]["epoch"] >= 1  # the resumed part crossed into the next epoch
    for row in rows:
        if "loss" in row:
            assert row["pairs/small"] > 0 and row["pairs/big"] > 0
            assert row["tgt_tokens/small"] > row["pairs/small"]
    drawn = sum(row.get("pairs/small", 0) + row.get("pairs/big", 0) for row in rows)
    small = sum(row.get("pairs/small", 0) for row in rows)
    assert math.isclose(small / drawn, 248 / 330, abs_tol=0.1)


def test_one_data_file_trains_as_before_and_writes_no_per_corpus_counts(corpora, tmp_path):
    """`--weights 7` on one data file changes nothing: the same weights as without it."""
    plain, weighted = tmp_path / "plain", tmp_path / "weighted"
    for run_dir, extra in ((plain, ()), (weighted, ("--weights", "7"))):
        result = run_attn(*train_args([corpora["small"]], run_dir, "--max-steps", 2, *extra))
        assert result.returncode == 0, result.stderr
        assert "data files" not in result.stderr
    assert_same_weights(final_weights(weighted), final_weights(plain))
    assert not any("pairs/" in key for row in _rows(plain) for key in row)


# -------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("weights,fragments", [
    ("1,4", ["gives 2 weight(s) for 3 data file(s)", "small.st", "big.st", "en-de.st"]),
    ("1,2,3,4", ["gives 4 weight(s) for 3 data file(s)"]),
    ("1,0,4", ["the weight of", "big.st", "'0', is not a positive number"]),
    ("1,-2,4", ["big.st", "'-2', is not a positive number"]),
    ("1,2,nan", ["en-de.st", "'nan', is not a positive number"]),
    ("1,inf,2", ["big.st", "'inf'"]),
    ("1,,2", ["big.st", "'', is not a positive number"]),
])
def test_bad_weights_are_one_line_naming_the_file(corpora, tmp_path, weights, fragments):
    data = [corpora["small"], corpora["big"], corpora["en-de"]]
    result = run_attn(*train_args(data, tmp_path / "run", "--weights", weights, "--max-steps", 1))
    assert_clean_error(result, "--weights", *fragments)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("names,fragments", [
    (["small", "other-vocab"], ["other-vocab.st was binarized with another vocabulary than",
                                "small.st", "--vocab"]),
    (["en-de", "en-fr"], ["en-fr.st records the language pair en-fr and", "en-de.st en-de",
                          "carries no target tag"]),
    (["en-de.tagged", "en-fr"], ["en-fr.st carries no target tag"]),
])
def test_data_files_that_cannot_be_mixed_are_one_line_naming_the_file(corpora, tmp_path, names,
                                                                      fragments):
    result = run_attn(*train_args([corpora[name] for name in names], tmp_path / "run",
                                  "--max-steps", 1))
    assert_clean_error(result, *fragments)


def test_target_languages_may_differ_where_each_file_carries_its_tag(corpora):
    """Allowed: different targets, each file tagged; different sources into one target (a
    many-to-one model); a file that records no languages beside one that does."""
    for names in (["en-de.tagged", "en-fr.tagged"], ["en-de", "fr-de"], ["small", "en-fr"]):
        assert len(Corpora([corpora[name] for name in names]).parts) == 2


def test_a_data_file_without_pairs_is_refused(corpora, tmp_path):
    """An empty corpus has nothing to draw (and one alone would batch nothing, for ever)."""
    tensors = {name: tensor[:1] if name.endswith(".offsets") else
               tensor[:0] if name.endswith(".ids") else tensor
               for name, tensor in load_file(str(corpora["small"])).items()}
    empty = _with_metadata(corpora["small"], tmp_path / "empty.st")
    save_file(tensors, str(empty), ParallelData(corpora["small"]).metadata)
    with pytest.raises(AttnError, match=f"data file {empty} holds no pairs"):
        Corpora([corpora["small"], empty])


def test_guided_alignment_takes_one_data_file(corpora, tmp_path):
    result = run_attn(*train_args([corpora["small"], corpora["big"]], tmp_path / "run",
                                  "--guided-alignment", "--max-steps", 1))
    assert_clean_error(result, "--guided-alignment reads the alignments of one data file")

