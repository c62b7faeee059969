"""checks/gpu_smoke.py, the first run on a GPU, tried where there is none: run as a user runs it
(`python -m checks.gpu_smoke`, from another directory, only the checkout on PYTHONPATH, by a
Python in which attn is not installed), since tests do not import checks/ (test_layout.py).

Its pure parts (the profile's busy time, the WMT-shaped data file) through its hidden
--self-test; the several-GPU stages 5 and 6 on gloo CPU processes with a mocked GPU count."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from .conftest import REPO


def python_without_attn(directory: Path) -> Path:
    """A Python that has this one's packages (torch, typer, ...) but not attn: a fresh venv
    whose one .pth lists this interpreter's site-packages. A directory on a .pth line is added
    to the path without its own .pth files, so an editable install of attn (a .pth there) stays
    out; a regular install would not (then the checkout comes first on PYTHONPATH anyway)."""
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(directory)
    site_packages = [path for path in sys.path if path.endswith("site-packages")]
    python = directory / "bin" / "python"
    found = subprocess.run([python, "-c", "import sysconfig; "
                            "print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                           text=True, check=True).stdout.strip()
    Path(found, "dependencies.pth").write_text("\n".join(site_packages) + "\n")
    return python


def smoke(python: Path, cwd: Path, *args, env: dict | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                   **(env or {})}
    return subprocess.run([str(python), "-m", "checks.gpu_smoke", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=environment, timeout=timeout)


def test_self_test_from_another_directory(tmp_path):
    """The profile's GPU busy time adds kernels alone, overlapping ones once (review N3); the
    WMT-shaped data file reads back with 37,000 pieces and lengths of mean ~28 (N13); each call
    has its stages and --deadline 540."""
    result = smoke(Path(sys.executable), tmp_path, "--self-test")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["self_test"] == "ok"
    assert found["profile"]["gpu_busy_ms"] == 1.0


@pytest.mark.long
def test_several_gpu_stages_on_gloo_with_a_mocked_count(tmp_path):
    """Stages 2, 5 and 6 with --device cpu and ATTN_SMOKE_GPUS=2, attn not installed: 2 gloo
    processes train the weights of 1 (and of a 2-process run resumed on 1), a killed rank ends
    the job with an error line, 3 processes on "2 GPUs" are refused; every child imported this
    checkout's attn_cli (review N2)."""
    python = python_without_attn(tmp_path / "venv")
    installed = subprocess.run([python, "-c", "import attn_cli"], capture_output=True,
                               cwd=tmp_path).returncode == 0
    out = tmp_path / "out"
    result = smoke(python, tmp_path, out, "--work", tmp_path / "work", "--stages", "2,5,6",
                   "--device", "cpu", "--preset", "tiny", "--lines", 400, "--vocab-size", 250,
                   "--ddp-steps", 4, env={"ATTN_SMOKE_GPUS": "2"})
    results = json.loads((out / "results.json").read_text())
    stages = results["stages"]
    failed = {number: stage.get("problems") or stage.get("summary")
              for number, stage in stages.items() if stage.get("status") != "PASS"}
    assert result.returncode == 0, (installed, failed, result.stderr[-1500:])
    assert results["checkout"]["children_import_attn_cli_from"] == str(REPO / "attn_cli")
    assert [stages[n]["status"] for n in ("2", "5", "6")] == ["PASS"] * 3
    assert stages["5"]["weights_max_abs_diff"]["two_vs_one"] <= 1e-5
    assert stages["5"]["weights_max_abs_diff"]["two_then_one_vs_one"] <= 1e-5
    assert stages["6"]["killed_rank"]["ended_in_time"]
    assert any("waiting for the other processes failed" in line
               for line in stages["6"]["killed_rank"]["error_lines"])
    assert stages["6"]["too_many_processes"]["refused"]
    assert "PASS stage 6" in (out / "smoke.log").read_text()


@pytest.mark.long
def test_issue_54s_call_on_a_cpu(tmp_path):
    """Call T with --device cpu --preset tiny: the compiled step's six runs (eager and
    compiled, the one-rank proxy, half and twice the batch) and, where ctranslate2 is
    installed, decoding against it; stage 0 and 11 SKIP without a GPU."""
    out = tmp_path / "out"
    result = smoke(Path(sys.executable), tmp_path, out, "--work", tmp_path / "work", "--call",
                   "T", "--device", "cpu", "--preset", "tiny", "--lines", 400,
                   "--vocab-size", 250, timeout=600)
    stages = json.loads((out / "results.json").read_text())["stages"]
    failed = {number: stage.get("summary") for number, stage in stages.items()
              if stage.get("status") == "FAIL"}
    assert result.returncode == 0, (failed, result.stderr[-1500:])
    compiled = stages["12"]
    assert compiled["status"] == "PASS"
    assert compiled["compiled"]["compiled"] and not compiled["eager"]["compiled"]
    assert compiled["proxy_compiled"]["compiled"] and compiled["compiled"]["graphs"] > 0
    assert {"compiled_over_eager", "proxy_compiled_over_eager"} <= set(compiled["speedups"])
    for name in ("eager", "compiled", "proxy_eager", "proxy_compiled", "half_batch",
                 "double_batch"):
        assert compiled[name]["exit"] == 0 and compiled[name]["steps"] == 12, name
    if importlib.util.find_spec("ctranslate2") is not None:
        assert stages["13"]["status"] == "PASS", stages["13"]
        assert set(stages["13"]["runs"]) == {"beam4", "beam1"}
