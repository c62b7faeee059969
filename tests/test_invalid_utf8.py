"""No line is lost to a bad byte: `decode`, `parse` and `score` replace invalid UTF-8 by U+FFFD,
process the line and name it on stderr; `--strict` makes it an error after the lines before it
are written. `vocab` and `binarize` refuse it unless told `--replace-invalid`."""

from __future__ import annotations

import pytest

from attn_cli.data import ParallelData
from attn_cli.errors import AttnError
from attn_cli.files import Utf8Policy

from .conftest import assert_clean_error, run_attn, run_attn_process

# Eight lines, the sixth with "café" in Latin-1 (0xE9 alone is not UTF-8), the third empty.
LINES = [b"a man is riding a bike", b"two dogs play", b"", b"a woman sings", b"a red car",
         b"a caf\xe9 on the street", b"children run in a park", b"the end"]
BAD_STDIN = b"\n".join(LINES) + b"\n"
REPLACED = BAD_STDIN.decode("utf-8", "replace")  # what the sixth line is read as
WARNING = "warning: <stdin>:6: invalid UTF-8 (byte 6 of the line), replaced by U+FFFD"


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: ")]


def assert_error_after_the_lines_before(result, expected_stdout: str, fragment: str) -> None:
    """--strict: exit 2, one error line naming file and line, no traceback, and stdout holding
    exactly the results of the lines before the bad one."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], result.stderr
    assert result.stdout == expected_stdout


# ----------------------------------------------------------------------------------- the policy


def test_policy_replaces_names_the_first_lines_then_counts():
    said = []
    policy = Utf8Policy(strict=False, warn=said.append)
    lines = [policy.decode(b"ok \xff\n", "f.txt", number) for number in range(1, 9)]
    assert lines == ["ok \ufffd"] * 8
    assert said == [f"warning: f.txt:{n}: invalid UTF-8 (byte 4 of the line), replaced by "
                    "U+FFFD" for n in range(1, Utf8Policy.NAMED + 1)]
    policy.finish()
    assert said[-1] == ("warning: f.txt: 8 line(s) with invalid UTF-8 in all, bytes replaced by "
                        "U+FFFD (first at line 1, last at line 8)")
    assert policy.decode(b"fine\r\n", "f.txt", 9) == "fine" and policy.count == 8


def test_few_bad_lines_need_no_count_at_the_end():
    said = []
    policy = Utf8Policy(strict=False, warn=said.append)
    policy.decode(b"\xff", "f.txt", 3)
    policy.finish()
    assert len(said) == 1


def test_strict_policy_names_file_line_and_byte():
    with pytest.raises(AttnError, match=r"^f.txt:4: invalid UTF-8 \(byte 2 of the line\)$"):
        Utf8Policy(strict=True).decode(b"a\xc3(\n", "f.txt", 4)


# ----------------------------------------------------------------------------------- decode


def test_decode_replaces_the_bad_bytes_and_keeps_every_line(trained):
    model, _ = trained
    options = ["decode", "-m", model, "--beam", "2", "--max-len-b", "5"]
    result = run_attn(*options, stdin=BAD_STDIN)
    assert result.returncode == 0, result.stderr
    out = result.stdout.split("\n")
    assert len(out) - 1 == len(LINES) and out[2] == ""
    assert warnings(result.stderr) == [WARNING]
    assert "1 with invalid UTF-8 replaced" in result.stderr.splitlines()[-1]
    # Every line, the repaired one included, translates as its replaced text does.
    assert result.stdout == run_attn(*options, stdin=REPLACED).stdout


def test_decode_strict_writes_the_lines_before_the_bad_one(trained):
    model, _ = trained
    options = ["decode", "-m", model, "--beam", "2", "--max-len-b", "5"]
    before = run_attn(*options, stdin=b"\n".join(LINES[:5]) + b"\n").stdout
    assert before.count("\n") == 5
    for buffer_size in ("2000", "1", "4"):  # the bad line first, alone, or inside a window
        result = run_attn(*options, "--strict", "--buffer-size", buffer_size, stdin=BAD_STDIN)
        assert_error_after_the_lines_before(result, before, "<stdin>:6: invalid UTF-8")


def test_decode_counts_many_bad_lines_at_the_end(trained, tmp_path):
    model, _ = trained
    source = tmp_path / "latin1.txt"
    source.write_bytes(b"".join(b"caf\xe9 %d\n" % n for n in range(12)))
    result = run_attn("decode", "-m", model, "--beam", "1", "--max-len-b", "3", "-i", source)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 12
    said = warnings(result.stderr)
    assert len(said) == Utf8Policy.NAMED + 1 and f"{source}:1:" in said[0]
    assert f"{source}: 12 line(s) with invalid UTF-8 in all" in said[-1]


# ------------------------------------------------------------------------------------ parse


@pytest.mark.slow
def test_parse_replaces_the_bad_bytes_and_keeps_every_line(word_parser):
    model = word_parser / "parser.st"
    result = run_attn("parse", "-m", model, "--beam", "2", stdin=BAD_STDIN)
    assert result.returncode == 0, result.stderr
    trees = result.stdout.split("\n")
    assert len(trees) - 1 == len(LINES) and trees[2] == ""  # empty in, empty out
    assert "caf\ufffd" in trees[5] and all(trees[i].startswith("(TOP") for i in (0, 1, 3, 5, 7))
    assert warnings(result.stderr) == [WARNING]
    strict = run_attn("parse", "-m", model, "--beam", "2", "--strict", stdin=BAD_STDIN)
    assert_error_after_the_lines_before(strict, "\n".join(trees[:5]) + "\n", "<stdin>:6")


# ------------------------------------------------------------------------------------ score


def test_score_replaces_the_bad_bytes_and_scores_every_line(tmp_path):
    hypotheses, references = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hypotheses.write_bytes(BAD_STDIN)
    references.write_bytes(REPLACED.encode("utf-8"))
    result = run_attn("score", "--ref", references, hypotheses, "--sentence-level")
    assert result.returncode == 0, result.stderr
    scores = result.stdout.splitlines()
    assert len(scores) == len(LINES) and float(scores[5]) == 100.0  # the same text once read
    assert warnings(result.stderr) == [WARNING.replace("<stdin>", str(hypotheses))]
    corpus = run_attn("score", "--ref", references, hypotheses)
    assert corpus.returncode == 0 and "= 100.0" in corpus.stdout.splitlines()[0]
    strict = run_attn("score", "--ref", references, hypotheses, "--sentence-level", "--strict")
    assert_error_after_the_lines_before(strict, "\n".join(scores[:5]) + "\n", f"{hypotheses}:6")
    assert_clean_error(run_attn("score", "--ref", references, hypotheses, "--strict"),
                       f"{hypotheses}:6")


def test_force_decoding_replaces_the_bad_bytes(trained, tmp_path):
    model, _ = trained
    sources, targets = tmp_path / "src.txt", tmp_path / "tgt.txt"
    sources.write_bytes(BAD_STDIN)
    targets.write_bytes(b"\n".join(b"ein Satz %d" % n for n in range(len(LINES))) + b"\n")
    result = run_attn("score", "-m", model, sources, targets)
    assert result.returncode == 0, result.stderr
    rows = result.stdout.splitlines()
    assert len(rows) == len(LINES) and len(warnings(result.stderr)) == 1
    strict = run_attn("score", "-m", model, sources, targets, "--strict")
    assert_error_after_the_lines_before(strict, "\n".join(rows[:5]) + "\n", f"{sources}:6")


def test_tree_scoring_counts_a_bad_byte_as_an_error_sentence(tmp_path):
    gold = tmp_path / "gold.mrg"
    gold.write_text("(TOP (S (NP (NN café)) (VP (VBZ opens))))\n"
                    "(TOP (S (NP (NN tea)) (VP (VBZ cools))))\n", encoding="utf-8")
    test = tmp_path / "test.txt"
    test.write_bytes(b"(TOP (S (NP (XX caf\xe9)) (VP (XX opens))))\n"
                     b"(TOP (S (NP (XX tea)) (VP (XX cools))))\n")
    result = run_attn("score", "--trees", "--ref", gold, test, "--sentence-level")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["nan\tnan\tnan", "100.00\t100.00\t100.00"]
    assert f"{test}:1: error sentence" in result.stderr
    strict = run_attn("score", "--trees", "--ref", gold, test, "--strict")
    assert_clean_error(strict, f"{test}:1: invalid UTF-8")


# ------------------------------------------------------------------------ vocab and binarize


def test_training_data_needs_the_option_to_be_repaired(spm_model, tmp_path):
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    src.write_bytes(b"fine\nstill fine\nthird\n")
    tgt.write_bytes(b"gut\nkaputt \xff\xfe hier\ndritte\n")
    assert_clean_error(run_attn("binarize", "--vocab", spm_model, src, tgt, "-o",
                                tmp_path / "o.st"), f"{tgt}:2", "UTF-8")
    repaired = run_attn("binarize", "--vocab", spm_model, src, tgt, "-o", tmp_path / "o.st",
                        "--replace-invalid")
    assert repaired.returncode == 0, repaired.stderr
    assert warnings(repaired.stderr) == [f"warning: {tgt}:2: invalid UTF-8 (byte 8 of the "
                                         "line), replaced by U+FFFD"]
    assert len(ParallelData(tmp_path / "o.st")) == 3
    vocab = run_attn("vocab", tgt, "-o", tmp_path / "v.model", "--size", "20",
                     "--replace-invalid")
    assert vocab.returncode == 0 and len(warnings(vocab.stderr)) == 1, vocab.stderr


def test_a_real_process_reading_a_pipe_keeps_every_line(trained):
    """The same through a real process, whose stdin is read from its file descriptor."""
    model, _ = trained
    options = ["decode", "-m", model, "--beam", "1", "--max-len-b", "3"]
    lenient = run_attn_process(*options, stdin=BAD_STDIN)
    assert lenient.returncode == 0 and lenient.stdout.count("\n") == len(LINES)
    assert warnings(lenient.stderr) == [WARNING]
    strict = run_attn_process(*options, "--strict", stdin=BAD_STDIN)
    assert_error_after_the_lines_before(strict, "".join(lenient.stdout.splitlines(True)[:5]),
                                        "<stdin>:6: invalid UTF-8")
