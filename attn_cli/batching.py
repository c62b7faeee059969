"""Sentences into padded batches, one rule everywhere: sentences × longest sentence (padding and
EOS/BOS included) within a token budget.

Training cuts a data file into length-bucketed, shuffled micro-batches (`token_batches`, §5.1),
shares a global batch among processes and forward passes (`BatchPlan`), and streams them epoch
after epoch from a resumable position (`MicroBatchStream`), a step at a time, collated ahead on a
GPU (`StepStream`); several data files are drawn from by weight, each epoch's pairs a function of
(seed, epoch) (`CorpusMix`); every teacher-forced pass (training, validation loss, `score -m`,
attention maps) collates x + EOS, BOS + y and y + EOS, and where the targets are (`collate`);
searches (`decode`, `parse`, validation by BLEU/F1) cut sources sorted by length
(`token_budget_batches`; `balanced_batches` for several search workers) and pad them
(`pad_sequences`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from .data import Corpora, ParallelData
from .formats import BOS_ID, EOS_ID, PAD_ID

# --------------------------------------------------------------------------------- training


def token_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_tokens: int,
                  seed: int, epoch: int = 0) -> list[np.ndarray]:
    """Length-bucketed batches bounded by a token budget (§5.1: "sentence pairs were batched
    together by approximate sequence length").

    Pairs are sorted by target then source length (ties broken at random from `seed` and
    `epoch`), then packed greedily so that sentences × longest sentence, padding and EOS/BOS
    included, stays within `max_tokens` on each side. The batch order is shuffled. A pair longer
    than the budget on its own becomes a batch of one."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(src_lengths))
    order = order[np.lexsort((src_lengths[order], tgt_lengths[order]))]
    src_sorted = (src_lengths[order] + 1).tolist()  # + EOS
    tgt_sorted = (tgt_lengths[order] + 1).tolist()  # + BOS (input) / EOS (output)
    boundaries = [0]
    longest_src = longest_tgt = 0
    for position, (src_len, tgt_len) in enumerate(zip(src_sorted, tgt_sorted)):
        longest_src = max(longest_src, src_len)
        longest_tgt = max(longest_tgt, tgt_len)
        count = position - boundaries[-1] + 1
        if count > 1 and max(longest_src, longest_tgt) * count > max_tokens:
            boundaries.append(position)
            longest_src, longest_tgt = src_len, tgt_len
    boundaries.append(len(order))
    batches = [order[begin:end] for begin, end in zip(boundaries[:-1], boundaries[1:])]
    return [batches[i] for i in rng.permutation(len(batches))]


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is split: tokens per forward pass, passes per process per step."""

    batch_tokens: int  # per side, per optimizer step, over all processes
    max_tokens: int  # per forward pass (padding included): the micro-batch's budget
    world_size: int
    accumulation: int  # forward passes per process per step

    @property
    def micro_batches_per_step(self) -> int:
        return self.accumulation * self.world_size

    @property
    def step_tokens(self) -> int:
        """The budget of a whole step: --batch-tokens, rounded up by less than a token per pass."""
        return self.max_tokens * self.micro_batches_per_step

    def describe(self) -> str:
        return (f"batch plan  {self.batch_tokens} tokens/side/step over {self.world_size} "
                f"process(es): {self.max_tokens} tokens per forward pass, "
                f"{self.accumulation} accumulation step(s) per process "
                f"({self.step_tokens} tokens/side in all)")

    def record(self) -> dict:
        return dataclasses.asdict(self)

    def brief(self) -> str:
        return (f"{self.world_size} process(es) x {self.accumulation} pass(es) x "
                f"{self.max_tokens} tokens")


def batch_plan(batch_tokens: int, max_tokens: int | None, world_size: int) -> BatchPlan:
    """As few forward passes as the cap `max_tokens` allows, all of one budget, the smallest
    that adds up to `batch_tokens`: the global batch is the same for any process count (a
    budget left at the cap would round it up by up to a pass: 28,672 instead of 25,000 on
    1 process with a 4096 cap, 36,864 on 3)."""
    per_process = math.ceil(batch_tokens / world_size)
    cap = min(max_tokens or per_process, per_process)
    accumulation = math.ceil(per_process / cap)
    budget = math.ceil(batch_tokens / (world_size * accumulation))  # ≤ cap
    return BatchPlan(batch_tokens, budget, world_size, accumulation)


class MicroBatchStream:
    """The endless sequence of micro-batches (index arrays), epoch after epoch, each epoch
    bucketed and shuffled from (seed, epoch). `position` is what resuming needs. An epoch holds
    every pair of the data once, or, with a `mix` of several corpora, the pairs it draws for
    that epoch (CorpusMix.epoch_pairs, a function of the seed and the epoch too).

    A run resumed with another budget per micro-batch (another process count or --max-tokens)
    goes on from the same place in the data: the epoch's batches used so far stay as they were
    cut (`earlier_budgets`: (budget, batches) for each earlier part of the epoch), and the rest
    of the epoch is cut with the new budget from the pairs they left, so that no pair is
    skipped or seen twice."""

    def __init__(self, data: ParallelData | Corpora, max_tokens: int, seed: int, epoch: int = 0,
                 offset: int = 0, earlier_budgets: tuple[tuple[int, int], ...] = (),
                 mix: CorpusMix | None = None):
        self.data, self.max_tokens, self.seed, self.mix = data, max_tokens, seed, mix
        self.epoch, self.offset = epoch, offset
        self.earlier_budgets = tuple((int(budget), int(count))
                                     for budget, count in earlier_budgets)
        self._batches = self._epoch_batches()

    def _epoch_batches(self) -> list[np.ndarray]:
        """This epoch's batches: each earlier budget's share cut from the pairs the ones before
        it left, the rest with this stream's budget. What is left is kept as places in the
        epoch's list of pairs, not as pairs: a pair a mix draws twice is there twice (one
        corpus alone: the places are the pairs, as they always were)."""
        pairs = (np.arange(len(self.data)) if self.mix is None
                 else self.mix.epoch_pairs(self.seed, self.epoch))
        unused = np.arange(len(pairs))
        batches: list[np.ndarray] = []
        for budget, count in (*self.earlier_budgets, (self.max_tokens, None)):
            if len(unused) == 0:
                break
            chosen = pairs[unused]
            cut = token_batches(self.data.src_lengths[chosen], self.data.tgt_lengths[chosen],
                                budget, self.seed, self.epoch)[:count]
            batches += [chosen[indices] for indices in cut]
            if count is not None:
                unused = np.setdiff1d(unused, np.concatenate([unused[indices]
                                                              for indices in cut]))
        return batches

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.offset

    @property
    def epoch_length(self) -> int:
        """Micro-batches in the current epoch."""
        return len(self._batches)

    def next_epoch(self) -> None:
        self.epoch, self.offset, self.earlier_budgets = self.epoch + 1, 0, ()
        self._batches = self._epoch_batches()

    def change_budget(self, max_tokens: int) -> None:
        """Go on with micro-batches of `max_tokens` from the same place in the data."""
        if max_tokens == self.max_tokens:
            return
        used_at_this_budget = self.offset - sum(count for _, count in self.earlier_budgets)
        previous, self.max_tokens = self.max_tokens, max_tokens
        if self.offset >= len(self._batches):
            self.next_epoch()
            return
        if used_at_this_budget > 0:
            self.earlier_budgets += ((previous, used_at_this_budget),)
        self._batches = self._epoch_batches()

    def take(self, count: int) -> list[np.ndarray]:
        taken = []
        while len(taken) < count:
            if self.offset >= len(self._batches):
                self.next_epoch()
            taken.append(self._batches[self.offset])
            self.offset += 1
        return taken


# -------------------------------------------------------------------- several corpora, weighted

# The RNG stream of a corpus's passes: [seed, this, corpus, pass], apart from token_batches'
# [seed, epoch] and dropout's seeds.
PASS_STREAM = 43


@dataclass(frozen=True)
class CorpusMix:
    """What an epoch draws from several corpora (`attn train A.st B.st C.st --weights 1,1,4`):
    as many pairs as they hold together, of which corpus i gives `quotas[i]`, in proportion to
    its weight. Each corpus is read as an endless sequence of passes, each pass a permutation of
    its pairs drawn from (seed, corpus, pass); epoch e takes the quota's next stretch of it,
    positions e × quota to (e + 1) × quota. A corpus whose quota is above its size is repeated
    (its whole passes, then part of one); one whose quota is below it is subsampled without
    replacement, epoch after epoch through the same pass, so that every pair is seen before any
    is seen again. Everything is a function of (seed, epoch, the sizes and the quotas): a
    resumed run draws what the uninterrupted one did, and no cursor needs saving. With the
    default weights (each corpus's size) every quota is its size and an epoch is the
    concatenation of the corpora, pair for pair: one data file is drawn from as it always was."""

    sizes: tuple[int, ...]  # pairs in each corpus, in the order given
    quotas: tuple[int, ...]  # pairs each gives an epoch; they add up to sum(sizes)
    shares: tuple[float, ...]  # the weights normalised (what the quotas are rounded from)

    @property
    def starts(self) -> np.ndarray:
        """Each corpus's first index among all the pairs (Corpora's numbering)."""
        return np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

    def epoch_pairs(self, seed: int, epoch: int) -> np.ndarray:
        """The pairs of epoch `epoch`, as indices into all the corpora: corpus by corpus, each's
        draw sorted (a pair drawn k times is there k times). token_batches shuffles them."""
        return np.concatenate([start + corpus_draw(size, quota, seed, corpus, epoch)
                               for corpus, (start, size, quota)
                               in enumerate(zip(self.starts, self.sizes, self.quotas))])

    def corpus_of(self, indices: np.ndarray) -> np.ndarray:
        """The corpus (its place in the order given) each pair of `indices` comes from."""
        return np.searchsorted(self.starts, indices, side="right") - 1

    def describe(self, names: Sequence[str]) -> list[str]:
        """A log line per corpus: its size, weight and what an epoch takes of it."""
        return [f"corpus {name}: {size:,} pairs, weight {share:.3g}, {quota:,} pairs an epoch "
                f"({quota / size:.3g}x its size)"
                for name, size, share, quota in zip(names, self.sizes, self.shares, self.quotas)]


def corpus_mix(sizes: Sequence[int], weights: Sequence[Fraction] | None = None) -> CorpusMix:
    """The mix of corpora of `sizes` pairs, weighted by `weights` (positive; None: by size).
    An epoch holds sum(sizes) pairs; corpus i's quota is its exact share, sum × w_i / sum(w),
    rounded by largest remainder (Hamilton's method): each quota is its share rounded down, and
    the pairs that rounding leaves go one each to the largest remainders (ties: the earlier
    corpus), so that the quotas add up to the epoch exactly and each is within 1 of its share.
    In exact fractions, so that the quotas are the same on every machine."""
    weights = [Fraction(size) for size in sizes] if weights is None else list(weights)
    total, weight_sum = sum(sizes), sum(weights)
    shares = [total * weight / weight_sum for weight in weights]
    quotas = [math.floor(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (quotas[i] - shares[i], i))
    for corpus in by_remainder[:total - sum(quotas)]:
        quotas[corpus] += 1
    return CorpusMix(tuple(int(size) for size in sizes), tuple(quotas),
                     tuple(float(weight / weight_sum) for weight in weights))


def corpus_draw(size: int, quota: int, seed: int, corpus: int, epoch: int) -> np.ndarray:
    """The pairs a corpus of `size` gives epoch `epoch` (its indices, sorted, a pair drawn k
    times k times): positions epoch × quota to (epoch + 1) × quota of its sequence of passes,
    pass p a permutation of its pairs from (seed, corpus, p) (CorpusMix). Passes wholly inside
    that stretch give every pair once whatever their order, so only the part-passes at its two
    ends are permuted: a tiny corpus drawn a thousand times an epoch costs no more than once."""
    begin, end = epoch * quota, (epoch + 1) * quota
    first_whole, end_whole = -(-begin // size), end // size  # passes [first_whole, end_whole)
    counts = np.zeros(size, dtype=np.int64)
    if end_whole < first_whole:  # inside one pass
        parts = [(begin, end)]
    else:
        counts += end_whole - first_whole
        parts = [(begin, first_whole * size), (end_whole * size, end)]
    for part_begin, part_end in parts:
        if part_end > part_begin:
            pass_number = part_begin // size
            order = np.random.default_rng([seed, PASS_STREAM, corpus, pass_number]) \
                .permutation(size)
            counts[order[part_begin - pass_number * size:part_end - pass_number * size]] += 1
    return np.repeat(np.arange(size, dtype=np.int64), counts)


# -------------------------------------------------------------------------- teacher forcing


@dataclass(frozen=True)
class Batch:
    """Padded int64 arrays (numpy; tensors after `to`): src_tokens = x + EOS, tgt_input = BOS + y,
    tgt_output = y + EOS; and where the loss is taken: `target_positions`, the flat (row-major)
    indices of tgt_output's non-padding entries, and `targets`, the tokens there. They are found
    here, on the host: found on a GPU (a boolean mask) their count would be read back, a wait for
    the device in every forward pass."""

    src_tokens: np.ndarray | torch.Tensor  # (B, S)
    tgt_input: np.ndarray | torch.Tensor  # (B, T)
    tgt_output: np.ndarray | torch.Tensor  # (B, T)
    target_positions: np.ndarray | torch.Tensor  # (N,)
    targets: np.ndarray | torch.Tensor  # (N,)

    @property
    def target_count(self) -> int:
        return len(self.targets)

    def pinned(self) -> Batch:
        """As tensors in page-locked memory: copies from there to a GPU run beside its work."""
        return Batch(*(torch.from_numpy(array).pin_memory() if isinstance(array, np.ndarray)
                       else array.pin_memory() for array in self._arrays()))

    def to(self, device: torch.device | str) -> Batch:
        """As tensors on `device` (without waiting for the copy, where the batch is pinned)."""
        return Batch(*(torch.as_tensor(array).to(device, non_blocking=True)
                       for array in self._arrays()))

    def _arrays(self) -> tuple:
        return (self.src_tokens, self.tgt_input, self.tgt_output, self.target_positions,
                self.targets)


def collate_pairs(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], bos_id: int = BOS_ID,
                  eos_id: int = EOS_ID, pad_id: int = PAD_ID) -> Batch:
    """(x, y) pairs of token ids, without BOS or EOS, into a padded `Batch`."""
    src_width = max(len(src) for src, _ in pairs) + 1
    tgt_width = max(len(tgt) for _, tgt in pairs) + 1
    src_tokens = np.full((len(pairs), src_width), pad_id, dtype=np.int64)
    tgt_input = np.full((len(pairs), tgt_width), pad_id, dtype=np.int64)
    tgt_output = np.full((len(pairs), tgt_width), pad_id, dtype=np.int64)
    for row, (src, tgt) in enumerate(pairs):
        src_tokens[row, :len(src)] = src
        src_tokens[row, len(src)] = eos_id
        tgt_input[row, 0] = bos_id
        tgt_input[row, 1:len(tgt) + 1] = tgt
        tgt_output[row, :len(tgt)] = tgt
        tgt_output[row, len(tgt)] = eos_id
    target_positions = np.flatnonzero(tgt_output != pad_id)
    return Batch(src_tokens, tgt_input, tgt_output, target_positions,
                 tgt_output.reshape(-1)[target_positions])


def collate(data: ParallelData | Corpora, indices: np.ndarray) -> Batch:
    """The pairs `indices` of a data file as a `Batch`, with its special ids (attn's, or an
    imported model's: `ParallelData.special_ids`)."""
    ids = data.special_ids
    return collate_pairs([data.pair(int(i)) for i in indices], ids.bos, ids.eos, ids.pad)


@dataclass(frozen=True)
class Step:
    """One optimizer step's micro-batches: all of them (index arrays, every process's), this
    process's share collated (each with its place in the step), and the stream's position
    after them (what a checkpoint of this step records)."""

    micro_batches: list[np.ndarray]
    mine: list[tuple[int, Batch]]
    position: tuple[int, int]
    earlier_budgets: tuple[tuple[int, int], ...]


def process_share(data: ParallelData | Corpora, micro_batches: list[np.ndarray], rank: int,
                  world_size: int) -> list[tuple[int, Batch]]:
    """Process `rank`'s micro-batches of a step, every world_size-th from its rank, collated,
    each with its place in the step (which seeds its dropout)."""
    return [(place, collate(data, micro_batches[place]))
            for place in range(rank, len(micro_batches), world_size)]


class StepStream:
    """The steps of a run from a `MicroBatchStream`, this process's share collated. With
    `ahead` (on a GPU), a background thread collates step s + 1 while the device computes step
    s: collation is a loop over pairs in Python, and done in line the device would idle
    through it at every step. With `pinned`, the batches are put in page-locked memory, from
    which copies to the GPU do not hold up the host. Taking a step ahead changes nothing in
    what each step holds: the stream is only read in step order, and `position` is the one
    after the last step given out, not the one taken ahead."""

    def __init__(self, stream: MicroBatchStream, plan: BatchPlan, rank: int, ahead: bool,
                 pinned: bool = False):
        self.stream, self.plan, self.rank, self.pinned = stream, plan, rank, pinned
        self.position, self.earlier_budgets = stream.position, stream.earlier_budgets
        self._pool = None
        self._next = None
        if ahead:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attn-collate")
            self._next = self._pool.submit(self._collate, *self._take())

    def _take(self) -> tuple[list[np.ndarray], tuple[int, int], tuple[tuple[int, int], ...]]:
        micro_batches = self.stream.take(self.plan.micro_batches_per_step)
        return micro_batches, self.stream.position, self.stream.earlier_budgets

    def _collate(self, micro_batches, position, earlier_budgets) -> Step:
        mine = process_share(self.stream.data, micro_batches, self.rank, self.plan.world_size)
        if self.pinned:
            mine = [(place, batch.pinned()) for place, batch in mine]
        return Step(micro_batches, mine, position, earlier_budgets)

    def next(self) -> Step:
        if self._pool is None:
            step = self._collate(*self._take())
        else:
            step = self._next.result()
            self._next = self._pool.submit(self._collate, *self._take())
        self.position, self.earlier_budgets = step.position, step.earlier_budgets
        return step

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


# ---------------------------------------------------------------------------------- search


# One rule decides every search batch (decode, parse, the server's queue, validation): a batch of
# sentences searched together holds at most `source_budget` source tokens, padding included,
# with --batch-tokens counting source tokens × the rows each sentence searches (its beam).


def source_budget(batch_tokens: int, rows_per_sentence: int) -> int:
    """Source tokens of one search batch, padding included: `batch_tokens` shared by the rows
    each sentence searches (its beam; 1 when sampling)."""
    return max(1, batch_tokens // rows_per_sentence)


def fits(longest: int, sentences: int, budget: int) -> bool:
    """Whether `sentences` padded to `longest` fit a batch's source budget."""
    return longest * sentences <= budget


def token_budget_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices sorted by length, cut so that sentences × longest ≤ budget (source side)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current, longest = [], [], 0
    for index in order:
        longest_if_added = max(longest, lengths[index])
        if current and not fits(longest_if_added, len(current) + 1, budget):
            batches.append(current)
            current, longest_if_added = [], lengths[index]
        current.append(index)
        longest = longest_if_added
    if current:
        batches.append(current)
    return batches


def balanced_batches(lengths: list[int], budget: int, workers: int) -> list[list[int]]:
    """`token_budget_batches` for `workers` searching side by side: as many batches as the
    budget needs, rounded up to a multiple of `workers`, cut as evenly as the sorted order
    allows (the smallest budget that gives no more of them). A last round with one short
    batch would leave the other workers idle: 1,000 lines greedy at 8,000 tokens are 533,
    372 and 95 sentences, and two workers then wait on the one searching 372 + 95."""
    batches = token_budget_batches(lengths, budget)
    if workers <= 1 or len(lengths) <= 1:
        return batches
    count = -(-len(batches) // workers) * workers
    low, high = 1, budget
    while low < high:  # bisect the smallest budget cutting into at most `count` batches
        middle = (low + high) // 2
        if len(token_budget_batches(lengths, middle)) <= count:
            high = middle
        else:
            low = middle + 1
    return token_budget_batches(lengths, low)


def pad_sequences(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """(B, longest) int64, each row left-aligned and padded with `pad_id`."""
    out = torch.full((len(rows), max(len(row) for row in rows)), pad_id, dtype=torch.long)
    for index, row in enumerate(rows):
        out[index, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out
