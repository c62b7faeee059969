"""Data-parallel training (distributed.py): what the processes agree on, and real gloo processes
on the CPU (torchrun, and ranks started by hand as on separate nodes)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from attn_cli import batching
from attn_cli.checkpoints import list_checkpoints
from attn_cli.config import TrainOptions
from attn_cli.data import ParallelData
from attn_cli.train import distributed
from attn_cli.train import loop as training

from ..conftest import (
    Result,
    assert_clean_error,
    assert_same_weights,
    final_weights,
    run_attn,
    train_args,
)


def test_rank_disagreement_names_the_rank_and_what_differs():
    facts = {"options": {"lr_scale": 0.5, "seed": 1}, "data file": "ab" * 32,
             "resumed from": {"step": 4}}
    same = [{"host": "a", "facts": facts}, {"host": "b", "facts": dict(facts)}]
    assert distributed.rank_disagreement(same) is None
    other_options = {**facts, "options": {"lr_scale": 0.25, "seed": 1}}
    problem = distributed.rank_disagreement([same[0], same[1], {"host": "c",
                                                             "facts": other_options}])
    assert problem.startswith("rank 2 (on c) does not match rank 0: options: lr_scale is 0.25 "
                              "where rank 0 has 0.5")
    other_data = {**facts, "data file": "cd" * 32}
    assert "rank 1 (on b) does not match rank 0: its data file differs from rank 0's" in \
        distributed.rank_disagreement([same[0], {"host": "b", "facts": other_data}])
    failed = [same[0], {"host": "b", "error": "data file x.st does not exist"}]
    assert distributed.rank_disagreement(failed) == "rank 1 (on b): data file x.st does not exist"


def test_gradients_are_all_reduced_in_bf16_between_nodes_on_gpus_only(monkeypatch):
    from attn_cli.errors import AttnError

    gpu = distributed.Processes(3, 16, torch.device("cuda", 3))
    cpu = distributed.Processes(3, 16, torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 2 nodes of 8
    assert distributed.gradient_sync_dtype("auto", gpu) == "bf16"
    assert distributed.gradient_sync_dtype("auto", cpu) == "fp32"  # gloo sums float32
    assert distributed.gradient_sync_dtype("fp32", gpu) == "fp32"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # one node of 16
    assert distributed.gradient_sync_dtype("auto", gpu) == "fp32"
    assert distributed.gradient_sync_dtype("bf16", gpu) == "bf16"
    with pytest.raises(AttnError, match="--grad-sync bf16 needs CUDA"):
        distributed.gradient_sync_dtype("bf16", cpu)


def test_cudnn_attention_off_is_trains_default_without_effect_on_a_cpu(data_files, tmp_path,
                                                                      monkeypatch):
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append, raising=False)
    result = run_attn(*train_args(data_files[0], tmp_path / "run", "--max-steps", 1))
    assert result.returncode == 0, result.stderr
    assert calls == [] and "cuDNN" not in result.stderr
    assert json.loads(saved_state(tmp_path / "run", 1)["options"])["cudnn_attention"] == "off"


@pytest.mark.parametrize("environment,threads", [
    ({"OMP_NUM_THREADS": "3"}, 3),  # one process: the user's word, set whatever torch has now
    ({"OMP_NUM_THREADS": "3,1"}, 3),  # OpenMP's nested list: the outer level
    ({"OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, None),  # torchrun's
])
def test_a_cpu_training_process_sets_its_threads(environment, threads, monkeypatch):
    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    world_size = int(environment.get("WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    expected = threads or max(1, cores // 2)
    assert distributed.cpu_threads(world_size) == expected


# ------------------------------------------------------------------------------------ processes


def torchrun(nproc: int, *args) -> subprocess.CompletedProcess:
    """`attn ARGS` in `nproc` CPU processes (gloo) under torchrun, one thread each."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "attn_cli", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def saved_state(run_dir: Path, step: int) -> dict:
    with safe_open(str(run_dir / f"checkpoint-{step}.state.st"), "pt") as handle:
        return handle.metadata()


@pytest.mark.long  # ~20 s on 2 cores: with the long tests, for make test's 4 minutes
def test_two_gloo_processes_equal_one_process_and_resume_on_1_and_3(data_files, tmp_path):
    """torchrun with 2 CPU processes trains the same parameters as 1 process accumulating the
    same global batch (dropout on: its masks follow the micro-batch, not the process). With
    validation at a save on the last step: every rank must take part in it, or one waits for
    the other in vain.

    Then the 2-process run resumed on 1 process and on 3. On 1 the plan keeps its micro-batches
    (2 x 600 tokens become 1 process x 2 passes): the parameters stay those of the 1-process
    run. On 3 the global batch (1200) is 3 passes of 400 tokens: the rest of the epoch is cut
    anew from the pairs not yet used, from where the saved position says."""
    common = ["--batch-tokens", 1200, "--max-tokens", 600, "--save-every", 2,
              "--valid", data_files[1]]
    one, two = tmp_path / "one", tmp_path / "two"
    single = run_attn(*train_args(data_files[0], one, *common, "--max-steps", 4))
    assert single.returncode == 0, single.stderr
    assert "2 accumulation step(s)" in single.stderr
    double = torchrun(2, *train_args(data_files[0], two, *common, "--max-steps", 4))
    assert double.returncode == 0, double.stderr
    assert "rank 0/2" in double.stderr and "rank 1/2" in double.stderr
    assert_same_weights(final_weights(one), final_weights(two), atol=1e-5)

    for run_dir in (one, two):
        resumed = run_attn(*train_args(data_files[0], run_dir, *common, "--max-steps", 6,
                                       "--resume"))
        assert resumed.returncode == 0, resumed.stderr
    assert ("resume: batch plan 2 process(es) x 1 pass(es) x 600 tokens -> 1 process(es) x "
            "2 pass(es) x 600 tokens (1200 -> 1200 tokens/side/step); micro-batches cut as "
            "before") in resumed.stderr
    assert_same_weights(final_weights(one), final_weights(two), atol=1e-5)

    three = torchrun(3, *train_args(data_files[0], two, *common, "--max-steps", 8,
                                    "--resume"))
    assert three.returncode == 0, three.stderr
    assert ("-> 3 process(es) x 1 pass(es) x 400 tokens (1200 -> 1200 tokens/side/step); the "
            "rest of epoch") in three.stderr
    assert "cut into 400-token micro-batches from the pairs not yet used" in three.stderr
    # Where the run says it is in the data: 6 steps of 2 x 600, then 2 steps of 3 x 400.
    expected = batching.MicroBatchStream(ParallelData(data_files[0]), 600, seed=1)
    expected.take(12)
    expected.change_budget(400)
    expected.take(6)
    state = saved_state(two, 8)
    assert (int(state["epoch"]), int(state["offset"])) == expected.position
    assert [tuple(cut) for cut in json.loads(state["earlier_budgets"])] == \
        list(expected.earlier_budgets)
    assert json.loads(state["batch_plan"])["world_size"] == 3
    rows = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, 9))


def start_ranks(*argv_by_rank: list) -> list:
    """Each rank started by hand (as on separate nodes), with its own command line."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = []
    for rank, argv in enumerate(argv_by_rank):
        environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "WORLD_SIZE": str(len(argv_by_rank)), "RANK": str(rank),
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "attn_cli", *map(str, argv), "--dist-timeout", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment))
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=180)
        results.append(Result(process.returncode, stdout, stderr))
    return results


@pytest.mark.slow
def test_a_rank_with_another_data_file_stops_every_rank(data_files, tmp_path):
    results = start_ranks(train_args(data_files[0], tmp_path / "run", "--max-steps", 2),
                          train_args(data_files[1], tmp_path / "run", "--max-steps", 2))
    for result in results:
        assert_clean_error(result, "rank 1 (on ", "does not match rank 0: its data file "
                           "differs from rank 0's")
    assert not list_checkpoints(tmp_path / "run")


@pytest.mark.slow
def test_a_rank_that_cannot_see_rank_0s_run_directory_stops_every_rank(data_files, tmp_path):
    """Several nodes without a shared disk: rank 0 resumes from its checkpoint; another rank,
    whose -o holds none, says so instead of starting afresh beside it."""
    shared = tmp_path / "rank0"
    assert run_attn(*train_args(data_files[0], shared, "--max-steps", 2)).returncode == 0
    results = start_ranks(train_args(data_files[0], shared, "--max-steps", 3, "--resume"),
                          train_args(data_files[0], tmp_path / "rank1", "--max-steps", 3,
                                     "--resume"))
    for result in results:
        assert_clean_error(result, "rank 1 (on ", "holds no checkpoint-2.st",
                           "shared file system")
    assert [step for step, _ in list_checkpoints(shared)] == [2]


@pytest.mark.slow
def test_two_gloo_processes_accumulating_equal_one_process_accumulating(data_files, tmp_path):
    """DDP with gradient accumulation (`no_sync` on every pass but the last): 2 processes x 2
    passes of 300 tokens train the parameters of 1 process x 4 passes, dropout on."""
    common = ["--batch-tokens", 1200, "--max-tokens", 300, "--max-steps", 3]
    one, two = tmp_path / "one", tmp_path / "two"
    single = run_attn(*train_args(data_files[0], one, *common))
    assert single.returncode == 0, single.stderr
    assert "4 accumulation step(s)" in single.stderr
    double = torchrun(2, *train_args(data_files[0], two, *common))
    assert double.returncode == 0, double.stderr
    assert "2 accumulation step(s)" in double.stderr
    assert_same_weights(final_weights(one), final_weights(two), atol=1e-5)


# ------------------------------------------------------------- inside the processes (mp.spawn)


def in_two_processes(work, *arguments) -> list:
    """`work(rank, *arguments)` in 2 gloo processes started like torchrun's; what each
    returns (JSON), in rank order."""
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = Path(arguments[-1])
    mp.spawn(_in_process, args=(work, port, arguments), nprocs=2, join=True)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def _in_process(rank: int, work, port: int, arguments: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                      RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      OMP_NUM_THREADS="1")
    processes = distributed.start_processes("cpu", 1.0)
    finished = False
    try:
        result = work(processes, *arguments)
        finished = True
    finally:
        distributed.stop_processes(processes, finished)  # as `attn train` ends
    (Path(arguments[-1]) / f"rank{rank}.json").write_text(json.dumps(result))


def _gradient_addresses(processes, data: str, out: str) -> dict:
    options = TrainOptions(data=Path(data), output=Path(out) / "run", preset="tiny",
                           batch_tokens=1200, max_tokens=300, device="cpu", max_steps=5)
    run = training._start(options, processes, training._Quiet())
    addresses = []
    for step in range(5):
        training._step(run, step, training.Votes)
        addresses.append([None if p.grad is None else p.grad.data_ptr()
                          for p in run.model.parameters()])
    run.steps.close()
    return {"addresses": addresses}


@pytest.mark.slow
def test_gradients_stay_in_ddps_buckets_from_step_to_step(data_files, tmp_path):
    """DDP keeps gradients as views of its communication buckets (gradient_as_bucket_view):
    zeroed in place after each step, never set to None (which would make every step allocate
    them anew and copy them into the buckets). DDP rebuilds its buckets once, early (in the
    order the gradients came; with accumulation, at the first synchronised pass): from then on,
    the same memory."""
    for result in in_two_processes(_gradient_addresses, str(data_files[0]), str(tmp_path)):
        *_, third, fourth, fifth = result["addresses"]
        assert None not in third
        assert third == fourth == fifth, result["addresses"]


def _failing_start(processes, out: str) -> dict:
    from attn_cli.errors import AttnError

    def prepare():
        if processes.rank == 1:
            raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details")
        return "ready"

    try:
        distributed.same_on_every_rank(processes, prepare, lambda prepared: {})
    except AttnError as error:
        return {"error": str(error)}
    return {"error": None}


@pytest.mark.slow
def test_any_failure_of_a_rank_at_start_stops_every_rank(tmp_path):
    """Not only attn's own errors: an out-of-memory (or any exception) on one rank is told to
    every rank, in one line, instead of leaving them waiting for it until --dist-timeout."""
    for result in in_two_processes(_failing_start, str(tmp_path)):
        assert result["error"] == ("rank 1 (on " + socket.gethostname() + "): MemoryError: "
                                   "CUDA out of memory. Tried to allocate 2.00 GiB more details")


def _hashing_start(processes, data: str, valid: str, out: str) -> dict:
    from attn_cli.train import start as start_module

    hashed = []
    original = start_module.file_sha256

    def counting(path):
        hashed.append(Path(path).name)
        return original(path)

    start_module.file_sha256 = counting
    options = TrainOptions(data=Path(data), valid=Path(valid), output=Path(out) / "run",
                           preset="tiny", device="cpu", max_steps=1)
    start_module.start(options, processes)
    return {"hashed": hashed}


@pytest.mark.slow
def test_the_data_files_are_read_for_their_checksum_once_per_node(data_files, tmp_path):
    """Two processes on one node (LOCAL_RANK 0 and 1): the first hashes the data and the
    validation file, the second takes the sums from it, and both agree."""
    results = in_two_processes(_hashing_start, str(data_files[0]), str(data_files[1]),
                               str(tmp_path))
    assert [result["hashed"] for result in results] == [["train.st", "valid.st"], []]


def test_ddp_buckets_are_larger_when_the_job_spans_nodes(monkeypatch):
    processes = distributed.Processes(3, 16, torch.device("cuda", 3))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 2 nodes of 8
    assert distributed.bucket_megabytes(processes) == 100
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert distributed.bucket_megabytes(processes) == 25


# -------------------------------------------------------------------- validation while training

SLOW_SCORING = """\
import os, sys, time
from attn_cli.train import validation
from attn_cli.cli import main

original = validation.Validator.score_texts

def slow(self, texts):  # the main process scores: as slow as a large validation set
    time.sleep(float(os.environ["SCORING_SECONDS"]))
    return original(self, texts)

validation.Validator.score_texts = slow
main(sys.argv[1:])
"""


def torchrun_script(nproc: int, script: Path, seconds: float, *args):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), str(script), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "SCORING_SECONDS": str(seconds)})


@pytest.mark.long  # ~21 s on 2 cores: CI runs it after make test (-m long)
def test_validation_by_bleu_on_two_processes_and_past_the_timeout(data_files, tmp_path):
    """Every process decodes a share of the validation set, the main one scores it. A slow
    scoring within --dist-timeout (1 s of 12) ends well, with a BLEU row at each save; one past
    it (10 s of 6) stops every process with an error, not a hang."""
    script = tmp_path / "slow_scoring.py"
    script.write_text(SLOW_SCORING, encoding="utf-8")
    common = ["--valid", data_files[1], "--valid-metric", "bleu", "--save-every", 2,
              "--max-steps", 4]
    run_dir = tmp_path / "run"
    result = torchrun_script(2, script, 1, *train_args(data_files[0], run_dir, *common,
                                                       "--dist-timeout", 0.2))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "valid_bleu" in row] == [2, 4]
    started = time.monotonic()
    late = torchrun_script(2, script, 10, *train_args(data_files[0], tmp_path / "late",
                                                      *common, "--dist-timeout", 0.1))
    assert late.returncode != 0
    assert time.monotonic() - started < 120
    assert "error: rank 1: waiting for the other processes failed" in late.stderr
    assert "--dist-timeout 0.1 min: it must exceed a validation and a save" in late.stderr
    assert "]: Traceback" not in late.stderr  # none from a rank (torchrun prints its own)


# ------------------------------------------------------------------ DDP on one rank (the switch)


def metrics_losses(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"], row["nll"]) for row in rows if "loss" in row]


def test_ddp_on_one_rank_trains_bitwise_what_one_process_does(data_files, tmp_path,
                                                              monkeypatch):
    """ATTN_DDP_ONE_RANK=1 (what the GPU smoke runs on one GPU over NCCL; here gloo): a process
    group of one rank and the model in DDP (bucket views, `no_sync` over 4 accumulated passes,
    object collectives) train the same weights, bitwise, and the same losses as one process
    without DDP; stopped at step 2 and resumed, too."""
    common = ["--batch-tokens", 1200, "--max-tokens", 300, "--save-every", 2, "--seed", 3]
    alone, grouped = tmp_path / "alone", tmp_path / "grouped"
    plain = run_attn(*train_args(data_files[0], alone, *common, "--max-steps", 4))
    assert plain.returncode == 0, plain.stderr
    assert "4 accumulation step(s)" in plain.stderr and "DDP" not in plain.stderr
    monkeypatch.setenv(distributed.ONE_RANK_SWITCH, "1")
    for steps, resume in ((2, ()), (4, ("--resume",))):
        result = run_attn(*train_args(data_files[0], grouped, *common, "--max-steps", steps,
                                      *resume))
        assert result.returncode == 0, result.stderr
        assert "train: DDP on one rank (ATTN_DDP_ONE_RANK=1): rank 0/1 on " in result.stderr
    for step in (2, 4):  # before and after the resume
        expected = load_file(str(alone / f"checkpoint-{step}.st"))
        for name, tensor in load_file(str(grouped / f"checkpoint-{step}.st")).items():
            assert torch.equal(tensor, expected[name]), (step, name)
    assert metrics_losses(grouped) == metrics_losses(alone)


# ----------------------------------------------------------------------- the run directory


def unusable_directory(tmp_path: Path) -> Path:
    """An -o that rank 0 cannot make or lock: under a read-only directory, or (as root, whom
    permissions do not stop) under a regular file."""
    if os.geteuid() == 0:
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        return blocker / "run"
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    return read_only / "run"


@pytest.mark.slow
def test_a_run_directory_rank_0_cannot_make_stops_every_rank_with_one_line(data_files,
                                                                          tmp_path):
    """A file system error on rank 0 while it makes and locks -o (read-only, permissions,
    quota) is told to every rank, like a refused lock: each exits 2 with one line, none waits
    for rank 0 until --dist-timeout."""
    run_dir = unusable_directory(tmp_path)
    started = time.monotonic()
    results = start_ranks(*[train_args(data_files[0], run_dir, "--max-steps", 1)] * 2)
    assert time.monotonic() - started < 50  # not --dist-timeout's minute
    for result in results:
        assert_clean_error(result, f"cannot make or lock the run directory -o {run_dir}: ",
                           "Error: [Errno ")


@pytest.mark.long  # two processes that wait out their --start-timeout: ~11 s
@pytest.mark.parametrize("hang", ["a rank that never comes", "a first collective that hangs"])
def test_a_process_group_that_cannot_start_stops_within_start_timeout(data_files, tmp_path,
                                                                       hang):
    """First contact bounded (distributed.start_watchdog): a peer that never reaches the
    store (a node that cannot reach MASTER_ADDR), or a first all-reduce that never returns
    (NCCL connecting over the wrong interface, mocked), ends the process within
    --start-timeout (3 s here, not --dist-timeout's minute) with one line naming what to check."""
    train_st, _ = data_files
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "OMP_NUM_THREADS": "1"}
    argv = [*train_args(train_st, tmp_path / "run", "--max-steps", 2), "--dist-timeout", "1",
            "--start-timeout", "0.05"]
    mock = ""
    if hang == "a first collective that hangs":  # one rank alone in a group of one
        environment.update(WORLD_SIZE="1", ATTN_DDP_ONE_RANK="1")
        mock = ("import time, torch.distributed as dist\n"
                "dist.all_reduce = lambda *args, **kwargs: time.sleep(600)\n")
    program = mock + "import sys\nfrom attn_cli.cli import main\nmain(sys.argv[1:])\n"
    started = time.monotonic()
    completed = subprocess.run([sys.executable, "-c", program, *map(str, argv)],
                               capture_output=True, text=True, env=environment, timeout=60)
    seconds = time.monotonic() - started
    assert completed.returncode == 2, completed.stderr
    assert seconds < 30  # the 3 s, and the start and import of a process
    lines = [line for line in completed.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in completed.stderr, completed.stderr
    assert "rank 0: the gloo process group did not start within --start-timeout 0.05 min" \
        in lines[0]
    assert f"127.0.0.1:{port}" in lines[0] and "GLOO_SOCKET_IFNAME" in lines[0]


@pytest.mark.long
def test_sigterm_to_torchrun_saves_within_its_grace_and_resumes_exactly(data_files, tmp_path):
    """torchrun forwards SIGTERM to its processes and kills them 30 s later. Every rank stops
    after the same step (the stop is voted on with the losses), and rank 0 saves without
    validating (a validation may outlast the grace; the next save validates): the run ends
    well inside the 30 s, and resumed it equals the run never stopped, weights and losses."""
    common = ["--batch-tokens", 1200, "--max-tokens", 600, "--save-every", 100000,
              "--valid", data_files[1], "--log-every", 1]
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "attn_cli",
               *map(str, train_args(data_files[0], stopped, *common, "--max-steps", 100000))]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    metrics = stopped / "metrics.jsonl"
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert time.monotonic() - signalled < 25, stderr  # inside torchrun's 30 s
    assert "stopped by a signal: saving without validating" in stderr, stderr
    saved = [step for step, _ in list_checkpoints(stopped, need_state=True)]
    assert len(saved) == 1 and saved[0] >= 3, stderr
    step = saved[0]
    resumed = torchrun(2, *train_args(data_files[0], stopped, *common, "--max-steps",
                                      step + 2, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    uninterrupted = torchrun(2, *train_args(data_files[0], whole, *common, "--max-steps",
                                            step + 2))
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    assert_same_weights(final_weights(stopped), final_weights(whole))
    assert metrics_losses(stopped) == metrics_losses(whole)
