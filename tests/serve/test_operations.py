"""What operators get of `attn serve` (attn_cli/serve/operations.py): the translation cache (LRU
within lines and characters, thread-safe, keyed by everything that decides an output), the
request rate's token buckets (on a clock of the test's), the Prometheus text and the ASGI wrapper
in-process; then one real server over HTTP: /metrics scraped and its counters moving, a repeated
request answered from the cache exactly as it was searched, and the request past --req-limit
refused 429 with Retry-After."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from types import SimpleNamespace

import pytest

from attn_cli.config import ServeOptions
from attn_cli.decode.options import DecodeOptions
from attn_cli.serve.keys import Key, Keys
from attn_cli.serve.operations import (
    METRICS_CONTENT_TYPE,
    Operations,
    RequestRate,
    TranslationCache,
    client_of,
    search_key,
)

from .client import Connection, Server, request

parser = pytest.importorskip("prometheus_client.parser", reason="attn[serve] is not installed")


def samples(text: str) -> dict:
    """{(sample name, sorted labels): value} of an exposition text."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in parser.text_string_to_metric_families(text)
            for sample in family.samples}


def operations(**changes) -> Operations:
    queue = SimpleNamespace(waiting=3, searching=5)
    return Operations(ServeOptions(**changes), lambda: queue)


# ----------------------------------------------------------------------------------- the cache


def test_cache_keeps_the_most_recently_used_within_lines_and_characters():
    cache = TranslationCache(max_lines=3, max_chars=100)
    for key in "abc":
        cache.put(key, key.upper(), 10)
    assert cache.get("a") == "A"  # now the most recently used: "b" leaves first
    cache.put("d", "D", 10)
    assert [cache.get(key) for key in "abcd"] == ["A", None, "C", "D"]
    cache.put("e", "E", 85)  # 4 lines and 115 characters: the least recent two leave
    assert (len(cache), cache.chars) == (2, 95) and cache.get("a") is None
    cache.put("e", "E2", 5)  # replaced, its characters counted once
    assert (cache.get("e"), cache.chars) == ("E2", 15)
    cache.put("huge", "H", 101)  # larger than the whole cache: not kept, nothing dropped
    assert cache.get("huge") is None and len(cache) == 2


def test_cache_bounds_hold_under_threads():
    cache = TranslationCache(max_lines=50, max_chars=400)

    def hammer(offset: int) -> None:
        for n in range(2000):
            cache.put((offset, n % 70), n, 1 + n % 9)
            cache.get((offset, (n * 7) % 70))

    threads = [threading.Thread(target=hammer, args=(offset,)) for offset in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(cache) <= 50 and cache.chars <= 400
    assert cache.chars == sum(chars for _, chars in cache._entries.values())


def fake_translator(model="model", **options):
    return SimpleNamespace(model=model, options=DecodeOptions(**options))


def test_a_key_holds_what_decides_an_output_and_nothing_else():
    beam4 = search_key(fake_translator())
    assert search_key(fake_translator(batch_tokens=64, workers=2, worker_threads=3)) == beam4
    for other in (fake_translator(beam=2), fake_translator(alpha=1.0),
                  fake_translator(max_len_b=10), fake_translator(raw=True),
                  fake_translator(nbest=2), fake_translator(sample=True, seed=1),
                  fake_translator(model="another pair")):
        assert search_key(other) != beam4


def test_found_lines_skip_the_search_and_the_searched_are_kept():
    ops = operations(cache_lines=10)
    translator = fake_translator()
    lines = ["a cat", "", "a dog", "a cat"]
    first = ops.look_up(translator, lines)
    assert first.to_search == lines  # nothing kept yet
    job = SimpleNamespace(outputs=[[(None, f"<{line}>")] if line else [(None, "")]
                                   for line in first.to_search])
    ops.answered(first, job)
    second = ops.look_up(translator, ["a dog", "a bird", "  ", "a cat"])
    assert second.to_search == ["", "a bird", "  ", ""]  # every line keeps its place
    job = SimpleNamespace(outputs=[[(None, "")], [(None, "<a bird>")], [(None, "")],
                                   [(None, "")]])
    ops.answered(second, job)
    assert [output[0][1] for output in job.outputs] == ["<a dog>", "<a bird>", "", "<a cat>"]
    # Other settings, or a sampled line in another place, are other keys.
    assert ops.look_up(fake_translator(beam=2), ["a dog"]).to_search == ["a dog"]
    sampling = fake_translator(sample=True, seed=3)
    sampled = ops.look_up(sampling, ["a fox", "a cow"])
    ops.answered(sampled, SimpleNamespace(outputs=[[(None, "<1>")], [(None, "<2>")]]))
    assert ops.look_up(sampling, ["a fox", "a cow"]).to_search == ["", ""]
    assert ops.look_up(sampling, ["a cow", "a fox"]).to_search == ["a cow", "a fox"]
    counted = samples(ops.metrics.text().decode())
    assert counted[("attn_serve_cache_hits_total", ())] == 2 + 2
    assert counted[("attn_serve_cache_misses_total", ())] == 3 + 1 + 1 + 2 + 2
    assert counted[("attn_serve_translated_sentences_total", ())] == 3 + 3 + 2
    assert counted[("attn_serve_cache_lines", ())] == len(ops.cache)


def test_a_line_with_a_prefix_of_its_own_is_not_cached_but_a_language_start_is():
    """Autocompletion's prefixes change at every keystroke: such a line is neither looked up
    nor kept. A model whose languages are tokens starts every output with the target's
    (NLLB's fra_Latn: `target_start`), which is no prefix of the line's: those are cached."""
    from attn_cli.decode.controls import Controls

    ops = operations(cache_lines=10)
    nllb = fake_translator(target_start=(7,))
    language, typed = Controls(prefix=(7,)), Controls(prefix=(7, 12))
    first = ops.look_up(nllb, ["a cat", "a dog"], [language, typed])
    assert first.keys[0] is not None and first.keys[1] is None
    ops.answered(first, SimpleNamespace(outputs=[[(None, "<a cat>")], [(None, "<a dog>")]]))
    again = ops.look_up(nllb, ["a cat", "a dog"], [language, typed])
    assert again.to_search == ["", "a dog"]
    plain = fake_translator()  # no language start: any prefix is the line's own
    assert ops.look_up(plain, ["a cat"], [Controls(prefix=(7,))]).keys == [None]


def test_no_cache_searches_every_line():
    ops = operations(cache_lines=0)
    assert ops.cache is None
    assert ops.look_up(fake_translator(), ["a", "a"]).to_search == ["a", "a"]


# ------------------------------------------------------------------------------- the rate


def test_a_client_sends_its_limit_at_once_then_one_every_60_over_n_seconds():
    now = [100.0]
    rate = RequestRate(per_minute=3, clock=lambda: now[0])
    assert [rate.wait("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rate.wait("a") == pytest.approx(20.0)  # the 4th in the minute
    assert rate.wait("b") == 0.0  # another client, another bucket
    now[0] += 15
    assert rate.wait("a") == pytest.approx(5.0)  # a refusal costs no token
    now[0] += 5
    assert rate.wait("a") == 0.0 and rate.wait("a") == pytest.approx(20.0)
    now[0] += 1000  # refilled, never above the limit
    assert [rate.wait("a") for _ in range(4)][-1] == pytest.approx(20.0)


def test_buckets_of_clients_gone_quiet_are_forgotten():
    now = [0.0]
    rate = RequestRate(per_minute=60, clock=lambda: now[0])
    for client in range(1000):
        rate.wait(client)
        now[0] += 0.01
    assert len(rate) == 1000
    now[0] += 55  # every bucket full again: the next prune (once a minute) forgets them
    rate.wait("new")
    assert len(rate) == 1


def test_a_client_is_the_server_s_key_if_it_sends_it_in_a_header_else_its_address():
    def scope(*headers):
        return {"headers": [(name, value) for name, value in headers],
                "client": ("10.0.0.7", 5000)}

    single = Keys("K")
    assert client_of(scope((b"x-api-key", b"K")), single) == (("key", "api-key"),
                                                                Key("api-key"))
    assert client_of(scope((b"authorization", b"Bearer K")), single)[0] == ("key", "api-key")
    assert client_of(scope((b"x-api-key", b"made up")), single) == (("address", "10.0.0.7"),
                                                                     None)
    assert client_of(scope((b"x-api-key", b"K")), Keys()) == (("address", "10.0.0.7"), None)


def test_a_key_of_its_own_rate_has_its_own_bucket_and_0_is_no_limit():
    now = [0.0]
    rate = RequestRate(per_minute=60, clock=lambda: now[0])
    assert [rate.wait("a", 2) for _ in range(3)][-1] == pytest.approx(30.0)
    assert all(rate.wait("b", 0) == 0.0 for _ in range(100))
    assert all(rate.wait("c") == 0.0 for _ in range(60)) and rate.wait("c") > 0


def test_two_keys_are_each_refused_429_at_their_own_rate_and_counted_by_name(tmp_path):
    """--api-keys: the key "slow" may send 2 requests a minute, "fast" 5, an address the
    server's --req-limit 3; each is refused past its own, and /metrics counts each key's
    requests and refusals under its name, never its value."""
    path = tmp_path / "keys.txt"
    path.write_text("slow key-slow 2 -\nfast key-fast 5 -\n")
    queue = SimpleNamespace(waiting=0, searching=0)
    options = ServeOptions(req_limit=3, api_keys=path)
    ops = Operations(options, lambda: queue, Keys(path=path))
    app = ops.middleware(translated, ["/v1/translate"])

    def statuses(headers, count):
        return [call_app(app, "POST", "/v1/translate", headers)[0] for _ in range(count)]

    assert statuses([(b"x-api-key", b"key-slow")], 3) == [200, 200, 429]
    assert statuses([(b"authorization", b"Bearer key-fast")], 6) == [200] * 5 + [429]
    assert statuses([], 4) == [200] * 3 + [429]
    status, headers, body = call_app(app, "POST", "/v1/translate", [(b"x-api-key", b"key-slow")])
    assert status == 429 and int(headers[b"retry-after"]) <= 30
    assert "2 a minute from the key 'slow' (--api-keys)" in json.loads(body)["error"]
    text = call_app(app, "GET", "/metrics")[2].decode()
    counted = samples(text)
    by_key = "attn_serve_key_requests_total"
    assert counted[(by_key, (("key", "slow"), ("status", "200")))] == 2
    assert counted[(by_key, (("key", "slow"), ("status", "429")))] == 2
    assert counted[(by_key, (("key", "fast"), ("status", "429")))] == 1
    assert counted[("attn_serve_key_rate_limited_requests_total", (("key", "slow"),))] == 2
    assert "key-slow" not in text and "key-fast" not in text


# ----------------------------------------------------------------------------- the middleware


def call_app(middleware, method: str, path: str, headers=()):
    """(status, headers, body) of one request through an ASGI app, in-process."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers),
             "client": ("127.0.0.1", 4000), "state": {}}
    asyncio.run(middleware(scope, receive, send))
    start, body = sent[0], b"".join(message.get("body", b"") for message in sent[1:])
    return start["status"], dict(start["headers"]), body


async def translated(scope, receive, send):
    if scope["path"] == "/v1/translate":
        scope["state"]["lines"] = 2
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def test_metrics_count_requests_by_endpoint_and_status_and_429_the_rate():
    ops = operations(req_limit=2, metrics_auth_token="T")
    app = ops.middleware(translated, ["/v1/translate", "/health"])
    assert call_app(app, "POST", "/v1/translate")[0] == 200
    assert call_app(app, "POST", "/no/such/path")[0] == 200  # the fake app answers anything
    status, headers, body = call_app(app, "POST", "/v1/translate")
    assert status == 429 and headers[b"retry-after"] == b"30"
    assert "--req-limit 2" in json.loads(body)["error"]
    assert all(call_app(app, "GET", "/health")[0] == 200 for _ in range(3))  # never limited
    assert call_app(app, "GET", "/metrics")[0] == 401
    assert call_app(app, "GET", "/metrics", [(b"authorization", b"Bearer nope")])[0] == 401
    status, headers, body = call_app(app, "GET", "/metrics", [(b"authorization", b"Bearer T")])
    assert status == 200 and headers[b"content-type"] == METRICS_CONTENT_TYPE.encode()
    counted = samples(body.decode())
    requests = "attn_serve_requests_total"
    assert counted[(requests, (("endpoint", "/v1/translate"), ("status", "200")))] == 1
    assert counted[(requests, (("endpoint", "/v1/translate"), ("status", "429")))] == 1
    assert counted[(requests, (("endpoint", "other"), ("status", "200")))] == 1
    assert counted[(requests, (("endpoint", "/health"), ("status", "200")))] == 3
    assert counted[(requests, (("endpoint", "/metrics"), ("status", "401")))] == 2
    assert counted[("attn_serve_rate_limited_requests_total", ())] == 1
    assert counted[("attn_serve_translated_lines_total", ())] == 2  # the one 200 translating
    assert counted[("attn_serve_request_seconds_count", (("endpoint", "/v1/translate"),))] == 2
    assert counted[("attn_serve_queued_lines", ())] == 3
    assert counted[("attn_serve_searching_lines", ())] == 5


def test_batch_sizes_are_histograms():
    ops = operations()
    for lines, tokens in ((1, 12), (8, 160), (8, 96)):
        ops.metrics.batch_formed(lines, tokens)
    counted = samples(ops.metrics.text().decode())
    assert counted[("attn_serve_batch_lines_count", ())] == 3
    assert counted[("attn_serve_batch_lines_sum", ())] == 17
    assert counted[("attn_serve_batch_lines_bucket", (("le", "8.0"),))] == 3
    assert counted[("attn_serve_batch_source_tokens_bucket", (("le", "128.0"),))] == 2
    assert counted[("attn_serve_batch_source_tokens_sum", ())] == 268


# ------------------------------------------------------------------------- a real server


KEY = {"X-API-Key": "K"}
LIMIT = 10


@pytest.fixture(scope="module")
def server(trained):
    """A server with a key (its holder's requests draw on one bucket, the keyless ones on
    their address's), a rate limit, and a cache of 2 lines (so that one request meets
    lines found and lines not)."""
    model, _ = trained
    process = Server([sys.executable, "-m", "attn_cli", "serve", "-m", str(model), "--port",
                      "0", "--threads", "2", "--api-key", "K", "--req-limit", str(LIMIT),
                      "--cache-lines", "2"])
    process.wait_ready()
    yield process
    assert process.stop() == 0


def call(server, method, path, payload=None, headers=None):
    return asyncio.run(request(server.host, server.port, method, path, payload, headers))


def raw_call(server, method: str, path: str):
    """(status, headers, body bytes)."""
    async def send():
        connection = Connection(server.host, server.port)
        try:
            return await connection.send(method, path)
        finally:
            await connection.close()
    return asyncio.run(send())


def scrape(server) -> dict:
    status, headers, body = raw_call(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    return samples(body.decode())


@pytest.mark.slow
def test_metrics_move_and_a_repeated_request_is_answered_from_the_cache(server, corpus):
    a, b, c, d = corpus["val.en"].read_text(encoding="utf-8").splitlines()[:4]
    before = scrape(server)  # open: --api-key does not cover /metrics
    ok = ("attn_serve_requests_total", (("endpoint", "/v1/translate"), ("status", "200")))
    body = {"text": [a, b, c, d], "beam": 2, "scores": True}
    status, searched = call(server, "POST", "/v1/translate", body, KEY)
    assert status == 200
    after = scrape(server)
    assert after[ok] - before.get(ok, 0) == 1
    assert after[("attn_serve_translated_lines_total", ())] == 4
    assert after[("attn_serve_cache_misses_total", ())] == 4
    assert after[("attn_serve_batch_lines_sum", ())] - before[("attn_serve_batch_lines_sum", ())] \
        == 4
    # The cache keeps the last 2 lines: the same request again meets 2 found, 2 searched.
    status, again = call(server, "POST", "/v1/translate", body, KEY)
    assert status == 200 and again == searched
    later = scrape(server)
    assert later[("attn_serve_cache_hits_total", ())] == 2
    assert later[("attn_serve_cache_misses_total", ())] == 4 + 2
    # Now a and b are kept: a request of them only is not searched at all.
    status, found = call(server, "POST", "/v1/translate",
                         {"text": [b, "", a], "beam": 2, "scores": True}, KEY)
    assert status == 200
    assert found["translations"] == [searched["translations"][1], "",
                                     searched["translations"][0]]
    assert found["scores"][::2] == [searched["scores"][1], searched["scores"][0]]
    last = scrape(server)
    assert last[("attn_serve_cache_hits_total", ())] == 2 + 2
    assert last[("attn_serve_batch_lines_count", ())] == later[("attn_serve_batch_lines_count",
                                                                ())]
    assert last[("attn_serve_queued_lines", ())] == last[("attn_serve_searching_lines", ())] == 0


@pytest.mark.slow
def test_the_request_past_the_limit_is_429_with_retry_after(server):
    """Keyless requests draw on the address's bucket, untouched by the keyed ones above."""
    statuses = [call(server, "GET", "/languages")[0] for _ in range(LIMIT)]
    assert statuses == [200] * LIMIT
    status, headers, body = raw_call(server, "GET", "/languages")
    assert status == 429 and 1 <= int(headers["retry-after"]) <= 60 // LIMIT
    assert f"--req-limit {LIMIT}" in json.loads(body)["error"]
    assert call(server, "GET", "/health")[0] == 200  # never limited
    assert call(server, "GET", "/v1/models", headers=KEY)[0] == 200  # the key's own bucket
    assert scrape(server)[("attn_serve_rate_limited_requests_total", ())] == 1


@pytest.mark.long  # a server of its own that waits for its key file: ~9 s
def test_a_key_file_changed_on_disk_or_told_by_sighup_takes_effect_without_a_restart(
        trained, tmp_path):
    """`attn serve --api-keys FILE`: a key added to the file answers within a few seconds of
    the change, a key removed is refused (401), a file broken on the way keeps the keys it had
    (one log line), and SIGHUP reads it at once; each key holds to its own characters."""
    import signal
    import time

    model, _ = trained
    path = tmp_path / "keys.txt"
    path.write_text("first key-1 0 12\n")
    process = Server([sys.executable, "-m", "attn_cli", "serve", "-m", str(model), "--port",
                      "0", "--threads", "1", "--api-keys", str(path)])
    try:
        process.wait_ready()

        def status(key, text="A dog runs."):
            return call(process, "POST", "/translate", {"q": text, "source": "en",
                                                        "target": "de", "api_key": key})[0]

        def until(key, wanted):
            deadline = time.monotonic() + 10
            while status(key) != wanted and time.monotonic() < deadline:
                time.sleep(0.2)
            return status(key)

        assert status("key-1") == 200 and status("key-2") == 401
        assert status("key-1", "A dog runs fast.") == 400  # 16 characters, over its 12
        path.write_text("second key-2 0 -\n")
        assert until("key-2", 200) == 200 and status("key-1") == 401
        path.write_text("second key-2 zero -\n")
        time.sleep(1.5)
        assert status("key-2") == 200  # the broken file: the keys it had
        assert any("line 1: requests a minute must be" in line for line in process.log)
        path.write_text("third key-3 0 -\n")
        process.process.send_signal(signal.SIGHUP)
        assert until("key-3", 200) == 200
        assert any("read again (SIGHUP)" in line or "read again (changed on disk)" in line
                   for line in process.log)
    finally:
        assert process.stop() == 0


@pytest.mark.long  # a server of its own
def test_a_key_sent_in_the_body_is_held_to_its_own_rate_too(trained, tmp_path):
    """LibreTranslate's clients send the key as the body's api_key field, which the rate's
    middleware cannot see: the endpoint draws it from the key's bucket once it has read the
    body (2 a minute here: the third is 429 with the key's words), and counts it by name."""
    model, _ = trained
    path = tmp_path / "keys.txt"
    path.write_text("tight key-t 2 -\n")
    process = Server([sys.executable, "-m", "attn_cli", "serve", "-m", str(model), "--port",
                      "0", "--threads", "1", "--langs", "en-de", "--api-keys", str(path)])
    try:
        process.wait_ready()
        body = {"q": "A dog runs.", "source": "en", "target": "de", "api_key": "key-t"}
        answers = [call(process, "POST", "/translate", body) for _ in range(3)]
        assert [status for status, _ in answers] == [200, 200, 429]
        assert "2 a minute from the key 'tight' (--api-keys)" in answers[2][1]["error"]
        counted = scrape(process)
        by_key = "attn_serve_key_requests_total"
        assert counted[(by_key, (("key", "tight"), ("status", "200")))] == 2
        assert counted[(by_key, (("key", "tight"), ("status", "429")))] == 1
    finally:
        assert process.stop() == 0
