"""The queue behind `attn serve` (attn_cli/serve/request_queue.py): lines of different requests
share batches without changing any output, settings never mix in a batch, the capacity is a hard
bound, cancelled requests cost nothing (waiting or midway through a batch, whose other lines get
their outputs), a request's work is known before it is queued, and a failing search fails its
requests only."""

from __future__ import annotations

import math
import threading

import pytest

from attn_cli.decode.stream import Stream
from attn_cli.decode.stream import supported as stream_supported
from attn_cli.decode.translator import load_translator
from attn_cli.serve.request_queue import Job, QueueFull, RequestQueue, _Line, streamable

from ..conftest import bundled_lines


@pytest.fixture(scope="module")
def translator(trained):
    model, _ = trained
    return load_translator(model, 4, threads=1)


def submit_and_wait(queue: RequestQueue, jobs: list[Job]) -> None:
    finished = threading.Semaphore(0)
    for job in jobs:
        job.done = lambda job: finished.release()
        queue.submit(job)
    for _ in jobs:
        assert finished.acquire(timeout=120)


def lines_of(job: Job) -> list[_Line]:
    """A job's lines as a worker takes them from the queue."""
    return [_Line(job, index, ids) for index, ids in enumerate(job.sources)]


def texts(job: Job) -> list[str]:
    return [output[0][1] for output in job.outputs]


def test_requests_sharing_batches_get_what_each_alone_gets(translator):
    lines = bundled_lines("val.en", 24)
    requests = [lines[0:5], ["", lines[5], "  "], lines[6:7], lines[7:24]]
    settings = [{}, {"beam": 1}, {}, {"beam": 1, "nbest": 1}]
    jobs = [Job(text, translator.with_options(**change), None, name=f"request {n}")
            for n, (text, change) in enumerate(zip(requests, settings))]
    queue = RequestQueue(workers=2, worker_threads=1, capacity=100, window_s=0.01)
    try:
        submit_and_wait(queue, jobs)
    finally:
        queue.close()
    for job, text, change in zip(jobs, requests, settings):
        assert job.error is None
        assert texts(job) == translator.with_options(**change).translate(text)
    assert texts(jobs[1])[0] == texts(jobs[1])[2] == ""


def test_a_batch_holds_one_setting_within_the_budget_and_skips_cancelled_requests(translator):
    lines = bundled_lines("val.en", 12)
    queue = RequestQueue(workers=0, capacity=100)  # no worker: the test takes the batches
    greedy = Job(lines[:4], translator.with_options(beam=1), lambda job: None)
    beam = Job(lines[4:8], translator, lambda job: None)
    gone = Job(lines[8:12], translator.with_options(beam=1), lambda job: None)
    for job in (greedy, beam, gone):
        queue.submit(job)
    assert queue.waiting == 12
    queue.cancel(gone)
    assert queue.waiting == 8  # the cancelled request's lines left at once, unsearched
    batch = queue._take(0, 0.0)
    assert {line.job for line in batch} == {greedy} and len(batch) == 4
    queue._search(batch)
    assert queue.waiting == 4
    assert texts(greedy) == translator.with_options(beam=1).translate(lines[:4])
    small = translator.with_options(batch_tokens=4 * 30)  # 30 source tokens a batch at beam 4
    tight = Job(lines[:4], small, lambda job: None)
    queue._take(0, 0.0)  # the beam-4 request's lines
    queue.submit(tight)
    batch = queue._take(0, 0.0)
    assert max(len(line.ids) for line in batch) * len(batch) <= 30 or len(batch) == 1


def test_the_capacity_is_a_hard_bound(translator):
    queue = RequestQueue(workers=0, capacity=5)
    queue.submit(Job(["a", "b", "c"], translator, lambda job: None))
    with pytest.raises(QueueFull, match="3 lines are waiting"):
        queue.submit(Job(["d", "e", "f"], translator, lambda job: None))
    done = []
    queue.submit(Job(["", ""], translator, done.append))  # empty lines: answered, not queued
    assert len(done) == 1 and queue.waiting == 3


def test_a_failing_search_fails_its_requests_and_the_workers_go_on(translator):
    broken = translator.with_options(beam=2)

    def fail(*args, **kwargs):
        raise RuntimeError("out of something")

    broken.search = fail
    broken.stepped = broken.model  # the eager step: a batch's search, not a stream
    failing, fine = fail_then_answer(broken, translator)
    assert isinstance(failing.error, RuntimeError)
    assert fine.error is None and texts(fine) == translator.translate(fine.lines)


def fail_then_answer(failing_translator, translator) -> tuple[Job, Job]:
    """The same three lines through one worker, first with `failing_translator`, then, once
    that job is done, with `translator`: the two jobs."""
    lines = bundled_lines("val.en", 3)
    failing, fine = Job(lines, failing_translator, None), Job(lines, translator, None)
    queue = RequestQueue(workers=1, capacity=100)
    try:
        submit_and_wait(queue, [failing])
        submit_and_wait(queue, [fine])
    finally:
        queue.close()
    return failing, fine


def test_a_failing_stream_fails_its_requests_and_the_workers_go_on(translator, monkeypatch):
    """A stream's step that raises fails the jobs in flight; the worker makes a new stream
    for the next ones, which are answered as ever."""
    assert streamable(lines_of(Job(["a"], translator, None)))
    steps = []
    real_step = Stream.step

    def step_failing_once(stream):
        steps.append(stream)
        if len(steps) == 3:
            raise RuntimeError("out of something")
        return real_step(stream)

    monkeypatch.setattr(Stream, "step", step_failing_once)
    failing, fine = fail_then_answer(translator, translator)
    assert isinstance(failing.error, RuntimeError)
    assert fine.error is None and texts(fine) == translator.translate(fine.lines)
    assert steps[0] is steps[2] is not steps[-1]  # a new stream after the failure


def test_a_job_s_work_is_its_lines_beams_times_their_longest_outputs(translator):
    """Each line's beam × its longest output L = a·|x| + b, its positions weighed 1 + t / span
    (the cache each step reads): L + L(L + 1) / (2 span), span = 0.9 × d_model."""
    job = Job(["", "A dog runs.", "Two men talk."], translator, None)
    assert job.sources[0] is None
    lengths = [len(ids) - 1 for ids in job.sources[1:]]  # EOS left out, as the limit counts
    span = 0.9 * translator.config.d_model

    def weighed(longest):
        return longest + longest * (longest + 1) / (2 * span)

    assert job.work == math.ceil(sum(4 * weighed(length + 50) for length in lengths))
    sampled = Job(job.lines, translator.with_options(sample=True, max_len_a=2.0), None)
    assert sampled.work == math.ceil(sum(weighed(2 * length + 50) for length in lengths))
    # one line to 4,096 positions at beam 32 costs over 100 times one to 256
    short, long = (translator.with_options(beam=32, max_len_a=0.0, max_len_b=b)
                   .search_work([[5, 3]]) for b in (255, 4095))
    assert long > 100 * short


def test_a_job_cancelled_midway_leaves_its_batch_and_the_others_get_their_outputs(translator):
    """Two requests in one batch; one is cancelled at the search's third step: it is never
    done, and the other's outputs are what it gets alone."""
    lines = bundled_lines("val.en", 8)
    queue = RequestQueue(workers=0, capacity=100)  # the test takes and searches the batch
    searching = translator.with_options()
    done = []
    kept, gone = (Job(text, searching, done.append) for text in (lines[:4], lines[4:]))
    search = searching.search

    def cancelling_at_the_third_step(ids, constraint, line_numbers, cancelled, controls=None):
        steps = iter(range(1_000_000))

        def asked() -> list[int]:
            if next(steps) == 2:
                queue.cancel(gone)
            return cancelled()
        found = search(ids, constraint, line_numbers, asked, controls)
        assert sorted(asked()) == sorted(place for place, line in enumerate(batch)
                                         if line.job is gone)
        return found

    searching.search = cancelling_at_the_third_step
    queue.submit(kept)
    queue.submit(gone)
    batch = queue._take(0, 0.0)
    assert {line.job for line in batch} == {kept, gone} and queue.waiting == 0
    assert queue.searching == 8
    queue._search(batch)
    assert done == [kept] and gone.cancelled and queue.searching == 0
    assert texts(kept) == translator.translate(lines[:4])


def test_requests_with_target_prefixes_share_batches_with_those_without():
    """A job's prefixes (`/v1/translate`'s `prefix`) force its own lines only: on the committed
    reversal model, each job gets what `translate_window` gives it alone."""
    import json
    from pathlib import Path

    from attn_cli.decode.controls import Controls

    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    golden = json.loads((fixtures / "golden.json").read_text(encoding="utf-8"))
    translator = load_translator(fixtures / golden["checkpoint"], device="cpu", threads=1,
                                 workers=1)
    requests = [golden["inputs"][0:3], golden["inputs"][3:5]]
    prefixes = [translator.tgt_vocab.encode(["j j", "", "a"]), None]
    controls = [[Controls(prefix=tuple(prefix)) for prefix in prefixes[0]], None]
    jobs = [Job(text, translator, None, controls=lines)
            for text, lines in zip(requests, controls)]
    # they fly in one stream, each line's prefix forced at its own steps; a phrase to hold
    # needs the constrained batch search
    assert streamable(lines_of(jobs[0]) + lines_of(jobs[1]))
    holding = Job(requests[1], translator, None,
                  controls=[Controls(phrases=((5,),)), Controls()])
    assert not streamable(lines_of(jobs[0]) + lines_of(holding))
    queue = RequestQueue(workers=1, worker_threads=1, capacity=100, window_s=0.05)
    try:
        submit_and_wait(queue, jobs)
    finally:
        queue.close()
    for job, text, lines in zip(jobs, requests, controls):
        alone = translator.translate_window(text, 1, controls=lines)
        assert texts(job) == [translator.outputs(hypotheses)[0][1] for hypotheses in alone]
    assert texts(jobs[0])[0].startswith("j j") and texts(jobs[0])[2].startswith("a")


def test_a_line_arriving_mid_search_joins_it_and_leaves_at_its_own_end(translator,
                                                                         monkeypatch):
    """Iteration-level batching: a request that arrives while a worker searches joins its
    stream at the next step (one worker: no other could take it) and is answered at its own
    last step, before the long lines it joined end; every answer is what each gets alone."""
    # every hypothesis searched to its limit (a·|x| + 5): the long lines run 20 steps and more,
    # the short one 9
    translator = translator.with_options(stop="limit", max_len_b=5)
    long_lines = [line for line in bundled_lines("val.en", 200) if len(line) > 80][:6]
    late = Job(["A dog."], translator, None)
    order, steps = [], []
    finished = threading.Semaphore(0)
    queue = RequestQueue(workers=1, capacity=100)
    real_step = Stream.step

    def step(stream):
        steps.append(stream.sentences)
        if len(steps) == 2:  # the long ones are in flight: the short one arrives
            queue.submit(late)
        return real_step(stream)

    monkeypatch.setattr(Stream, "step", step)
    early = Job(long_lines, translator, None)
    for job, name in ((early, "early"), (late, "late")):
        job.done = lambda job, name=name: (order.append(name), finished.release())
    try:
        queue.submit(early)
        assert finished.acquire(timeout=120) and finished.acquire(timeout=120)
    finally:
        queue.close()
    assert order == ["late", "early"]
    assert max(steps) == len(long_lines) + 1  # the late line flew with the early ones
    assert texts(early) == translator.translate(long_lines)
    assert texts(late) == translator.translate(late.lines)


def test_a_translator_with_banned_phrases_searches_in_batches(trained):
    """Bans are a constraint a stream does not know: such a translator's lines are searched
    in batches (`attn serve --ban`), its outputs free of the phrase."""
    model, _ = trained
    plain = load_translator(model, 4, threads=1)
    lines = bundled_lines("val.en", 50)
    line, output = next((line, output) for line, output in zip(lines, plain.translate(lines))
                        if output.split())  # the test model leaves some outputs empty
    line, banned_word = [line], output.split()[0]
    banning = load_translator(model, 4, threads=1, bans=[banned_word])
    assert stream_supported(plain) and not stream_supported(banning)
    assert not streamable(lines_of(Job(line, banning, None)))
    job = Job(line, banning, None)
    queue = RequestQueue(workers=1, capacity=100)
    try:
        submit_and_wait(queue, [job])
    finally:
        queue.close()
    assert banned_word not in texts(job)[0].split()
