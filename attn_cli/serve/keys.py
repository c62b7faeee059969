"""API keys, each with its own limits (`attn serve --api-keys FILE`), as LibreTranslate's
operators give each team or app a key with its own request rate and character limit.

The file, one key a line (blank lines and `#` comments skipped):

    # name     key                                requests/minute   characters/request
    team-a     9f2c4e0b7d1a43c8a5e6f7b8c9d0e1f2   60                5000
    batch-job  0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e   0                 -

The name labels the key's counters in /metrics (the key itself is never exported); requests a
minute, 0 for none, `-` for the server's `--req-limit`; characters a request, `-` for the
server's `--char-limit`. The file is read again when it changes on disk (looked at no more than
once a second, as requests come) and on SIGHUP, without a restart; a file that no longer reads
keeps the keys it had, and says why in one line. Keys are compared by their SHA-256 digests,
each in constant time (`hmac.compare_digest`), against every key of the file: how long a check
takes says nothing of how much of a key was right. `--api-key KEY` is the simple case: one key,
named "api-key", with the server's limits.

No torch here: the module is tested in-process (tests/serve/test_keys.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import AttnError, say

RECHECK_SECONDS = 1.0  # how often a request may look at the file's modification time


@dataclass(frozen=True)
class Key:
    """A key's name and limits: None is the server's own (--req-limit, --char-limit); a
    requests_per_minute of 0 is no limit."""

    name: str
    requests_per_minute: int | None = None
    char_limit: int | None = None


def read_keys(path: Path) -> dict[bytes, Key]:
    """The file's keys by their SHA-256 digest. AttnError naming the file and line where a line
    does not read, a name or a key is repeated, or no key is found."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise AttnError(f"--api-keys {path}: cannot read it ({error})") from None
    keys: dict[bytes, Key] = {}
    names: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"--api-keys {path}, line {number}"
        if len(fields) != 4:
            raise AttnError(f"{where}: {len(fields)} fields where 4 are needed: name, key, "
                            "requests a minute (0: none; -: --req-limit), characters a "
                            "request (-: --char-limit)")
        name, secret, requests, chars = fields
        if name in names:
            raise AttnError(f"{where}: the name {name!r} is used twice")
        digest = hashlib.sha256(secret.encode()).digest()
        if digest in keys:
            raise AttnError(f"{where}: this key is also {keys[digest].name!r}'s")
        keys[digest] = Key(name, _count(requests, where, "requests a minute", least=0),
                           _count(chars, where, "characters a request", least=1))
        names.add(name)
    if not keys:
        raise AttnError(f"--api-keys {path}: no key in it (one a line: name, key, requests a "
                        "minute, characters a request)")
    return keys


def _count(field: str, where: str, what: str, least: int) -> int | None:
    if field == "-":
        return None
    if not field.isdigit() or int(field) < least:
        raise AttnError(f"{where}: {what} must be a whole number of at least {least}, or -, "
                        f"not {field!r}")
    return int(field)


class Keys:
    """The keys a server takes: `--api-key`'s one, `--api-keys`' file (kept up to date), or
    both; `required` is false when neither was given (every request is let in)."""

    def __init__(self, single: str | None = None, path: Path | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.path, self.clock = (Path(path) if path else None), clock
        self._single = {hashlib.sha256(single.encode()).digest(): Key("api-key")} \
            if single else {}
        self._lock = threading.Lock()
        self._from_file: dict[bytes, Key] = {}
        self._stamp = None
        self._looked = clock()
        if self.path is not None:
            self._from_file = read_keys(self.path)  # a bad file stops the server at start
            self._stamp = self._file_stamp()

    @property
    def required(self) -> bool:
        return bool(self._single) or self.path is not None

    def find(self, given: str | bytes | None) -> Key | None:
        """The key `given` is, or None. Every key is compared, each in constant time."""
        if given is None:
            return None
        self._maybe_reload()
        raw = given.encode() if isinstance(given, str) else given
        digest = hashlib.sha256(raw).digest()
        with self._lock:
            every = [*self._single.items(), *self._from_file.items()]
        found = None
        for known, key in every:
            if hmac.compare_digest(digest, known) and found is None:
                found = key
        return found

    def reload(self, why: str = "SIGHUP") -> None:
        """Read the file again; where it no longer reads, keep the keys it had (one line)."""
        if self.path is None:
            return
        stamp = self._file_stamp()
        try:
            keys = read_keys(self.path)
        except AttnError as error:
            say(f"serve: {error}; the {len(self._from_file)} keys read before are kept")
            with self._lock:
                self._stamp = stamp  # said once, not at every request
            return
        with self._lock:
            self._from_file, self._stamp = keys, stamp
        say(f"serve: --api-keys {self.path} read again ({why}): {len(keys)} keys")

    def _maybe_reload(self) -> None:
        if self.path is None:
            return
        now = self.clock()
        if now - self._looked < RECHECK_SECONDS:
            return
        self._looked = now
        if self._file_stamp() != self._stamp:
            self.reload("changed on disk")

    def _file_stamp(self):
        try:
            status = os.stat(self.path)
        except OSError:
            return None
        return status.st_mtime_ns, status.st_size, status.st_ino
