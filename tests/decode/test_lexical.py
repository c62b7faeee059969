"""Lexical constraints and banned phrases (lexical.py): the matching of phrases, dynamic beam
allocation against exhaustive constrained search, phrases that must and must not appear, and a
constrained step's one read on a GPU's terms."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attn_cli.decode.lexical import (
    UNMET_PENALTY,
    BannedPhrases,
    LexicalConstraint,
    Progress,
    WordPieces,
    failure_links,
    holds,
)
from attn_cli.decode.prefix import PrefixConstraint
from attn_cli.search import Chained, beam_search, length_penalty, sample, sentence_uniforms

from ..toys import CountedSteps, HostSyncs, random_model

EOS = 3


def test_failure_links_are_knuth_morris_pratts():
    assert failure_links([4, 4, 5]) == [0, 0, 1, 0]
    assert failure_links([4, 5, 4, 5, 6]) == [0, 0, 0, 1, 2, 0]
    assert failure_links([7]) == [0, 0]


@pytest.mark.parametrize("output, phrase", [([4, 4, 4, 5], [4, 4, 5]),
                                            ([4, 5, 4, 5, 4, 5, 6], [4, 5, 4, 5, 6]),
                                            ([5, 4, 6, 4, 5], [4, 5]),
                                            ([4, 6, 5], [4, 5])])
def test_progress_finds_a_phrase_wherever_the_output_holds_it(output, phrase):
    """A token that breaks a partial match falls back to the longest match it continues, so a
    phrase is met exactly when the output holds it (token by token, as the search advances)."""
    constraint = LexicalConstraint.for_batch([[phrase]], EOS)
    state = constraint.start(1, 1, "cpu")
    origin = torch.zeros(1, 1, dtype=torch.long)
    for length, token in enumerate(output, 1):
        state = constraint.advance(state, origin, torch.tensor([[token]]))
        met = bool(state.matched[0, 0, 0] == len(phrase))
        assert met == holds(output[:length], phrase), (output[:length], state.matched)


# Pieces 0-3 special; 4 "▁Jeans", 5 "anzug", 6 "▁und", 7 ".", 8 "▁Hose"
WORDS = WordPieces.of(["<pad>", "<unk>", "<s>", "</s>", "\u2581Jeans", "anzug", "\u2581und",
                       ".", "\u2581Hose"], {0, 1, 2, 3})


@pytest.mark.parametrize("output, met", [([4, 5], False), ([4, 6], True), ([4, 7], True),
                                         ([4, 5, 6, 4, 7], True), ([4, 5, 4, 5], False)])
def test_a_phrase_ending_in_a_word_is_met_where_its_word_ends(output, met):
    """"▁Jeans" then "anzug" is "Jeansanzug": the phrase waits for a piece that starts a word,
    punctuation, or (`unmet` lets EOS come) the output's end."""
    constraint = LexicalConstraint.for_batch([[[4]]], EOS, WORDS)
    state = constraint.start(1, 1, "cpu")
    origin = torch.zeros(1, 1, dtype=torch.long)
    for token in output:
        state = constraint.advance(state, origin, torch.tensor([[token]]))
    assert bool(state.matched[0, 0, 0] == 2) == met == holds(output, [4], WORDS)
    assert not bool(constraint.unmet(state)) or output[-1] == 5  # "▁Jeans" last: EOS may end it
    assert holds([6, 4], [4], WORDS) and not holds([4], [5], WORDS)


def test_eos_waits_for_every_phrase_and_the_limit_takes_it_penalised():
    constraint = LexicalConstraint.for_batch([[[4], [5, 6]]], EOS)
    state = Progress(torch.tensor([[[1, 2], [1, 0]]]), torch.tensor([0]))  # met; one unmet
    log_probs = torch.full((1, 2, 7), -1.0)
    free, _ = constraint.candidates(log_probs.clone(), state, torch.tensor([0]),
                                    torch.tensor([3]), torch.tensor([False]))
    assert free[0, 0, EOS] == -1.0 and free[0, 1, EOS] == -math.inf
    limited, _ = constraint.candidates(log_probs.clone(), state, torch.tensor([0]),
                                       torch.tensor([0]), torch.tensor([True]))
    assert limited[0, 1, EOS] == -1.0 - UNMET_PENALTY


ALLOWED = [1, 4, 5, 6]  # of random_model's 7 pieces: not padding, BOS or EOS


def exhaustive_constrained(model, src, max_body: int, alpha: float, phrases: list[list[int]]):
    """The best output (log p / lp) of at most `max_body` pieces that holds every phrase."""
    best_tokens, best_score = None, -math.inf
    for length in range(max_body + 1):
        for body in itertools.product(ALLOWED, repeat=length):
            if not all(holds(list(body), phrase) for phrase in phrases):
                continue
            tgt_in = torch.tensor([[model.config.bos_id, *body]])
            target = torch.tensor([*body, EOS])
            with torch.no_grad():
                log_probs = torch.log_softmax(model(src, tgt_in)[0], dim=-1)
            score = log_probs[torch.arange(length + 1), target].sum().item() / \
                length_penalty(length + 1, alpha)
            if score > best_score:
                best_tokens, best_score = list(body), score
    return best_tokens, best_score


@pytest.mark.parametrize("seed, phrases", [(0, [[5, 4]]), (1, [[6], [4]]), (2, [[1, 6, 5]]),
                                           (3, [[4, 4]])])
def test_a_beam_holding_every_candidate_finds_the_exhaustive_constrained_optimum(seed, phrases):
    """With a beam as wide as every hypothesis the search can make (4 pieces, outputs of at most
    3), dynamic beam allocation loses nothing: the search returns the best output that holds
    every phrase, as exhaustive search over all of them finds it."""
    model = random_model(seed=seed)
    src = torch.tensor([[4, 5, 6, 3]])
    tokens, score = exhaustive_constrained(model, src, 3, 0.6, phrases)
    constraint = LexicalConstraint.for_batch([phrases], EOS)
    found = beam_search(model, src, beam=128, alpha=0.6, max_len_a=0.0, max_len_b=4,
                        constraint=constraint)[0][0]
    assert found.tokens == tokens
    assert found.score == pytest.approx(score, abs=1e-5)


SENTENCES = [[4, 5, 6, 3], [6, 6, 3, 0], [5, 4, 4, 5], [1, 3, 0, 0]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_phrase_is_in_every_output_at_beam_4(device):
    """Phrases the free search does not produce, one to three per sentence, some sharing
    pieces, one repeating its own start: each is in the output. (Not in each of the nbest: the
    beams are dealt over the banks, and the full bank may hold one hypothesis at a time.)
    On a GPU's tensors too."""
    model = random_model(vocab=12, seed=4).to(device)
    src = torch.tensor([[s if s < 12 else 5 for s in sentence] for sentence in SENTENCES])
    src[2, 3] = 3
    src = src.to(device)
    phrases = [[[7, 8]], [[9], [10, 9, 11]], [[8, 8, 9], [7]], []]
    found = beam_search(model, src, beam=4, max_len_b=12,
                        constraint=LexicalConstraint.for_batch(phrases, EOS))
    free = beam_search(model, src, beam=4, max_len_b=12)
    for hypotheses, sentence_phrases in zip(found, phrases):
        tokens = hypotheses[0].tokens
        assert all(holds(tokens, phrase) for phrase in sentence_phrases), \
            (tokens, sentence_phrases)
        assert hypotheses[0].score > -UNMET_PENALTY / 2
    assert found[3][0].tokens == free[3][0].tokens  # no phrase: the free output
    assert any(not all(holds(unforced[0].tokens, p) for p in ps)
               for unforced, ps in zip(free[:3], phrases[:3]))  # the phrases are not free


@pytest.mark.parametrize("beam", [1, 4])
def test_constraints_without_phrases_change_nothing(beam):
    """A batch whose sentences have no phrases, searched through the constraint (its ranking,
    its extra candidates): what the free search finds, scores included."""
    model = random_model(vocab=12, seed=6)
    src = torch.tensor([[4, 5, 6, 3], [7, 8, 3, 0]])
    free = beam_search(model, src, beam=beam, nbest=beam, max_len_b=8)
    ranked = beam_search(model, src, beam=beam, nbest=beam, max_len_b=8,
                         constraint=LexicalConstraint.for_batch([[], []], EOS))
    assert ranked == free


def test_banned_phrases_never_appear_and_single_pieces_go_everywhere():
    """Ban the free output's first two pieces as a phrase, and one piece alone: neither appears
    in any of the nbest, the rest of the vocabulary stays free."""
    model = random_model(vocab=12, seed=4)
    src = torch.tensor([[4, 5, 6, 3], [6, 6, 3, 0]])
    free = beam_search(model, src, beam=4, nbest=4, max_len_b=10)
    pair = next(h.tokens[:2] for h in free[0] if len(h.tokens) >= 2)
    single = next(h.tokens[0] for h in free[1] if h.tokens)
    ban = BannedPhrases.from_phrases([pair, [single]], EOS)
    found = beam_search(model, src, beam=4, nbest=4, max_len_b=10, constraint=ban)
    for hypotheses in found:
        for hypothesis in hypotheses:
            assert not holds(hypothesis.tokens, pair) and single not in hypothesis.tokens
    drawn = sample(model, src, sentence_uniforms(1, [0, 1], 20), max_len_b=10, constraint=ban)
    for hypotheses in drawn:
        assert not holds(hypotheses[0].tokens, pair) and single not in hypotheses[0].tokens


def test_a_prefix_phrases_and_bans_together():
    model = random_model(vocab=12, seed=4)
    src = torch.tensor([[4, 5, 6, 3], [6, 6, 3, 0]])
    prefix = PrefixConstraint.for_batch([[9, 9], []], EOS)
    phrases = LexicalConstraint.for_batch([[[7, 8]], [[10]]], EOS)
    ban = BannedPhrases.from_phrases([[11]], EOS)
    found = beam_search(model, src, beam=4, max_len_b=10,
                        constraint=Chained([prefix, phrases, ban]))
    assert found[0][0].tokens[:2] == [9, 9] and holds(found[0][0].tokens, [7, 8])
    assert holds(found[1][0].tokens, [10])
    assert all(11 not in hypotheses[0].tokens for hypotheses in found)


@pytest.mark.parametrize("beam", [1, 4])
def test_a_constrained_step_reads_once_and_uploads_nothing(beam):
    """As the free search: on a GPU a step waits once, for its two counts, and the phrases'
    matching, the extra candidates and the dealing of the beams are all on the device."""
    syncs = HostSyncs()
    model = CountedSteps(syncs)
    generator = torch.Generator().manual_seed(9)
    sentences = [torch.randint(4, 40, (n,), generator=generator).tolist() + [3]
                 for n in (3, 9, 1, 6)]
    width = max(map(len, sentences))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in sentences])
    constraint = Chained([LexicalConstraint.for_batch([[[7, 8]], [[9], [10, 9, 9]], [], [[5]]],
                                                      EOS),
                          BannedPhrases.from_phrases([[12, 13], [14]], EOS)])
    with syncs:
        found = beam_search(model, batch, beam=beam, max_len_b=10, constraint=constraint)
    assert len(found) == 4
    assert model.per_step() == [(1, 0)] * (len(model.marks) - 1) + [(2, 0)], \
        (syncs.reads, syncs.uploads)
