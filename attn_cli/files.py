"""Files: UTF-8 line reading that names file and line, the invalid-UTF-8 policy, atomic writes.

No torch here. Every command's I/O goes through these few functions so that the rules hold
everywhere: a bad input is one `error: ...` line naming the file (and line), and nothing is ever
half-written (temp file in the same directory + fsync + os.replace).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import AttnError, say

STDIO = "-"


def display_name(path: str | os.PathLike) -> str:
    return "<stdin>" if str(path) == STDIO else str(path)


def check_readable(path: str | os.PathLike, what: str = "file") -> Path:
    """Fail early, with the file's name, for a missing, unreadable or directory input."""
    p = Path(path)
    if not p.exists():
        raise AttnError(f"{what} {p} does not exist")
    if p.is_dir():
        raise AttnError(f"{what} {p} is a directory, not a file")
    if not os.access(p, os.R_OK):
        raise AttnError(f"{what} {p} is not readable")
    return p


@contextlib.contextmanager
def open_binary(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Open an input for reading bytes; `-` is stdin."""
    if str(path) == STDIO:
        yield sys.stdin.buffer
        return
    check_readable(path)
    with open(path, "rb") as handle:
        yield handle


class Utf8Policy:
    """What a line of invalid UTF-8 does. Strict (the default, and what training data gets): an
    error naming the file, the line and the byte. Lenient (`decode`, `parse` and `score` unless
    --strict; `vocab`/`binarize --replace-invalid`): the bad bytes become U+FFFD, the line is
    processed like any other, and stderr names the first few such lines, then gives a count at
    the end (`finish`), so that one stray byte never costs the lines around it."""

    NAMED = 5  # lines named one by one, per run; after these, only the count at the end

    def __init__(self, strict: bool = True, warn: Callable[[str], None] | None = None):
        self.strict = strict
        self.warn = warn or say
        self.replaced: dict[str, list[int]] = {}  # file → its lines with bytes replaced

    def decode(self, raw: bytes, path: str | os.PathLike, line_number: int) -> str:
        """One line without its line ending."""
        try:
            return raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as error:
            where = (f"{display_name(path)}:{line_number}: invalid UTF-8 "
                     f"(byte {error.start + 1} of the line)")
            if self.strict:
                raise AttnError(where) from None
        self.replaced.setdefault(display_name(path), []).append(line_number)
        if self.count <= self.NAMED:
            self.warn(f"warning: {where}, replaced by U+FFFD")
        return raw.decode("utf-8", "replace").rstrip("\r\n")

    def finish(self) -> None:
        """The count, when more lines were replaced than were named."""
        if self.count <= self.NAMED:
            return
        for name, lines in self.replaced.items():
            self.warn(f"warning: {name}: {len(lines)} line(s) with invalid UTF-8 in all, bytes "
                      f"replaced by U+FFFD (first at line {lines[0]}, last at line {lines[-1]})")

    @property
    def count(self) -> int:
        return sum(map(len, self.replaced.values()))


STRICT = Utf8Policy(strict=True)


def read_lines(path: str | os.PathLike, policy: Utf8Policy = STRICT) -> Iterator[str]:
    """The lines of a UTF-8 text file (or `-`), lazily, without line endings."""
    with open_binary(path) as handle:
        for line_number, raw in enumerate(handle, start=1):
            yield policy.decode(raw, path, line_number)


def read_raw_lines(path: str | os.PathLike) -> list[bytes]:
    """Every line of a file (or `-`) as bytes, line endings kept: for inputs read whole."""
    with open_binary(path) as handle:
        return list(handle)


def take_lines(handle: BinaryIO, count: int) -> list[bytes]:
    """The next `count` raw lines (fewer at the end of the file)."""
    lines = []
    for raw in handle:
        lines.append(raw)
        if len(lines) == count:
            break
    return lines


def decode_chunk(raw_lines: list[bytes], path: str | os.PathLike, first_line_number: int,
                 policy: Utf8Policy = STRICT) -> list[str]:
    """Decode consecutive raw lines; a bad line is an error naming it, or replaced (`policy`)."""
    try:
        # One decode call for the whole chunk is much faster than one per line.
        text = b"".join(raw_lines).decode("utf-8")
    except UnicodeDecodeError:
        return [policy.decode(raw, path, first_line_number + offset)
                for offset, raw in enumerate(raw_lines)]
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    # A lone "\r" inside a line is not a line break for us (only "\n" is), as for the reader above.
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` to write to; renamed to `path` when the block ends cleanly,
    removed otherwise, so readers see the old file or the whole new one, never a part."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                                 dir=target.parent)
    except OSError as error:
        raise cannot_write(target, error) from None
    os.close(descriptor)
    try:
        yield Path(temp_name)
        os.chmod(temp_name, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
        with open(temp_name, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temp_name, target)
    except BaseException as error:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        if write_failure(error) is not None:  # a full disk, a quota, a read-only file system
            raise cannot_write(target, error) from None
        raise


def cannot_write(path: str | os.PathLike, error: BaseException) -> AttnError:
    """The one error line of a failed write: the file, and the operating system's reason."""
    return AttnError(f"cannot write {path}: {write_failure(error)}")


def write_failure(error: BaseException) -> str | None:
    """The operating system's reason a write failed (None: not a failed write). safetensors
    reports one as its own error, with the OS error code in its text."""
    if isinstance(error, OSError):
        if error.strerror:
            return error.strerror
        return f"a short write ({error}): the disk may be full"  # numpy's tofile
    if type(error).__name__ == "SafetensorError":
        import re

        code = re.search(r"os error (\d+)|code: (\d+)", str(error))
        if code:
            return os.strerror(int(code.group(1) or code.group(2)))
    return None


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "wb") -> Iterator:
    """An open file whose contents replace `path` atomically when the block ends cleanly."""
    encoding = None if "b" in mode else "utf-8"
    with atomic_path(path) as temp, open(temp, mode, encoding=encoding) as handle:
        yield handle


def check_output_directory(output_dir: str | Path, force: bool) -> Path:
    """A directory to write anew (an export's): refused if it is a file, or holds anything and
    not `force`."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise AttnError(f"{output_dir} exists and is not a directory")
    if output_dir.exists() and any(output_dir.iterdir()) and not force:
        raise AttnError(f"{output_dir} exists and is not empty (--force replaces it)")
    return output_dir


@contextlib.contextmanager
def staged_directory(output_dir: Path) -> Iterator[Path]:
    """A directory to write into, beside `output_dir` and renamed into place when the block ends
    well: `atomic_path` for a directory, so that a killed writer leaves no half of one. Its files
    get the modes a plain mkdir and open would give (mkdtemp's directory is private)."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        yield staging
        umask = _umask()
        staging.chmod(0o777 & ~umask)
        for path in staging.iterdir():
            path.chmod(0o666 & ~umask)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(staging, output_dir)
    except OSError as error:  # a full disk, a quota, a read-only file system
        raise cannot_write(output_dir, error) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def file_sha256(path: Path) -> str:
    """A file's checksum: how processes on different nodes check they read the same data."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def read_metrics(path: str | os.PathLike) -> tuple[list[dict], str | None]:
    """The rows of a run's metrics.jsonl (none if it has none yet), and what was wrong with its
    last line, if it was torn: a run killed in the middle of an append leaves half a row, which
    is dropped (the resumed run writes it again). Any other unreadable line is one error."""
    path = Path(path)
    if not path.exists():
        return [], None
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows, torn = [], None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as error:
            if number == len(lines):
                torn = f"{path}: its last line ({number}) is torn and was left out: {line[:40]!r}"
                break
            raise AttnError(f"{path}:{number}: not a metrics row ({error})") from None
        rows.append(row)
    return rows, torn


def attn_cache(name: str) -> Path:
    """attn's folder `name` in the user's cache (`$XDG_CACHE_HOME/attn`, else `~/.cache/attn`):
    what is built once and kept (the C++ decoder step, inductor's compiled code)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attn" / name
