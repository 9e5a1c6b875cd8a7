"""The reward server's pure guards (vlrft.rewards.server_checks, wire limits) and the client's
retry policy (vlrft.rewards.retrying_call). The real server process: tests/integration/test_reward_server.py."""

import base64
import http.client
import io
import json
import random
import struct
import time
import urllib.error
import zlib

import pytest
from PIL import Image

from vlrft.errors import ConfigError
from vlrft.rewards import wire
from vlrft.rewards.loading import resolve_recipe
from vlrft.rewards.retrying_call import backoff_delay, is_retryable
from vlrft.rewards.server_checks import (TOKEN_ENV, Limits, Rejected, check_body_length, check_headers,
                                         check_request, check_start, check_token, is_json_type, is_loopback,
                                         is_loopback_host, parse_json, read_token, runs_code)
from tests.marks import needs_sandbox


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height (1-bit grey) with next to no pixel data: what
    a decompression bomb looks like before decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def as_image(raw: bytes) -> dict:
    return {"png_base64": base64.b64encode(raw).decode()}


def depth(text: str, max_depth: int) -> bool:
    """Whether the body is refused for nesting deeper than max_depth."""
    try:
        parse_json(text.encode(), Limits(max_json_depth=max_depth))
    except Rejected as err:
        return "--max-json-depth" in str(err)
    return False


def test_nesting_counts_levels_outside_strings_only():
    assert not depth('{"a": [[[1]]]}', 4) and depth('{"a": [[[1]]]}', 3)
    assert not depth('[{"s": "]]]]\\"[[[[[[", "t": "\\\\"}]', 2)  # brackets and escapes in strings
    assert not depth('[{"é€": "x"}, []]', 2)  # multi-byte UTF-8
    assert depth("[" * 2000 + "]" * 2000, 32)  # past the interpreter's recursion limit: refused, not a crash
    assert depth("[" * 2000, 32)  # never closed, and as deep
    assert not depth('"just a string"', 1)


def test_deep_nesting_is_refused_without_recursion():
    bomb = ("[" * 200_000 + "]" * 200_000).encode()
    with pytest.raises(Rejected, match=r"deeper than 32 levels \(--max-json-depth\)") as err:
        parse_json(bomb, Limits())
    assert err.value.status == 413
    comb = "[" + ",".join(["[" * 31 + "]" * 31] * 5_000) + "]"  # just inside the limit
    start = time.perf_counter()
    plain = json.loads(comb)
    loads = time.perf_counter() - start
    start = time.perf_counter()
    assert parse_json(comb.encode(), Limits()) == plain
    # One pass in C and a walk: a few times json.loads alone (1-4x here), measured side by side
    # so a loaded machine slows both; a walk that recursed or rescanned would be far more.
    assert time.perf_counter() - start < 50 * loads + 0.5


def test_json_values_and_encoding_limits():
    many = json.dumps([0] * 1000).encode()
    with pytest.raises(Rejected, match=r"more than 1000 values \(--max-json-values\)") as err:
        parse_json(many, Limits(max_json_values=1000))
    assert err.value.status == 413
    assert parse_json(many, Limits(max_json_values=1001)) == [0] * 1000  # the list and its 1000 numbers
    with pytest.raises(Rejected, match="not UTF-8") as err:
        parse_json(b'["\xff"]', Limits())
    assert err.value.status == 400
    with pytest.raises(Rejected, match=r"^request body is not JSON \(Expecting property name") as err:
        parse_json(b"{not json", Limits())
    assert err.value.status == 400


def test_the_shape_check_holds_one_iterator_per_level_not_one_entry_per_value():
    """Counting 300,000 values (the parse already holds them) takes next to no memory of its
    own: a stack of (value, depth) pairs took 56 bytes per value, 50 bytes per body byte in all."""
    import tracemalloc

    from vlrft.rewards.server_checks import check_json_shape

    body = {"completions": [], "samples": [{} for _ in range(300_000)]}
    tracemalloc.start()
    try:
        check_json_shape(body, Limits())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000, f"the shape check took {peak} bytes"
    with pytest.raises(Rejected, match=r"more than 300002 values"):
        check_json_shape(body, Limits(max_json_values=300_002))
    check_json_shape(body, Limits(max_json_values=300_003))  # the body, its two lists and the dicts
    with pytest.raises(Rejected, match="deeper than 2 levels"):
        check_json_shape(body, Limits(max_json_depth=2))
    check_json_shape(body, Limits(max_json_depth=3))


def test_what_a_client_sent_is_logged_on_one_line_escaped_and_cut():
    from vlrft.rewards.server_checks import loggable

    assert loggable("/score") == "/score"
    assert loggable("/x\nvlrft reward server: forged\x1b[2J\u202e") == "/x\\nvlrft reward server: forged\\x1b[2J\\u202e"
    assert loggable("/" + "a" * 500, 20) == "/" + "a" * 19 + "..."
    assert "\n" not in loggable("".join(map(chr, range(0x20))) + "\u2028\u0085")


def test_escaped_quotes_cost_one_pass():
    """A string of escaped quotes, closed or not: a pattern search for JSON strings retried from
    each quote took seconds for 40 KB and hours for a MiB."""
    for size in (2**20, 4 * 2**20):
        open_ = b'{"completions": ["' + b'\\"' * (size // 2)
        start = time.perf_counter()
        with pytest.raises(Rejected, match="Unterminated string") as err:
            parse_json(open_, Limits())
        assert err.value.status == 400
        assert parse_json(open_ + b'"]}', Limits()) == {"completions": ['"' * (size // 2)]}
        assert time.perf_counter() - start < 5.0  # ~0.01 s here


def test_numbers_out_of_range_are_422():
    for number, message in [
        ("9" * 5000, "an integer of 5000 digits, over the limit of 4300"),
        ("-" + "9" * 4301, "an integer of 4301 digits"),
        ("1e999", "a number out of range: 1e999"),
        ("-1e400", "a number out of range: -1e400"),
        ("NaN", "NaN, which is not a JSON number"),
        ("-Infinity", "-Infinity, which is not a JSON number"),
    ]:
        with pytest.raises(Rejected, match=f"^request JSON holds {message}") as err:
            parse_json(f'{{"samples": [{{"answer": {number}}}]}}'.encode(), Limits())
        assert err.value.status == 422
    assert parse_json(b'[' + b"9" * 4300 + b', -1.5e300, 0]', Limits()) == [int("9" * 4300), -1.5e300, 0]


def test_header_checks():
    def refused(headers: dict, token=None, method="POST") -> tuple[int, str] | None:
        try:
            check_headers(method, {"CONTENT_TYPE": "application/json", **headers}, token, 8000)
        except Rejected as err:
            return err.status, str(err)
        return None

    here = {"HOST": "127.0.0.1:8000"}
    assert refused(here) is None and refused({"HOST": "[::1]:8000"}) is None
    assert refused({**here, "ORIGIN": "http://evil.example"}) == (
        403, "requests sent by web pages are refused (Origin: 'http://evil.example')")
    assert refused({**here, "ORIGIN": "null"})[0] == 403  # a sandboxed frame or a file:// page
    assert refused({**here, "ORIGIN": "http://127.0.0.1:8000"})[0] == 403  # this server serves no pages
    assert refused({"HOST": "evil.example:8000"}) == (
        403, "Host 'evil.example:8000' is not this machine: without a token only 127.0.0.1:8000, "
             "localhost:8000 or [::1]:8000 are answered")
    assert refused({})[0] == 403  # no Host at all
    assert refused({**here, "CONTENT_TYPE": "text/plain"}) == (415, "a POST needs 'Content-Type: application/json', got 'text/plain'")
    assert refused({**here, "CONTENT_TYPE": ""}, method="GET") is None  # a GET sends no body
    # With a token, the token is the authentication: any Host name, but still no web page.
    assert refused({"HOST": "rm-host:8000"}, token="t")[0] == 401
    assert refused({"HOST": "rm-host:8000", "AUTHORIZATION": "Bearer t"}, token="t") is None
    assert refused({"HOST": "rm-host:8000", "AUTHORIZATION": "Bearer t", "ORIGIN": "http://rm-host"}, token="t")[0] == 403


def test_loopback_host_names_and_json_types():
    for host in ["127.0.0.1:8000", "localhost:8000", "LOCALHOST:8000", "[::1]:8000", "127.0.0.2:8000"]:
        assert is_loopback_host(host, 8000), host
    for host in ["127.0.0.1:8001", "127.0.0.1", "localhost", "evil.example:8000", "localhost.:8000",
                 "localhost.evil.example:8000", "2130706433:8000", "127.1:8000", "localhost:08000", "", None]:
        assert not is_loopback_host(host, 8000), host
    assert is_loopback_host("localhost", 80) and is_loopback_host("[::1]", 80)  # HTTP's default port may be left out
    for kind in ["application/json", "application/json; charset=utf-8", 'Application/JSON;charset="UTF-8"']:
        assert is_json_type(kind), kind
    for kind in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "application/jsonx",
                 "application/json; charset=latin-1", "", None]:
        assert not is_json_type(kind), kind


def test_a_refused_request_is_answered_before_its_body_is_read():
    """waitress's parser with the header checks: a stranger's large body is not read (the
    request completes at its headers); a small one is read and dropped, so its client sees
    the answer rather than a connection reset."""
    from waitress.adjustments import Adjustments

    from vlrft.rewards.server_http import CheckedParser, Refused

    def check(method, headers):
        check_headers(method, headers, "s3cret", 8000)

    head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    big = CheckedParser(Adjustments(), check)
    data = head % 10_000_000 + b"[" * 1000
    assert big.received(data) == len(data) and big.completed  # all taken, none of it kept as a body
    assert isinstance(big.error, Refused) and big.error.code == 401 and big.body_bytes_received == 0
    small = CheckedParser(Adjustments(), check)
    data = head % 10 + b"[1,"
    assert small.received(data) == len(head % 10) and small.error is None  # the headers; the body is next
    assert small.received(b"[1,") == 3 and not small.completed  # read, as the connection would feed it ...
    small.received(b"2, 3]  ")  # the 10th byte
    assert small.completed and isinstance(small.error, Refused) and small.error.code == 401  # ... then refused
    allowed = CheckedParser(Adjustments(), check)
    data = (head % 2).replace(b"Host: x", b"Authorization: Bearer s3cret") + b"{}"
    allowed.received(data[allowed.received(data):])
    assert allowed.completed and allowed.error is None and allowed.let_in


def test_body_and_item_limits():
    limits = Limits(max_body_bytes=100, max_items=2)
    check_body_length(100, limits)
    check_body_length(None, limits)  # chunked: the capped read is checked instead
    with pytest.raises(Rejected, match=r"101 bytes is over the limit of 100 \(--max-body-mb\)"):
        check_body_length(101, limits)
    assert check_request({"completions": ["a"], "samples": [{}]}, limits) == (["a"], [{}])
    for body, status, message in [
        ({"completions": ["a"] * 3, "samples": [{}] * 3}, 413, r"3 completions are over the limit of 2 \(--max-items\)"),
        ({"completions": ["a"], "samples": []}, 422, "1 completions but 0 samples"),
        ({"completions": [1], "samples": [{}]}, 422, "completion 0 is a int"),
        ({"completions": ["a"], "samples": [[]]}, 422, "sample 0 is a list"),
        ([], 422, "body must be JSON"),
    ]:
        with pytest.raises(Rejected, match=message) as err:
            check_request(body, limits)
        assert err.value.status == status


def test_pixel_limits_read_the_header_before_decoding(monkeypatch):
    decoded = []
    monkeypatch.setattr(wire, "_decode", lambda image, where: decoded.append(where))
    bomb = as_image(png_header_only(9_000, 9_000))  # 81 M pixels (243 MB as RGB) in ~60 bytes
    assert len(png_header_only(9_000, 9_000)) < 100
    with pytest.raises(wire.PixelLimitError, match=r"sample 0 image 0: 9000x9000 is over the limit of 1000000 pixels"):
        wire.decode_samples([{"images": [bomb]}], max_image_pixels=1_000_000)
    with pytest.raises(wire.PixelLimitError, match="sample 0 image 0: Image size .* exceeds limit"):
        wire.decode_samples([{"images": [as_image(png_header_only(30_000, 30_000))]}])  # PIL's own bomb check
    small = as_image(png_header_only(600, 600))
    counted = 2 * (600 * 600 + 3 * wire.STRUCTURE_STEP_PIXELS)  # each image's pixels and its three chunks
    with pytest.raises(wire.PixelLimitError, match=rf"over 500000 pixels \(--max-request-pixels\), {counted} by sample 1 image 0$"):
        wire.decode_samples([{"images": [small]}, {"images": [small]}], max_request_pixels=500_000)
    assert decoded == []  # refused before any image was decoded


def test_bad_images_are_named():
    gif = io.BytesIO()
    Image.new("RGB", (2, 2)).save(gif, format="GIF")
    for image, message in [
        ({"png_base64": "not*base64!"}, "sample 0 image 0: png_base64 is not valid base64"),
        (as_image(b"hello"), "sample 0 image 0: not a PNG/JPEG/WEBP image"),
        (as_image(gif.getvalue()), "not a PNG/JPEG/WEBP image"),  # a decoder we do not expose
        ({"png": "x"}, "must be {'png_base64': str}"),
    ]:
        with pytest.raises(wire.WireError, match=message):
            wire.decode_samples([{"images": [image]}])
    truncated = wire.encode_samples([{"images": [Image.effect_noise((64, 64), 50).convert("RGB")]}])[0]["images"][0]
    raw = base64.b64decode(truncated["png_base64"])
    with pytest.raises(wire.WireError, match="sample 0 image 0: cannot decode"):
        wire.decode_samples([{"images": [as_image(raw[: len(raw) // 2])]}])
    ok = wire.decode_samples(wire.encode_samples([{"images": [Image.new("L", (3, 2))]}]))
    assert ok[0]["images"][0].mode == "RGB" and ok[0]["images"][0].size == (3, 2)


def test_loopback_and_tokens(tmp_path, monkeypatch):
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "rm-host", "localhost.evil.com"]))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert read_token(None) is None
    monkeypatch.setenv(TOKEN_ENV, " s3cret\n")
    assert read_token(None) == "s3cret"
    (tmp_path / "token").write_text("from-file\n")
    assert read_token(str(tmp_path / "token")) == "from-file"  # the file wins over the env var
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty: must hold one non-empty line"):
        read_token(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="missing: No such file"):
        read_token(str(tmp_path / "missing"))
    check_token("Bearer from-file", "from-file")
    check_token(None, None)  # no token configured: loopback without auth
    for header in [None, "", "Bearer wrong", "Basic from-file", "Bearer from-fil"]:
        with pytest.raises(Rejected, match="missing or wrong token") as err:
            check_token(header, "from-file")
        assert err.value.status == 401


@needs_sandbox  # without it a code recipe is refused before the token is looked at
def test_start_checks():
    exact, code = resolve_recipe("exact_match"), resolve_recipe("code_unit_tests")
    assert runs_code(code) and not runs_code(exact)
    check_start("127.0.0.1", None, "code_unit_tests", code, allow_code=False)  # local: the user's own machine
    with pytest.raises(ConfigError, match=r"--host 0.0.0.0 is not a loopback address, so a token is required"):
        check_start("0.0.0.0", None, "exact_match", exact, allow_code=False)
    check_start("0.0.0.0", "t", "exact_match", exact, allow_code=False)
    with pytest.raises(ConfigError, match="recipe 'code_unit_tests' executes .* needs --allow-code-recipe"):
        check_start("0.0.0.0", "t", "code_unit_tests", code, allow_code=False)
    check_start("0.0.0.0", "t", "code_unit_tests", code, allow_code=True)


def test_a_code_recipe_needs_isolation_or_the_unsafe_opt_in(monkeypatch):
    """Where bubblewrap cannot run, the server refuses a code recipe, even on loopback."""
    from vlrft.isolation import sandbox

    code, exact = resolve_recipe("code_unit_tests"), resolve_recipe("exact_match")
    monkeypatch.setattr(sandbox, "_bubblewrap", lambda: (None, "bubblewrap (bwrap) is not installed"))
    with pytest.raises(ConfigError, match=r"^reward server recipe 'code_unit_tests' runs model-written code, which "
                                          r"needs OS isolation, and bubblewrap \(bwrap\) is not installed: .*"
                                          r"or give --unsafe-no-isolation to run it with only in-process guards \(unsafe\)$"):
        check_start("127.0.0.1", None, "code_unit_tests", code, allow_code=False)
    check_start("127.0.0.1", None, "code_unit_tests", code, allow_code=False, unsafe_no_isolation=True)
    check_start("127.0.0.1", None, "exact_match", exact, allow_code=False)  # no code: no sandbox needed
    with pytest.raises(ConfigError, match="max_body_bytes must be a positive integer"):
        Limits(max_body_bytes=0)


def test_user_recipes_using_the_sandbox_count_as_code(tmp_path):
    (tmp_path / "mine.py").write_text("from vlrft.isolation.sandbox import run_python\n"
                                      "def run(completions, samples):\n    return [0.0] * len(completions)\n")
    assert runs_code(resolve_recipe(f"{tmp_path / 'mine.py'}:run"))
    (tmp_path / "theirs.py").write_text("from vlrft.isolation import sandbox\n"
                                        "def run(completions, samples):\n    return [0.0] * len(completions)\n")
    assert runs_code(resolve_recipe(f"{tmp_path / 'theirs.py'}:run"))
    (tmp_path / "plain.py").write_text("import os\ndef run(completions, samples):\n    return [0.0] * len(completions)\n")
    assert not runs_code(resolve_recipe(f"{tmp_path / 'plain.py'}:run"))


def http_error(code: int) -> urllib.error.HTTPError:
    return urllib.error.HTTPError("http://x/score", code, "reason", {}, io.BytesIO(b"{}"))


def test_retry_classification():
    for code in (429, 502, 503, 504):
        assert is_retryable(http_error(code))
    for code in (400, 401, 404, 413, 422, 500):
        assert not is_retryable(http_error(code))
    for err in (urllib.error.URLError("refused"), TimeoutError("timed out"), ConnectionResetError(),
                http.client.RemoteDisconnected("closed")):
        assert is_retryable(err)
    assert not is_retryable(ValueError("bad JSON"))


def test_backoff_is_exponential_and_jittered():
    rng = random.Random(0)
    for attempt in (1, 2, 3, 4):
        base = 0.5 * 2 ** (attempt - 1)
        delays = [backoff_delay(0.5, attempt, rng) for _ in range(200)]
        assert base / 2 <= min(delays) and max(delays) <= base
        assert max(delays) - min(delays) > base / 4  # spread: clients refused together do not return together


class ScriptedServer:
    """A loopback HTTP server answering POSTs from a script of (status, JSON) and counting them."""

    def __init__(self, script):
        import http.server
        import threading

        self.script, self.requests = list(script), 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests += 1
                status, answer = outer.script.pop(0) if outer.script else (200, {"scores": [1.0]})
                if status == "sleep":
                    time.sleep(answer)
                    status, answer = 200, {"scores": [1.0]}
                body = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except BrokenPipeError:  # the client's timeout came first
                    pass

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()


def test_client_retries_only_what_may_pass():
    from vlrft.rewards.remote import RemoteRewardError, remote_reward

    busy = (503, {"error": "busy"})
    with ScriptedServer([busy, (429, {"error": "slow down"})]) as server:
        assert remote_reward(["a"], [{}], server.url, retries=2, backoff_s=0.01) == [1.0]
        assert server.requests == 3
    with ScriptedServer([(413, {"error": "request body of 9 bytes is over the limit of 8 (--max-body-mb)"})]) as server:
        with pytest.raises(RemoteRewardError, match=r"HTTP 413: request body of 9 bytes is over the limit of 8 "
                                                    r"\(--max-body-mb\) \(after 1 attempt\)$"):
            remote_reward(["a"], [{}], server.url, retries=5, backoff_s=0.01)
        assert server.requests == 1
    with ScriptedServer([busy] * 10) as server:
        with pytest.raises(RemoteRewardError, match=r"HTTP 503: busy \(after 3 attempts\)$"):
            remote_reward(["a"], [{}], server.url, retries=2, backoff_s=0.01)


def test_client_deadline_covers_every_attempt():
    from vlrft.rewards.remote import RemoteRewardError, remote_reward

    with ScriptedServer([("sleep", 2.0)] * 10) as server:
        start = time.perf_counter()
        with pytest.raises(RemoteRewardError, match=r"timed out; deadline_s reached \(after [23] attempts\)$"):
            remote_reward(["a"], [{}], server.url, timeout_s=0.4, retries=10, backoff_s=0.05, deadline_s=1.0)
        assert time.perf_counter() - start < 2.0  # without the deadline: 11 attempts x 0.4 s = 4.4 s
    with ScriptedServer([(503, {"error": "busy"})] * 10) as server:
        start = time.perf_counter()
        with pytest.raises(RemoteRewardError, match=r"HTTP 503: busy; deadline_s reached"):
            remote_reward(["a"], [{}], server.url, retries=10, backoff_s=0.2, deadline_s=0.5)
        assert time.perf_counter() - start < 1.2  # without it: 10 backoffs >= 0.1 s x (2^10 - 1)
