"""`attn train` and `attn average`: the paper's recipe (§5), data parallel, crash-safe."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from attn_cli import batching, config, distributed, training
from attn_cli import model as model_module
from attn_cli.checkpoints import list_checkpoints
from attn_cli.config import PRESETS
from attn_cli.data import ParallelData
from attn_cli.errors import AttnError
from attn_cli.loss import label_smoothed_loss, projected_label_smoothed_loss
from attn_cli.model import Transformer
from attn_cli.modelfile import load_model

from .conftest import assert_clean_error, run_attn
from .toys import reversal_pairs

# ------------------------------------------------------------------------- recipe, by formula


@pytest.mark.parametrize("step,expected", [
    (1, 512 ** -0.5 * 1 * 4000 ** -1.5),  # warming up: linear
    (4000, 512 ** -0.5 * 4000 ** -0.5),  # the peak
    (100_000, 512 ** -0.5 * 100_000 ** -0.5),  # decaying as step^-0.5
])
def test_schedule_matches_the_paper(step, expected):
    assert training.inverse_sqrt_lr(step, 512, 4000) == pytest.approx(expected, rel=1e-12)
    assert training.inverse_sqrt_lr(step, 512, 4000, scale=2.0) == pytest.approx(2 * expected)


def test_schedule_numbers():
    assert training.inverse_sqrt_lr(4000, 512, 4000) == pytest.approx(6.9877e-4, rel=1e-4)
    assert training.inverse_sqrt_lr(1, 512, 4000) == pytest.approx(1.7469e-7, rel=1e-4)


def test_label_smoothing_by_hand():
    """Loss = -Σ_k q(k) log p(k) with q = (1-ε)·onehot + ε/V; padding targets ignored."""
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 0.4], [5.0, 5.0, 5.0, 5.0]])
    target = torch.tensor([1, 3, 0])  # the last one is padding (pad id 0)
    epsilon = 0.1
    expected_loss = expected_nll = 0.0
    for row, gold in ((0, 1), (1, 3)):
        exp = [math.exp(v) for v in logits[row].tolist()]
        log_p = [math.log(e / sum(exp)) for e in exp]
        q = [epsilon / 4 + (1 - epsilon) * (k == gold) for k in range(4)]
        expected_loss -= sum(qk * lp for qk, lp in zip(q, log_p))
        expected_nll -= log_p[gold]
    loss, nll = label_smoothed_loss(logits, target, epsilon, pad_id=0)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert nll.item() == pytest.approx(expected_nll, rel=1e-6)


@pytest.mark.parametrize("block_rows", [1, 7, 64, 1000])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_projected_loss_equals_the_loss_of_the_logits(block_rows, epsilon):
    """The fused projection + loss (forward, and the gradients it works out itself) against
    autograd through `label_smoothed_loss` of the full logits, in float64."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(50, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(30, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    target = torch.randint(1, 30, (50,), generator=generator)
    loss, nll = label_smoothed_loss(hidden @ weight.T, target, epsilon, pad_id=0)
    (loss * 0.37).backward()
    expected = loss.item(), nll.item(), hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss, nll = projected_label_smoothed_loss(hidden, weight, target, epsilon, block_rows)
    (loss * 0.37).backward()
    assert (loss.item(), nll.item()) == pytest.approx(expected[:2], rel=1e-12)
    assert not nll.requires_grad
    torch.testing.assert_close(hidden.grad, expected[2], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight.grad, expected[3], rtol=1e-10, atol=1e-12)


def test_projected_loss_under_bf16_autocast_matches_the_autocast_logits():
    """Mixed precision: projections in bf16, softmax in float32, as the unfused path did."""
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 32, generator=generator)
    weight = torch.randn(50, 32, generator=generator) * 0.3
    target = torch.randint(1, 50, (40,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = hidden @ weight.T
        fused, _ = projected_label_smoothed_loss(hidden, weight, target, 0.1, block_rows=16)
    reference, _ = label_smoothed_loss(logits, target, 0.1, pad_id=0)
    assert fused.item() == pytest.approx(reference.item(), rel=2e-3)


def test_cpu_dropout_keeps_one_minus_p_and_rescales_exactly():
    torch.manual_seed(0)
    x = torch.ones(200_000)
    scale = model_module.cpu_dropout_scale(x, 0.1)
    kept = scale != 0
    assert kept.float().mean().item() == pytest.approx(0.9, abs=0.003)
    assert torch.all(scale[kept] == scale[kept][0])
    assert scale[kept][0].item() == pytest.approx(1 / 0.9, rel=1e-5)  # E[x · scale] = x
    torch.manual_seed(0)
    assert torch.equal(model_module.cpu_dropout_scale(x, 0.1), scale)  # the seed decides
    assert not torch.equal(model_module.cpu_dropout_scale(x, 0.1), scale)
    assert torch.all(model_module.cpu_dropout_scale(x, 1.0) == 0)


@pytest.mark.parametrize("text,expected", [("10m", (600.0, "time")), ("90s", (90.0, "time")),
                                           ("2h", (7200.0, "time")), ("5000", (5000.0, "steps")),
                                           ("300u", (300.0, "steps"))])
def test_intervals(text, expected):
    assert config.parse_interval(text) == expected


def test_bad_interval():
    with pytest.raises(AttnError, match="interval"):
        config.parse_interval("soon")


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


# ------------------------------------------------------------------------------- helpers


def train_args(train_st, run_dir, *extra):
    return ["train", train_st, "-o", run_dir, "--preset", "tiny", "--log-every", "1",
            "--device", "cpu", *map(str, extra)]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    step, path = list_checkpoints(run_dir)[-1]
    weights = load_file(str(path))
    return {name: tensor for name, tensor in weights.items() if not name.startswith("vocab.")}


def assert_same_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0 if atol == 0 else 1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ----------------------------------------------------------------------- gradient accumulation


def test_accumulated_micro_batches_equal_one_batch(data_files):
    """Two micro-batches accumulated with the step's token normalisation give the gradient of
    the two taken as one batch (padding does not leak, the normalisation is global)."""
    data = ParallelData(data_files[0])
    config = PRESETS["tiny"].model_config(len(data.src_vocab), dropout=0.0)
    model = Transformer(config)
    indices = np.arange(40)
    halves = [indices[:20], indices[20:]]
    tokens = int(data.tgt_lengths[indices].sum()) + len(indices)
    processes = distributed.Processes(0, 1, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cuda", enabled=False)

    def gradients(micro_batches):
        model.zero_grad()
        training.forward_backward(model, data, micro_batches, 1 / tokens, 0.1, processes,
                                  "fp32", scaler, seed=(1, 0))
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    together, accumulated = gradients([indices]), gradients(halves)
    for name in together:
        torch.testing.assert_close(accumulated[name], together[name], atol=1e-6, rtol=1e-4)


# ------------------------------------------------------------------------- whole training runs


def test_train_writes_checkpoints_metrics_and_decodable_models(data_files, tmp_path):
    train_st, valid_st = data_files
    run_dir = tmp_path / "run"
    result = run_attn(*train_args(train_st, run_dir, "--max-steps", 6, "--save-every", 3,
                                  "--valid", valid_st, "--keep", 1))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    shown = [line for line in result.stderr.splitlines() if line.startswith("train: step ")]
    assert len(shown) == 6 and "valid_ppl" in shown[2]  # a row per step, validation at saves
    assert [step for step, _ in list_checkpoints(run_dir)] == [6]  # --keep 1
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoint-6.st", "checkpoint-6.state.st", "metrics.jsonl"]
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    for row in rows:
        assert {"step", "loss", "lr", "tokens_per_s"} <= row.keys()
    assert {"valid_loss", "valid_ppl"} <= rows[2].keys() and "valid_ppl" in rows[5]
    assert rows[5]["valid_ppl"] == pytest.approx(math.exp(rows[5]["valid_nll"]))
    loaded = load_model(run_dir / "checkpoint-6.st")
    assert loaded.metadata["step"] == "6" and loaded.metadata["preset"] == "tiny"


def test_refuses_to_overwrite_a_run_without_resume(data_files, tmp_path):
    run_dir = tmp_path / "run"
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 1)).returncode == 0
    assert_clean_error(run_attn(*train_args(data_files[0], run_dir, "--max-steps", 2)),
                       "--resume")


def torchrun(nproc: int, *args) -> subprocess.CompletedProcess:
    """`attn ARGS` in `nproc` CPU processes (gloo) under torchrun, one thread each."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "attn_cli", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def saved_state(run_dir: Path, step: int) -> dict:
    from safetensors import safe_open

    with safe_open(str(run_dir / f"checkpoint-{step}.state.st"), "pt") as handle:
        return handle.metadata()


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
    import socket

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
    from .conftest import Result

    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=180)
        results.append(Result(process.returncode, stdout, stderr))
    return results


def test_a_rank_with_another_data_file_stops_every_rank(data_files, tmp_path):
    results = start_ranks(train_args(data_files[0], tmp_path / "run", "--max-steps", 2),
                          train_args(data_files[1], tmp_path / "run", "--max-steps", 2))
    for result in results:
        assert_clean_error(result, "rank 1 (on ", "does not match rank 0: its data file "
                           "differs from rank 0's")
    assert not list_checkpoints(tmp_path / "run")


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


def test_kill_and_resume_reaches_the_same_parameters(data_files, tmp_path):
    common = ["--max-steps", 24, "--save-every", 4, "--seed", 5]
    reference = run_attn(*train_args(data_files[0], tmp_path / "whole", *common))
    assert reference.returncode == 0, reference.stderr

    run_dir = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-m", "attn_cli",
                                *map(str, train_args(data_files[0], run_dir, *common))],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoint-8.st").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)  # kill -9: no chance to save
    process.wait()
    steps = [step for step, _ in list_checkpoints(run_dir)]
    assert 8 in steps and steps[-1] < 24, steps
    resumed = run_attn(*train_args(data_files[0], run_dir, *common, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {run_dir} from step {steps[-1]}" in resumed.stderr
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(run_dir))
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, 25))


def test_a_steps_metrics_row_is_on_disk_before_its_checkpoint(data_files, tmp_path,
                                                              monkeypatch):
    """A kill between the two writes must not lose the row: the checkpoint marks the step done,
    and a resumed run only rewrites rows after its checkpoint."""
    import json

    from attn_cli import training

    run_dir = tmp_path / "run"
    saved_steps = []
    save = training._save

    def checking_save(run_dir_, step, *args, **kwargs):
        rows = (run_dir_ / "metrics.jsonl").read_text().splitlines()
        assert json.loads(rows[-1])["step"] == step
        saved_steps.append(step)
        return save(run_dir_, step, *args, **kwargs)

    monkeypatch.setattr(training, "_save", checking_save)
    training.train(config.TrainOptions(
        data=data_files[0], output=run_dir, valid=data_files[1], preset="tiny", max_steps=6,
        save_every="3", log_every=100, device="cpu"))
    assert saved_steps == [3, 6]


def test_resume_refuses_a_training_state_of_another_format_version(data_files, tmp_path):
    from safetensors.torch import load_file, save_file

    run_dir = tmp_path / "run"
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 1)).returncode == 0
    state = run_dir / "checkpoint-1.state.st"
    from safetensors import safe_open

    with safe_open(str(state), "pt") as handle:
        metadata = {**handle.metadata(), "format_version": "99"}
    save_file(load_file(str(state)), str(state), metadata=metadata)
    assert_clean_error(run_attn(*train_args(data_files[0], run_dir, "--max-steps", 2,
                                            "--resume")), "format version 99")


def test_sigterm_finishes_the_step_saves_and_exits_zero(data_files, tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "attn_cli",
                                *map(str, train_args(data_files[0], run_dir,
                                                     "--max-steps", 100000))],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "stopped by a signal" in stderr
    steps = [step for step, _ in list_checkpoints(run_dir, need_state=True)]
    assert len(steps) == 1 and steps[0] >= 3


def test_resume_reports_changes_and_refuses_another_architecture(data_files, tmp_path):
    run_dir = tmp_path / "run"
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 2)).returncode == 0
    changed = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 3, "--resume",
                                   "--lr-scale", "0.25"))
    assert changed.returncode == 0, changed.stderr
    assert "resume: lr_scale 0.5 -> 0.25 (changes the recipe)" in changed.stderr
    other = run_attn("train", data_files[0], "-o", run_dir, "--preset", "small", "--resume",
                     "--max-steps", "4")
    assert_clean_error(other, "another architecture", "d_model 64 -> 256")


def test_reset_schedule_restarts_the_warmup_and_the_restart_is_kept(data_files, tmp_path):
    import json

    run_dir = tmp_path / "run"
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 4)).returncode == 0
    reset = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 6, "--resume",
                                 "--reset-schedule"))
    assert reset.returncode == 0 and "warmup starts again at step 5" in reset.stderr
    # A later resume keeps counting from the restart (the offset is part of the state).
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 7,
                                "--resume")).returncode == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lr = {row["step"]: row["lr"] for row in rows if "lr" in row}
    tiny = PRESETS["tiny"]
    for step, counted in ((4, 4), (5, 1), (6, 2), (7, 3)):
        assert lr[step] == pytest.approx(training.inverse_sqrt_lr(
            counted, tiny.d_model, tiny.warmup_steps, tiny.lr_scale)), step


def data_with_another_vocab(corpus, directory: Path) -> Path:
    """The validation pairs binarized with a vocabulary learned on German only."""
    other_vocab = directory / "other.model"
    assert run_attn("vocab", corpus["train.de"], "-o", other_vocab, "--size", "300"
                    ).returncode == 0
    other_data = directory / "other.st"
    assert run_attn("binarize", "--vocab", other_vocab, corpus["val.en"], corpus["val.de"],
                    "-o", other_data).returncode == 0
    return other_data


def test_resume_refuses_another_vocabulary(data_files, corpus, tmp_path):
    run_dir = tmp_path / "run"
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 1)).returncode == 0
    other_data = data_with_another_vocab(corpus, tmp_path)
    assert_clean_error(run_attn(*train_args(other_data, run_dir, "--max-steps", 2,
                                            "--resume")), "another vocabulary")


def test_valid_data_with_another_vocabulary_is_refused(data_files, corpus, tmp_path):
    other_valid = data_with_another_vocab(corpus, tmp_path)
    assert_clean_error(run_attn(*train_args(data_files[0], tmp_path / "r", "--valid",
                                            other_valid)), "another vocabulary")


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_checkpoint(
        data_files, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    real_loss = model_module.projected_label_smoothed_loss
    calls = {"count": 0}

    def poisoned(*args, **kwargs):
        calls["count"] += 1
        loss, nll = real_loss(*args, **kwargs)
        return (loss * float("nan"), nll) if calls["count"] > 4 else (loss, nll)

    monkeypatch.setattr(model_module, "projected_label_smoothed_loss", poisoned)
    options = config.TrainOptions(data=data_files[0], output=run_dir, preset="tiny",
                                    max_steps=10, save_every="2", device="cpu", log_every=1)
    with pytest.raises(training.TrainingDiverged, match="nan at step 5.*checkpoint-4.st"):
        training.train(options)
    assert [step for step, _ in list_checkpoints(run_dir)] == [2, 4]


@pytest.mark.parametrize("limit,native", [("AVX2", False), ("AVX512_CORE", False),
                                           ("AVX512_CORE_AMX", None), ("ALL", None)])
def test_native_bf16_follows_the_cpu_and_onednn_limit(monkeypatch, limit, native):
    from attn_cli import devices

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if native is None:  # not held back: what the CPU has
        native = "avx512_bf16" in flags or "amx_bf16" in flags or not flags and \
            torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert devices.cpu_has_native_bf16() is native


def test_bf16_training_on_a_cpu_that_emulates_it_warns_once(data_files, tmp_path, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # as an AVX2-only CPU
    result = run_attn(*train_args(data_files[0], tmp_path / "r", "--max-steps", 1,
                                  "--dtype", "bf16"))
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("without native bf16") == 1
    assert "fp32" in result.stderr
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    result = run_attn(*train_args(data_files[0], tmp_path / "f", "--max-steps", 1))
    assert "native bf16" not in result.stderr  # fp32, the CPU default: no warning


def test_dry_run_prints_the_batch_plan():
    result = run_attn("train", "--preset", "base", "--vocab-size", "37000", "--dry-run",
                      "--nproc", "2", "--max-tokens", "4096")
    assert result.returncode == 0, result.stderr
    assert ("25000 tokens/side/step over 2 process(es): 3125 tokens per forward pass, "
            "4 accumulation step(s) per process (25000 tokens/side in all)") in result.stdout


# -------------------------------------------------------------------------------- averaging


def test_average_equals_the_manual_mean(data_files, tmp_path):
    run_dir = tmp_path / "run"
    result = run_attn(*train_args(data_files[0], run_dir, "--max-steps", 12, "--save-every", 3))
    assert result.returncode == 0, result.stderr
    out = tmp_path / "avg.st"
    averaged = run_attn("average", run_dir, "--last", 3, "-o", out)
    assert averaged.returncode == 0, averaged.stderr
    for step in (6, 9, 12):
        assert f"checkpoint-{step}.st (step {step})" in averaged.stderr
    assert "checkpoint-3.st" not in averaged.stderr
    parts = [load_file(str(run_dir / f"checkpoint-{step}.st")) for step in (6, 9, 12)]
    mean = load_file(str(out))
    for name in parts[0]:
        if name.startswith("vocab."):
            assert torch.equal(mean[name], parts[0][name])
        else:
            torch.testing.assert_close(mean[name], sum(p[name] for p in parts) / 3)
    loaded = load_model(out)  # a model file like any other, without optimizer state
    assert "step" not in loaded.metadata and not any("exp_avg" in n for n in mean)


def test_average_orders_checkpoints_by_step_not_name(tmp_path, data_files):
    run_dir = tmp_path / "run"
    assert run_attn(*train_args(data_files[0], run_dir, "--max-steps", 10, "--save-every", 5,
                                "--keep", 5)).returncode == 0
    result = run_attn("average", run_dir, "--last", 1, "-o", tmp_path / "a.st")
    assert "checkpoint-10.st (step 10)" in result.stderr  # not checkpoint-5 (name order)


def test_average_refuses_mismatched_models(data_files, tmp_path):
    for name, preset in (("a", "tiny"), ("b", "small")):
        assert run_attn("train", data_files[0], "-o", tmp_path / name, "--preset", preset,
                        "--max-steps", "1", "--device", "cpu").returncode == 0
    result = run_attn("average", tmp_path / "a" / "checkpoint-1.st",
                      tmp_path / "b" / "checkpoint-1.st", "-o", tmp_path / "x.st")
    assert_clean_error(result, "another architecture")
    assert not (tmp_path / "x.st").exists()


def test_average_of_an_empty_directory(tmp_path):
    assert_clean_error(run_attn("average", tmp_path, "--last", 5, "-o", tmp_path / "x.st"),
                       "no checkpoint")


# ----------------------------------------------------------------------------- end to end


def test_learns_to_reverse_sequences(tmp_path):
    """A tiny model learns a toy task (reverse a sequence of letters) through the real commands,
    trained, then averaged as §6.1 does: greedy outputs on sequences it never saw are their
    reversals, and it gives them a low NLL.

    Which of its last checkpoints is good is chance: with this little data and no dropout,
    Adam's loss spikes now and then, and where depends on the seed and on the CPU's kernels
    (AVX2 and AVX-512 round differently). The last checkpoint alone, after 600 steps, measured
    held-out exact match 0.39-0.98 and NLL 0.004-0.44 over seeds 1-15 on AVX-512 and forced AVX2
    kernels (1 in 30 below the bounds); the average of the checkpoints at 400, 600 and 800
    steps measured 0.78-0.99 and 0.007-0.104. The bounds below leave a wide margin (3.8x on the
    NLL) and stay far from what an untrained or broken model gets (exact match 0, NLL above
    1.5)."""
    sources, targets = reversal_pairs(2000, seed=0)
    (tmp_path / "src.txt").write_text("\n".join(sources) + "\n")
    (tmp_path / "tgt.txt").write_text("\n".join(targets) + "\n")
    assert run_attn("vocab", tmp_path / "src.txt", "-o", tmp_path / "v.model", "--size", "24",
                    "--type", "unigram").returncode == 0
    assert run_attn("binarize", "--vocab", tmp_path / "v.model", tmp_path / "src.txt",
                    tmp_path / "tgt.txt", "-o", tmp_path / "d.st").returncode == 0
    result = run_attn("train", tmp_path / "d.st", "-o", tmp_path / "run", "--preset", "tiny",
                      "--label-smoothing", "0", "--dropout", "0", "--max-steps", "800",
                      "--batch-tokens", "1000", "--warmup", "100", "--lr-scale", "0.5",
                      "--log-every", "100", "--save-every", "200", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    model = tmp_path / "model.st"
    assert run_attn("average", tmp_path / "run", "--last", "3", "-o", model).returncode == 0
    held_out, expected = reversal_pairs(200, seed=99)
    (tmp_path / "held_out.src").write_text("\n".join(held_out) + "\n")
    (tmp_path / "held_out.tgt").write_text("\n".join(expected) + "\n")
    scored = run_attn("score", "-m", model, tmp_path / "held_out.src", tmp_path / "held_out.tgt")
    assert scored.returncode == 0, scored.stderr
    nll = math.log(float(re.search(r"perplexity ([\d.]+)", scored.stderr).group(1)))
    assert nll < REVERSAL_MAX_NLL, scored.stderr
    decoded = run_attn("decode", "-m", model, "--beam", "1", "-i", tmp_path / "held_out.src")
    assert decoded.returncode == 0, decoded.stderr
    outputs = decoded.stdout.splitlines()
    exact = sum(output == target for output, target in zip(outputs, expected)) / len(expected)
    assert exact >= REVERSAL_MIN_EXACT, (exact, list(zip(held_out, outputs))[:10])


REVERSAL_MAX_NLL = 0.4
REVERSAL_MIN_EXACT = 0.5
