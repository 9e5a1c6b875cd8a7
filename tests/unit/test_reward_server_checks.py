"""The reward server's pure guards (vlrft.rewards.server_checks, wire limits) and the client's
retry policy (vlrft.rewards.remote). The real server process: tests/integration/test_reward_server.py."""

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
from vlrft.rewards.remote import backoff_delay, is_retryable
from vlrft.rewards.server_checks import (TOKEN_ENV, Limits, Rejected, check_body_length, check_json_text,
                                         check_request, check_start, check_token, is_loopback, nesting_exceeds,
                                         json_structure, read_token, runs_code)
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
    return nesting_exceeds(json_structure(text), max_depth)


def test_nesting_scan_counts_levels_outside_strings_only():
    assert not depth('{"a": [[[1]]]}', 4) and depth('{"a": [[[1]]]}', 3)
    assert not depth('[{"s": "]]]]\\"[[[[[[", "t": "\\\\"}]', 2)  # brackets and escapes in strings
    assert not depth('[{"é€": "x"}, []]', 2)  # multi-byte UTF-8
    assert not depth("[[]", 5) and not depth("[]]", 5)  # unbalanced: json.loads reports it (400)
    assert depth("[" * 6, 5)  # never closed, but json.loads would recurse 6 deep before failing
    assert not depth("", 1) and not depth('"just a string"', 1)


def test_deep_nesting_is_refused_without_recursion():
    bomb = ("[" * 200_000 + "]" * 200_000).encode()  # json.loads would raise RecursionError
    with pytest.raises(Rejected, match=r"deeper than 32 levels \(--max-json-depth\)") as err:
        check_json_text(bomb, Limits())
    assert err.value.status == 413
    comb = "[" + ",".join(["[" * 31 + "]" * 31] * 100_000) + "]"  # 6 MB just inside the limit
    start = time.perf_counter()
    assert check_json_text(comb.encode(), Limits(max_json_values=10**7)) == comb
    assert time.perf_counter() - start < 2.0  # linear passes in C, ~0.1 s here


def test_json_values_and_encoding_limits():
    many = json.dumps([0] * 1000).encode()
    with pytest.raises(Rejected, match=r"about 1001 values, over the limit of 1000 \(--max-json-values\)"):
        check_json_text(many, Limits(max_json_values=1000))
    with pytest.raises(Rejected, match="not UTF-8") as err:
        check_json_text(b'["\xff"]', Limits())
    assert err.value.status == 400


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
    with pytest.raises(wire.PixelLimitError, match=r"over 500000 pixels \(--max-request-pixels\), 720000 by sample 1"):
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
