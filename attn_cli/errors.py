"""The errors a user sees. Each is shown as one `error: ...` line on stderr, exit status 2,
never a traceback (cli.main): the message must say what was wrong, where (file and line), and
what to do. No imports but the standard library's: every module may raise them."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


def say(line: str) -> None:
    """One line on stderr in one write: print() writes the text and its newline apart, and the
    processes of one torchrun job share a pipe, where their lines then ran together ("error:
    ...error: ..."). A write of one line is atomic on a pipe up to PIPE_BUF (4 KiB)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class AttnError(Exception):
    """A problem with the user's input or environment."""


class TrainingDiverged(AttnError):
    """The training loss became inf or NaN: the run stops, its last good checkpoint kept."""


def is_out_of_memory(error: BaseException) -> bool:
    """torch's out-of-memory error of a device (torch.OutOfMemoryError, once
    torch.cuda.OutOfMemoryError), known by name so that this module needs no torch."""
    return type(error).__name__ == "OutOfMemoryError"


def compiler_error_line(error: BaseException) -> str:
    """What a compiler's failure says, in a line: its first line naming an error where there
    is one (C++ compilers' and inductor's texts start with the whole command line or a dump),
    else its first line; cut to 200 characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = next((line for line in lines if "error:" in line), lines[0] if lines else "")
    text = text or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def out_of_memory_line(error: BaseException) -> str:
    """torch's first line of it (what was asked, what the device has), on one line."""
    return " ".join(str(error).split("\n")[0].split())[:200]


@contextlib.contextmanager
def batch_must_fit(batch: str, remedy: str) -> Iterator[None]:
    """Where the batch size is known: the device running out of memory in the block becomes one
    line naming that batch ("search batches of 8000 source tokens × beam") and the option that
    makes the work fit, with its value ("lower --batch-tokens (8000)")."""
    try:
        yield
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        raise AttnError(f"out of GPU memory with {batch} ({out_of_memory_line(error)}): "
                        f"{remedy}") from None
