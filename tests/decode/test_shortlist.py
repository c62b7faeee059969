"""Vocabulary shortlists (decode/shortlist.py; issue 44): IBM model 1 against the textbook's
loops, the shortlist's choice, the output projection over a shortlist against the full one
masked, a search with every piece shortlisted equal to the free search, and `attn shortlist` and
`decode --shortlist` through the real entry point, bad files included."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from attn_cli.data import ParallelData
from attn_cli.decode.shortlist import Shortlist, build, ibm_model1
from attn_cli.decode.translator import load_translator
from attn_cli.devices import inference_model
from attn_cli.search import beam_search, sample, sentence_uniforms
from attn_cli.vocab import Vocabulary

from ..conftest import assert_clean_error, run_attn
from ..toys import random_model, save_random_model


def textbook_model1(pairs: list[tuple[list[int], list[int]]], null: int,
                    iterations: int) -> dict[tuple[int, int], float]:
    """Brown et al. (1993)'s EM for model 1, as loops over dictionaries: t(f|e) uniform, then
    each round the expected counts c(f, e) of each target token f over its sentence's sources
    and NULL, normalised per source e."""
    t: dict[tuple[int, int], float] = defaultdict(lambda: 1.0)
    for _ in range(iterations):
        counts: dict[tuple[int, int], float] = defaultdict(float)
        totals: dict[int, float] = defaultdict(float)
        for source, target in pairs:
            extended = source + [null]
            for f in target:
                norm = sum(t[(e, f)] for e in extended)
                for e in extended:
                    share = t[(e, f)] / norm
                    counts[(e, f)] += share
                    totals[e] += share
        t = defaultdict(float, {(e, f): count / totals[e] for (e, f), count in counts.items()})
    return dict(t)


@pytest.fixture(scope="module")
def data(data_files) -> ParallelData:
    return ParallelData(data_files[0])


def test_ibm_model1_is_the_textbooks(data):
    pairs = [tuple(side.tolist() for side in data.pair(i)) for i in range(60)]
    null = len(data.src_vocab)
    expected = textbook_model1(pairs, null, iterations=3)

    class First60:  # the data file's first 60 pairs, as ibm_model1 reads a data file
        path, src_vocab, tgt_vocab, ids, offsets = (data.path, data.src_vocab, data.tgt_vocab,
                                                    data.ids, data.offsets)
        src_lengths, tgt_lengths = data.src_lengths[:60], data.tgt_lengths[:60]

        def __len__(self):
            return 60

    table = ibm_model1(First60(), iterations=3)
    size = table.target_size
    found = {(int(k // size), int(k % size)): p for k, p in zip(table.keys, table.probs)}
    assert set(found) == set(expected)
    assert max(abs(found[key] - expected[key]) for key in expected) < 1e-12
    # each source's probabilities sum to one
    sums = np.bincount(table.keys // size, weights=table.probs)
    assert np.allclose(sums[np.unique(table.keys // size)], 1.0)
    # every target token counted once per pair
    assert table.target_counts.sum() == sum(len(target) for _, target in pairs)


def test_chunks_cut_anywhere_learn_the_same_table(data, monkeypatch):
    whole = ibm_model1(data, iterations=2)
    monkeypatch.setattr("attn_cli.decode.shortlist.CHUNK_ENTRIES", 997)  # many small chunks
    cut = ibm_model1(data, iterations=2)
    assert np.array_equal(whole.keys, cut.keys)
    assert np.allclose(whole.probs, cut.probs, rtol=1e-12, atol=0)
    sampled = ibm_model1(data, iterations=1, max_pairs=100)
    assert sampled.target_counts.sum() < whole.target_counts.sum()


def test_the_shortlist_keeps_each_pieces_best_and_the_frequent(data):
    table = ibm_model1(data, iterations=3)
    shortlist = build(table, data, best=4, frequent=10, threshold=0.0)
    size = table.target_size
    sources, targets = table.keys // size, table.keys % size
    for source in np.unique(sources)[:40]:
        if source >= len(data.src_vocab):
            continue  # NULL
        mine = sources == source
        ranked = targets[mine][np.argsort(-table.probs[mine], kind="stable")]
        row = shortlist.candidates[source]
        assert list(row[row >= 0]) == list(ranked[:4])
    assert (shortlist.candidates[~np.isin(np.arange(len(data.src_vocab)), sources)] == -1).all()
    probable = build(table, data, best=4, frequent=10, threshold=0.2).candidates
    probability = dict(zip(table.keys.tolist(), table.probs.tolist()))
    kept = [(source, target) for source, row in enumerate(probable) for target in row[row >= 0]]
    assert kept and all(probability[source * size + target] >= 0.2 for source, target in kept)
    assert (probable >= 0).sum() < (shortlist.candidates >= 0).sum()
    frequent = set(np.argsort(-table.target_counts, kind="stable")[:10].tolist())
    assert set(shortlist.always.tolist()) == frequent | {3, 1}  # and </s>, <unk>
    src = torch.tensor([[int(sources[0]), 0, 0]])  # padding adds nothing
    allowed = shortlist.ids_for(src, keep={7})
    row = shortlist.candidates[int(sources[0])]
    assert set(allowed.tolist()) == set(row[row >= 0].tolist()) | frequent | {1, 3, 7} | \
        set(shortlist.candidates[0][shortlist.candidates[0] >= 0].tolist())
    assert allowed.tolist() == sorted(allowed.tolist())


@pytest.mark.parametrize("linears", ["dense", "packed", "int8"])
def test_the_projection_over_a_shortlist_is_the_full_ones_there(linears):
    model = inference_model(random_model(vocab=50, seed=3), torch.device("cpu"),
                            linears=linears)
    assert linears != "packed" or hasattr(model.output_projection, "for_rows")
    ids = torch.tensor([1, 3, 8, 9, 20, 49])
    hidden = torch.randn(5, model.config.d_model)
    subset = model.output_subset(ids)(hidden)
    assert subset.shape == (5, 6)  # column c: id ids[c]
    full = model.step_logits(hidden)
    # int8: the rows quantized each on its own, as the whole projection's are
    assert torch.allclose(subset, full[:, ids], atol=1e-5)


class Masked:
    """The model with every logit outside `allowed` -inf: what a shortlist means."""

    def __init__(self, model, allowed: torch.Tensor):
        self.model, self.config, self.allowed = model, model.config, allowed

    def encode(self, src_tokens):
        return self.model.encode(src_tokens)

    def start_decoding(self, memory, src_mask):
        return self.model.start_decoding(memory, src_mask)

    def decode_step(self, tokens, cache):
        logits, cache = self.model.decode_step(tokens, cache)
        outside = torch.ones(logits.shape[-1], dtype=torch.bool)
        outside[self.allowed] = False
        return logits.masked_fill(outside, -math.inf), cache


def test_a_search_over_a_shortlist_is_the_masked_models_and_over_everything_the_free_one():
    model = random_model(vocab=40, seed=4)
    src = torch.tensor([[5, 9, 12, 7, 3], [8, 30, 3, 0, 0], [21, 22, 23, 24, 3]])
    with torch.inference_mode():
        free = beam_search(model, src, beam=4, nbest=2, max_len_b=8)
        everything = beam_search(model, src, beam=4, nbest=2, max_len_b=8,
                                 output_ids=torch.arange(40))
        allowed = torch.tensor([3, 5, 6, 9, 12, 13, 17, 21, 30, 31, 39])
        short = beam_search(model, src, beam=4, nbest=2, max_len_b=8, output_ids=allowed)
        masked = beam_search(Masked(model, allowed), src, beam=4, nbest=2, max_len_b=8)
        uniforms = sentence_uniforms(1, [0, 1, 2], 30)
        drawn = sample(model, src, uniforms, max_len_b=8, output_ids=allowed)
    for a, b in ((free, everything), (short, masked)):
        assert [[h.tokens for h in hs] for hs in a] == [[h.tokens for h in hs] for hs in b]
        assert all(abs(x.score - y.score) < 1e-4 for hs, gs in zip(a, b)
                   for x, y in zip(hs, gs))
    kept = set(allowed.tolist())
    assert all(set(h.tokens) <= kept for hs in short + drawn for h in hs)
    assert [[h.tokens for h in hs] for hs in short] != [[h.tokens for h in hs] for hs in free]
    # sampling over the shortlist's columns draws what the masked model's full vocabulary does
    with torch.inference_mode():
        masked_drawn = sample(Masked(model, allowed), src, uniforms, max_len_b=8)
    assert [h[0].tokens for h in drawn] == [h[0].tokens for h in masked_drawn]
    # under a constraint (ids of the whole vocabulary) the logits are spread over it: a
    # phrase of shortlisted pieces is held, and nothing outside the shortlist is written
    from attn_cli.decode.constraints import search_constraint
    from attn_cli.decode.controls import Controls

    phrase = (17, 13)
    with torch.inference_mode():
        held = beam_search(model, src, beam=4, max_len_b=8, output_ids=allowed,
                           constraint=search_constraint([Controls(phrases=(phrase,))] * 3,
                                                        None, 3))
    for hypotheses in held:
        tokens = hypotheses[0].tokens
        assert set(tokens) <= kept
        assert any(tuple(tokens[i:i + 2]) == phrase for i in range(len(tokens) - 1))


def test_shortlist_and_decode_through_the_command_line(data_files, trained, spm_model, corpus,
                                                        tmp_path):
    model, _ = trained
    shortlist, vmap = tmp_path / "shortlist.st", tmp_path / "vmap.txt"
    result = run_attn("shortlist", data_files[0], "-o", shortlist, "--best", "8",
                      "--frequent", "20", "--vmap", vmap)
    assert result.returncode == 0, result.stderr
    assert "EM round 5 of 5" in result.stderr and result.stdout == ""
    loaded = Shortlist.load(shortlist)
    assert loaded.best == 8 and loaded.metadata["lexical_table"] == "IBM model 1"
    vocabulary = Vocabulary.from_file(spm_model)
    lines = vmap.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("\t") and "</s>" in lines[0].split("\t")[1].split()
    first = [line.split("\t") for line in lines[1:]]
    assert all(len(targets.split()) <= 8 for _, targets in first)
    assert {source for source, _ in first} <= {vocabulary.piece(i) for i in range(400)}
    text = "\n".join(corpus["val.en"].read_text(encoding="utf-8").splitlines()[:12]) + "\n\n"
    search = ["-m", model, "--beam", "2", "--threads", "1", "--max-len-b", "10"]
    free = run_attn("decode", *search, stdin=text)
    short = run_attn("decode", *search, "--shortlist", shortlist, stdin=text)
    assert short.returncode == 0, short.stderr
    assert "target pieces a batch" in short.stderr and "shortlist" not in free.stderr
    assert len(short.stdout.split("\n")) == len(free.stdout.split("\n")) == 14
    # the Python API: outputs hold shortlisted pieces only
    translator = load_translator(model, 2, device="cpu", threads=1, max_len_b=10,
                                 shortlist=shortlist)
    lines = text.splitlines()[:12]
    ids = translator.encode(lines, 1)
    found = translator.search(ids)
    from attn_cli.batching import pad_sequences

    allowed = set(loaded.ids_for(pad_sequences(ids, 0), {3, 1}).tolist())
    assert all(set(hypotheses[0].tokens) <= allowed for hypotheses in found)
    assert translator.translate(lines) == short.stdout.split("\n")[:12]


def test_bad_shortlists_are_one_error_line(data_files, trained, spm_model, other_vocab_data,
                                           tmp_path):
    model, _ = trained
    other = tmp_path / "other.st"
    assert run_attn("shortlist", other_vocab_data, "-o", other, "--iterations",
                    "1").returncode == 0
    decode = ["decode", "-m", model, "--shortlist"]
    assert_clean_error(run_attn(*decode, other, stdin="a\n"), f"shortlist {other}",
                       "other vocabularies")
    assert_clean_error(run_attn(*decode, tmp_path / "missing.st", stdin="a\n"), "missing.st")
    (tmp_path / "empty.st").write_bytes(b"")
    assert_clean_error(run_attn(*decode, tmp_path / "empty.st", stdin="a\n"), "empty.st")
    assert_clean_error(run_attn(*decode, data_files[0], stdin="a\n"),
                       "is not a shortlist file", "attn shortlist")
    assert_clean_error(run_attn("serve", "-m", model, "--shortlist", data_files[0]),
                       "is not a shortlist file")
    assert_clean_error(run_attn("shortlist", model, "-o", tmp_path / "x.st"), "attn binarize")
    assert not (tmp_path / "x.st").exists()


def test_an_ensemble_searches_over_the_shortlist_too(spm_model, data_files, tmp_path):
    vocabulary = Vocabulary.from_file(spm_model)
    first = save_random_model(tmp_path / "a.st", vocabulary, seed=1)
    second = save_random_model(tmp_path / "b.st", vocabulary, seed=2)
    shortlist = tmp_path / "shortlist.st"
    assert run_attn("shortlist", data_files[0], "-o", shortlist, "--iterations",
                    "1").returncode == 0
    translator = load_translator([first, second], 2, device="cpu", threads=1, max_len_b=6,
                                 shortlist=shortlist)
    ids = translator.encode(["A man is riding a bike."], 1)
    from attn_cli.batching import pad_sequences

    allowed = set(translator.controls.shortlist.ids_for(pad_sequences(ids, 0), {1, 3}).tolist())
    assert set(translator.search(ids)[0][0].tokens) <= allowed
