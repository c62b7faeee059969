"""Beam search and sampling (search.py): the pure pieces, a toy model with hand-set probabilities,
beam search against exhaustive search, batch independence, early stopping, sampling."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from attn_cli.model import DecoderCache, Transformer, grow_cache, sinusoidal_positions
from attn_cli.search import (
    Beams,
    Chained,
    Finished,
    Hypothesis,
    Stop,
    Unconstrained,
    beam_search,
    can_stop,
    draw,
    first_not_ending,
    length_penalty,
    max_output_length,
    only_eos_at_limit,
    output_limits,
    sample,
    sentence_uniforms,
    sentences_done,
    topk_blocked,
    topk_over_beams,
)

from .conftest import REPO
from .toys import CountedSteps, HostSyncs, random_model

# ---------------------------------------------------------------------------------- pure pieces


def test_length_penalty_is_gnmt():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)
    assert length_penalty(7, 0.6) == pytest.approx((12 / 6) ** 0.6)
    assert length_penalty(10, 0.0) == 1.0


def test_max_output_length_is_input_plus_50():
    assert max_output_length(12, 1.0, 50) == 62
    assert max_output_length(12, 0.0, 3) == 3


def test_topk_over_beams_picks_across_beams():
    scores = torch.tensor([[0.0, -1.0]])
    log_probs = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]]]))
    best, origin, token = topk_over_beams(scores, log_probs, 3)
    assert origin.tolist() == [[0, 1, 0]] and token.tolist() == [[0, 0, 1]]
    assert best[0, 1].item() == pytest.approx(-1.0 + math.log(0.9))


@pytest.mark.parametrize("size", [8000, 8003, 300, 40])
def test_topk_blocked_equals_topk(size):
    generator = torch.Generator().manual_seed(size)
    values = torch.randn(5, 4, size, generator=generator)
    values[0, 0, :size // 2] = -math.inf  # masked vocabulary, as constraints and bans make
    values[1, 1, 7] = 100.0  # one outlier block
    for k in (1, 2, 8):
        top, index = topk_blocked(values, k)
        expected = values.topk(k, dim=-1)
        assert torch.equal(top, expected.values)
        assert torch.equal(values.gather(-1, index), top)


def test_can_stop_only_when_no_live_hypothesis_can_win():
    # The n-th best finished score is -2.0. A live log-prob of -1.0 over the longest penalty
    # (lp(10) = 2.5^0.6 = 1.73) could still reach -0.58 > -2.0: not yet; -10.0 reaches -5.8 at
    # best: stop. With fewer than n finished the threshold is -inf: never.
    longest = torch.tensor([10, 10, 10])
    kth_best = torch.tensor([-2.0, -2.0, -math.inf])
    live = torch.tensor([-1.0, -10.0, -10.0])
    assert can_stop(kth_best, live, longest, alpha=0.6).tolist() == [False, True, False]
    # -10 / 1.73 = -5.78: it could still beat -6.0, not -5.5
    assert can_stop(torch.tensor([-6.0, -5.5]), torch.tensor([-10.0, -10.0]),
                    torch.tensor([10, 10]), alpha=0.6).tolist() == [False, True]


def test_output_limits_count_the_source_without_eos_and_cap_at_longest():
    src = torch.tensor([[5, 6, 7, 3], [5, 3, 0, 0]])  # 3 and 1 words, EOS, padding 0
    assert output_limits(src, 0, 1.0, 50, None).tolist() == [53, 51]
    assert output_limits(src, 0, 2.0, 1, 52).tolist() == [7, 3]
    assert output_limits(src, 0, 1.0, 50, 52).tolist() == [52, 51]


def test_only_eos_at_the_limit_keeps_eos_log_prob():
    log_probs = torch.log_softmax(torch.randn(2, 3, 5, generator=torch.Generator(
        ).manual_seed(1)), dim=-1)
    expected_eos = log_probs[1, :, 3].clone()
    untouched = log_probs[0].clone()
    only_eos_at_limit(log_probs, torch.tensor([False, True]), eos=3)
    assert torch.equal(log_probs[0], untouched)
    assert torch.equal(log_probs[1, :, 3], expected_eos)
    assert (log_probs[1, :, [0, 1, 2, 4]] == -math.inf).all()


def test_first_not_ending_keeps_rank_order():
    ends = torch.tensor([[True, False, False, True, False, False],
                         [False, False, False, False, True, True]])
    assert first_not_ending(ends, 3).tolist() == [[1, 2, 4], [0, 1, 2]]


def test_sentences_done_for_greedy_beam_and_exhaustion():
    scores = torch.tensor([[-1.0, -2.0], [-math.inf, -math.inf], [-30.0, -40.0]])
    kth_best = torch.tensor([-math.inf, -math.inf, -1.0])
    limits = torch.tensor([10, 10, 10])
    # No live hypothesis (row 1) is always done; row 2 cannot beat -1.0 any more.
    best_ended = torch.tensor([True, False, False])
    ended = torch.tensor([1, 0, 1])
    done = [sentences_done(scores, kth_best, limits, 0.6, 2, stop, best_ended, ended).tolist()
            for stop in (Stop.bound, Stop.limit, Stop.best_ends, Stop.patience)]
    assert done == [[False, True, True], [False, True, False], [False, True, False],
                    [False, True, False]]
    # best-ends: the best candidate ended once and a hypothesis is finished (row 0 has none).
    kth_best[0] = -5.0
    assert sentences_done(scores, kth_best, limits, 0.6, 2, Stop.best_ends, best_ended, ended
                          ).tolist() == [True, True, False]
    # patience: K = 2 hypotheses ended, whatever their scores and the live ones'.
    assert sentences_done(scores, kth_best, limits, 0.6, 2, Stop.patience, best_ended,
                          torch.tensor([2, 0, 1])).tolist() == [True, True, False]
    # Greedy: done as soon as one hypothesis finished, whatever the rule.
    for stop in Stop:
        assert sentences_done(scores[:, :1], kth_best, limits, 0.6, 1, stop, best_ended, ended
                              ).tolist() == [True, True, True]


def test_finished_collects_eos_among_the_first_k_and_tracks_the_nth_best():
    """Hypotheses ending among a sentence's first K candidates are kept on the device, their
    scores joining its n best there (no read); one that cannot be among the n best (no better
    than the n-th, found later) is not kept; `best` reads what was kept."""
    penalties = torch.tensor([1.0, 1.0, 1.0, 2.0, 1.5], dtype=torch.float64)
    finished = Finished(batch=1, nbest=2, penalties=penalties)

    def step(history, best, origin, ends):
        live = Beams(scores=torch.zeros(1, 2), tokens=history[:, :, -1], history=history,
                     active=torch.tensor([0]))
        finishing = finished.collect(best, ends, live, beam=2)
        finished.keep(finishing, int(finishing.sum()), best, origin, live)
        return finishing.tolist()

    two = torch.tensor([[[5, 7], [6, 8]]])  # length 3 with EOS: penalty 2.0
    # EOS at ranks 0, 2, 3: only rank 0 is among the first K = 2
    assert step(two, torch.tensor([[-1.0, -2.0, -3.0, -4.0]]), torch.tensor([[1, 0, 0, 1]]),
                torch.tensor([[True, False, True, True]])) == [[True, False]]
    assert finished.kth_best[0] == -math.inf  # one of the two asked for
    three = torch.tensor([[[5, 7, 9], [6, 8, 9]]])  # length 4: penalty 1.5
    assert step(three, torch.tensor([[-3.0, -1.0, -5.0, -6.0]]), torch.tensor([[0, 0, 1, 1]]),
                torch.tensor([[True, False, False, False]])) == [[True, False]]
    assert finished.kth_best[0] == -2.0 and finished.top.tolist() == [[-0.5, -2.0]]
    # -3.0 / 1.5 = -2.0 ties the 2nd best, found earlier: not kept; -2.25 / 1.5 beats it
    assert step(three, torch.tensor([[-3.0, -2.25, -5.0, -6.0]]), torch.tensor([[1, 0, 1, 1]]),
                torch.tensor([[True, True, False, False]])) == [[False, True]]
    assert finished.top.tolist() == [[-0.5, -1.5]]
    assert finished.best() == [[Hypothesis([6, 8], -0.5, -1.0),
                                Hypothesis([5, 7, 9], -1.5, -2.25)]]
    assert Finished(batch=1, nbest=1, penalties=penalties).best() == [
        [Hypothesis([], -math.inf, -math.inf)]]


def test_beams_advance_drops_done_sentences_and_reorders_the_cache():
    class Cache:
        def reorder(self, rows, sources):
            self.rows, self.sources = rows, sources
            return self

    live = Beams(scores=torch.zeros(3, 2), tokens=torch.zeros(3, 2, dtype=torch.long),
                 history=torch.tensor([[[1], [2]], [[3], [4]], [[5], [6]]]),
                 active=torch.tensor([4, 5, 6]))
    kept = torch.tensor([0, 2])
    parents = torch.tensor([[1, 1], [0, 0], [1, 0]])
    tokens = torch.tensor([[10, 11], [12, 13], [14, 15]])
    cache = Cache()
    after, _ = live.advance(torch.zeros(3, 2), parents, tokens, kept, cache)
    assert after.active.tolist() == [4, 6]
    assert after.history.tolist() == [[[2, 10], [2, 11]], [[6, 14], [5, 15]]]
    assert cache.rows.tolist() == [1, 1, 5, 4] and torch.equal(cache.sources, kept)


# --------------------------------------------------------------- a model with set probabilities


@dataclass(frozen=True)
class ToyConfig:
    pad_id: int = 0
    unk_id: int = 1
    bos_id: int = 2
    eos_id: int = 3


class ToyModel:
    """Next-token probabilities set by hand, as a function of the prefix (fairseq's test idea).
    Greedy picks 4 (0.6) then must end badly; beam search finds 5 5 EOS."""

    config = ToyConfig()
    table = {(): {4: 0.6, 5: 0.4},
             (4,): {3: 0.3, 4: 0.35, 5: 0.35},
             (5,): {5: 0.9, 3: 0.1},
             (5, 5): {3: 1.0}}

    def encode(self, src):
        return src.float().unsqueeze(-1), src != 0

    def start_decoding(self, memory, src_mask):
        batch = memory.shape[0]
        return DecoderCache(src_mask=src_mask, memory_kv=(),
                            self_kv=((torch.zeros(batch, 1, 0, 1), torch.zeros(batch, 1, 0, 1)),))

    def decode_step(self, tokens, cache):
        history, _ = grow_cache(cache.self_kv[0][0], tokens.float().view(-1, 1, 1, 1),
                                cache.self_rows)
        logits = torch.full((tokens.shape[0], 6), -1e9)
        for row in range(tokens.shape[0]):
            prefix = tuple(int(t) for t in history[row, 0, 1:, 0].tolist())
            for token, p in self.table.get(prefix, {3: 1.0}).items():
                logits[row, token] = math.log(p)
        return logits, DecoderCache(cache.src_mask, (), ((history, history),), cache.step + 1)


def test_beam_finds_what_greedy_misses():
    src = torch.tensor([[7, 3]])
    greedy = beam_search(ToyModel(), src, beam=1, alpha=0.0)[0][0]
    beam = beam_search(ToyModel(), src, beam=2, alpha=0.0)[0][0]
    assert greedy.tokens[0] == 4
    assert beam.tokens == [5, 5]
    assert beam.log_prob == pytest.approx(math.log(0.4 * 0.9 * 1.0))


# -------------------------------------------------------------------- against exhaustive search


def exhaustive_best(model, src, max_length: int, alpha: float) -> tuple[list[int], float]:
    config = model.config
    allowed = [t for t in range(config.tgt_vocab_size)
               if t not in (config.pad_id, config.bos_id, config.eos_id)]
    best_tokens, best_score = None, -math.inf
    for length in range(0, max_length):
        for body in itertools.product(allowed, repeat=length):
            tgt_in = torch.tensor([[config.bos_id, *body]])
            target = torch.tensor([*body, config.eos_id])
            with torch.no_grad():
                log_probs = torch.log_softmax(model(src, tgt_in)[0], dim=-1)
            log_prob = log_probs[torch.arange(length + 1), target].sum().item()
            score = log_prob / length_penalty(length + 1, alpha)
            if score > best_score:
                best_tokens, best_score = list(body), score
    return best_tokens, best_score


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_search_matches_exhaustive_search(seed):
    """With a beam as wide as the prefixes, beam search (early stopping included) must find the
    exhaustive optimum of log p / lp over a 7-token vocabulary and outputs of ≤ 3 tokens."""
    model = random_model(seed=seed)
    src = torch.tensor([[4, 5, 6, 3]])
    tokens, score = exhaustive_best(model, src, 3, alpha=0.6)
    found = beam_search(model, src, beam=16, alpha=0.6, max_len_a=0.0, max_len_b=3)[0][0]
    assert found.tokens == tokens
    assert found.score == pytest.approx(score, abs=1e-5)


def test_beam_of_one_is_greedy_decoding():
    """Beam 1 takes the most probable token each step and stops at the first EOS (whatever
    the length penalty), as tensor2tensor's greedy decoding does."""
    model = random_model(vocab=12, seed=6)
    config = model.config
    for source in ([4, 5, 6, 3], [7, 3], [8, 9, 10, 11, 4, 3]):
        src = torch.tensor([source])
        expected = []
        with torch.no_grad():
            while len(expected) < 20:
                logits = model(src, torch.tensor([[config.bos_id, *expected]]))[0, -1]
                logits[[config.pad_id, config.bos_id]] = -math.inf
                token = int(logits.argmax())
                if token == config.eos_id:
                    break
                expected.append(token)
        for alpha in (0.0, 0.6, 2.0):
            found = beam_search(model, src, beam=1, alpha=alpha, max_len_a=0, max_len_b=21)
            assert found[0][0].tokens == expected


def test_batched_decoding_equals_one_by_one():
    model = random_model(vocab=30, seed=3)
    sentences = [[5, 9, 3], [7, 8, 9, 10, 11, 12, 3], [20, 3], [4, 4, 4, 4, 3]]
    width = max(map(len, sentences))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in sentences])
    for beam in (1, 4):
        together = beam_search(model, batch, beam=beam, max_len_b=12, nbest=beam)
        for row, sentence in enumerate(sentences):
            alone = beam_search(model, torch.tensor([sentence]), beam=beam, max_len_b=12,
                                nbest=beam)[0]
            assert [h.tokens for h in together[row]] == [h.tokens for h in alone]
            for a, b in zip(together[row], alone):
                assert a.score == pytest.approx(b.score, abs=1e-4)


@pytest.mark.parametrize("beam,nbest", [(1, 1), (4, 1), (4, 4), (5, 2)])
def test_early_stopping_changes_nothing(beam, nbest):
    """Stopping a sentence once no live hypothesis can beat its n-th best finished one returns
    exactly what running every sentence to its length limit returns."""
    model = random_model(vocab=40, seed=5)
    generator = torch.Generator().manual_seed(9)
    sentences = [torch.randint(4, 40, (n,), generator=generator).tolist() + [3]
                 for n in (3, 9, 1, 6, 12, 4)]
    width = max(map(len, sentences))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in sentences])
    for alpha in (0.0, 0.6, 1.0):
        early = beam_search(model, batch, beam=beam, alpha=alpha, nbest=nbest, max_len_b=10)
        full = beam_search(model, batch, beam=beam, alpha=alpha, nbest=nbest, max_len_b=10,
                           stop="limit")
        for found, expected in zip(early, full):
            assert [h.tokens for h in found] == [h.tokens for h in expected]
            assert [h.score for h in found] == pytest.approx([h.score for h in expected])


def test_the_inexact_rules_stop_no_later_and_find_nothing_better():
    """best-ends (OpenNMT-py's rule) and patience (fairseq's; CTranslate2's at α ≠ 0) follow
    the same beams as the exact bound: they decode fewer rows than a search to the limit,
    best-ends fewest, find nothing better than it, and greedy is the same under every rule."""
    model = random_model(vocab=12, seed=2)
    generator = torch.Generator().manual_seed(4)
    sentences = [torch.randint(4, 12, (n,), generator=generator).tolist() + [3]
                 for n in (3, 9, 1, 6, 12, 4, 7, 2)]
    width = max(map(len, sentences))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in sentences])
    decode_step, rows = model.decode_step, {}

    def counted(tokens, cache):  # and EOS made likelier, so that searches end at all
        rows[rule] = rows.get(rule, 0) + len(tokens)
        logits, cache = decode_step(tokens, cache)
        logits[:, model.config.eos_id] += 2.0
        return logits, cache

    model.decode_step = counted
    found = {}
    for rule in Stop:
        found[rule] = beam_search(model, batch, beam=4, max_len_b=10, stop=rule)
    assert rows[Stop.best_ends] < rows[Stop.patience] < rows[Stop.limit]
    assert rows[Stop.bound] < rows[Stop.limit]
    for rule in (Stop.best_ends, Stop.patience):
        for quick, full in zip(found[rule], found[Stop.limit]):
            assert quick[0].score <= full[0].score + 1e-6
    greedy = [beam_search(model, batch, beam=1, max_len_b=10, stop=rule) for rule in Stop]
    assert all(result == greedy[0] for result in greedy)


def test_patience_stops_a_sentence_once_beam_many_hypotheses_ended():
    """fairseq's rule by hand, EOS made by far the best token: at the first step one
    hypothesis ends (one row, BOS), which settles the exact bound's answer (no live hypothesis
    can catch up) but is 1 of the K = 3 patience waits for; at the second the 3 live beams each
    end, 4 >= 3, and the sentence stops."""
    model = random_model(vocab=12, seed=5)
    batch = torch.tensor([[5, 6, 7, 3]])
    decode_step, steps = model.decode_step, []

    def eos_first(tokens, cache):
        steps.append(len(tokens))
        logits, cache = decode_step(tokens, cache)
        logits[:, model.config.eos_id] += 50.0
        return logits, cache

    model.decode_step = eos_first
    beam_search(model, batch, beam=3, max_len_b=10, stop=Stop.bound)
    assert steps == [1]
    steps.clear()
    beam_search(model, batch, beam=3, max_len_b=10, stop=Stop.patience)
    assert steps == [1, 3]


def test_nbest_is_sorted_and_distinct():
    model = random_model(vocab=30, seed=4)
    hypotheses = beam_search(model, torch.tensor([[5, 6, 7, 3]]), beam=5, nbest=5,
                             max_len_b=8)[0]
    assert len(hypotheses) == 5
    scores = [h.score for h in hypotheses]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(h.tokens) for h in hypotheses}) == 5


# ------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("temperature,topk,topp", [(1.0, 0, 1.0), (0.5, 0, 1.0),
                                                   (2.0, 3, 1.0), (1.0, 0, 0.7),
                                                   (1.5, 4, 0.9)])
def test_draw_samples_the_tempered_truncated_distribution(temperature, topk, topp):
    """Over evenly spread uniforms, each token is drawn as often as the distribution says:
    p^(1/T) renormalised, cut to the top k, then to the nucleus holding p of the mass."""
    p = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.05, 0.02, 0.0])
    log_probs = p.log().unsqueeze(0)  # the last token at -inf (banned): never drawn
    expected = p ** (1 / temperature)
    expected /= expected.sum()
    order = expected.argsort(descending=True)
    if topk:
        expected[order[topk:]] = 0
        expected /= expected.sum()
    if topp < 1:
        before = expected[order].cumsum(0) - expected[order]
        expected[order[before >= topp]] = 0
        expected /= expected.sum()
    draws = 20000
    uniforms = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    tokens = draw(log_probs.expand(draws, -1), uniforms, temperature, topk, topp)
    frequencies = torch.bincount(tokens, minlength=8).double() / draws
    torch.testing.assert_close(frequencies, expected.double(), atol=2 / draws, rtol=0)


def test_sampling_is_reproducible_batch_independent_and_greedy_at_top1():
    model = random_model(vocab=30, seed=3)
    sentences = [[5, 9, 3], [7, 8, 9, 10, 11, 12, 3], [20, 3], [4, 4, 4, 4, 3]]
    width = max(map(len, sentences))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in sentences])
    lines = [11, 12, 13, 14]  # the sentences' input lines: what their random numbers follow

    def sampled(seed, rows=range(4), **options):
        src = torch.tensor([sentences[i] + [0] * (width - len(sentences[i])) for i in rows])
        uniforms = sentence_uniforms(seed, [lines[i] for i in rows], 30)
        return [h[0].tokens for h in sample(model, src, uniforms, max_len_b=12, **options)]

    flat = {"temperature": 4.0}  # this model is sharp: flattened, the draws matter
    together = sampled(7, **flat)
    assert together == sampled(7, **flat)
    assert [sampled(7, [i], **flat)[0] for i in range(4)] == together  # alone: same draws
    assert sampled(7, [3, 1], **flat) == [together[3], together[1]]
    assert sampled(8, **flat) != together
    greedy = beam_search(model, batch, beam=1, max_len_b=12)
    assert sampled(7, topk=1) == [h[0].tokens for h in greedy]
    assert sampled(9, temperature=0.01) == [h[0].tokens for h in greedy]


# ------------------------------------------------------------------------------ on a GPU's terms


def test_the_sync_counter_sees_what_a_cpu_run_hides():
    """`HostSyncs`, which the test below trusts: on a CPU, `.tolist()` and `.to(device)`
    dispatch no op, and data uploaded from a Python list shows only as torch's lift_fresh."""
    x = torch.zeros(4)
    with HostSyncs() as syncs:
        x[[1, 2]] = torch.ones(2)  # the index made on the host: uploaded on a GPU
        torch.tensor([1.0, 2.0], device=x.device)
        x.to(x.device), x.to(torch.float64)  # a move (counted); a cast only
        x.nonzero(), x.tolist(), float(x[0])
    assert syncs.uploads == ["lift_fresh", "lift_fresh", "to"]
    assert syncs.reads == ["nonzero", "tolist", "_local_scalar_dense"]


@pytest.mark.parametrize("beam, nbest", [(1, 1), (4, 1), (4, 2), (4, 4), ("sample", 1)])
def test_a_search_step_reads_once_and_uploads_nothing(beam, nbest):
    """On a GPU each read of a result (a count, a value, the finished hypotheses) is a wait
    for the device, and so is each upload of host data. A step of greedy or beam search or
    sampling reads one thing, how many hypotheses finished and how many sentences go on at
    once, and uploads nothing; the finished hypotheses are read once, after the last step.
    On 8 sentences finishing at different steps, some at their length limit."""
    syncs = HostSyncs()
    model = CountedSteps(syncs)
    generator = torch.Generator().manual_seed(9)
    sentences = [torch.randint(4, 40, (n,), generator=generator).tolist() + [3]
                 for n in (3, 9, 1, 6, 12, 4, 7, 2)]
    width = max(map(len, sentences))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in sentences])
    with syncs:
        if beam == "sample":
            found = sample(model, batch, sentence_uniforms(1, list(range(8)), 30), max_len_b=10,
                           temperature=2.0)
        else:
            found = beam_search(model, batch, beam=beam, nbest=nbest, max_len_b=10)
    assert sum(len(hypotheses) for hypotheses in found) == 8 * nbest
    limits = output_limits(batch, 0, 1.0, 10, None).tolist()
    assert sum(len(h.tokens) + 1 < limit for hypotheses, limit in zip(found, limits)
               for h in hypotheses) >= 3 * nbest  # not only at the limit
    assert model.per_step() == [(1, 0)] * (len(model.marks) - 1) + [(2, 0)], \
        (syncs.reads, syncs.uploads)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_search_runs_past_the_sinusoid_table(device):
    """A model converted to bf16 (decode --dtype bf16) searching past its position table: the
    positions past it are computed in the model's dtype (float32 positions would meet bf16
    weights), the same as a longer table's, and the table is left as it was (a forward pass
    changes nothing in the model)."""
    torch.manual_seed(3)
    config = dataclasses.replace(random_model(vocab=30).config, max_positions=8)
    model = Transformer(config).eval().to(device, torch.bfloat16)
    table = model.sinusoids.clone()
    src = torch.tensor([[5, 9, 7, 3]], device=device)
    found = beam_search(model, src, beam=2, max_len_a=0, max_len_b=20, stop="limit")
    assert found[0][0].score > -math.inf  # live hypotheses ran on to position 20
    assert torch.equal(model.sinusoids, table)
    past = model.positions(6, 14)
    assert past.dtype == torch.bfloat16 and past.device.type == device
    assert torch.equal(past, sinusoidal_positions(20, config.d_model)[6:].to(past))


# ------------------------------------------------------------------------------ calling off


class CallingOff:
    """`cancelled` for a search: the sentences `named`, from the `after`-th question on (one
    question a step), each question counted."""

    def __init__(self, named: list[int], after: int):
        self.named, self.after, self.asked = named, after, 0

    def __call__(self) -> list[int]:
        self.asked += 1
        return self.named if self.asked > self.after else []


@pytest.mark.parametrize("beam, nbest", [(1, 1), (4, 1), (4, 3), ("sample", 1)])
def test_sentences_called_off_leave_and_the_others_find_the_same(beam, nbest):
    """Two of 8 sentences called off at the 3rd step: from then on the steps hold the other
    six only, which end with the same hypotheses as in the search nobody called off (the same
    tokens; the scores as close as a sentence's alone, test_batched_decoding_equals_one_by_one:
    a float32 matmul's last bits follow its row count); every step still reads once and uploads
    nothing (the calls are host state)."""
    generator = torch.Generator().manual_seed(9)
    sentences = [torch.randint(4, 40, (n,), generator=generator).tolist() + [3]
                 for n in (3, 9, 1, 6, 12, 4, 7, 2)]
    width = max(map(len, sentences))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in sentences])

    def search(cancelled=None):
        syncs = HostSyncs()
        model = CountedSteps(syncs)
        rows = []
        step = model.decode_step
        model.decode_step = lambda tokens, cache: (rows.append(len(tokens)), step(tokens,
                                                                                cache))[1]
        with syncs:
            if beam == "sample":
                found = sample(model, batch, sentence_uniforms(1, list(range(8)), 30),
                               max_len_b=10, temperature=2.0, cancelled=cancelled)
            else:
                found = beam_search(model, batch, beam=beam, nbest=nbest, max_len_b=10,
                                    stop="limit", cancelled=cancelled)
        *steps, last = model.per_step()
        assert steps == [(1, 0)] * len(steps) and last in ((2, 0), (1, 0))  # (1, 0): none found
        return found, rows

    untouched, _ = search()
    calling_off = CallingOff([5, 1], after=2)
    found, rows = search(calling_off)
    kept = [0, 2, 3, 4, 6, 7]
    for sentence in kept:
        assert [h.tokens for h in found[sentence]] == [h.tokens for h in untouched[sentence]]
        assert [h.score for h in found[sentence]] == pytest.approx(
            [h.score for h in untouched[sentence]], abs=1e-4)
    width_of = 1 if beam in (1, "sample") else beam
    assert rows[3] <= width_of * 6 and calling_off.asked == len(rows)
    assert search(CallingOff(list(range(8)), after=0))[1] == rows[:1]  # all off: one step


# --------------------------------------------------------------------------- the constraints


def constraint_classes() -> dict[str, ast.ClassDef]:
    """Every class of the package that implements the constraint protocol (it defines
    `candidates`), read from the sources: "module.Class" → its definition."""
    found = {}
    for path in sorted((REPO / "attn_cli").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(item, ast.FunctionDef) and item.name == "candidates"
                    for item in node.body):
                found[f"{path.stem}.{node.name}"] = node
    return found


def body_of(function: ast.FunctionDef) -> str:
    """A method's statements (its docstring left out), as their syntax tree: what it does."""
    statements = function.body
    if statements and isinstance(statements[0], ast.Expr) and \
            isinstance(statements[0].value, ast.Constant):
        statements = statements[1:]
    return ast.dump(ast.Module(statements, []))


def test_every_constraint_extends_unconstrained_and_writes_only_what_it_changes():
    """The do-nothing behaviour of each part of the protocol is written once, in
    `Unconstrained`; a constraint extends it and defines only the parts it changes, none that
    does again what the base does."""
    classes = constraint_classes()
    base = classes.pop("search.Unconstrained")
    classes.pop("search.Constraint")  # the protocol itself
    identities = {item.name: body_of(item) for item in base.body
                  if isinstance(item, ast.FunctionDef) and item.name != "__init__"}
    assert set(identities) == {"to", "start", "candidates", "token_ids", "advance", "rank",
                               "bound", "select"}
    assert {"prefix.PrefixConstraint", "lexical.LexicalConstraint", "lexical.BannedPhrases",
            "constraint.TreeConstraint"} <= set(classes)
    again = []
    for name, node in classes.items():
        assert [ast.unparse(base) for base in node.bases] == ["Unconstrained"], name
        again += [f"{name}.{item.name}" for item in node.body
                  if isinstance(item, ast.FunctionDef)
                  and identities.get(item.name) == body_of(item)]
    assert not again, f"do-nothing methods written again: {again}"


class Ranking(Unconstrained):
    """A constraint that ranks its own way (the candidates of the worst scores first), so
    that a test sees whose `rank` a chain asks."""

    ranks = True

    def rank(self, scores, log_probs, columns, state, beam):
        self.asked = True
        return topk_over_beams(scores, -log_probs.masked_fill(log_probs == -math.inf, math.inf),
                               2 * beam)


def test_a_chain_asks_its_parts_which_one_ranks():
    free, ranking = Unconstrained(3), Ranking(3)
    assert not Chained([free, Unconstrained(3)]).ranks
    chain = Chained([free, ranking])
    assert chain.ranks and chain.ranker == 1
    scores, log_probs = torch.zeros(1, 1), torch.log_softmax(torch.randn(1, 1, 9), dim=-1)
    assert torch.equal(chain.rank(scores, log_probs, None, (None, None), 2)[2],
                       ranking.rank(scores, log_probs, None, None, 2)[2])
    assert not torch.equal(chain.rank(scores, log_probs, None, (None, None), 2)[2],
                           Chained([free]).rank(scores, log_probs, None, (None,), 2)[2])
    with pytest.raises(ValueError, match="cannot be chained"):
        Chained([Ranking(3), ranking])
