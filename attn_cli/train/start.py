"""Where a run starts: new (the preset's network, drawn from --seed), fine-tuning a model file
(--init: its network and weights, with Adam and the schedule from step 0), or its own newest
checkpoint (--resume). Rank 0 decides from its run directory for every process; each process then
reads the data and builds the model itself, and they compare notes before the first step.

A resumed run equals the uninterrupted one because everything that decides the next step is in
the checkpoint: the weights, Adam's moments, the schedule's start, the data position (epoch, and
micro-batches used, cut as they were: `earlier_budgets`), and dropout seeded from the step.
Several data files are drawn from by weight (`check_data_options`, batching.CorpusMix), each
epoch's draw a function of the seed and the epoch: the data position is still (epoch, offset).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch

from .. import checkpoints
from ..batching import BatchPlan, CorpusMix, MicroBatchStream, corpus_mix
from ..checkpoints import ResumePoint, ResumeState
from ..config import (
    FREELY_CHANGED,
    PER_NODE_OPTIONS,
    TRAIN_DEFAULTS,
    Architecture,
    ModelConfig,
    TrainOptions,
    get_preset,
)
from ..data import Corpora, ParallelData
from ..devices import resolve_dtype
from ..errors import AttnError
from ..files import file_sha256
from ..model import Transformer
from ..modelfile import LoadedModel, init_config, load_model
from .distributed import (
    EveryRankStops,
    Processes,
    from_main,
    once_per_node,
    one_line,
    same_on_every_rank,
)
from .guided import guided_config


@dataclass
class Start:
    """What a run starts with, the same on every process."""

    data: Corpora  # the training data files, read as one
    valid: ParallelData | None
    dtype: str  # the forward pass's precision: fp32, bf16 or fp16
    model: Transformer
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    point: ResumePoint  # where it goes on from (step 0 for a new run)
    provenance: dict[str, str]  # what every checkpoint records besides the preset (--init)
    resumed: bool  # from a checkpoint of its own
    mix: CorpusMix  # what each epoch draws from each data file


def lock_run_directory(run_dir: Path, processes: Processes) -> checkpoints.RunLock | None:
    """The main process makes and locks the run directory (checkpoints.RunLock); where another
    training holds it, or the file system refuses (read-only, permissions, quota), every
    process stops with the main one's error line."""
    lock, refused = None, None
    if processes.is_main:
        try:
            lock = checkpoints.RunLock(run_dir)
        except AttnError as error:
            refused = str(error)
        except Exception as error:  # noqa: BLE001 (told to every rank, or the others would
            # wait for this one until --dist-timeout)
            refused = f"cannot make or lock the run directory -o {run_dir}: {one_line(error)}"
    refused = from_main(refused, processes)
    if refused:
        raise EveryRankStops(refused)
    return lock


def start(options: TrainOptions, processes: Processes) -> Start:
    """The data, the model, Adam and the point a run starts from, the same on every process:
    with --resume, the newest whole checkpoint's (`resume_step`), with Adam's moments, the data
    position and the schedule as they were; else a new model (the preset's, or --init's model
    file) from step 0. A process that fails, or differs from rank 0, stops every process
    (distributed.same_on_every_rank)."""
    run_dir = Path(options.output)
    resume_from = resume_step(run_dir, options.resume, processes)
    dtype = resolve_dtype(options.dtype, processes.device)
    # --init is read by new runs only: a resumed one goes on from its checkpoint
    checksums = node_checksums({**data_file_names(options), "validation file": options.valid,
                                "init model file": options.init if resume_from is None
                                else None}, processes)
    dropout = options.recipe().dropout
    weights = check_data_options(options)

    def prepare() -> Start:
        data = Corpora(options.data_files)
        mix = corpus_mix(data.sizes, weights)
        valid = ParallelData(options.valid) if options.valid else None
        if valid is not None:
            data.check_same_vocab(valid)
        torch.manual_seed(options.seed)
        scaler = torch.amp.GradScaler("cuda", enabled=dtype == "fp16")
        if resume_from is not None:
            config = preset_config(options.preset, dropout, data, options.architecture())
            loaded, state = load(run_dir, resume_from, processes.device)
            check_resume(loaded, state, config, data, options, processes)
            model = loaded.model.train()
            # the head --guided-alignment supervises (the network's shape is the same)
            model.config = guided_config(model.config, options, data)
            optimizer = adam(model)
            point = restore(state, model, optimizer, scaler, options, dtype, processes)
            # the model file it was seeded from, as its checkpoint recorded it (--init may have
            # moved since; it is not read again)
            return Start(data, valid, dtype, model, optimizer, scaler, point,
                         checkpoints.init_provenance(loaded), resumed=True, mix=mix)
        if options.init is not None:
            model, provenance = init_model(options.init, dropout, data, processes.device,
                                           checksums["init model file"])
            model.config = guided_config(model.config, options, data)  # as on resuming
        else:
            config = guided_config(preset_config(options.preset, dropout, data,
                                                 options.architecture()), options, data)
            model, provenance = Transformer(config).to(processes.device), {}
        return Start(data, valid, dtype, model.train(), adam(model), scaler, ResumePoint(),
                     provenance, resumed=False, mix=mix)

    return same_on_every_rank(processes, prepare,
                              lambda begun: rank_facts(options, begun, checksums))


def announce(begun: Start, options: TrainOptions, plan: BatchPlan, processes: Processes) -> None:
    """On the main process: the run directory made (a resumed run's metrics rows after its
    checkpoint dropped, which it writes again), and what is trained, on what, in which
    batches."""
    run_dir = Path(options.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    if begun.resumed:
        torn = checkpoints.truncate_metrics(run_dir, begun.point.step)
        if torn:
            processes.log(f"resume: {torn}")
    what = (options.preset if "init" not in begun.provenance else
            f"fine-tuning {begun.provenance['init']} with {options.preset}'s recipe")
    corpora = len(begun.data.parts)
    processes.log(f"{what}: {sum(p.numel() for p in begun.model.parameters()):,} parameters, "
                  f"{len(begun.data)} training pairs"
                  f"{f' in {corpora} data files' if corpora > 1 else ''}, {begun.dtype} on "
                  f"{processes.device}")
    if corpora > 1:
        for line in begun.mix.describe([str(part.path) for part in begun.data.parts]):
            processes.log(line)
    processes.log(plan.describe())


def check_data_options(options: TrainOptions) -> list[Fraction] | None:
    """--weights read against the data files (None: not given, each file weighs its size):
    one positive number a file. Several files are drawn from by weight (batching.CorpusMix).
    Weights are an option, not a file of corpora and weights: a Makefile composes them from its
    own variables, nothing new is there to learn or to version, and a config file can come
    later as another way to say the same."""
    paths = options.data_files
    if options.guided_alignment and len(paths) > 1:
        raise AttnError(f"--guided-alignment reads the alignments of one data file, and "
                        f"{len(paths)} are given ({', '.join(map(str, paths))}): binarize the "
                        "corpora into one with --alignments")
    if options.weights is None:
        return None
    texts = options.weights.split(",")
    if len(texts) != len(paths):
        raise AttnError(f"--weights {options.weights} gives {len(texts)} weight(s) for "
                        f"{len(paths)} data file(s) ({', '.join(map(str, paths))}): give one "
                        "a file, in their order")
    weights = []
    for text, path in zip(texts, paths):
        try:
            weight = Fraction(text.strip())
        except (ValueError, ZeroDivisionError):  # nan, inf, words, 1/0
            weight = None
        if weight is None or weight <= 0:
            raise AttnError(f"--weights {options.weights}: the weight of {path}, {text!r}, is "
                            "not a positive number")
        weights.append(weight)
    return weights


def data_file_names(options: TrainOptions) -> dict[str, Path]:
    """Each training data file under the name the processes compare it by (its checksum)."""
    return {"data file" if place == 1 else f"data file {place}": path
            for place, path in enumerate(options.data_files, start=1)}


def preset_config(preset: str, dropout: float, data: Corpora,
                  architecture: dict | None = None) -> ModelConfig:
    """The preset's network for the data's vocabulary and its special ids (attn's, or those of
    the model whose vocabulary binarized it), with the recipe's dropout and the architecture
    options given over it (TrainOptions.architecture)."""
    ids = data.special_ids
    return get_preset(preset).model_config(
        len(data.src_vocab), None if data.shared_vocab else len(data.tgt_vocab), dropout=dropout,
        pad_id=ids.pad, unk_id=ids.unk, bos_id=ids.bos, eos_id=ids.eos, **(architecture or {}))


def adam(model: torch.nn.Module) -> torch.optim.Adam:
    """§5.3: Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 (the rate is set every step). Fused (one
    kernel for every parameter) where torch has it: CUDA, and CPUs from torch 2.4."""
    parameters = list(model.parameters())
    try:
        return torch.optim.Adam(parameters, lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
    except RuntimeError:  # this torch has no fused Adam for this device
        return torch.optim.Adam(parameters, lr=0.0, betas=(0.9, 0.98), eps=1e-9)


def rank_facts(options: TrainOptions, begun: Start, checksums: dict[str, str | None]) -> dict:
    """What every rank must share with rank 0: the options (less the paths, which may differ
    from node to node: the files' contents are compared instead), the data and the model file
    a fine-tuning run starts from by checksum (node_checksums), and the point it resumes
    from."""
    point = begun.point
    return {
        "options": {key: value for key, value in options.record().items()
                    if key not in PER_NODE_OPTIONS},
        **{name: checksums[name] for name in data_file_names(options)},
        "validation file": checksums["validation file"],
        "init model file": begun.provenance.get("init_sha256"),
        "resumed from": {"step": point.step, "epoch": point.epoch,
                         "offset": point.offset, "elapsed_s": point.elapsed_seconds},
    }


def node_checksums(paths: dict[str, Path | None], processes: Processes) -> dict[str, str | None]:
    """The sha256 of each named file (None: not given, or unreadable, which reading it later
    says better), read once per node: a node's first process reads the files, its other
    processes take the sums from it (distributed.once_per_node). Eight processes reading a
    multi-GB data file at every start would be eight times the disk's or the network file
    system's work for the same answer. A process given another path than its node's first one
    reads its own file. A process alone compares with no one: nothing is read (init_model sums
    its file itself)."""
    if not processes.distributed:
        return dict.fromkeys(paths)

    def checksum(path: Path | None) -> str | None:
        try:
            return None if path is None else file_sha256(path)
        except Exception:  # noqa: BLE001 (every process must reach the collective)
            return None

    def read_here() -> dict:
        return {name: (str(path), checksum(path)) for name, path in paths.items()}

    shared = once_per_node(read_here, processes)
    return {name: shared[name][1] if shared[name][0] == str(path) else checksum(path)
            for name, path in paths.items()}


# ---------------------------------------------------------------------- fine-tuning: --init


def init_model(init: Path, dropout: float, data: Corpora, device: torch.device,
               init_sha256: str | None) -> tuple[Transformer, dict[str, str]]:
    """Fine-tuning: the network of the model file `init` (its config as it is, whatever fields
    it has, with the recipe's dropout) holding its weights, loaded strictly; and the provenance
    its run's checkpoints record, with the file's checksum (node_checksums). The optimizer and
    the schedule start afresh at step 0."""
    try:
        loaded = load_model(init)
    except AttnError as error:
        raise AttnError(f"--init: {error}") from None
    check_init_vocabulary(init, loaded, data)
    model = Transformer(dataclasses.replace(loaded.config, dropout=dropout)).to(device)
    model.load_state_dict(loaded.model.state_dict(), strict=True)
    languages = {"lang_codes": loaded.metadata["lang_codes"]} \
        if "lang_codes" in loaded.metadata else {}
    return model, {"init": str(init), "init_sha256": init_sha256 or file_sha256(init),
                   **languages}


def check_init_vocabulary(init: Path, loaded: LoadedModel, data: Corpora) -> None:
    """The data must be in the model's pieces: the vocabularies' checksums must agree (those
    of the first data file, which every other shares: Corpora), and so must the ids of BOS,
    EOS and padding it is collated with (an imported model's own: OPUS-MT's </s> is 0)."""
    for side, vocabulary in (("src", loaded.src_vocab), ("tgt", loaded.tgt_vocab)):
        binarized_with = data.metadata.get(f"{side}_vocab_sha256")
        if binarized_with != vocabulary.checksum:
            raise AttnError(f"{data.path} was binarized with another vocabulary than the model "
                            f"file {init} ({side} vocabulary sha256 {str(binarized_with)[:12]} "
                            f"vs {vocabulary.checksum[:12]}): binarize it with the model's "
                            f"(`attn binarize --vocab {init} ...`)")
    from ..data import SpecialIds

    if data.special_ids != SpecialIds.of_config(loaded.config):
        raise AttnError(f"{data.path} was binarized with {data.special_ids} as its special ids, "
                        f"the model file {init} has {SpecialIds.of_config(loaded.config)}: "
                        f"binarize it again with `attn binarize --vocab {init} ...`")


def check_init_preset(init: Path, preset_name: str) -> None:
    """A --preset given beside --init must describe the model file's architecture (its dropout
    aside, a recipe option): the file's architecture is the one trained, and a contradicting
    preset is a mistake to say, not an override to drop silently."""
    config = init_config(init)
    preset = get_preset(preset_name)
    differ = [field.name for field in dataclasses.fields(Architecture)
              if field.name != "dropout"
              and getattr(preset, field.name) != getattr(config, field.name)]
    if differ:
        model_has = ", ".join(f"{name} {getattr(config, name)}" for name in differ)
        preset_has = ", ".join(str(getattr(preset, name)) for name in differ)
        raise AttnError(f"--preset {preset_name} contradicts --init {init}: the model has "
                        f"{model_has} where the preset has {preset_has} (the architecture comes "
                        "from the model file: leave out --preset, or give one of that "
                        "architecture for its recipe)")


# ------------------------------------------------------------------------- resuming: --resume


def resume_step(run_dir: Path, resume: bool, processes: Processes) -> int | None:
    """The step of the checkpoint to resume from (None: a new run), as rank 0 finds its run
    directory, sent to every rank: no rank decides from its own disk, which on another node may
    hold other checkpoints or none. Refuses to overwrite a run without --resume."""
    decision: dict = {}
    if processes.is_main:
        try:
            decision = resume_decision(run_dir, resume, processes)
        except AttnError as error:
            decision = {"error": str(error)}
        except Exception as error:  # noqa: BLE001 (an unreadable directory: told to every
            # rank, or the others would wait for this one until --dist-timeout)
            decision = {"error": f"cannot read the run directory -o {run_dir}: "
                                 f"{one_line(error)}"}
    decision = from_main(decision, processes)
    if "error" in decision:
        raise EveryRankStops(decision["error"])
    return decision.get("step")


def resume_decision(run_dir: Path, resume: bool, processes: Processes) -> dict:
    """On the main process, from the run directory: {"step": the checkpoint to resume from},
    {} for a new run, or {"error"}."""
    existing = checkpoints.list_checkpoints(run_dir, need_state=True)
    if existing and not resume:
        return {"error": f"{run_dir} already holds checkpoints (last: step {existing[-1][0]}); "
                         "add --resume to continue that run, or choose another -o"}
    if existing:
        return newest_intact(run_dir, [step for step, _ in existing], processes)
    if resume:
        processes.log(f"nothing to resume in {run_dir}: starting a new run")
    return {}


def newest_intact(run_dir: Path, steps: list[int], processes: Processes) -> dict:
    """{"step": the newest checkpoint whose model and state files are whole}, each newer one
    skipped named with why (a disk or copy fault, a kill in the middle of a copy), or {"error"}
    when none is."""
    skipped = []
    for step in reversed(steps):
        problem = checkpoints.intact_checkpoint(run_dir, step)
        if problem is None:
            for earlier in skipped:
                processes.log(f"resume: skipped {earlier}")
            return {"step": step}
        skipped.append(f"checkpoint-{step}: {problem}")
    return {"error": f"no checkpoint in {run_dir} can be resumed from: " + "; ".join(skipped)}


def load(run_dir: Path, step: int, device: torch.device) -> tuple[LoadedModel, ResumeState]:
    """Checkpoint `step` of the run and its state, which every process must see at rank 0's
    run directory path."""
    if not (checkpoints.checkpoint_path(run_dir, step).exists()
            and checkpoints.state_path(run_dir, step).exists()):
        raise AttnError(f"{run_dir} holds no checkpoint-{step}.st and its state, which rank 0 "
                        "resumes from: every process must see rank 0's run directory at its -o "
                        "path (on several nodes, a shared file system)")
    return checkpoints.load_checkpoint(run_dir, step, device)


def check_resume(loaded: LoadedModel, state: ResumeState, config: ModelConfig,
                 data: Corpora, options: TrainOptions, processes: Processes) -> None:
    """Refuse a changed architecture (against `config`, the preset's) or vocabulary; say which
    options differ. A run seeded by --init (its checkpoints record the model file) has that
    file's architecture, not the preset's, and goes on with it whether or not --init is given
    again."""
    if loaded.src_vocab.checksum != data.metadata["src_vocab_sha256"]:
        raise AttnError(f"{options.data} was binarized with another vocabulary than the run "
                        f"in {options.output}: resuming needs the same vocabulary")
    # dropout is the recipe's; which head guided alignment supervises is an option's
    architecture = ({f.name for f in dataclasses.fields(ModelConfig)} - {"dropout"}
                    - set(ModelConfig.GUIDED_FIELDS))
    seeded = "init" in loaded.metadata
    changed = [] if seeded else [name for name in sorted(architecture)
                                 if getattr(loaded.config, name) != getattr(config, name)]
    if changed:
        differences = ", ".join(f"{name} {getattr(loaded.config, name)} -> "
                                f"{getattr(config, name)}" for name in changed)
        raise AttnError(f"the run in {options.output} has another architecture "
                        f"({differences}); start a new run to change it")
    recorded, saved = options.record(), state.options
    for key in sorted(set(recorded) | set(saved)):
        if key == "resume" or (key == "init" and recorded.get(key) is None):
            continue  # --init seeds a new run only: leaving it out on resume changes nothing
        if key not in saved and recorded[key] == TRAIN_DEFAULTS.get(key):
            continue  # an option newer than the checkpoint, at its default: nothing changes
        before, after = saved.get(key), recorded.get(key)
        if before != after:
            note = "" if key in FREELY_CHANGED else " (changes the recipe)"
            processes.log(f"resume: {key} {before} -> {after}{note}")


def restore(state: ResumeState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler, options: TrainOptions, dtype: str,
            processes: Processes) -> ResumePoint:
    """Adam's moments and the fp16 loss scale as they were (unless --reset-optimizer), and the
    point the run goes on from (the warmup restarted with --reset-schedule)."""
    if options.reset_optimizer:
        processes.log("--reset-optimizer: Adam's moments start from zero")
    else:
        checkpoints.restore_adam(model, optimizer, state.adam)
        if state.scaler and dtype == "fp16":
            scaler.load_state_dict(state.scaler)
    point = state.point
    if options.init is not None:
        processes.log(f"resume: --init {options.init} is not read: it seeds a new run, and this "
                      "one goes on from its checkpoint")
    if options.reset_schedule:
        point = dataclasses.replace(point, schedule_offset=point.step)
        processes.log(f"--reset-schedule: warmup starts again at step {point.step + 1}")
    processes.log(f"resuming {Path(options.output)} from step {point.step} (epoch "
                  f"{point.epoch}, batch {point.offset})")
    return point


def resumed_stream(data: Corpora, mix: CorpusMix, plan: BatchPlan, seed: int,
                   point: ResumePoint, processes: Processes) -> MicroBatchStream:
    """The micro-batches from where the run stopped (a new run: from the start). Under another
    plan than the checkpoint's (another process count, --max-tokens or --batch-tokens) the run
    goes on from the same place in the data with the new plan's global batch, and says so."""
    saved = BatchPlan(**point.batch_plan) if point.batch_plan else None
    stream = MicroBatchStream(data, saved.max_tokens if saved else plan.max_tokens, seed,
                              point.epoch, point.offset, point.earlier_budgets, mix=mix)
    if stream.offset > stream.epoch_length:  # only with other data files than the run's
        where = ", ".join(str(part.path) for part in data.parts)
        processes.log(f"resume: the data position (epoch {stream.epoch}, batch "
                      f"{stream.offset}) lies past the end of that epoch in {where} "
                      f"({stream.epoch_length} batches): going on with epoch {stream.epoch + 1}")
        stream.next_epoch()
    if saved is not None and saved != plan:
        if saved.max_tokens == plan.max_tokens:
            how = "micro-batches cut as before"
        else:
            how = (f"the rest of epoch {stream.epoch} (from its micro-batch {stream.offset}) cut "
                   f"into {plan.max_tokens}-token micro-batches from the pairs not yet used")
        processes.log(f"resume: batch plan {saved.brief()} -> {plan.brief()} "
                      f"({saved.step_tokens} -> {plan.step_tokens} tokens/side/step); {how}")
        stream.change_budget(plan.max_tokens)
    return stream
