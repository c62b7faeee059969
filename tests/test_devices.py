"""Devices and precision (devices.py): bf16 on CPUs with and without native support, the CPU's
packed weights, and, where a GPU is, training, decoding and scoring on it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from attn_cli import devices
from attn_cli.checkpoints import list_checkpoints, state_path
from attn_cli.config import PRESETS
from attn_cli.model import Transformer
from attn_cli.modelfile import load_model

from .conftest import run_attn, train_args

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text(encoding="utf-8"))
FIXTURE_MODEL = FIXTURES / GOLDEN["checkpoint"]


@pytest.mark.parametrize("limit,native", [("AVX2", False), ("AVX512_CORE", False),
                                           ("AVX512_CORE_AMX", None), ("ALL", None)])
def test_native_bf16_follows_the_cpu_and_onednn_limit(monkeypatch, limit, native):
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


def test_packed_weights_for_cpu_inference_compute_the_same():
    """Decoding on a CPU swaps the linear layers for oneDNN's packed ones: same logits, and
    each row's result independent of the batch it is in."""
    if not devices.packed_linear_works():
        pytest.skip("this torch build has no oneDNN packed linear")
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"].model_config(50, dropout=0.0)).eval()
    src, tgt = torch.randint(4, 50, (5, 7)), torch.randint(4, 50, (5, 6))
    with torch.no_grad():
        expected = model(src, tgt)
        devices.pack_for_cpu_inference(model)
        packed = model(src, tgt)
        alone = model(src[2:3], tgt[2:3])
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    torch.testing.assert_close(packed, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(alone[0], packed[2])


# ------------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_training_on_a_gpu_writes_checkpoints_and_resumes(dtype, data_files, tmp_path):
    """A few steps on CUDA in mixed precision (fp16 with its loss scaler, saved with the
    state), then one more resumed from the checkpoint."""
    run_dir = tmp_path / "run"
    common = ["train", data_files[0], "-o", run_dir, "--preset", "tiny", "--device", "cuda",
              "--dtype", dtype, "--save-every", "3", "--log-every", "1"]
    result = run_attn(*common, "--max-steps", "3")
    assert result.returncode == 0, result.stderr
    assert [step for step, _ in list_checkpoints(run_dir, need_state=True)] == [3]
    assert load_model(run_dir / "checkpoint-3.st").metadata["step"] == "3"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(math.isfinite(row["loss"]) for row in rows)
    with safe_open(str(state_path(run_dir, 3)), "pt") as handle:
        scaler = json.loads(handle.metadata()["scaler"])
    assert bool(scaler) == (dtype == "fp16")  # the loss scale is part of an fp16 run's state
    resumed = run_attn(*common, "--max-steps", "4", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr


@pytest.mark.gpu
def test_greedy_decoding_on_a_gpu_gives_the_golden_output():
    """The committed model's greedy decodes (every token 0.3+ nats ahead of the next best:
    no rounding of a GPU's kernels changes them) on CUDA in fp32."""
    result = run_attn("decode", "-m", FIXTURE_MODEL, "--device", "cuda", "--dtype", "fp32",
                      "--beam", "1", stdin="\n".join(GOLDEN["inputs"]) + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == GOLDEN["greedy"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tolerance", [
    ("fp32", 1e-2),
    # bf16 rounds the logits: on a CPU (bf16 autocast) these lines' log-probs move by up to
    # 7e-3 from fp32's (measured), so bf16 on a GPU gets a wider bound.
    ("bf16", 3e-2),
])
def test_scoring_on_a_gpu_gives_the_cpus_log_probabilities(dtype, tolerance, tmp_path):
    (tmp_path / "src").write_text("\n".join(GOLDEN["inputs"]) + "\n", encoding="utf-8")
    (tmp_path / "tgt").write_text("\n".join(GOLDEN["greedy"]) + "\n", encoding="utf-8")
    scores = {}
    for device, precision in (("cpu", "fp32"), ("cuda", dtype)):
        result = run_attn("score", "-m", FIXTURE_MODEL, tmp_path / "src", tmp_path / "tgt",
                          "--format", "json", "--device", device, "--dtype", precision)
        assert result.returncode == 0, result.stderr
        scores[device] = [json.loads(line)["log_prob"] for line in result.stdout.splitlines()]
    assert len(scores["cuda"]) == len(GOLDEN["inputs"])
    assert scores["cuda"] == pytest.approx(scores["cpu"], abs=tolerance)
