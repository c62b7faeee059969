"""The translated files of `POST /translate_file`, kept for `GET /download_file/<name>`.

LibreTranslate answers a file with the URL of its translation, to be fetched afterwards, so the
server holds on to it: here in a temporary directory of its own (made at the first file,
removed when the server stops), each file written atomically (a download never sees half of
one), kept FILE_SECONDS and at most FILE_COUNT of them (the oldest go first): the disk a server
uses for files stays bounded whatever its clients send. A file's name starts with 32 random hex
digits, so only the client that sent the file can fetch its translation (the download, as
LibreTranslate's, needs no API key); what follows is the sent file's name, for the download.
"""

from __future__ import annotations

import re
import secrets
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

from ..files import atomic_output

FILE_SECONDS = 3600.0
FILE_COUNT = 200
# What a stored name looks like (api.download_name makes the part after the dot): a request
# for any other name is answered 404 without a look at the disk.
STORED_NAME = re.compile(r"[0-9a-f]{32}\.[A-Za-z0-9][A-Za-z0-9._-]*")


class Downloads:
    """`add(name, data)` → the name to download it by; `get(stored)` → (data, the sent name)
    or None once expired or dropped. Safe from any thread (the server writes from a worker
    thread, so that the event loop never waits for the disk)."""

    def __init__(self, seconds: float = FILE_SECONDS, count: int = FILE_COUNT,
                 clock=time.monotonic):
        self.seconds, self.count, self.clock = seconds, count, clock
        self.directory: Path | None = None
        self._files: OrderedDict[str, float] = OrderedDict()  # stored name → when it expires
        self._lock = threading.Lock()

    def add(self, name: str, data: bytes) -> str:
        with self._lock:
            if self.directory is None:
                self.directory = Path(tempfile.mkdtemp(prefix="attn-serve-files-"))
            stored = f"{secrets.token_hex(16)}.{name}"
            with atomic_output(self.directory / stored) as handle:
                handle.write(data)
            self._files[stored] = self.clock() + self.seconds
            self._drop_old()
            return stored

    def get(self, stored: str) -> tuple[bytes, str] | None:
        with self._lock:
            self._drop_old()
            if not STORED_NAME.fullmatch(stored) or stored not in self._files:
                return None
            return (self.directory / stored).read_bytes(), stored.split(".", 1)[1]

    def _drop_old(self) -> None:  # the lock held
        now = self.clock()
        while self._files and (len(self._files) > self.count
                               or next(iter(self._files.values())) <= now):
            stored, _ = self._files.popitem(last=False)
            (self.directory / stored).unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._files)

    def close(self) -> None:
        """Remove the directory and every file in it."""
        with self._lock:
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
            self._files.clear()
