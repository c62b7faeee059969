"""The processes of a training job: one, or torchrun's (NCCL on GPUs, gloo on CPUs), and what
they must agree on.

ATTN_DDP_ONE_RANK=1 puts a job of one process through the same path as several: a process group
of one rank and the model wrapped in DDP (bucket views, `no_sync` while accumulating, the bf16
hook with --grad-sync bf16, object collectives, barrier and teardown), and trains bitwise the
weights of a run without it (tested under gloo). It is how DDP's code runs on a machine with one
GPU, where NCCL refuses a second rank.

Every collective here is issued by every process in the same order, so no process can wait for
another that went elsewhere; a process that cannot start (a missing file, a different data file)
tells the others instead of leaving them waiting until --dist-timeout.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..devices import pick_device
from ..errors import AttnError, say
from ..formats import GRAD_SYNC

# The switch that makes a one-process job a process group of one rank, trained through DDP.
ONE_RANK_SWITCH = "ATTN_DDP_ONE_RANK"


@dataclass(frozen=True)
class Processes:
    """This process's place in the job."""

    rank: int
    world_size: int
    device: torch.device
    one_rank_group: bool = False  # alone, but in a process group and DDP (ONE_RANK_SWITCH)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether the job runs as a process group, its model wrapped in DDP."""
        return self.world_size > 1 or self.one_rank_group

    def log(self, message: str) -> None:
        """A line of `attn train`'s on stderr, from the main process only."""
        if self.is_main:
            say(f"train: {message}")


def start_processes(device_option: str, timeout_minutes: float,
                    start_minutes: float = 5.0) -> Processes:
    """One process, or one of torchrun's (WORLD_SIZE, RANK, LOCAL_RANK in the environment):
    NCCL on CUDA, gloo on CPU. One process with ATTN_DDP_ONE_RANK=1: a process group of one."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    one_rank_group = world_size == 1 and os.environ.get(ONE_RANK_SWITCH) == "1"
    check_process_layout(device_option)
    device = pick_device(device_option, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # float32 matmuls on tensor cores (TF32: 10-bit mantissa inputs, float32 sums) on
        # Ampere and later, as mixed-precision trainers do; bf16/fp16 runs are unaffected.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(cpu_threads(world_size))
    if world_size > 1 or one_rank_group:
        backend = "nccl" if device.type == "cuda" else "gloo"
        with start_watchdog(backend, rank, start_minutes):
            init_process_group(backend, device, timeout_minutes, alone=one_rank_group)
        what = (f"DDP on one rank ({ONE_RANK_SWITCH}=1): rank 0/1" if one_rank_group
                else f"rank {rank}/{world_size}")
        say(f"train: {what} on {socket.gethostname()} pid {os.getpid()}, {device} "
            f"({backend}), {torch.get_num_threads()} threads")
    return Processes(rank, world_size, device, one_rank_group)


def cpu_threads(world_size: int) -> int:
    """Torch threads of a process training on the CPU: OMP_NUM_THREADS's count when one
    process runs and the variable is set, set here rather than left to what torch read at
    import (a library caller may have changed it since; the CPU's sums, hence the weights,
    depend on the count: a run and its resumption must agree). Else the cores this process may
    run on (not the machine's) shared out among a node's processes: under torchrun the
    variable is not the user's word (torchrun sets it to 1 unless told otherwise)."""
    asked = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if world_size == 1 and asked.isdigit() and int(asked) > 0:
        return int(asked)
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def init_process_group(backend: str, device: torch.device, timeout_minutes: float,
                       alone: bool) -> None:
    """The default process group: torchrun's rendezvous (MASTER_ADDR, ...), or `alone`, a group
    of one rank over an in-process store (no address, no port to find free; NCCL and gloo both
    take it)."""
    import torch.distributed as dist

    where = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if alone else {}
    dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes),
                            **({"device_id": device} if device.type == "cuda" else {}), **where)
    # The first collective, where NCCL's communicators connect (lazily, in some versions)
    dist.all_reduce(torch.zeros(1, device=device))


@contextlib.contextmanager
def start_watchdog(backend: str, rank: int, minutes: float):
    """The process group's start (torchrun's store at MASTER_ADDR, NCCL's communicators, the
    first collective) bounded in time: a first contact between nodes that cannot reach each
    other (a firewall, NCCL on the wrong network interface) would otherwise wait the whole
    --dist-timeout, 30 minutes by default, or forever inside NCCL's set-up. Past `minutes`
    the process says so in one line, naming what to check, and exits (status 2): torchrun then
    ends the others. A timer thread, since the hang may be in C++ that never returns."""
    def give_up() -> None:
        where = (f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}")
        network = ("NCCL_SOCKET_IFNAME=<the interface the nodes share> (NCCL_DEBUG=INFO shows "
                   "the one NCCL took; NCCL_IB_DISABLE=1 where InfiniBand is absent)"
                   if backend == "nccl" else
                   "GLOO_SOCKET_IFNAME=<the interface the nodes share>")
        say(f"error: rank {rank}: the {backend} process group did not start within "
            f"--start-timeout {minutes:g} min: check that every node reaches {where} "
            f"(torchrun's --rdzv-endpoint or --master-addr/--master-port) and {network}; "
            "docs/distributed.md")
        os._exit(2)

    timer = threading.Timer(minutes * 60, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def check_process_layout(device_option: str) -> None:
    """The mistakes that would otherwise go wrong silently or with a traceback from NCCL: more
    processes on a node than GPUs (two would share one), and tasks started by `srun` without
    torchrun (each would be a whole job of one process, all writing one run directory)."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    if "WORLD_SIZE" not in os.environ and tasks > 1:
        raise AttnError(f"srun started {tasks} tasks of attn train, which makes {tasks} separate "
                        "one-process runs: start one task per node that runs `torchrun "
                        "--nnodes N --nproc-per-node GPUS ... -m attn_cli train ...` "
                        "(srun --ntasks-per-node 1)")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device_option == "cpu" or local_world == 1 or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if local_world > gpus:
        raise AttnError(f"{local_world} processes on this node (torchrun --nproc-per-node) but "
                        f"torch sees {gpus} GPU(s): start at most one process per GPU, or "
                        "--device cpu")


def gradient_sync_dtype(option: str, processes: Processes) -> str:
    """The precision DDP all-reduces gradients in. auto: bf16 when the job spans nodes on GPUs,
    where the network is the bottleneck (every step sends the float32 gradients of the whole
    model, which between nodes takes longer than the step's compute), fp32 within a node.
    bf16 rounds each process's gradient before the sum (8 bits of mantissa); Adam's update
    and the parameters stay float32."""
    if option not in GRAD_SYNC:
        raise AttnError(f"--grad-sync must be one of {', '.join(GRAD_SYNC)}, not {option!r}")
    if option == "bf16" and processes.device.type != "cuda":
        raise AttnError("--grad-sync bf16 needs CUDA (NCCL); gloo sums float32")
    if option != "auto":
        return option
    return "bf16" if spans_nodes(processes) and processes.device.type == "cuda" else "fp32"


def spans_nodes(processes: Processes) -> bool:
    """Whether the job's processes run on more than one node (torchrun's LOCAL_WORLD_SIZE)."""
    return processes.world_size > int(os.environ.get("LOCAL_WORLD_SIZE", processes.world_size))


def bucket_megabytes(processes: Processes) -> int:
    """The size of DDP's gradient buckets (one all-reduce each). Between nodes every all-reduce
    pays the network's latency (each of a ring's 2(N-1) hops, tens of µs) besides its bytes:
    100 MB buckets make base's ~250 MB of float32 gradients 3 all-reduces instead of 10. Within
    a node the latency is small, and torch's 25 MB lets the first buckets go out while the
    backward pass is still computing the rest."""
    return 100 if spans_nodes(processes) else 25


def wrap_for_ddp(model: torch.nn.Module, processes: Processes,
                 grad_sync: str) -> torch.nn.Module:
    """The model as DDP trains it when distributed (alone, the model itself): the gradients
    all-reduced in `grad_sync`'s precision (gradient_sync_dtype) during the last backward pass
    of a step."""
    if not processes.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    # Gradients live in DDP's communication buckets (no copy in and out of them each step;
    # `loop._step` zeroes them in place, which keeps them there). The one buffer, the sinusoid
    # table, is a constant: not sent again before every forward pass.
    constant_buffers = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                        inspect.signature(DistributedDataParallel).parameters
                        else {"broadcast_buffers": False})  # torch < 2.13's name
    ddp_model = DistributedDataParallel(
        model, device_ids=[processes.device.index] if processes.device.type == "cuda"
        else None, gradient_as_bucket_view=True, bucket_cap_mb=bucket_megabytes(processes),
        **constant_buffers)
    if gradient_sync_dtype(grad_sync, processes) == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        processes.log("gradients all-reduced in bf16 (--grad-sync)")
    return ddp_model


def collective_failed(error: BaseException) -> bool:
    """Whether `error` is a collective that failed: a peer gone, or a timeout. (NCCL's
    watchdog aborts the process instead; gloo raises a RuntimeError naming itself.)"""
    import torch.distributed as dist

    return isinstance(error, getattr(dist, "DistError", ())) or "gloo" in str(error)


class EveryRankStops(AttnError):
    """An error every rank raises at the same point (told to all by a collective): each is
    alive to wait for the others before the process group goes down."""


def stop_processes(processes: Processes, finished: bool = False) -> None:
    """The process group torn down. After a run that `finished` normally every process first
    waits for the others (rank 0 saves last): gloo torn down on one rank while a peer still
    uses the group aborted it now and then ("terminate called without an active exception",
    SIGABRT at exit), so after an EveryRankStops too. After another error, no wait: a peer may
    be gone."""
    if processes.distributed:
        import torch.distributed as dist

        if finished:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(values: list[float] | torch.Tensor, processes: Processes) -> list[float]:
    """The values summed over the processes, read to the host (the one wait for the device)."""
    tensor = torch.as_tensor(values, dtype=torch.float64).to(processes.device)
    if processes.distributed:
        import torch.distributed as dist

        dist.all_reduce(tensor)
    return tensor.tolist()


def gather_to_main(value, processes: Processes) -> list | None:
    """Every process's `value` (any picklable object), in rank order, on the main process
    (None on the others)."""
    if not processes.distributed:
        return [value]
    import torch.distributed as dist

    gathered = [None] * processes.world_size if processes.is_main else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def from_main(value, processes: Processes):
    """The main process's `value` (any picklable object), on every process."""
    if not processes.distributed:
        return value
    import torch.distributed as dist

    sent = [value]
    dist.broadcast_object_list(sent, src=0)
    return sent[0]


def once_per_node(compute: Callable, processes: Processes):
    """`compute()` on each node's first process (LOCAL_RANK 0) only, its result sent to the
    node's other processes (every process takes part in one all-gather). `compute` must not
    raise (a process that left would leave the others waiting) and returns something not None.
    Under torchrun a node's processes run one command line and hold consecutive ranks; a rank
    whose node's first process is not where it expects (ranks started by hand) computes for
    itself."""
    if not processes.distributed:
        return compute()
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    results: list = [None] * processes.world_size
    dist.all_gather_object(results, compute() if local_rank == 0 else None)
    shared = results[processes.rank - local_rank] if local_rank <= processes.rank else None
    return shared if shared is not None else compute()


def one_line(error: BaseException) -> str:
    """An exception as one line of an error message: its type and its text (CUDA's and some
    OS errors run over several lines), cut short."""
    said = " ".join(str(error).split())
    return f"{type(error).__name__}: {said[:400]}"


def same_on_every_rank(processes: Processes, prepare: Callable, facts: Callable):
    """`prepare()` on every rank, then each rank's `facts(prepared)` compared with rank 0's: a
    rank that failed or differs stops every rank with an error naming it (a rank that stopped
    alone would leave the others waiting for it until --dist-timeout)."""
    if not processes.distributed:
        return prepare()
    import torch.distributed as dist

    prepared, report = None, {"host": socket.gethostname()}
    try:
        prepared = prepare()
        report["facts"] = facts(prepared)
    except AttnError as error:
        report["error"] = str(error)
    except Exception as error:  # noqa: BLE001 (out of memory, a busy GPU, a file system error:
        # told to every rank, or the others would wait for this one until --dist-timeout)
        report["error"] = one_line(error)
    reports: list = [None] * processes.world_size
    dist.all_gather_object(reports, report)
    problem = rank_disagreement(reports)
    if problem:
        raise EveryRankStops(problem)
    return prepared


def rank_disagreement(reports: list[dict]) -> str | None:
    """The first rank that failed, or whose facts differ from rank 0's, and how (None: they all
    agree). `reports[r]`: rank r's {"host", and "facts" or "error"}."""
    for rank, report in enumerate(reports):
        if "error" in report:
            return f"rank {rank} (on {report['host']}): {report['error']}"
    reference = reports[0]["facts"]
    for rank, report in enumerate(reports[1:], start=1):
        for name, theirs in reference.items():
            mine = report["facts"].get(name)
            if mine == theirs:
                continue
            if isinstance(theirs, dict) and isinstance(mine, dict):
                key = next(key for key in sorted(set(theirs) | set(mine))
                           if theirs.get(key) != mine.get(key))
                what = f"{name}: {key} is {mine.get(key)!r} where rank 0 has {theirs.get(key)!r}"
            elif isinstance(theirs, str) or isinstance(mine, str):
                what = (f"its {name} differs from rank 0's (sha256 {str(mine)[:16]} against "
                        f"{str(theirs)[:16]})")
            else:
                what = f"{name}: {mine!r} where rank 0 has {theirs!r}"
            return (f"rank {rank} (on {report['host']}) does not match rank 0: {what}; every "
                    "process must run the same command on the same files")
    return None
