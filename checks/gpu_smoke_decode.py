"""The GPU smoke's stages 7 and 8 (checks/gpu_smoke.py): decoding on the GPU against fp32 and the
CPU, `score -m`, and a toy parser trained and parsed on the GPU. Both need the model stage 3
trains in the same call.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .gpu_smoke_common import (
    Skip,
    attn_command,
    log,
    run,
    run_attn,
    save_progress,
    stderr_tail,
    time_left,
)
from .gpu_smoke_train import need_data, need_device


def trained_model(work: Path) -> Path:
    """The model of stage 3's base run, its last 3 checkpoints averaged."""
    model = work / "model.st"
    if not model.exists():
        if not (work / "base" / "done").exists():
            raise Skip("no trained model: stage 3 trains it (run it in the same call)")
        run(attn_command("average", work / "base", "--last", 3, "-o", model))
    return model


def decode(work: Path, name: str, model: Path, source: bytes, device: str, *options,
           timeout: float = 300) -> tuple[list[str], dict]:
    """`attn decode` of `source`: its output lines and its summary (--stats-json)."""
    stats = work / f"{name}.stats.json"
    stats.unlink(missing_ok=True)
    completed = run(attn_command("decode", "-m", model, "--device", device, "--stats-json",
                                 stats, *options), input=source, timeout=timeout, check=False)
    summary = json.loads(stats.read_text()) if stats.exists() else {}
    summary = {key: summary[key] for key in ("sentences", "seconds", "sentences_per_s",
                                             "tokens_per_s", "load_seconds") if key in summary}
    summary["exit"] = completed.returncode
    if completed.returncode:
        summary["stderr"] = stderr_tail(completed, 600)
    return completed.stdout.decode("utf-8", "replace").splitlines(), summary


def bleu(hypotheses: list[str], references: list[str]) -> float:
    import sacrebleu

    return round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2)


def same_lines(a: list[str], b: list[str]) -> int:
    return sum(x == y for x, y in zip(a, b))


# ---------------------------------------------------------------------------------- stage 7


def stage_decoding(args, work: Path, found: dict) -> None:
    """The test set at beam 4 in bf16 and fp32 on the device and fp32 on the CPU (lines
    identical, BLEU), batch sizes (each compared with --batch-tokens 8000, N15), --stop
    best-ends, greedy; syncs per search step; the review's F3 probe."""
    need_device(args)
    data = need_data(work)
    model = trained_model(work)
    source = (data / "test_2016_flickr.en").read_bytes()
    references = (data / "test_2016_flickr.de").read_text().splitlines()
    outputs: dict = {}
    configs = {
        "beam4_auto": [],  # bf16 and 64000 batch tokens on a GPU
        "beam4_fp32": ["--dtype", "fp32"],
        "beam4_bt8000": ["--batch-tokens", 8000],  # the CPU's default
        "beam4_bt32000": ["--batch-tokens", 32000],
        "beam4_bt64000": ["--batch-tokens", 64000],
        "beam4_best_ends": ["--stop", "best-ends"],
        "greedy_auto": ["--beam", 1],
        "greedy_bt64000": ["--beam", 1, "--batch-tokens", 64000],
    }
    for name, options in configs.items():
        if time_left(args) < 30:
            found[name] = "skipped: out of time"
            continue
        lines, summary = decode(work, name, model, source, args.device, *options)
        outputs[name] = lines
        found[name] = {**summary, "lines": len(lines),
                       "bleu": bleu(lines, references) if len(lines) == len(references)
                       else None}
        log(f"       {name}: {found[name]}")
        save_progress()
    cpu_source = b"".join(source.splitlines(keepends=True)[:200])
    cpu_lines, found["cpu_fp32_200"] = decode(work, "cpu", model, cpu_source, "cpu", "--dtype",
                                              "fp32", timeout=max(60, time_left(args)))
    agreement: dict = {"of_cpu": len(cpu_lines)}
    if "beam4_fp32" in outputs:
        agreement["device_fp32_vs_cpu_fp32_identical"] = same_lines(outputs["beam4_fp32"],
                                                                    cpu_lines)
    if "beam4_fp32" in outputs and "beam4_auto" in outputs:
        agreement["device_auto_vs_device_fp32_identical"] = same_lines(outputs["beam4_auto"],
                                                                       outputs["beam4_fp32"])
        agreement["auto_minus_fp32_bleu"] = round((found["beam4_auto"]["bleu"] or 0)
                                                  - (found["beam4_fp32"]["bleu"] or 0), 2)
    for size in ("beam4_bt32000", "beam4_bt64000"):  # against 8000 (N15), each a batch size
        if size in outputs and "beam4_bt8000" in outputs:
            agreement[f"{size}_vs_beam4_bt8000_identical"] = same_lines(outputs[size],
                                                                        outputs["beam4_bt8000"])
    agreement["of"] = len(references)
    found["agreement"] = agreement
    if args.device == "cuda" and time_left(args) > 60:
        found["search_syncs"] = search_syncs(work, model, cpu_source)
    found["f3_probe"] = f3_probe(args.device)
    auto = found.get("beam4_auto", {}) if isinstance(found.get("beam4_auto"), dict) else {}
    found["summary"] = (
        f"beam 4 {'bf16' if args.device == 'cuda' else 'auto'}: BLEU {auto.get('bleu')}, "
        f"{auto.get('sentences_per_s', 0):.0f} sent/s; greedy "
        f"{(found.get('greedy_auto') or {}).get('sentences_per_s', 0):.0f} sent/s; agreement "
        f"{agreement}; syncs/step {(found.get('search_syncs') or {}).get('per_step')}; F3 "
        f"{found['f3_probe']}")
    exits = [result.get("exit") for result in found.values() if isinstance(result, dict)]
    if any(exits) or found["f3_probe"].startswith("crash"):
        found["status"] = "FAIL"


def search_syncs(work: Path, model: Path, source: bytes) -> dict:
    """Host-device syncs per search step: 200 lines at beam 4, bf16, from the third step on."""
    _, report = run_attn(work, "search-syncs", "decode", "-m", model, "--device", "cuda",
                         input=source, env={"ATTN_SMOKE_SEARCH_SYNCS": "1"}, check=False,
                         timeout=300)
    counted = [sync for sync in report.get("syncs", []) if sync["step"] >= 3]
    where: dict = {}
    for sync in counted:
        where[sync["where"]] = where.get(sync["where"], 0) + 1
    steps = max(1, report.get("steps", 0) - 2)
    return {"per_step": round(len(counted) / steps, 2), "steps": steps, "where": where,
            "peak_gib": report.get("peak_gib")}


def f3_probe(device: str) -> str:
    """bf16 decoding past the position table (review F3): a model whose table holds 8
    positions, converted to bf16, searched to 20 positions."""
    import torch

    from attn_cli.config import PRESETS
    from attn_cli.model import Transformer
    from attn_cli.search import beam_search

    config = PRESETS["tiny"].model_config(64, max_positions=8)
    torch.manual_seed(0)
    model = Transformer(config).to(device, torch.bfloat16).eval()
    src = torch.tensor([[5, 6, 7, config.eos_id]], device=device)
    try:
        hypotheses = beam_search(model, src, beam=2, max_len_a=0.0, max_len_b=20)
        return f"ok ({len(hypotheses[0][0].tokens)} tokens)"
    except RuntimeError as error:
        return f"crash: {str(error).splitlines()[0][:100]}"


# ---------------------------------------------------------------------------------- stage 8


def stage_score_parse(args, work: Path, found: dict) -> None:
    """`score -m` on the device against the CPU; a toy parser trained on the device, parsed
    with --constrain at two batch sizes and on the CPU."""
    need_device(args)
    data = need_data(work)
    model = trained_model(work)
    per_device = {}
    for device in dict.fromkeys((args.device, "cpu")):
        completed, report = run_attn(work, f"score-{device}", "score", "-m", model,
                                     data / "val.en", data / "val.de", "--device", device,
                                     timeout=max(60, time_left(args)))
        per_device[device] = ([float(line.split("\t")[0]) for line in
                               completed.stdout.decode().splitlines()],
                              report.get("peak_gib"), completed.seconds)
    device, cpu = per_device[args.device][0], per_device["cpu"][0]
    found["score"] = {"max_abs_logprob_diff": max(abs(a - b) for a, b in zip(device, cpu)),
                      "mean_abs_logprob_diff": sum(abs(a - b) for a, b in zip(device, cpu))
                      / len(device), "device_peak_gib": per_device[args.device][1],
                      "device_s": per_device[args.device][2], "cpu_s": per_device["cpu"][2]}
    save_progress("stage 8: the toy parser")
    if time_left(args) > 60:
        found["parse"] = toy_parse(work, args.device)
    parse = found.get("parse", {})
    found["summary"] = (f"score -m on {args.device} vs CPU fp32: max |Δ log p| "
                        f"{found['score']['max_abs_logprob_diff']:.2e}; parse: "
                        f"{parse.get('summary', 'skipped: out of time')}")
    if parse and not parse.get("ok", True):
        found["status"] = "FAIL"


def toy_parse(work: Path, device: str) -> dict:
    """tests/toys.py's word parser, trained on the device, parsed with --constrain at beam 21
    on the device at two batch sizes and on the CPU."""
    from tests.toys import toy_parser_commands

    directory = work / "parser"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    trained = None
    for command in toy_parser_commands(directory, "words", 400, device):
        completed = run(attn_command(*command))
        if command[0] == "train":
            trained = completed
    sentences = (directory / "dev.src").read_bytes()
    trees = {}
    for name, options in (("device_8000", ["--device", device]),
                          ("device_64000", ["--device", device, "--batch-tokens", 64000]),
                          ("cpu", ["--device", "cpu"])):
        completed = run(attn_command("parse", "-m", directory / "parser.st", "--constrain",
                                     *options), input=sentences, timeout=300, check=False)
        trees[name] = completed.stdout.decode().splitlines()
    scored = run(attn_command("score", "--trees", "--ref", directory / "dev.mrg", "--format",
                              "json"), input="\n".join(trees["device_8000"]).encode() + b"\n",
                 timeout=120, check=False)
    f1 = json.loads(scored.stdout.decode())["all"]["f1"] if scored.returncode == 0 else None
    same = {name: sum(a == b for a, b in zip(lines, trees["cpu"]))
            for name, lines in trees.items() if name != "cpu"}
    lines = len(sentences.splitlines())
    ok = all(len(found) == lines for found in trees.values())
    return {"train_s": trained.seconds, "f1": f1, "identical_to_cpu": same, "lines": lines,
            "ok": ok, "summary": f"toy word parser trained on {device} ({trained.seconds:.0f}s), "
            f"dev F1 {f1}, trees equal to the CPU's: {same} of {lines}"}
