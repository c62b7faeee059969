"""`attn decode` (decode/pipe.py): one line out per line in, in order, as soon as ready, through
the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..conftest import assert_clean_error, run_attn


def test_decode_keeps_one_line_per_line_in_order(trained, corpus):
    model, _ = trained
    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:6]
    lines.insert(2, "")
    lines.insert(5, "   ")
    lines.append("word " * 3000)  # longer than the model takes: truncated, not dropped
    stdin = "\n".join(lines) + "\n"
    result = run_attn("decode", "-m", model, "--beam", "2", "--max-len-b", "5", "--dtype", "fp32",
                      stdin=stdin)
    assert result.returncode == 0, result.stderr
    out = result.stdout.split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines)
    assert out[2] == "" and out[5] == ""
    assert "truncated" in result.stderr
    assert "sentences/s" in result.stderr.splitlines()[-1]
    # Each line translates as it would alone: order kept, batching invisible.
    alone = run_attn("decode", "-m", model, "--beam", "2", "--max-len-b", "5", "--dtype", "fp32",
                     stdin=lines[3] + "\n")
    assert alone.stdout == out[3] + "\n"


@pytest.mark.slow
def test_decode_batches_searched_side_by_side_change_nothing(trained, corpus):
    """Worker threads searching several batches at once (small batches: many of them) give
    the output of one batch at a time, and of one line at a time."""
    model, _ = trained
    stdin = corpus["val.en"].read_text(encoding="utf-8")
    common = ["decode", "-m", model, "--beam", "3", "--max-len-b", "6", "--dtype", "fp32"]
    parallel = run_attn(*common, "--workers", "3", "--threads", "3", "--batch-tokens", "60",
                        stdin=stdin)
    serial = run_attn(*common, "--workers", "1", stdin=stdin)
    alone = run_attn(*common, "--buffer-size", "1", stdin=stdin)
    assert parallel.returncode == serial.returncode == alone.returncode == 0, parallel.stderr
    assert parallel.stdout.count("\n") == stdin.count("\n")
    assert parallel.stdout == serial.stdout == alone.stdout


@pytest.mark.slow
def test_decode_stop_rule_option(trained, corpus):
    model, _ = trained
    stdin = corpus["val.en"].read_text(encoding="utf-8")
    common = ["decode", "-m", model, "--beam", "3", "--max-len-b", "6", "--dtype", "fp32"]
    for rule in ("best-ends", "patience"):
        quick = run_attn(*common, "--stop", rule, stdin=stdin)
        assert quick.returncode == 0, quick.stderr
        assert quick.stdout.count("\n") == stdin.count("\n")
        alone = run_attn(*common, "--stop", rule, "--buffer-size", "1", stdin=stdin)
        assert alone.stdout == quick.stdout  # a per-sentence rule: batching changes nothing
    assert_clean_error(run_attn(*common, "--stop", "soon", stdin=stdin), "--stop", "'soon'")


@pytest.mark.slow
def test_decode_sample_option(trained, corpus):
    model, _ = trained
    stdin = "\n".join(corpus["val.en"].read_text(encoding="utf-8").splitlines()[:20]) + "\n"
    common = ["decode", "-m", model, "--max-len-b", "6", "--dtype", "fp32", "--sample"]
    first = run_attn(*common, "--seed", "5", "--topp", "0.95", stdin=stdin)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("\n") == 20
    again = run_attn(*common, "--seed", "5", "--topp", "0.95", "--buffer-size", "1",
                     stdin=stdin)
    assert again.stdout == first.stdout  # same seed, other batches: same output
    other = run_attn(*common, "--seed", "6", "--topp", "0.95", stdin=stdin)
    assert other.stdout != first.stdout
    top1 = run_attn(*common, "--topk", "1", stdin=stdin)
    greedy = run_attn("decode", "-m", model, "--max-len-b", "6", "--dtype", "fp32", "--beam",
                      "1", stdin=stdin)
    assert top1.stdout == greedy.stdout
    assert_clean_error(run_attn(*common, "--nbest", "2", stdin=stdin), "--nbest", "--sample")
    assert_clean_error(run_attn("decode", "-m", model, "--topk", "5", stdin=stdin), "--sample")
    assert_clean_error(run_attn(*common, "--topp", "0", stdin=stdin), "--topp must be above 0")
    assert_clean_error(run_attn(*common, "--temperature", "0", stdin=stdin),
                       "--temperature must be at least 0.001")
    for beyond in ("inf", "100000"):  # the search's work bound: Typer's, before anything loads
        assert_clean_error(run_attn(*common, "--max-len-a", beyond, stdin=stdin),
                           "--max-len-a", "less than or equal to 10")


def test_decode_nbest_format(trained):
    model, _ = trained
    result = run_attn("decode", "-m", model, "--nbest", "3", "--beam", "4", "--max-len-b", "4",
                      stdin="a man\n\na dog\n")
    assert result.returncode == 0, result.stderr
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert len(rows) == 9 and all(len(row) == 3 for row in rows)
    assert [row[0] for row in rows] == ["0"] * 3 + ["1"] * 3 + ["2"] * 3
    scores = [float(row[1]) for row in rows[:3]]
    assert scores == sorted(scores, reverse=True)


def test_decode_streams_before_stdin_ends(trained):
    model, _ = trained
    process = subprocess.Popen([sys.executable, "-m", "attn_cli", "decode", "-m", str(model),
                                "--max-len-b", "4"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    process.stdin.write(b"a man is walking\n")
    process.stdin.flush()
    first = process.stdout.readline()  # arrives while stdin is still open
    process.stdin.write(b"two dogs\n")
    process.stdin.close()
    rest = process.stdout.read()
    assert process.wait(timeout=60) == 0
    assert first.endswith(b"\n") and rest.count(b"\n") == 1


def test_decode_closed_stdout_ends_quietly(trained):
    model, _ = trained
    command = (f"yes 'a man on a bike' | head -n 400 | {sys.executable} -m attn_cli decode "
               f"-m {model} --max-len-b 3 --buffer-size 10 | head -n 1")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.count("\n") == 1
    assert "Traceback" not in result.stderr and "Broken pipe" not in result.stderr


def test_decode_bad_inputs(trained, tmp_path):
    model, _ = trained
    assert_clean_error(run_attn("decode", "-m", tmp_path / "none.st", stdin="x\n"),
                       "does not exist")
    broken = tmp_path / "broken.st"
    broken.write_bytes(model.read_bytes()[:1000])
    assert_clean_error(run_attn("decode", "-m", broken, stdin="x\n"), str(broken))
    assert_clean_error(run_attn("decode", "-m", model, "-i", tmp_path / "none.txt"),
                       "none.txt", "does not exist")


def test_decode_stats_json_writes_the_summary(trained, corpus, tmp_path):
    """--stats-json: the summary as one JSON object. Its output tokens are the pieces written
    (--raw) and an EOS per sentence; empty lines are no sentences."""
    model, _ = trained
    lines = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:5]
    lines.insert(2, "")
    stats_path = tmp_path / "stats.json"
    result = run_attn("decode", "-m", model, "--beam", "2", "--max-len-b", "5", "--dtype", "fp32",
                      "--raw", "--stats-json", stats_path, stdin="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    text = stats_path.read_text(encoding="utf-8")
    assert text.count("\n") == 1 and text.endswith("\n")  # one object, one line
    stats = json.loads(text)
    outputs = result.stdout.split("\n")[:-1]
    assert len(outputs) == len(lines)
    assert stats["sentences"] == 5
    assert stats["output_tokens"] == sum(len(output.split()) + 1
                                         for line, output in zip(lines, outputs) if line)
    assert stats["seconds"] > 0 and stats["load_seconds"] > 0
    assert stats["truncated"] == stats["replaced"] == 0
