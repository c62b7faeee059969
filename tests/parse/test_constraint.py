"""The well-formed-tree constraint of `attn parse --constrain` (tree_search.py), on models with
random weights, and how a parser's vocabulary tells its terminals."""

from __future__ import annotations

import itertools

import pytest
import torch

from attn_cli.parse.constraint import TreeConstraint, model_terminals
from attn_cli.search import Stop, beam_search
from attn_cli.vocab import Vocabulary

from ..conftest import run_attn
from ..toys import random_model, toy_treebank


def test_tree_constraint_gives_balanced_trees_with_the_word_count():
    pieces = ["<pad>", "<unk>", "<s>", "</s>", "\u2581XX", "\u2581(S", "\u2581)S", "\u2581(NP",
              "\u2581)NP", "junk"]
    model = random_model(vocab=len(pieces), seed=5)
    src = torch.tensor([[4, 5, 6, 3], [7, 3, 0, 0]])
    words = [3, 1]
    constraint = TreeConstraint.for_pieces(pieces, eos_id=3, word_counts=words)
    found = beam_search(model, src, beam=3, nbest=3, max_len_a=0, max_len_b=20,
                        constraint=constraint)
    for count, hypotheses in zip(words, found):
        for hypothesis in hypotheses:
            tokens = [pieces[t] for t in hypothesis.tokens]
            assert tokens.count("\u2581XX") == count and "junk" not in tokens
            depth = 0
            for token in tokens:
                depth += token.startswith("\u2581(") - token.startswith("\u2581)")
                assert depth >= 0
            assert depth == 0
            text = " ".join(tokens)
            assert not any(f"\u2581({label} \u2581){label}" in text for label in ("S", "NP"))


def test_word_constraint_forces_the_input_pieces_in_order():
    pieces = ["<pad>", "<unk>", "<s>", "</s>", "\u2581(S", "\u2581)S", "\u2581(NP", "\u2581)NP",
              "\u2581the", "\u2581cat", "\u2581s", "leeps"]
    model = random_model(vocab=len(pieces), seed=7)
    src = torch.tensor([[8, 9, 10, 11, 3], [9, 3, 0, 0, 0]])
    required = [[8, 9, 10, 11], [9]]
    constraint = TreeConstraint.for_pieces(pieces, eos_id=3, word_counts=[4, 1],
                                           placeholder=None, required=required)
    found = beam_search(model, src, beam=3, nbest=3, max_len_a=0, max_len_b=16,
                        constraint=constraint)
    for ids, hypotheses in zip(required, found):
        for hypothesis in hypotheses:
            tokens = [pieces[t] for t in hypothesis.tokens]
            assert [t for t in hypothesis.tokens if t >= 8] == ids
            depth = 0
            for token in tokens:
                depth += token.startswith("\u2581(") - token.startswith("\u2581)")
                assert depth >= 0
            assert depth == 0
            if 10 in hypothesis.tokens:  # "▁s" "leeps" is one word: no bracket inside
                position = hypothesis.tokens.index(10)
                assert hypothesis.tokens[position + 1] == 11


def test_given_words_are_scored_as_any_word_at_their_place():
    """--score-words given: a word's first piece scores log Σ p(piece) over the pieces that
    start a word; its other pieces score 0; brackets and EOS keep the model's scores. The
    candidates are the brackets, EOS and the sentence's next piece, nothing else."""
    pieces = ["<pad>", "<unk>", "<s>", "</s>", "\u2581(S", "\u2581)S", "\u2581the", "\u2581s",
              "leeps"]
    required = [[6, 7, 8]]
    log_probs = torch.log_softmax(torch.randn(1, 2, len(pieces), generator=torch.Generator(
        ).manual_seed(3)), dim=-1)
    placed = torch.tensor([[0, 2]])  # the first beam is before "▁the", the second inside "sleeps"
    state = (placed, torch.zeros_like(placed), torch.zeros_like(placed))
    active, room = torch.tensor([0]), torch.tensor([10])
    for score_words in ("given", "joint"):
        constraint = TreeConstraint.for_pieces(pieces, eos_id=3, word_counts=[3],
                                               placeholder=None, required=required,
                                               score_words=score_words)
        scored, allowed, tokens = constraint.next_tokens(log_probs.clone(), state, active, room)
        assert tokens.tolist() == [[[3, 4, 5, 6], [3, 4, 5, 8]]]
        assert tokens[0, 0, constraint.eos_column] == 3
        # brackets and EOS: the model's own scores; EOS not yet, no ")S" with nothing open,
        # no "(S" inside a word
        assert torch.equal(scored[..., :3], log_probs[..., 3:6])
        assert allowed.tolist() == [[[False, True, False, True], [False, False, False, True]]]
        if score_words == "joint":
            assert torch.equal(scored[0, :, 3], log_probs[0, [0, 1], [6, 8]])
            continue
        any_word = torch.logsumexp(log_probs[0, 0, [6, 7]], dim=0)
        assert scored[0, 0, 3] == pytest.approx(float(any_word))
        assert scored[0, 1, 3] == 0.0
        done = (torch.tensor([[3, 3]]),) + state[1:]  # every word placed: nothing rescored
        scored, allowed, tokens = constraint.next_tokens(log_probs.clone(), done, active, room)
        assert torch.equal(scored[..., 3], log_probs[..., 0])  # the padding piece, banned
        assert not allowed[..., 3].any() and allowed[..., constraint.eos_column].all()


def test_early_stop_is_exact_under_the_tree_constraint():
    """The constraint's bound on how long a tree can still grow lets a sentence stop early;
    the search still returns what it returns when every sentence runs to its length limit."""
    pieces = ["<pad>", "<unk>", "<s>", "</s>", "\u2581(S", "\u2581)S", "\u2581(NP", "\u2581)NP",
              "\u2581the", "\u2581cat", "\u2581s", "leeps"]
    src = torch.tensor([[8, 9, 10, 11, 3], [9, 3, 0, 0, 0], [8, 9, 3, 0, 0]])
    required = [[8, 9, 10, 11], [9], [8, 9]]
    rows = {Stop.bound: 0, Stop.limit: 0}
    for seed, nbest in itertools.product(range(4), (1, 3)):
        model = random_model(vocab=len(pieces), seed=seed)
        results = {}
        for stop in rows:
            constraint = TreeConstraint.for_pieces(pieces, eos_id=3, word_counts=[4, 1, 2],
                                                   placeholder=None, required=required)
            step = model.decode_step

            def counted(tokens, cache, stop=stop, step=step):
                rows[stop] += len(tokens)
                return step(tokens, cache)

            model.decode_step = counted
            results[stop] = beam_search(model, src, beam=5, nbest=nbest, alpha=0.6, max_len_a=0,
                                        max_len_b=100, constraint=constraint, stop=stop)
            del model.decode_step
        assert results[Stop.bound] == results[Stop.limit]
    # Measured: 2,809 decoder rows against 3,184 (the search's own bound, |x| + 100 long, stopped
    # no sentence earlier than the limit here).
    assert rows[Stop.bound] < 0.95 * rows[Stop.limit]


def test_score_words_is_given_or_joint():
    pieces = ["<pad>", "<unk>", "<s>", "</s>", "\u2581(S", "\u2581)S", "\u2581the"]
    for score_words in ("given", "joint"):
        constraint = TreeConstraint.for_pieces(pieces, eos_id=3, word_counts=[1],
                                               placeholder=None, score_words=score_words)
        assert constraint.score_words == score_words
    with pytest.raises(ValueError, match="score_words .*'any'"):
        TreeConstraint.for_pieces(pieces, eos_id=3, word_counts=[1], placeholder=None,
                                  score_words="any")


@pytest.mark.parametrize("terminals", ["placeholders", "words"])
def test_model_terminals_tells_placeholders_from_words(terminals, tmp_path):
    """A parser's vocabulary, learned as `attn vocab --symbols` learns it from linearized trees,
    holds the placeholder as a piece when its trees had placeholder terminals, and not when
    they had the words: how `attn parse --terminals auto` tells the two apart."""
    (tmp_path / "train.mrg").write_text(toy_treebank(200, seed=1), encoding="utf-8")
    result = run_attn("parse", "linearize", tmp_path / "train.mrg", "-o", tmp_path / "train",
                      "--terminals", terminals)
    assert result.returncode == 0, result.stderr
    result = run_attn("vocab", tmp_path / "train.src", tmp_path / "train.tgt", "-o",
                      tmp_path / "spm.model", "--size", "60", "--symbols",
                      tmp_path / "train.symbols")
    assert result.returncode == 0, result.stderr
    assert model_terminals(Vocabulary.from_file(tmp_path / "spm.model")) == terminals
