"""`attn serve` under load: throughput and latency against `attn decode` on the whole file.

On the Multi30k test set (1000 lines, bundled) it:
1. runs `attn decode -m MODEL` on the whole file (the reference: its sentences/s from its own
   summary, model load excluded, and its output);
2. starts `attn serve -m MODEL` on 127.0.0.1 (a free port), and for 1, 4, 16 and 64 concurrent
   clients (keep-alive connections, each sending the test set's lines one request per line, the
   next line as soon as its answer is back) reports sentences/s, p50/p99 latency, the ratio to
   the CLI's sentences/s, and whether every answer equals the CLI's line (byte for byte);
3. times one short sentence alone (the server idle) against that sentence's search time alone in
   this process (`--threads 1`, the server's one worker thread): the server's overhead;
4. with `--soak N`: N more requests from 64 clients, checking that none is lost and reading the
   server's resident memory before and after.

Targets (issue 28): at 16 clients >= 0.8x the CLI's file throughput; one short sentence answered
in <= 50 ms + its search time.

    python -m benchmarks.serve_load -m model.st
    python -m benchmarks.serve_load -m model.st --beam 1 --clients 1,16 --soak 10000

Report on stderr (with the CPU model and ISA), one JSON object on stdout. The clients run in this
process, on the same cores as the server (as a local editor or script would); they and the server
process are tests/serve/client.py's, which the server tests use too.
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
from pathlib import Path

from benchmarks._harness import attn_command, decode_stats, log, read_bundled
from tests.serve.client import request, run_clients, running_server

RATIO_TARGET = 0.8  # server sentences/s at 16 clients / CLI sentences/s on the whole file
OVERHEAD_TARGET_MS = 50.0  # one short sentence: latency - its search time
SHORT = "A man is riding a bike."


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


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

    from attn_cli.translate import load_translator

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


def main() -> None:
    from benchmarks.machine import cpu_info

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--lines", type=int, default=0, help="first N test lines (0: all)")
    parser.add_argument("--soak", type=int, default=0,
                        help="also send this many requests from 64 clients (memory, losses)")
    parser.add_argument("--extra", default="", help="more `attn serve` options")
    parser.add_argument("--server-log", type=Path, help="write the server's stderr here")
    args = parser.parse_args()

    model_name, isa = cpu_info()
    cpu = {"model": model_name, "isa": isa, "cores": os.cpu_count()}
    log(f"CPU: {model_name} ({isa}), {os.cpu_count()} cores")
    source = read_bundled("test_2016_flickr.en.gz")
    lines = source.split("\n")[:-1]
    if args.lines:
        lines = lines[:args.lines]
        source = "\n".join(lines) + "\n"
    reference = cli_reference(args.model, source, args.beam, [])
    log(f"attn decode, whole file, beam {args.beam}: {reference['sentences_per_s']:.1f} "
        f"sentences/s ({len(lines)} lines in {reference['seconds']:.2f}s, model load excluded)")
    result = {"cpu": cpu, "beam": args.beam, "lines": len(lines),
              "cli_sentences_per_s": reference["sentences_per_s"], "levels": []}
    # No translation cache: each level sends the same lines, which it would answer unsearched
    # (--extra "--cache-lines N" measures it).
    command = [*attn_command(), "serve", "-m", args.model, "--port", "0", "--beam",
               str(args.beam), "--cache-lines", "0", *args.extra.split()]
    with running_server(command) as server:
        log(f"{'clients':>7}  {'sent/s':>7}  {'x CLI':>6}  {'p50 ms':>7}  {'p99 ms':>7}  "
            "identical")
        for clients in map(int, args.clients.split(",")):
            asyncio.run(run_clients(server.host, server.port, lines[:clients], clients))  # warm
            run = asyncio.run(run_clients(server.host, server.port, lines, clients))
            rate = len(lines) / run["seconds"]
            same = sum(a == b for a, b in zip(run["outputs"], reference["outputs"]))
            level = {"clients": clients, "sentences_per_s": rate,
                     "ratio_to_cli": rate / reference["sentences_per_s"],
                     "p50_ms": 1000 * percentile(run["latencies"], 0.5),
                     "p99_ms": 1000 * percentile(run["latencies"], 0.99),
                     "identical": same, "statuses": run["statuses"]}
            result["levels"].append(level)
            log(f"{clients:>7}  {rate:>7.1f}  {level['ratio_to_cli']:>6.2f}  "
                f"{level['p50_ms']:>7.1f}  {level['p99_ms']:>7.1f}  {same}/{len(lines)}")
        one = []
        for _ in range(20):
            started = time.perf_counter()
            status, _ = asyncio.run(request(server.host, server.port, "POST", "/v1/translate",
                                            {"text": [SHORT]}))
            one.append(time.perf_counter() - started)
        if args.soak:
            before = server.resident_mib()
            soak_lines = [lines[i % len(lines)] for i in range(args.soak)]
            run = asyncio.run(run_clients(server.host, server.port, soak_lines, 64))
            after = server.resident_mib()
            answered = run["statuses"].get(200, 0)
            result["soak"] = {"requests": args.soak, "answered": answered,
                              "statuses": run["statuses"], "rss_before_mib": before,
                              "rss_after_mib": after, "seconds": run["seconds"]}
            log(f"soak: {answered}/{args.soak} answered 200 by 64 clients in "
                f"{run['seconds']:.1f}s; server memory {before:.0f} MiB before, {after:.0f} "
                "MiB after")
        status = server.stop()
        result["exit_status"] = status
        if args.server_log:
            args.server_log.write_text("\n".join(server.log) + "\n")
    search = search_time_alone(args.model, args.beam, SHORT)
    overhead_ms = 1000 * (statistics.median(one) - search)
    result["one_sentence"] = {"latency_ms": 1000 * statistics.median(one),
                              "search_ms": 1000 * search, "overhead_ms": overhead_ms}
    log(f"one short sentence: {1000 * statistics.median(one):.1f} ms answered, its search "
        f"alone {1000 * search:.1f} ms: overhead {overhead_ms:.1f} ms "
        f"(target <= {OVERHEAD_TARGET_MS:.0f})")
    at16 = [level for level in result["levels"] if level["clients"] == 16]
    if at16:
        log(f"16 clients: {at16[0]['ratio_to_cli']:.2f}x the CLI's file throughput "
            f"(target >= {RATIO_TARGET})")
    log(f"server exit status after SIGTERM: {status}")
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
