"""LibreTranslate serving an attn model, offline, for benchmarks/serve_load.py.

LibreTranslate (1.9.6 measured) runs Argos Translate packages: an .argosmodel zip of
`metadata.json` (from_code, to_code), `model/` (a CTranslate2 model) and `sentencepiece.model`
(one model for both sides: attn's vocabulary is shared, `attn export ct2` writes it as source.spm
and target.spm). Its sentence splitter by default is MiniSBD, whose ONNX models are downloaded
from GitHub on first use (minisbd/models.py, REPO_URL); with no internet here, the package carries
a spaCy pipeline instead (`spacy/`, a blank English one, to which argostranslate adds spaCy's
rule-based sentencizer) and the server runs with ARGOS_CHUNK_TYPE=SPACY. It needs spaCy in
LibreTranslate's environment (`pip install spacy`; then `pip install 'rich<13'` again for
flask-limiter). Everything else is LibreTranslate's own default: waitress with 4 threads, one
CTranslate2 replica (ARGOS_INTER_THREADS 1, ARGOS_INTRA_THREADS 0), beam 4, its length penalty
0.2, its punctuation and capitalisation touch-ups.

Two halves. `prepare` runs in attn's environment (it exports the model with attn) and returns
the command that starts the server; that command is this file run by LibreTranslate's Python:

    LT_PYTHON benchmarks/libretranslate_peer.py package CT2_DIR HOME   # build and install
    LT_PYTHON benchmarks/libretranslate_peer.py serve HOME --log FILE [--compute-type int8]

Everything lives under HOME (packages, settings, caches), none of it in the user's own
directories. An empty package index is written there: without one, LibreTranslate (fewer than
two packages installed) asks for the index at start, and argostranslate's
`get_available_packages` calls itself on every failed download (package.py, `except
FileNotFoundError: update_package_index(); return get_available_packages()`) about a thousand
times before giving up. `serve` picks a free port, prints `listening on http://127.0.0.1:PORT`
on stderr (what tests/serve/client.py's Server waits for; GET /health then says when it is
ready), sends LibreTranslate's own output (an INFO log line per step of every request) to
`--log`, and runs LibreTranslate with `--load-only en,de`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

# The Python of LibreTranslate's own environment (../shared/peers/README.md says how to make
# one): $LT_PYTHON, or serve_load.py's --lt-python.
LT_PYTHON = Path(os.environ["LT_PYTHON"]) if os.environ.get("LT_PYTHON") else None
PACKAGE_NAME = "translate-en_de-attn"


# --------------------------------------------------------------------------- attn's side


def prepare(model: str, workdir: Path, lt_python: Path, compute_type: str = "auto",
            inter_threads: int = 1, intra_threads: int = 0, beam: int = 4) -> list[str]:
    """Export `model`, package and install it under `workdir`, and return the command that
    serves it (`compute_type` etc.: ARGOS_COMPUTE_TYPE and the thread settings; LibreTranslate's
    defaults unless given). A second call with the same workdir reuses the installed package."""
    from attn_cli.interop.ct2 import export_ct2

    home = workdir / "home"
    if not (home / "packages" / PACKAGE_NAME).exists():
        ct2_dir = workdir / "ct2"
        export_ct2(model, ct2_dir, "float32", force=True)  # source EOS added by CTranslate2
        subprocess.run([str(lt_python), __file__, "package", str(ct2_dir), str(home)],
                       check=True, capture_output=True)
    log = workdir / f"libretranslate-{compute_type}-{inter_threads}x{intra_threads}.log"
    return [str(lt_python), __file__, "serve", str(home), "--log", str(log),
            "--compute-type", compute_type,
            "--inter-threads", str(inter_threads), "--intra-threads", str(intra_threads),
            "--beam", str(beam)]


# --------------------------------------------------------------- LibreTranslate's side


def isolate(home: Path) -> None:
    """Point argostranslate's and everything else's files at `home`: before any import."""
    for name, sub in (("HOME", ""), ("XDG_DATA_HOME", "data"), ("XDG_CONFIG_HOME", "config"),
                      ("XDG_CACHE_HOME", "cache")):
        os.environ[name] = str(home / sub)
    os.environ["ARGOS_PACKAGES_DIR"] = str(home / "packages")
    os.environ["ARGOS_CHUNK_TYPE"] = "SPACY"  # MiniSBD's models are downloaded at run time
    index = home / "data" / "argos-translate" / "index.json"
    index.parent.mkdir(parents=True, exist_ok=True)
    if not index.exists():
        index.write_text("[]\n")


def package(ct2_dir: Path, home: Path) -> None:
    """Build the .argosmodel of an `attn export ct2` directory and install it under `home`."""
    isolate(home)
    import spacy

    stage = home / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    root = stage / PACKAGE_NAME
    (root / "model").mkdir(parents=True)
    for name in ("config.json", "model.bin", "shared_vocabulary.json"):
        shutil.copy(ct2_dir / name, root / "model" / name)
    shutil.copy(ct2_dir / "source.spm", root / "sentencepiece.model")  # = target.spm
    spacy.blank("en").to_disk(root / "spacy")
    (root / "metadata.json").write_text(json.dumps({
        "package_version": "1.0", "argos_version": "1.9", "type": "translate",
        "from_code": "en", "from_name": "English", "to_code": "de", "to_name": "German"}))
    archive = stage / f"{PACKAGE_NAME}.argosmodel"
    with zipfile.ZipFile(archive, "w") as zipped:
        for path in sorted(root.rglob("*")):
            zipped.write(path, path.relative_to(stage))
    from argostranslate import package as argos_package

    argos_package.install_from_path(archive)
    shutil.rmtree(stage)


def serve(home: Path, log: Path, compute_type: str, inter_threads: int, intra_threads: int,
          beam: int) -> None:
    isolate(home)
    os.environ.update(ARGOS_COMPUTE_TYPE=compute_type, ARGOS_INTER_THREADS=str(inter_threads),
                      ARGOS_INTRA_THREADS=str(intra_threads), ARGOS_BEAM_SIZE=str(beam))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    print(f"libretranslate: listening on http://127.0.0.1:{port} (CTranslate2 {compute_type}, "
          f"inter_threads {inter_threads}, intra_threads {intra_threads}; its log: {log})",
          file=sys.stderr, flush=True)
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    sys.argv = ["libretranslate", "--host", "127.0.0.1", "--port", str(port),
                "--load-only", "en,de"]
    from libretranslate.main import main

    main()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packaging = commands.add_parser("package")
    packaging.add_argument("ct2_dir", type=Path)
    packaging.add_argument("home", type=Path)
    serving = commands.add_parser("serve")
    serving.add_argument("home", type=Path)
    serving.add_argument("--log", type=Path, required=True)
    serving.add_argument("--compute-type", default="auto")
    serving.add_argument("--inter-threads", type=int, default=1)
    serving.add_argument("--intra-threads", type=int, default=0)
    serving.add_argument("--beam", type=int, default=4)
    args = parser.parse_args()
    if args.command == "package":
        package(args.ct2_dir, args.home)
    else:
        serve(args.home, args.log, args.compute_type, args.inter_threads, args.intra_threads,
              args.beam)
