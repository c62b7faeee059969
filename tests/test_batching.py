"""Sentences into padded batches (batching.py): length-bucketed token batches, teacher-forced
collation, the batch plan over processes, the resumable micro-batch stream."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from attn_cli import batching
from attn_cli.batching import (
    balanced_batches,
    collate,
    pad_sequences,
    token_batches,
    token_budget_batches,
)
from attn_cli.data import ParallelData
from attn_cli.formats import BOS_ID, EOS_ID, PAD_ID


@pytest.fixture(scope="module")
def train_data(data_files) -> ParallelData:
    return ParallelData(data_files[0])


# ------------------------------------------------------------------ token batches and collation


def test_token_batches_cover_every_pair_once_within_budget(train_data):
    budget = 600
    batches = token_batches(train_data.src_lengths, train_data.tgt_lengths, budget, seed=3)
    everything = np.concatenate(batches)
    assert sorted(everything.tolist()) == list(range(len(train_data)))
    for batch in batches:
        padded = len(batch) * (max(train_data.src_lengths[batch].max(),
                                   train_data.tgt_lengths[batch].max()) + 1)
        assert padded <= budget or len(batch) == 1


def test_token_batches_group_similar_lengths(train_data):
    batches = token_batches(train_data.src_lengths, train_data.tgt_lengths, 600, seed=3)
    real = sum(int(train_data.tgt_lengths[b].sum()) + len(b) for b in batches)
    padded = sum(len(b) * (int(train_data.tgt_lengths[b].max()) + 1) for b in batches)
    assert real / padded > 0.9  # bucketing keeps target padding under 10%


def test_token_batches_are_reproducible_and_reshuffled_per_epoch(train_data):
    lengths = (train_data.src_lengths, train_data.tgt_lengths)
    first = token_batches(*lengths, 600, seed=3, epoch=0)
    again = token_batches(*lengths, 600, seed=3, epoch=0)
    other = token_batches(*lengths, 600, seed=3, epoch=1)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert [b.tolist() for b in first] != [b.tolist() for b in other]


def test_collate_adds_bos_eos_and_pads(train_data):
    indices = np.array([0, 5, 9])
    batch = collate(train_data, indices)
    for row, index in enumerate(indices):
        src, tgt = train_data.pair(int(index))
        assert batch.src_tokens[row, :len(src)].tolist() == src.tolist()
        assert batch.src_tokens[row, len(src)] == EOS_ID
        assert (batch.src_tokens[row, len(src) + 1:] == PAD_ID).all()
        assert batch.tgt_input[row, 0] == BOS_ID
        assert batch.tgt_input[row, 1:len(tgt) + 1].tolist() == tgt.tolist()
        assert batch.tgt_output[row, :len(tgt) + 1].tolist() == tgt.tolist() + [EOS_ID]
    assert int((batch.tgt_output != PAD_ID).sum()) == \
        sum(len(train_data.pair(int(i))[1]) + 1 for i in indices)
    # Where the loss is taken, found on the host: what a boolean mask would pick, in its order.
    mask = torch.from_numpy(batch.tgt_output) != PAD_ID
    assert batch.target_count == int(mask.sum())
    hidden = torch.randn(*batch.tgt_output.shape, 5)
    moved = batch.to("cpu")
    assert torch.equal(hidden.flatten(0, 1).index_select(0, moved.target_positions),
                       hidden[mask])
    assert torch.equal(moved.targets, moved.tgt_output[mask])


# ---------------------------------------------------- the batch plan and the micro-batch stream


def test_batch_plan_keeps_the_global_batch_whatever_the_world_size():
    assert batching.batch_plan(25000, None, 1).accumulation == 1
    eight = batching.batch_plan(25000, 3125, 8)
    assert (eight.max_tokens, eight.accumulation) == (3125, 1)
    one = batching.batch_plan(25000, 3125, 1)
    assert one.accumulation == 8 and one.micro_batches_per_step == eight.micro_batches_per_step


@pytest.mark.parametrize("batch_tokens,cap", [(25000, 4096), (25000, None), (25000, 1000),
                                              (1200, 600), (50000, 8192), (3000, 7)])
def test_batch_plan_adds_up_to_batch_tokens_for_1_to_16_processes(batch_tokens, cap):
    """The step's budget is --batch-tokens, rounded up by less than a token per forward pass,
    for every process count: the budget of a pass shrinks once accumulation is rounded up
    (before, a 4096 cap made 28,672 tokens on 1 process, 36,864 on 3, 49,152 on 6)."""
    for world_size in range(1, 17):
        plan = batching.batch_plan(batch_tokens, cap, world_size)
        assert plan.max_tokens <= (cap or batch_tokens), (world_size, plan)
        assert batch_tokens <= plan.step_tokens < batch_tokens + plan.micro_batches_per_step, \
            (world_size, plan)
        # as few passes as the cap allows: one pass fewer would not fit under the cap
        if plan.accumulation > 1:
            assert math.ceil(batch_tokens / world_size) > (plan.accumulation - 1) * cap
    plans = {n: batching.batch_plan(25000, 4096, n) for n in (1, 2, 3, 6, 8)}
    assert {n: (plan.accumulation, plan.max_tokens) for n, plan in plans.items()} == {
        1: (7, 3572), 2: (4, 3125), 3: (3, 2778), 6: (2, 2084), 8: (1, 3125)}


def stream_indices(stream: batching.MicroBatchStream, count: int) -> list[int]:
    return [int(i) for batch in stream.take(count) for i in batch]


def test_a_new_budget_goes_on_from_the_same_place_in_the_data(data_files):
    """Resuming with another micro-batch budget (another process count): the epoch's batches
    used so far are kept as they were cut, the rest is cut from the pairs they left, so each
    pair is seen once per epoch, however often the budget changes; a stream rebuilt from the
    saved position gives the same batches as the one that went on."""
    data = ParallelData(data_files[0])
    stream = batching.MicroBatchStream(data, 600, seed=3)
    seen = stream_indices(stream, 4)
    stream.change_budget(400)
    seen += stream_indices(stream, 3)
    stream.change_budget(900)
    assert stream.earlier_budgets == ((600, 4), (400, 3))
    rebuilt = batching.MicroBatchStream(data, 900, 3, *stream.position, stream.earlier_budgets)
    next_two = stream_indices(rebuilt, 2)
    assert next_two == stream_indices(stream, 2)  # the same next batches
    seen += next_two + stream_indices(rebuilt, rebuilt.epoch_length - rebuilt.offset)
    assert sorted(seen) == list(range(len(data)))  # every pair once: none skipped or repeated
    assert rebuilt.position == (0, rebuilt.epoch_length)
    stream_indices(rebuilt, 1)  # the next epoch: cut with the new budget alone
    assert rebuilt.position == (1, 1) and rebuilt.earlier_budgets == ()
    fresh = batching.MicroBatchStream(data, 900, 3, epoch=1)
    assert [b.tolist() for b in rebuilt._batches] == [b.tolist() for b in fresh._batches]


# ----------------------------------------------------------------------------- the search batcher


def test_search_batches_hold_each_sentence_once_within_the_budget():
    lengths = [5, 1, 9, 3, 3, 12, 7, 2, 40, 6]
    batches = token_budget_batches(lengths, 20)
    assert sorted(index for batch in batches for index in batch) == list(range(len(lengths)))
    for batch in batches:  # sentences × longest within the budget, or one sentence alone
        assert len(batch) * max(lengths[i] for i in batch) <= 20 or len(batch) == 1
    # in length order (little padding), each batch as full as the budget allows
    assert [[lengths[i] for i in batch] for batch in batches] == [[1, 2, 3, 3], [5, 6], [7, 9],
                                                                [12], [40]]


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_batches_for_several_workers_come_in_even_rounds(workers):
    """As many batches as the budget needs, rounded up to a multiple of the workers, each
    within the budget and the largest no larger than before: no last round of one short batch
    with the other workers idle. One worker: the budget's batches unchanged."""
    rng = random.Random(workers)
    lengths = [rng.randint(3, 40) for _ in range(1000)]

    def size(batch):
        return len(batch) * max(lengths[i] for i in batch)

    plain = token_budget_batches(lengths, 8000)
    even = balanced_batches(lengths, 8000, workers)
    assert len(even) % workers == 0 and len(plain) <= len(even) < len(plain) + workers
    assert sorted(index for batch in even for index in batch) == list(range(len(lengths)))
    assert max(map(size, even)) <= max(map(size, plain))
    assert min(map(size, even)) > 0.8 * max(map(size, even))  # even, to a sentence or two
    assert min(map(size, plain)) < 0.5 * max(map(size, plain))  # where plain had a short one
    assert balanced_batches(lengths, 8000, 1) == plain
    assert balanced_batches([5, 6], 8000, 2) == [[0], [1]]  # two workers, one sentence each
    assert balanced_batches([5], 8000, 2) == [[0]]


def test_pad_sequences_left_aligns_and_pads():
    assert pad_sequences([[5, 6, 7], [8], [9, 10]], pad_id=0).tolist() == [
        [5, 6, 7], [8, 0, 0], [9, 10, 0]]


@pytest.mark.parametrize("world_size", [1, 3])
def test_steps_collated_ahead_are_the_steps_collated_in_line(train_data, world_size):
    """On a GPU a thread collates step s + 1 while step s computes (into page-locked memory
    there; plain here): the steps, each process's share and the position a checkpoint records
    are those of collating each step when it comes."""
    plan = batching.batch_plan(2400, 400, world_size)
    for rank in range(world_size):
        inline = batching.StepStream(batching.MicroBatchStream(train_data, plan.max_tokens, 5),
                                     plan, rank, ahead=False)
        ahead = batching.StepStream(batching.MicroBatchStream(train_data, plan.max_tokens, 5),
                                    plan, rank, ahead=True)
        assert ahead.position == inline.position == (0, 0)
        try:
            for _ in range(40):  # past the end of an epoch
                expected, step = inline.next(), ahead.next()
                assert ahead.position == inline.position == step.position
                assert ahead.earlier_budgets == inline.earlier_budgets
                assert [b.tolist() for b in step.micro_batches] == \
                    [b.tolist() for b in expected.micro_batches]
                assert [place for place, _ in step.mine] == list(
                    range(rank, plan.micro_batches_per_step, world_size))
                for (_, got), (_, want) in zip(step.mine, expected.mine):
                    assert all(np.array_equal(np.asarray(a), b)
                               for a, b in zip(got._arrays(), want._arrays()))
            assert inline.position[0] >= 1  # an epoch went by
        finally:
            ahead.close()
