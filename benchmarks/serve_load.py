"""`attn serve` under load, against the peer users deploy (LibreTranslate) and against its own
search with no server at all.

On the Multi30k test set (1000 lines, bundled), two workloads: `sentences` (each test line one
request) and `paragraphs` (three consecutive test lines joined with a space, one request each:
the server cuts them). Every server gets the same requests through the same API, LibreTranslate's
`POST /translate` {q, source, target} → {translatedText}, from the same closed-loop clients
(tests/serve/client.py: N keep-alive connections in this process, each sending the next text as
soon as its answer is back). The servers (`--servers`):

- `attn`, `attn-int8`: `attn serve -m MODEL` (its defaults: one search worker per core, requests
  arriving together searched in shared batches; no line cache) and with `--int8`;
- `libretranslate`, `libretranslate-int8`: LibreTranslate itself serving the same model, exported
  with `attn export ct2` and packaged for Argos Translate (benchmarks/libretranslate_peer.py), with
  its default threads (one CTranslate2 replica on every core) and ARGOS_COMPUTE_TYPE=int8 for the
  second (at 16 clients only: it answers ~15 sentences/s on a 2-core VM whatever the load);
- `libretranslate-2x1`, `libretranslate-2x1-int8`: the same with ARGOS_INTER_THREADS=2,
  ARGOS_INTRA_THREADS=1 (two replicas of one thread: what a deployment on 2 cores would set);
- `ct2`, `ct2-int8`: the stand-in that does what LibreTranslate does inside, with attn's sentence
  splitter and search settings (benchmarks/ct2_server.py: each request's sentences one
  CTranslate2 `translate_batch`, no batching across requests, 2 replicas × 1 thread): the
  like-for-like reference, which runs where LibreTranslate does not;
- `attn-1x2`: `attn serve --workers 1 --threads 2` (one batch at a time on both cores), at 16
  clients only.

For each server, workload and 1, 4, 16, 64 clients: sentences/s (test lines answered per second),
p50/p99 latency of a request, the server's CPU use (its CPU seconds per second: "cores") and the
clients' (this process's, on the same cores), the load average, and how many answers equal
`attn decode --split-sentences`'s line for the same text, byte for byte (the float32 CLI; int8
rows also against `attn decode --int8 --split-sentences`).
Ratios: to the peer (LibreTranslate in its faster thread layout at that level, else the stand-in;
the same precision), to the stand-in, and to the bound: attn's search in this process with no HTTP
at the same number of sentences in flight (16 clients: 16 sentences, or 48 of paragraphs; 64:
64 or 192), the test sentences searched in batches of that many in arrival order, by 1 worker ×
2 threads and by 2 workers × 1 thread (batches of half as many, side by side); the better is the
bound. `--rounds R` runs every server (and the bound) R times in turn, interleaved; figures are
the medians. Targets (issue 41): attn at 16 clients >= 1.5x the peer's sentences/s; attn >= 0.9x
the bound at 16 and 64 clients.

The checks of issue 28 stay: the ratio to the CLI's sentences/s on the whole file, one short
sentence alone (`/v1/translate`, the server idle) against its search alone in this process
(target: <= 50 ms of server), and with `--soak N`, N more `/v1/translate` requests from 64
clients (none lost, resident memory before and after).

    python -m benchmarks.serve_load -m model.st                  # everything: ~30 min on 2 cores
    python -m benchmarks.serve_load -m model.st --quick          # 400 lines, 1 round: ~6 min
    python -m benchmarks.serve_load -m model.st --servers attn --clients 16 --soak 10000

Report on stderr (with the CPU model and ISA, and the load average beside every figure), one JSON
object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks._harness import attn_command, decode_stats, log, read_bundled
from benchmarks.libretranslate_peer import LT_PYTHON
from tests.serve.client import request, run_clients, run_libre_clients, running_server

RATIO_TARGET = 0.8  # server sentences/s at 16 clients / CLI sentences/s on the whole file
OVERHEAD_TARGET_MS = 50.0  # one short sentence: latency - its search time
PEER_TARGET = 1.5  # attn / the peer, sentences/s at 16 clients
BOUND_TARGET = 0.9  # attn / its search in-process at the same sentences in flight
SHORT = "A man is riding a bike."
PARAGRAPH = 3  # test lines per paragraph
SERVERS = ("attn", "attn-int8", "libretranslate", "libretranslate-int8", "libretranslate-2x1",
           "libretranslate-2x1-int8", "ct2", "ct2-int8", "attn-1x2")
# Run at 16 clients only: a variant, and LibreTranslate's int8 with its default threads (one
# CTranslate2 replica on every core), which on a 2-core VM answers ~15 sentences/s at any load.
ONLY_16 = ("attn-1x2", "libretranslate-int8")
BOUND_LAYOUTS = ((1, 2), (2, 1))  # (workers, torch threads each)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def load_average() -> float:
    return os.getloadavg()[0]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its finished children (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------ measuring


def cli_reference(model: str, source: str, beam: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        stats_path = Path(scratch) / "stats.json"
        result = subprocess.run([*attn_command(), "decode", "-m", model, "--beam", str(beam),
                                 *extra, "--stats-json", str(stats_path)],
                                input=source.encode(), capture_output=True, check=True)
        stats = decode_stats(stats_path, result.stderr.decode())
    return {"outputs": result.stdout.decode().split("\n")[:-1],
            "sentences_per_s": stats["sentences"] / stats["seconds"], "seconds": stats["seconds"]}


def search_time_alone(model: str, beam: int, sentence: str, repeats: int = 20) -> float:
    """Median seconds of one sentence's search alone, in this process, one torch thread (a
    server worker's), the model loaded and warmed up as the server does."""
    import torch

    from attn_cli.decode.translator import load_translator

    translator = load_translator(model, beam, threads=1)
    torch.set_num_threads(1)
    ids = translator.encode([sentence], 1)
    translator.search(ids)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        translator.detokenize(translator.search(translator.encode([sentence], 1))[0])
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def inprocess_bound(translator, sentences: list[str], in_flight: int, workers: int,
                    threads: int) -> float:
    """Sentences/s of `translator`'s search over `sentences` taken in arrival order, `in_flight`
    at a time: `workers` batches of in_flight / workers side by side, `threads` torch threads
    each; encoding and detokenizing counted, as a server's worker does them."""
    import torch

    size = max(1, in_flight // workers)
    batches = [sentences[i:i + size] for i in range(0, len(sentences), size)]

    def search(batch: list[str]) -> list[str]:
        hypotheses = translator.search(translator.encode(batch, 1))
        return translator.detokenize([found[0] for found in hypotheses])

    with ThreadPoolExecutor(workers, initializer=lambda: torch.set_num_threads(threads)) as pool:
        list(pool.map(search, batches[:workers]))  # warm: the threads' first batches
        started = time.perf_counter()
        list(pool.map(search, batches))
        seconds = time.perf_counter() - started
    return len(sentences) / seconds


def bounds(model: str, beam: int, int8: bool, workloads: dict, levels: list[int],
           lines: int) -> dict:
    """{workload: {clients: {"layouts": {"WxT": sentences/s}, "best_layout", "sentences_per_s":
    the best's, as test lines/s (of `lines`), ...}}} for each number of clients in `levels`."""
    import torch

    from attn_cli.decode.sentences import split_texts
    from attn_cli.decode.translator import load_translator

    found: dict = {}
    translator = load_translator(model, beam, threads=2, workers=1, int8=int8)
    threads_before = torch.get_num_threads()
    for name, texts in workloads.items():
        sentences = split_texts(texts, "en").sentences
        per_request = len(sentences) / len(texts)
        for clients in levels:
            in_flight = round(clients * per_request)
            rates = {f"{w}x{t}": inprocess_bound(translator, sentences, in_flight, w, t)
                     for w, t in BOUND_LAYOUTS}
            best = max(rates, key=rates.get)
            found.setdefault(name, {})[clients] = {
                "in_flight": in_flight, "layouts": rates, "best_layout": best,
                "sentences_per_s": rates[best] * lines / len(sentences),
                "load": load_average()}
    torch.set_num_threads(threads_before)
    return found


def server_command(name: str, model: str, beam: int, workdir: Path, lt_python: Path,
                   extra: list[str]) -> list[str]:
    if name.startswith("attn"):
        # No translation cache: each level sends the same lines, which it would answer
        # unsearched (--extra "--cache-lines N" measures it).
        options = {"attn": [], "attn-int8": ["--int8"],
                   "attn-1x2": ["--workers", "1", "--threads", "2"]}[name]
        return [*attn_command(), "serve", "-m", model, "--port", "0", "--beam", str(beam),
                "--cache-lines", "0", *options, *extra]
    if name.startswith("libretranslate"):
        from benchmarks.libretranslate_peer import prepare

        inter, intra = (2, 1) if "-2x1" in name else (1, 0)  # else LibreTranslate's defaults
        return prepare(model, workdir / "libretranslate", lt_python,
                       "int8" if name.endswith("int8") else "auto", inter, intra, beam)
    ct2_dir = workdir / "ct2"
    if not ct2_dir.exists():
        from attn_cli.interop.ct2 import export_ct2

        export_ct2(model, ct2_dir, "float32")
    return [sys.executable, "-m", "benchmarks.ct2_server", str(ct2_dir), "--beam", str(beam),
            "--compute-type", "int8" if name.endswith("int8") else "float32"]


def load_levels(server, name: str, workloads: dict, clients_levels: list[int],
                references: dict) -> list:
    """Every workload at every number of clients, against a server that is ready."""
    levels = []
    for workload, texts in workloads.items():
        lines = references["lines"]  # test lines, whichever way they are sent
        for clients in clients_levels:
            warm = asyncio.run(run_libre_clients(server.host, server.port,
                                                 texts[:max(clients, 8)], clients))
            if warm["statuses"] != {200: len(warm["outputs"])}:
                raise RuntimeError(f"warm-up answers: {warm['statuses']}\n"
                                   + "\n".join(server.log[-10:]))
            load_before, cpu_before = load_average(), cpu_seconds(server.process.pid)
            client_before = time.process_time()
            run = asyncio.run(run_libre_clients(server.host, server.port, texts, clients))
            cpu = cpu_seconds(server.process.pid) - cpu_before
            client_cpu = time.process_time() - client_before
            level = {"server": name, "workload": workload, "clients": clients,
                     "sentences_per_s": lines / run["seconds"], "seconds": run["seconds"],
                     "p50_ms": 1000 * percentile(run["latencies"], 0.5),
                     "p99_ms": 1000 * percentile(run["latencies"], 0.99),
                     "statuses": run["statuses"], "load": [load_before, load_average()],
                     # CPU seconds per second of the server, and of the clients (this
                     # process, on the same cores)
                     "server_cores": cpu / run["seconds"],
                     "client_cores": client_cpu / run["seconds"]}
            for key, expected in references[workload].items():
                level[f"identical_{key}"] = sum(a == b for a, b in zip(run["outputs"], expected))
            levels.append(level)
    return levels


def one_sentence(server, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        asyncio.run(request(server.host, server.port, "POST", "/v1/translate",
                            {"text": [SHORT]}))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def soak(server, lines: list[str], requests: int) -> dict:
    before = server.resident_mib()
    soak_lines = [lines[i % len(lines)] for i in range(requests)]
    run = asyncio.run(run_clients(server.host, server.port, soak_lines, 64))
    after = server.resident_mib()
    answered = run["statuses"].get(200, 0)
    log(f"soak: {answered}/{requests} answered 200 by 64 clients in {run['seconds']:.1f}s; "
        f"server memory {before:.0f} MiB before, {after:.0f} MiB after")
    return {"requests": requests, "answered": answered, "statuses": run["statuses"],
            "rss_before_mib": before, "rss_after_mib": after, "seconds": run["seconds"]}


# -------------------------------------------------------------------------------------- report


def median_level(runs: list[dict]) -> dict:
    """One level's figures over the rounds: medians, each round's sentences/s listed."""
    middle = dict(runs[0])
    for key in ("sentences_per_s", "p50_ms", "p99_ms", "server_cores", "client_cores"):
        middle[key] = statistics.median(run[key] for run in runs)
    middle["rounds"] = [round(run["sentences_per_s"], 1) for run in runs]
    middle["load"] = [round(value, 2) for run in runs for value in run["load"]]
    for key in [key for key in middle if key.startswith("identical_")]:
        middle[key] = min(run[key] for run in runs)
    return middle


def report(table: dict, bound: dict, lines: int, cli_rate: float | None, refs: dict) -> None:
    """The table on stderr, ratios filled into `table`'s levels (`refs`: the CLI's outputs)."""
    # The peer: LibreTranslate in whichever thread layout is faster at that level, else the
    # stand-in; the same precision.
    peers = {"fp32": ("libretranslate", "libretranslate-2x1"),
             "int8": ("libretranslate-int8", "libretranslate-2x1-int8")}
    standin = {"fp32": "ct2", "int8": "ct2-int8"}

    def find(name: str | None, workload: str, clients: int) -> dict | None:
        return next((level for level in table.get(name, [])
                     if level["workload"] == workload and level["clients"] == clients), None)

    for workload in dict.fromkeys(level["workload"] for levels in table.values()
                                  for level in levels):
        log(f"\n{workload} ({lines} test lines), LibreTranslate's POST /translate:")
        texts = len(next(iter(refs[workload].values())))
        log(f"{'server':<23} {'clients':>7} {'sent/s':>7} {'x peer':>6} {'x ct2':>6} "
            f"{'x bound':>7} {'p50 ms':>7} {'p99 ms':>7} {'=decode':>8} {'=int8':>8} {'cores':>5} "
            f"{'client':>6}  load")
        for name, levels in table.items():
            precision = "int8" if name.endswith("int8") else "fp32"
            for level in (x for x in levels if x["workload"] == workload):
                clients, rate = level["clients"], level["sentences_per_s"]
                found = [x for x in (find(other, workload, clients)
                                     for other in peers[precision]) if x] \
                    or [x for x in [find(standin[precision], workload, clients)] if x]
                best = max(found, key=lambda x: x["sentences_per_s"], default=None)
                level["peer"] = best and best["server"]
                level["ratio_to_peer"] = rate / best["sentences_per_s"] if best else None
                found = find(standin[precision], workload, clients)
                level["ratio_to_ct2"] = rate / found["sentences_per_s"] if found else None
                limit = bound.get(precision, {}).get(workload, {}).get(clients)
                level["ratio_to_bound"] = rate / limit["sentences_per_s"] if limit else None
                if cli_rate and workload == "sentences" and name == "attn":
                    level["ratio_to_cli"] = rate / cli_rate
                same = [f"{level[key]}/{texts}" if key in level else "-"
                        for key in ("identical_decode", "identical_decode_int8")]
                log(f"{name:<23} {clients:>7} {rate:>7.1f} {_x(level['ratio_to_peer']):>6} "
                    f"{_x(level['ratio_to_ct2']):>6} {_x(level['ratio_to_bound']):>7} "
                    f"{level['p50_ms']:>7.1f} {level['p99_ms']:>7.1f} {same[0]:>8} "
                    f"{same[1] if precision == 'int8' else '':>8} "
                    f"{level['server_cores']:>5.2f} {level['client_cores']:>6.2f}  "
                    f"{','.join(f'{v:.1f}' for v in level['load'])}")
    for precision, by_workload in bound.items():
        for workload, by_clients in by_workload.items():
            for clients, limit in by_clients.items():
                layouts = ", ".join(f"{layout} {rate:.1f}"
                                    for layout, rate in limit["layouts"].items())
                log(f"bound {precision} {workload} {clients} clients ({limit['in_flight']} "
                    f"sentences in flight): {limit['sentences_per_s']:.1f} lines/s "
                    f"(rounds {limit.get('rounds')}; the last round's workers x threads: "
                    f"{layouts} sentences/s; load {limit['load']:.1f})")
    for name in ("attn", "attn-int8"):
        for workload in ("sentences", "paragraphs"):
            at16 = find(name, workload, 16)
            if at16 and at16.get("ratio_to_peer") is not None:
                log(f"{name} {workload}, 16 clients: {at16['ratio_to_peer']:.2f}x "
                    f"{at16['peer']} (target >= {PEER_TARGET})")
            for clients in (16, 64):
                level = find(name, workload, clients)
                if level and level.get("ratio_to_bound") is not None:
                    log(f"{name} {workload}, {clients} clients: {level['ratio_to_bound']:.2f}x "
                        f"the in-process bound (target >= {BOUND_TARGET})")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    from benchmarks.machine import cpu_info

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--lines", type=int, default=0, help="first N test lines (0: all)")
    parser.add_argument("--servers", default=",".join(SERVERS), help="of " + ", ".join(SERVERS))
    parser.add_argument("--workloads", default="sentences,paragraphs")
    parser.add_argument("--rounds", type=int, default=None,
                        help="times every server runs, interleaved (medians reported; "
                        "default 2, with --quick 1)")
    parser.add_argument("--no-bound", action="store_true", help="skip the in-process bound")
    parser.add_argument("--quick", action="store_true",
                        help="400 lines, 1 round (unless --lines or --rounds say otherwise)")
    parser.add_argument("--lt-python", type=Path, default=LT_PYTHON,
                        help="the Python of LibreTranslate's environment (default: $LT_PYTHON)")
    parser.add_argument("--soak", type=int, default=0,
                        help="also send this many requests from 64 clients (memory, losses)")
    parser.add_argument("--extra", default="", help="more `attn serve` options")
    parser.add_argument("--server-log", type=Path, help="write attn serve's stderr here")
    args = parser.parse_args()
    if args.quick:
        args.lines = args.lines or 400
    args.rounds = args.rounds or (1 if args.quick else 2)

    model_name, isa = cpu_info()
    cpu = {"model": model_name, "isa": isa, "cores": os.cpu_count()}
    log(f"CPU: {model_name} ({isa}), {os.cpu_count()} cores; load {load_average():.2f}")
    source = read_bundled("test_2016_flickr.en.gz")
    lines = source.split("\n")[:-1]
    if args.lines:
        lines = lines[:args.lines]
        source = "\n".join(lines) + "\n"
    paragraphs = [" ".join(lines[i:i + PARAGRAPH]) for i in range(0, len(lines), PARAGRAPH)]
    workloads = {name: {"sentences": lines, "paragraphs": paragraphs}[name]
                 for name in args.workloads.split(",")}
    servers = args.servers.split(",")
    unknown = set(servers) - set(SERVERS)
    if unknown:
        parser.error(f"--servers: no {', '.join(sorted(unknown))} (of {', '.join(SERVERS)})")
    if args.lt_python is None or not args.lt_python.exists():
        log(f"no LibreTranslate at {args.lt_python} (--lt-python, $LT_PYTHON): its rows are "
            "skipped")
        servers = [name for name in servers if not name.startswith("libretranslate")]
    clients_levels = [int(c) for c in args.clients.split(",")]

    # The references: the CLI on the whole file (issue 28's ratio), and each workload's texts
    # through `attn decode --split-sentences` (what /translate answers), float32 and int8.
    plain = cli_reference(args.model, source, args.beam, [])
    log(f"attn decode, whole file, beam {args.beam}: {plain['sentences_per_s']:.1f} "
        f"sentences/s ({len(lines)} lines in {plain['seconds']:.2f}s, model load excluded); "
        f"load {load_average():.2f}")
    references: dict = {"lines": len(lines)}
    for workload, texts in workloads.items():
        text = "".join(t + "\n" for t in texts)
        references[workload] = {"decode": cli_reference(args.model, text, args.beam,
                                                        ["--split-sentences"])["outputs"]}
        if any(name.endswith("int8") for name in servers):
            references[workload]["decode_int8"] = cli_reference(
                args.model, text, args.beam, ["--split-sentences", "--int8"])["outputs"]
    result = {"cpu": cpu, "model": args.model, "beam": args.beam, "lines": len(lines),
              "paragraph_lines": PARAGRAPH, "cli_sentences_per_s": plain["sentences_per_s"],
              "servers": {}, "bound": {}}
    runs: dict = {name: [] for name in servers}
    bound_runs: dict = {}
    with tempfile.TemporaryDirectory(prefix="serve-load-") as scratch:
        workdir = Path(scratch)
        for round_ in range(args.rounds):
            for name in servers:
                command = server_command(name, args.model, args.beam, workdir, args.lt_python,
                                         args.extra.split() if name.startswith("attn") else [])
                levels = [16] if name in ONLY_16 else clients_levels
                with running_server(command) as server:
                    started = time.perf_counter()
                    runs[name].append(load_levels(server, name, workloads, levels, references))
                    log(f"round {round_ + 1}, {name}: "
                        + ", ".join(f"{x['workload'][:4]} {x['clients']}c "
                                    f"{x['sentences_per_s']:.1f}" for x in runs[name][-1])
                        + f" sentences/s ({time.perf_counter() - started:.0f}s, load "
                        f"{load_average():.2f})")
                    if name == "attn" and round_ == args.rounds - 1:
                        result["one_sentence_latency_s"] = one_sentence(server)
                        if args.soak:
                            result["soak"] = soak(server, lines, args.soak)
                        result["exit_status"] = server.stop()
                        if args.server_log:
                            args.server_log.write_text("\n".join(server.log) + "\n")
            if not args.no_bound:
                for precision in dict.fromkeys("int8" if name.endswith("int8") else "fp32"
                                               for name in servers if name.startswith("attn")):
                    bound_runs.setdefault(precision, []).append(
                        bounds(args.model, args.beam, precision == "int8", workloads,
                               [c for c in clients_levels if c in (16, 64)], len(lines)))
                log(f"round {round_ + 1}, bound: " + "; ".join(
                    f"{p} {w[:4]} {c}c {b['sentences_per_s']:.1f}"
                    for p, found in ((p, r[-1]) for p, r in bound_runs.items())
                    for w, by in found.items() for c, b in by.items()))
    for name, rounds in runs.items():
        result["servers"][name] = [median_level([levels[i] for levels in rounds])
                                   for i in range(len(rounds[0]))]
    for precision, rounds in bound_runs.items():
        merged: dict = {}
        for workload in rounds[0]:
            for clients in rounds[0][workload]:
                each = [r[workload][clients] for r in rounds]
                middle = dict(each[-1])
                middle["sentences_per_s"] = statistics.median(b["sentences_per_s"] for b in each)
                middle["rounds"] = [round(b["sentences_per_s"], 1) for b in each]
                merged.setdefault(workload, {})[clients] = middle
        result["bound"][precision] = merged
    report(result["servers"], result["bound"], len(lines), plain["sentences_per_s"], references)

    if "one_sentence_latency_s" in result:
        search = search_time_alone(args.model, args.beam, SHORT)
        answered = result.pop("one_sentence_latency_s")
        result["one_sentence"] = {"latency_ms": 1000 * answered, "search_ms": 1000 * search,
                                  "overhead_ms": 1000 * (answered - search)}
        log(f"one short sentence: {1000 * answered:.1f} ms answered, its search alone "
            f"{1000 * search:.1f} ms: overhead {1000 * (answered - search):.1f} ms "
            f"(target <= {OVERHEAD_TARGET_MS:.0f})")
        at16 = [level for level in result["servers"].get("attn", [])
                if level["workload"] == "sentences" and level["clients"] == 16]
        if at16 and "ratio_to_cli" in at16[0]:
            log(f"16 clients: {at16[0]['ratio_to_cli']:.2f}x the CLI's file throughput "
                f"(target >= {RATIO_TARGET})")
        log(f"attn serve's exit status after SIGTERM: {result['exit_status']}")
    log(f"load average at the end: {load_average():.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
