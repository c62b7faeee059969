"""`attn serve --api-keys FILE` (serve/keys.py): the file read and checked line by line, keys
found by their digests, the file read again when it changes (and on SIGHUP) without a restart,
a broken file keeping the keys it had."""

from __future__ import annotations

import os

import pytest

from attn_cli.errors import AttnError
from attn_cli.serve.keys import Key, Keys, read_keys

FILE = """# name  key  requests/minute  characters/request
team-a   key-of-a   2   50
batch    key-of-b   0   -   # no rate limit, the server's characters
"""


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_keys_are_found_with_their_limits_and_only_whole(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(FILE)
    keys = Keys(path=path)
    assert keys.required
    assert keys.find("key-of-a") == Key("team-a", 2, 50)
    assert keys.find("key-of-b") == Key("batch", 0, None)
    assert keys.find(b"key-of-b") == Key("batch", 0, None)
    for wrong in ("key-of-", "key-of-a ", "KEY-OF-A", "", None):
        assert keys.find(wrong) is None
    both = Keys(single="solo", path=path)
    assert both.find("solo") == Key("api-key") and both.find("key-of-a").name == "team-a"
    assert not Keys().required and Keys().find("anything") is None


@pytest.mark.parametrize("line, message", [
    ("team-a key-of-a 2", "line 2: 3 fields where 4 are needed"),
    ("team-a key-of-a 2 50\nteam-a other 1 1", "line 3: the name 'team-a' is used twice"),
    ("team-a key-of-a 2 50\nteam-b key-of-a 1 1", "line 3: this key is also 'team-a''s"),
    ("team-a key-of-a -2 50", "line 2: requests a minute must be a whole number of at least 0"),
    ("team-a key-of-a 2 0", "line 2: characters a request must be a whole number of at least 1"),
    ("", "no key in it"),
])
def test_a_file_that_does_not_read_is_one_error_naming_the_line(tmp_path, line, message):
    path = tmp_path / "keys.txt"
    path.write_text("# keys\n" + line + "\n")
    with pytest.raises(AttnError) as raised:
        read_keys(path)
    assert f"--api-keys {path}" in str(raised.value) and message in str(raised.value)


def test_a_changed_file_is_read_again_and_a_broken_one_keeps_the_old_keys(tmp_path, capsys):
    path = tmp_path / "keys.txt"
    path.write_text(FILE)
    clock = Clock()
    keys = Keys(path=path, clock=clock)
    path.write_text("team-c key-of-c 5 100\n")
    os.utime(path, ns=(1, 1))  # a new modification time, whatever the file system's grain
    assert keys.find("key-of-a") is not None  # looked at once a second at most
    clock.now += 1.5
    assert keys.find("key-of-a") is None and keys.find("key-of-c") == Key("team-c", 5, 100)
    assert "read again (changed on disk): 1 keys" in capsys.readouterr().err
    path.write_text("team-c key-of-c five 100\n")
    os.utime(path, ns=(2, 2))
    clock.now += 1.5
    assert keys.find("key-of-c") == Key("team-c", 5, 100)  # kept
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "line 1: requests a minute" in said[0] and "kept" in said[0]
    clock.now += 1.5
    keys.find("key-of-c")
    assert capsys.readouterr().err == ""  # said once
    path.write_text(FILE)
    keys.reload()  # SIGHUP's
    assert keys.find("key-of-a").name == "team-a" and keys.find("key-of-c") is None
    assert "read again (SIGHUP): 2 keys" in capsys.readouterr().err
