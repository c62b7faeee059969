"""Requests searched in shared batches: what lets `attn serve`'s throughput grow with its clients.

Every translation request becomes a `Job`; its non-empty lines wait in one queue, and search
workers (threads, one torch thread each on a CPU, as `attn decode --workers`) take lines from it
into token-budget batches. Lines of different requests share a batch when they ask for the same
models (a server of several language pairs queues all their jobs here, so its workers are as
many as the cores whatever the pairs) and the same search settings; a worker that finds the
queue idle waits a few milliseconds (the gathering window) for the requests that arrive
together, and idle workers split what is waiting between them rather than one taking it all.
A line's output depends only on the line and its settings (the search is independent of the
batching, as in `attn decode`), so which lines shared a batch never shows in an answer.

Where the translator's search can be (`decode.stream.supported`: attn's C++ step with its fused
kernels, a free beam search, a line with no phrases to hold: a prefix, a model's target-language
token among them, flies), a worker's batch is a stream
(iteration-level batching, `decode.stream.Stream`): lines that arrive while it searches join it
at the next step, up to the worker's share of the lines in flight and the token budget, and each
line leaves, answered, at its own last step; a worker never waits for a batch to end or to fill.

The queue holds at most `capacity` lines: a request that does not fit is refused (`QueueFull`,
the server's 503) instead of memory growing. A job whose client went away, or whose deadline
passed, is cancelled (`cancel`): its lines still waiting leave the queue at once, unsearched,
and its lines in a batch being searched leave that batch at the search's next step (the other
lines of the batch go on to the outputs they would have had).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..batching import fits
from ..decode.controls import NONE
from ..decode.stream import Stream
from ..decode.stream import supported as stream_supported
from ..decode.translator import EMPTY_LINE, Translator


class QueueFull(Exception):
    """The queue cannot take a request's lines now."""


@dataclass(eq=False)
class Job:
    """One request: its lines, the translator with its settings, and what came of them.
    `outputs[i]`: line i's outputs, `Translator.outputs` (nbest (hypothesis, text) pairs),
    filled by the workers; `done(job)` is called once, from a worker thread (or at submission
    when nothing waits), when every line has its output or the search failed (`error`); never
    for a job cancelled."""

    lines: list[str]
    translator: Translator
    done: Callable[[Job], None]
    name: str = "request"  # how warnings name it
    outputs: list = field(default_factory=list)
    error: BaseException | None = None
    remaining: int = 0
    arrived: float = 0.0
    cancelled: bool = False  # set once, under the queue's lock; read by the search unlocked
    # Each line's controls (`controls.Controls`: a target prefix, phrases to hold); None: none.
    controls: list | None = None
    # Each line's source ids, EOS included; None for an empty line (its output needs no search).
    sources: list = field(init=False)

    def __post_init__(self) -> None:
        # Encoded as the job is made, before it is queued (SentencePiece: microseconds a line):
        # its work is known before it costs any (`work`). All lines in one call (a truncation
        # warning names the request's own line number), the empty ones' ids then dropped.
        ids = self.translator.encode(self.lines, 1, self.name)
        self.sources = [line_ids if line.strip() else None
                        for line, line_ids in zip(self.lines, ids)]

    @property
    def settings(self):
        """Lines of jobs with equal settings may share a batch."""
        return self.translator.options

    def shares_batches_with(self, other: Job) -> bool:
        """Whether this job's lines may be searched in one batch with `other`'s: the same
        models (a server of several language pairs has a translator for each, all behind one
        queue) and equal settings."""
        return (self.translator.model is other.translator.model
                and self.translator.options == other.translator.options)

    @property
    def work(self) -> int:
        """The most output tokens its search may produce (`Translator.search_work`)."""
        return self.translator.search_work([ids for ids in self.sources if ids is not None])


@dataclass(eq=False)
class _Line:
    job: Job
    index: int  # the line's place in its job
    ids: list[int]  # source ids, EOS included

    @property
    def controls(self):
        """Its `controls.Controls` (NONE: none)."""
        return NONE if self.job.controls is None else self.job.controls[self.index]


class RequestQueue:
    """The queue and its search workers. `submit` from any thread; `close` lets the workers
    finish what is queued, then stops them."""

    def __init__(self, workers: int = 1, worker_threads: int = 1, capacity: int = 4096,
                 window_s: float = 0.003,
                 on_batch: Callable[[int, int], None] | None = None):
        self.workers, self.worker_threads = workers, worker_threads
        self.capacity, self.window_s = capacity, window_s
        # on_batch(lines, padded source tokens) as a worker takes each batch (the server's
        # metrics): from the worker's thread, outside the lock; it must not raise.
        self.on_batch = on_batch
        self._lines: deque[_Line] = deque()
        self._changed = threading.Condition()
        self._searching: list[list[_Line]] = []  # the batches being searched now
        self._closing = False
        self._threads = [threading.Thread(target=self._work, name=f"attn-serve-{n}", daemon=True)
                         for n in range(workers)]
        for thread in self._threads:
            thread.start()

    @property
    def waiting(self) -> int:
        """Lines waiting for a worker."""
        return len(self._lines)

    @property
    def searching(self) -> int:
        """Lines being searched, those of cancelled jobs left out (they leave their batch at its
        next step)."""
        with self._changed:
            return sum(1 for batch in self._searching for line in batch
                       if not line.job.cancelled)

    def submit(self, job: Job) -> None:
        """Queue a job's non-empty lines (an empty line's output is an empty line, at once).
        Raises QueueFull when they do not fit."""
        empty = job.translator.outputs([EMPTY_LINE])
        job.outputs = [empty if ids is None else None for ids in job.sources]
        todo = [index for index, ids in enumerate(job.sources) if ids is not None]
        job.remaining, job.arrived = len(todo), time.perf_counter()
        if not todo:
            job.done(job)
            return
        # Longest first, so that a long request's consecutive lines make batches of like
        # lengths, as `attn decode` sorts its buffer.
        lines = sorted((_Line(job, index, job.sources[index]) for index in todo),
                       key=lambda line: -len(line.ids))
        with self._changed:
            if self._closing:
                raise QueueFull("the server is stopping")
            if len(self._lines) + len(todo) > self.capacity:
                raise QueueFull(f"{len(self._lines)} lines are waiting (at most "
                                f"{self.capacity})")
            self._lines.extend(lines)
            self._changed.notify_all()

    def cancel(self, job: Job) -> None:
        """Call a job off (its client went away, or its deadline passed): its waiting lines
        leave the queue unsearched, now, and its lines in a batch being searched leave it at the
        search's next step. The job is never done."""
        with self._changed:
            job.cancelled = True
            self._drop(job)
            self._changed.notify_all()

    def _drop(self, job: Job) -> None:  # the lock held
        self._lines = deque(line for line in self._lines if line.job is not job)

    def close(self) -> None:
        """Search what is queued, then stop the workers."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()

    # ---------------------------------------------------------------------------------- workers

    def _work(self) -> None:
        torch.set_num_threads(self.worker_threads)
        last = (0, 0.0)  # this worker's last batch: lines, seconds
        streams: dict[int, Stream] = {}  # this worker's, one per translator, kept for reuse
        while True:
            batch = self._take(*last)
            if batch is None:
                return
            if batch and self.on_batch is not None:
                self.on_batch(len(batch), len(batch) * max(len(line.ids) for line in batch))
            started = time.perf_counter()
            if batch and streamable(batch):
                translator = batch[0].job.translator
                stream = streams.get(id(translator))
                if stream is None or stream.translator is not translator:
                    stream = streams[id(translator)] = Stream(translator)
                if not self._fly(stream, batch):
                    del streams[id(translator)]  # a failure may have left it half-way
            else:
                self._search(batch)
            last = (len(batch), time.perf_counter() - started)

    def _fly(self, stream: Stream, flying: list[_Line]) -> bool:
        """Search `flying` (the batch `_take` gave, registered as being searched) as a stream:
        step by step, each line answered at its own last step, lines waiting admitted between
        steps (`_admit`), until none is left in flight. A failure fails the jobs of the lines
        in flight, as `_search`'s does (and returns False)."""
        translator = flying[0].job.translator
        try:
            stream.add(list(flying), [line.ids for line in flying],
                       [line.controls.prefix for line in flying])
            while flying:
                for line in flying:
                    if line.job.cancelled:
                        stream.call_off(line)
                ended = stream.step()
                answers = [(line, None if line.job.cancelled else
                            translator.outputs(translator.without_start([found])[0]))
                           for line, found in ended]
                finished = self._answer(flying, answers)
                self._hand_back(finished, translator)
                admitted = self._admit(flying)
                if admitted:
                    if self.on_batch is not None:
                        self.on_batch(len(admitted),
                                      len(admitted) * max(len(line.ids) for line in admitted))
                    stream.add(admitted, [line.ids for line in admitted],
                               [line.controls.prefix for line in admitted])
            return True
        except Exception as error:  # the jobs in flight answer it; the server goes on
            with self._changed:
                finished = self._fail(flying, error)
                flying.clear()
            self._hand_back(finished, translator)
            return False
        finally:
            with self._changed:
                self._searching.remove(flying)
                self._changed.notify_all()

    def _answer(self, flying: list[_Line], answers: list) -> list[Job]:
        """Lines that left the stream, with their outputs (None: cancelled): out of `flying`,
        into their jobs; the jobs now complete."""
        with self._changed:
            for line, _ in answers:
                flying.remove(line)
            finished = self._record(answers)
            if answers:
                self._changed.notify_all()
        return finished

    @staticmethod
    def _record(answers: list) -> list[Job]:  # the lock held
        """Each line's output (None: cancelled) into its job; the jobs now complete. A job
        cancelled or failed meanwhile takes nothing: its outputs mean nothing, no one waits."""
        finished = []
        for line, output in answers:
            job = line.job
            if job.cancelled or job.error is not None:
                continue
            job.outputs[line.index] = output
            job.remaining -= 1
            if job.remaining == 0:
                finished.append(job)
        return finished

    def _admit(self, flying: list[_Line]) -> list[_Line]:
        """Lines waiting that may join the stream `flying` now (the same models and settings,
        no phrases to hold), within the token budget and this worker's share of all the lines in
        flight and waiting (the other workers' streams take the rest); never waits."""
        with self._changed:
            if not self._lines:
                return []
            first = flying[0].job
            alike = [line for line in self._lines if line.job.shares_batches_with(first)
                     and not line.controls.phrases]
            if not alike:
                return []
            in_flight = sum(len(batch) for batch in self._searching)
            share = math.ceil((in_flight + len(alike)) / self.workers) - len(flying)
            budget = first.settings.source_budget
            longest = max(len(line.ids) for line in flying)
            admitted = []
            for line in alike:
                if len(admitted) >= share or not fits(max(longest, len(line.ids)),
                                                      len(flying) + len(admitted) + 1, budget):
                    break
                admitted.append(line)
                longest = max(longest, len(line.ids))
            if admitted:
                chosen = set(map(id, admitted))
                self._lines = deque(line for line in self._lines if id(line) not in chosen)
                flying.extend(admitted)
            return admitted

    def _fail(self, lines: list[_Line], failure: BaseException) -> list[Job]:  # the lock held
        """Fail the jobs of `lines` (their other lines leave the queue); those now done."""
        finished = []
        for job in {line.job: None for line in lines}:
            if job.error is None and not job.cancelled:
                job.error = failure
                self._drop(job)  # its other lines are not searched
                finished.append(job)
        self._changed.notify_all()
        return finished

    @staticmethod
    def _hand_back(finished: list[Job], translator: Translator) -> None:
        for job in finished:
            try:
                job.done(job)
            except Exception as error:  # one answer lost, not the worker
                translator.warn(f"serve: {job.name}: could not hand back its answer: {error}")

    def _take(self, last_lines: int, last_seconds: float) -> list[_Line] | None:
        """The next batch: lines with the first waiting line's models and settings, within its
        token budget and this worker's share of them; None once closing and nothing is left.

        How long to wait for more: an idle server, the gathering window from the first line's
        arrival; a busy one, also until as many lines wait as this worker's last batch had (its
        clients, answered, are sending their next lines), for at most a quarter of that batch's
        search time. Without that wait, clients that come back a millisecond apart split into
        ever smaller batches, and a small batch costs nearly as much as a full one."""
        with self._changed:
            while True:
                if self._lines or self._closing:
                    break
                self._changed.wait()
            if not self._lines:
                return None
            arrived = self._lines[0].job.arrived
            window = arrived + self.window_s
            refill = time.perf_counter() + last_seconds / 4
            while not self._closing:
                now = time.perf_counter()
                if now < window:
                    self._changed.wait(window - now)
                elif now < refill and len(self._lines) < last_lines:
                    self._changed.wait(refill - now)
                else:
                    break
            if not self._lines:
                return None if self._closing else []
            first = self._lines[0].job
            budget = first.settings.source_budget
            alike = sum(1 for line in self._lines if line.job.shares_batches_with(first))
            # Idle workers split what waits: two batches side by side beat one twice as big.
            share = math.ceil(alike / max(1, self.workers - len(self._searching)))
            batch, longest, kept = [], 0, deque()
            for line in self._lines:
                room = fits(max(longest, len(line.ids)), len(batch) + 1, budget)
                if line.job.shares_batches_with(first) and len(batch) < share and (
                        room or not batch):
                    batch.append(line)
                    longest = max(longest, len(line.ids))
                else:
                    kept.append(line)
            self._lines = kept
            self._searching.append(batch)
            return batch

    def _search(self, batch: list[_Line]) -> None:
        """Search a batch and hand each finished job back; a failure fails the batch's jobs
        (their other lines leave the queue) and the worker goes on. Lines of jobs cancelled
        meanwhile leave the search at its next step (`called_off`); nothing is handed back
        for them."""
        if not batch:
            return
        translator = batch[0].job.translator
        finished, failure = [], None
        try:
            # Lines with and without controls share a batch: no prefix forces nothing, no
            # phrase holds nothing, and a batch with neither is searched without a constraint.
            found = translator.search_controlled([line.ids for line in batch],
                                                 [line.controls for line in batch],
                                                 [line.index + 1 for line in batch],
                                                 called_off(batch))
            outputs = [None if line.job.cancelled else translator.outputs(hypotheses)
                       for line, hypotheses in zip(batch, found)]
        except Exception as error:  # the jobs answer it; the server goes on
            failure = error
        with self._changed:
            self._searching.remove(batch)
            if failure is not None:
                finished = self._fail(batch, failure)
            else:
                finished = self._record(list(zip(batch, outputs)))
            self._changed.notify_all()
        self._hand_back(finished, translator)


def streamable(batch: list[_Line]) -> bool:
    """Whether a batch's lines (one translator, one set of settings) can fly in a Stream."""
    return stream_supported(batch[0].job.translator) and not any(
        line.controls.phrases for line in batch)


def called_off(batch: list[_Line]) -> Callable[[], list[int]]:
    """What the search asks before each step (`search.CalledOff`): the places in `batch` of
    the lines whose job is cancelled. Plain attribute reads, no lock: a cancellation seen a
    step late costs a step."""
    jobs = list({line.job: None for line in batch})

    def cancelled() -> list[int]:
        if not any(job.cancelled for job in jobs):  # the usual answer, in a few jobs' reads
            return []
        return [place for place, line in enumerate(batch) if line.job.cancelled]
    return cancelled
