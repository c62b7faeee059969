"""`attn ARGS` in a process that also records what only that process knows, for the GPU smoke
(checks/gpu_smoke.py runs it as `python -m checks.gpu_smoke_runner ARGS`, alone or under torchrun):

- always: the steps taken, the peak GPU memory, where attn_cli was imported from, and whether the
  model trained is wrapped in DDP (its class, the process group's backend and size, a comm hook);
- ATTN_SMOKE_SYNCS=1: every host-device sync from the third training step on, with the attn line
  that caused it;
- ATTN_SMOKE_PROFILE=S: on a GPU, a torch profile of training steps S to S+2 (the GPU's busy
  time, its kernels per step, the top kernels; a Chrome trace to ATTN_SMOKE_TRACE); on any
  device, the ops dispatched in step S+3 (the launch budget's count, on a CPU too);
- ATTN_SMOKE_SEARCH_SYNCS=1: the syncs of each search step (decode) from the third on;
- ATTN_SMOKE_PIDS=DIR: DIR/rank{RANK}.pid, so that a rank can be killed (stage 6);
- ATTN_SMOKE_MOCK_GPUS=N: torch sees N CUDA devices (for the refusal of more processes than GPUs,
  tried on a CPU: attn refuses before it touches a device).

The report goes to ATTN_SMOKE_REPORT (rank r > 0 of several: that path + `.rank{r}`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings

KERNEL_EXCLUDED = ("Memcpy", "Memset")  # device events that are copies, not kernel launches


def device_busy_us(intervals: list[tuple[float, float]]) -> float:
    """The time covered by the union of (start, end) intervals: a kernel on one stream counted
    once, overlapping kernels on several streams (NCCL beside compute) not twice."""
    busy, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy


def summarize_profile(records: list[dict], wall_s: float, steps: int) -> dict:
    """A profile's figures from its events, each {"name", "device": True for a GPU event (a
    kernel, a copy) and False for a host one (an op, a runtime call), "start_us", "end_us"}.
    Review N3: the busy time adds the device events alone, as the union of their intervals (a
    kernel also appears under the op that launched it: adding every row counts it twice); the
    top list names kernels only."""
    device = [record for record in records if record["device"]]
    busy_us = device_busy_us([(record["start_us"], record["end_us"]) for record in device])
    per_name: dict[str, float] = {}
    for record in device:
        per_name[record["name"]] = per_name.get(record["name"], 0.0) + \
            record["end_us"] - record["start_us"]
    kernels = [record for record in device if not record["name"].startswith(KERNEL_EXCLUDED)]
    top = sorted(per_name.items(), key=lambda item: -item[1])[:12]
    return {"wall_ms": wall_s * 1e3, "gpu_busy_ms": busy_us / 1e3,
            "busy_fraction": busy_us / 1e6 / wall_s if wall_s > 0 else None,
            "steps": steps, "kernels_per_step": len(kernels) / max(1, steps),
            "copies_per_step": (len(device) - len(kernels)) / max(1, steps),
            "top_kernels_ms": {name[:80]: round(us / 1e3, 3) for name, us in top}}


def profile_records(profile) -> list[dict]:
    """A torch profile's events as `summarize_profile` takes them."""
    from torch.autograd import DeviceType

    return [{"name": event.name, "device": event.device_type != DeviceType.CPU,
             "start_us": event.time_range.start, "end_us": event.time_range.end}
            for event in profile.events()]


def main() -> None:
    import torch

    rank = int(os.environ.get("RANK", "0"))
    report_path = os.environ.get("ATTN_SMOKE_REPORT")
    if report_path and rank:
        report_path = f"{report_path}.rank{rank}"
    report: dict = {"syncs": [], "steps": 0, "rank": rank}
    if os.environ.get("ATTN_SMOKE_PIDS"):
        with open(os.path.join(os.environ["ATTN_SMOKE_PIDS"], f"rank{rank}.pid"), "w") as handle:
            handle.write(str(os.getpid()))
    if os.environ.get("ATTN_SMOKE_MOCK_GPUS"):
        count = int(os.environ["ATTN_SMOKE_MOCK_GPUS"])
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: count
    on_gpu = torch.cuda.is_available() and not os.environ.get("ATTN_SMOKE_MOCK_GPUS")

    def attn_frame() -> str:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "attn_cli" in frame.filename and "warnings" not in frame.filename:
                return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
        return "outside attn_cli"

    def record_syncs(with_what: bool) -> None:
        warnings.simplefilter("always")

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message).lower():
                entry = {"step": report["steps"], "where": attn_frame()}
                if with_what:
                    entry["what"] = str(message)[:120]
                report["syncs"].append(entry)
        warnings.showwarning = show

    if os.environ.get("ATTN_SMOKE_SYNCS"):
        record_syncs(with_what=True)
    hook_comm_hooks(report)
    hook_training_steps(report, on_gpu)
    if os.environ.get("ATTN_SMOKE_SEARCH_SYNCS"):
        import attn_cli.model as model_module

        decode_step = model_module.Transformer.decode_step

        def counted_step(self, *args, **kwargs):
            report["steps"] += 1
            if report["steps"] == 3 and on_gpu:
                torch.cuda.set_sync_debug_mode("warn")
            return decode_step(self, *args, **kwargs)
        model_module.Transformer.decode_step = counted_step
        record_syncs(with_what=False)

    import attn_cli
    from attn_cli.cli import main as attn_main

    report["attn_cli"] = os.path.dirname(os.path.abspath(attn_cli.__file__))
    try:
        attn_main(sys.argv[1:])
    finally:
        if on_gpu:
            report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            report["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        if report_path:
            with open(report_path, "w") as handle:
                json.dump(report, handle)


def hook_comm_hooks(report: dict) -> None:
    """Record the name of any comm hook DDP is given (the bf16 all-reduce of --grad-sync)."""
    from torch.nn.parallel import DistributedDataParallel

    register = DistributedDataParallel.register_comm_hook

    def recorded(self, state, hook):
        report["comm_hook"] = getattr(hook, "__name__", str(hook))
        return register(self, state, hook)
    DistributedDataParallel.register_comm_hook = recorded


def hook_training_steps(report: dict, on_gpu: bool) -> None:
    """Wrap attn's training step: count steps, note DDP at the first, and take the syncs, the
    profile and the dispatch count the environment asks for."""
    import torch

    try:
        import attn_cli.train.loop as training
    except ImportError:
        return
    step_function = training._step
    profile_from = int(os.environ.get("ATTN_SMOKE_PROFILE", "0"))
    state: dict = {}

    def synchronize() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def counted(run, step, *args, **kwargs):
        if report["steps"] == 0:
            report["ddp"] = ddp_facts(run)
        if os.environ.get("ATTN_SMOKE_SYNCS") and report["steps"] == 2 and on_gpu:
            torch.cuda.set_sync_debug_mode("warn")
        if profile_from and step == profile_from and on_gpu:
            synchronize()
            state["profile"] = torch.profiler.profile(activities=[
                torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            state["profile"].__enter__()
            state["wall"] = time.perf_counter()
        counter = None
        if profile_from and step == profile_from + 3:
            counter = DispatchCounter()
            counter.__enter__()
        try:
            result = step_function(run, step, *args, **kwargs)
        finally:
            if counter is not None:
                counter.__exit__(None, None, None)
                report["dispatch_ops_per_step"] = counter.count
        report["steps"] += 1
        if profile_from and step == profile_from + 2 and on_gpu:
            synchronize()
            wall = time.perf_counter() - state["wall"]
            profile = state.pop("profile")
            profile.__exit__(None, None, None)
            report["profile"] = summarize_profile(profile_records(profile), wall, steps=3)
            trace = os.environ.get("ATTN_SMOKE_TRACE")
            if trace:
                profile.export_chrome_trace(trace)
        return result
    training._step = counted


def ddp_facts(run) -> dict:
    """What trains the model: DDP or the module itself, and the process group."""
    import torch.distributed as dist

    model = getattr(run, "ddp_model", None)
    facts = {"wrapped": type(model).__name__ if model is not None else None,
             "world_size": getattr(getattr(run, "processes", None), "world_size", None)}
    if dist.is_available() and dist.is_initialized():
        facts.update(backend=str(dist.get_backend()), group_size=dist.get_world_size())
    return facts


def _dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


class DispatchCounter:
    """The ops dispatched while it is entered (forward, backward, optimizer): on a GPU each is
    one or more kernel launches, so this counts the host's launch work on any device."""

    def __init__(self):
        counter = self

        class Mode(_dispatch_mode()):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.count += 1
                return func(*args, **(kwargs or {}))
        self.count = 0
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


if __name__ == "__main__":
    main()
