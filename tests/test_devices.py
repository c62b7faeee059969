"""Devices and precision (devices.py): bf16 on CPUs with and without native support, the CPU's
packed weights, and, where a GPU is, training, decoding and scoring on it."""

from __future__ import annotations

import copy
import dataclasses
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

from .conftest import assert_clean_error, run_attn, train_args

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
    """Decoding on a CPU runs a copy of the model with oneDNN's packed linear layers: same
    logits, and each row's result independent of the batch it is in."""
    if not devices.packed_linear_works():
        pytest.skip("this torch build has no oneDNN packed linear")
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"].model_config(50, dropout=0.0)).eval()
    src, tgt = torch.randint(4, 50, (5, 7)), torch.randint(4, 50, (5, 6))
    packed_model = devices.inference_model(model, torch.device("cpu"), "fp32", "packed")
    with torch.no_grad():
        expected = model(src, tgt)
        packed = packed_model(src, tgt)
        alone = packed_model(src[2:3], tgt[2:3])
    assert not any(isinstance(m, torch.nn.Linear) for m in packed_model.modules())
    assert isinstance(packed_model.output_projection, devices.PackedLinear)
    torch.testing.assert_close(packed, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(alone[0], packed[2])


def module_types(model: torch.nn.Module) -> list[tuple[str, type]]:
    return [(name, type(module)) for name, module in model.named_modules()]


@pytest.mark.parametrize("dtype,linears", [("fp32", "dense"), ("fp32", "packed"),
                                           ("fp32", "int8"), ("bf16", "dense")])
def test_a_model_made_for_inference_leaves_the_model_as_it_was(dtype, linears):
    """`inference_model` makes a new model: the one given keeps its modules, its weights (bit
    for bit), its training mode and its gradients, and trains on; what the new one takes
    unchanged it shares instead of copying."""
    torch.manual_seed(0)
    config = dataclasses.replace(PRESETS["tiny"].model_config(50, dropout=0.0),
                                 output_bias=True)
    model = Transformer(config).train()
    types, weights = module_types(model), {name: tensor.clone()
                                           for name, tensor in model.state_dict().items()}
    table = model.sinusoids.clone()
    prepared = devices.inference_model(model, torch.device("cpu"), dtype, linears)
    assert prepared is not model and not prepared.training
    assert not any(parameter.requires_grad for parameter in prepared.parameters())
    assert module_types(model) == types and model.output_projection is None
    assert model.training and all(p.requires_grad for p in model.parameters())
    state = model.state_dict()
    assert list(state) == list(weights)
    assert all(torch.equal(state[name], weights[name]) and state[name].dtype == weight.dtype
               for name, weight in weights.items())
    assert torch.equal(model.sinusoids, table)
    if dtype == "fp32":  # the embeddings (looked up, never packed) are the same memory
        assert prepared.tgt_embed.weight.data_ptr() == model.tgt_embed.weight.data_ptr()
    if linears == "dense" and dtype == "fp32":
        assert all(mine.data_ptr() == theirs.data_ptr() for mine, theirs in
                   zip(prepared.state_dict().values(), state.values()))
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 6))
    model(src, tgt).float().logsumexp(-1).sum().backward()  # still trainable
    assert all(parameter.grad is not None for parameter in model.parameters())


def tensors_of(model: torch.nn.Module) -> set[int]:
    """The data pointers of every tensor a module holds: parameters, buffers, and the plain
    tensor attributes of packed layers (but oneDNN's own, which have no pointer to give)."""
    held = {tensor.data_ptr() for tensor in [*model.parameters(), *model.buffers()]}
    return held | {value.data_ptr() for module in model.modules()
                   for value in vars(module).values()
                   if isinstance(value, torch.Tensor) and not value.is_mkldnn}


@pytest.mark.parametrize("linears", ["packed", "int8"])
def test_a_packed_model_holds_no_dense_weight_of_the_model(linears):
    """What a packed or int8 model replaces it does not keep: once the caller drops the model
    it was made from, each weight is in memory once."""
    if linears == "packed" and not devices.packed_linear_works():
        pytest.skip("this torch build has no oneDNN packed linear")
    model = Transformer(PRESETS["tiny"].model_config(50, dropout=0.0))
    prepared = devices.inference_model(model, torch.device("cpu"), "fp32", linears)
    dense = {module.weight.data_ptr() for module in model.modules()
             if isinstance(module, torch.nn.Linear)}
    assert dense and not dense & tensors_of(prepared)
    assert model.tgt_embed.weight.data_ptr() in tensors_of(prepared)  # shared, not copied


def test_a_model_made_for_inference_computes_what_converting_it_computed():
    """Dense, the new model's logits are the bits of the model itself (float32) or of the
    model converted with `.to` (bf16, what decoding on a GPU did in place)."""
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"].model_config(50, dropout=0.0)).eval()
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 1100))
    with torch.no_grad():
        for dtype, reference in (("fp32", model),
                                 ("bf16", copy.deepcopy(model).to(torch.bfloat16))):
            prepared = devices.inference_model(model, torch.device("cpu"), dtype)
            assert torch.equal(prepared(src, tgt), reference(src, tgt)), dtype


@pytest.mark.parametrize("linears", ["dense", "packed", "int8"])
def test_a_model_made_for_inference_decodes_the_golden_output(linears):
    """The committed model's beam search, through each kind of linear layer, as `attn
    decode` writes it (every token 0.3+ nats ahead of the next best)."""
    from attn_cli.search import beam_search

    loaded = load_model(FIXTURE_MODEL)
    prepared = devices.inference_model(loaded.model, torch.device("cpu"), "fp32", linears)
    ids = [line + [loaded.config.eos_id] for line in loaded.src_vocab.encode(GOLDEN["inputs"])]
    width = max(map(len, ids))
    src = torch.tensor([line + [loaded.config.pad_id] * (width - len(line)) for line in ids])
    with torch.inference_mode():
        found = beam_search(prepared, src, beam=4)
    assert loaded.tgt_vocab.decode([hypotheses[0].tokens for hypotheses in found]) == \
        GOLDEN["beam4"]


# ------------------------------------------------------------- choosing devices, on any machine


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@no_cuda
@pytest.mark.parametrize("argv", [
    ("decode", "-m", str(FIXTURE_MODEL), "--device", "cuda"),
    ("train", "data.st", "-o", "run", "--device", "cuda"),
    ("score", "-m", str(FIXTURE_MODEL), "a", "b", "--device", "cuda"),
    ("train", "data.st", "-o", "run", "--device", "cpu", "--dtype", "fp16"),
])
def test_asking_for_cuda_without_it_is_one_error_line(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / name).write_text("x\n", encoding="utf-8")
    assert_clean_error(run_attn(*argv, stdin="x\n"), "CUDA" if "fp16" not in argv else "fp16")


def test_cudnn_attention_off_turns_cudnns_kernels_off_on_cuda_only(monkeypatch):
    from attn_cli.errors import AttnError

    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append, raising=False)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert devices.choose_cudnn_attention("off", gpu) and calls == [False]
    assert not devices.choose_cudnn_attention("auto", gpu)  # torch's choice, untouched
    assert not devices.choose_cudnn_attention("off", cpu)  # nothing to choose on a CPU
    assert calls == [False]
    with pytest.raises(AttnError, match="--cudnn-attention must be one of off, auto"):
        devices.choose_cudnn_attention("on", gpu)


def test_models_loaded_for_inference_keep_attention_off_cudnn(monkeypatch):
    """decode, score, parse and serve load through load_models: on a GPU, attention off cuDNN's
    kernels (a decoder's every step is a new shape for them)."""
    from attn_cli import ensemble

    chosen = []
    monkeypatch.setattr(ensemble, "choose_cudnn_attention",
                        lambda option, device: chosen.append((option, device.type)))
    ensemble.load_models([FIXTURE_MODEL], "cpu")
    assert chosen == [("off", "cpu")]


def fake_gpus(monkeypatch, count: int, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")


@pytest.mark.parametrize("capability,expected", [((7, 0), "fp32"), ((7, 5), "fp32"),
                                                  ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_auto_precision_is_bf16_only_where_it_has_tensor_cores(monkeypatch, capability,
                                                               expected):
    """torch's is_bf16_supported() says yes on a V100 or T4 (emulated bf16, slower than fp32):
    auto goes by the compute capability instead, and an explicit bf16 there is warned about."""
    fake_gpus(monkeypatch, 1, capability)
    assert devices.resolve_dtype("auto", torch.device("cuda", 0)) == expected
    assert devices.resolve_dtype("auto", torch.device("cpu")) == "fp32"


def test_bf16_on_a_gpu_without_tensor_cores_is_warned_about(monkeypatch, capsys):
    fake_gpus(monkeypatch, 1, (7, 0))
    devices.warn_if_bf16_is_emulated("bf16", torch.device("cuda", 0), "train")
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "Tesla V100" in warning and "emulated" in warning


def test_more_processes_than_gpus_or_srun_without_torchrun_is_one_error(monkeypatch):
    from attn_cli.errors import AttnError
    from attn_cli.train.distributed import check_process_layout

    fake_gpus(monkeypatch, 2, (9, 0))
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    check_process_layout("auto")  # one process
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(AttnError, match="4 processes on this node .* torch sees 2 GPU"):
        check_process_layout("auto")
    check_process_layout("cpu")  # gloo processes share the CPU: any number
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_process_layout("cuda")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    with pytest.raises(AttnError, match="srun started 8 tasks.*torchrun"):
        check_process_layout("auto")
    with pytest.raises(AttnError, match="GPU 2 asked for, but torch sees 2"):
        devices.pick_device("cuda", 2)


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


@pytest.mark.gpu
def test_a_training_step_on_a_gpu_makes_no_host_sync(data_files):
    """The CPU's count of data-dependent ops (test_training.py), on CUDA itself: torch raises
    at any synchronizing call inside a step's forward and backward."""
    from attn_cli.batching import MicroBatchStream, process_share
    from attn_cli.data import ParallelData
    from attn_cli.train import distributed
    from attn_cli.train import loop as training

    data = ParallelData(data_files[0])
    device = torch.device("cuda", 0)
    model = Transformer(PRESETS["tiny"].model_config(len(data.src_vocab))).to(device).train()
    micro_batches = MicroBatchStream(data, 600, seed=1).take(2)
    share = [(place, batch.pinned()) for place, batch in process_share(data, micro_batches, 0,
                                                                        1)]
    tokens = sum(int(data.tgt_lengths[b].sum()) + len(b) for b in micro_batches)
    processes = distributed.Processes(0, 1, device)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    training.forward_backward(model, share, 1 / tokens, 0.1, processes, "bf16", scaler,
                              seed=(1, 0))  # warm-up: first calls may sync (allocations)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sums = training.forward_backward(model, share, 1 / tokens, 0.1, processes, "bf16",
                                         scaler, seed=(1, 1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(sums).all()


@pytest.mark.gpu
def test_bf16_decoding_on_a_gpu_runs_past_the_position_table(tmp_path):
    """Review F3 on the device it was found for: a 1,000-piece source, bf16, outputs allowed
    to run past position 1,024."""
    source = " ".join(["a"] * 1000) + "\n"
    result = run_attn("decode", "-m", FIXTURE_MODEL, "--device", "cuda", "--dtype", "bf16",
                      "--beam", "2", "--max-len-b", "60", stdin=source)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1


@pytest.mark.gpu
def test_fused_adam_on_a_gpu_is_saved_from_the_host_and_restored_on_the_device():
    from attn_cli import checkpoints
    from attn_cli.train.start import adam

    device = torch.device("cuda", 0)
    model = Transformer(PRESETS["tiny"].model_config(20, dropout=0.0)).to(device)
    optimizer = adam(model)
    model(torch.tensor([[4, 5, 3]], device=device),
          torch.tensor([[2, 6, 7]], device=device)).sum().backward()
    optimizer.step()
    saved = checkpoints.adam_tensors(model, optimizer)
    assert all(tensor.device.type == "cpu" for tensor in saved.values())
    again = adam(model)
    checkpoints.restore_adam(model, again, saved)
    for parameter in model.parameters():
        step = again.state[parameter]["step"]
        assert step.dtype == torch.float32 and float(step) == 1.0
        if again.defaults.get("fused"):
            assert step.device == parameter.device


@pytest.mark.gpu
def test_decoding_on_a_gpu_runs_attention_off_cudnn():
    from attn_cli.ensemble import load_models

    load_models([FIXTURE_MODEL], "cuda")
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_a_released_model_is_emptied_and_a_large_projection_stays_dense(monkeypatch):
    """`inference_model(release=True)`: the model given up is left on the meta device (its
    weights freed as their packed copies are made) and the new one computes the same; an
    output projection over PACKED_PROJECTION_BYTES stays the embedding matrix itself (a packed
    copy would hold a large vocabulary twice)."""
    if not devices.packed_linear_works():
        pytest.skip("this torch build has no oneDNN packed linear")
    model = Transformer(PRESETS["tiny"].model_config(50, dropout=0.0)).eval()
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 6))
    kept = devices.inference_model(model, torch.device("cpu"), "fp32", "packed")
    assert kept.output_projection is not None  # 50 × 64: packed
    with torch.inference_mode():
        expected = kept(src, tgt)
    monkeypatch.setattr(devices, "PACKED_PROJECTION_BYTES", 0)
    released = devices.inference_model(model, torch.device("cpu"), "fp32", "packed",
                                       release=True)
    assert all(parameter.is_meta for parameter in model.parameters())
    assert released.output_projection is None  # the embedding matrix, dense
    with torch.inference_mode():
        assert torch.allclose(released(src, tgt), expected, atol=1e-5)
