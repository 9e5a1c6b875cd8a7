"""The remote clients (the `remote` reward recipe, the remote teacher) against hostile servers:
an answer past its size limit, one trickled past the call's deadline, a redirect (never
followed: it would carry the bearer token elsewhere), and malformed numbers are each one line
naming the URL."""

import contextlib
import http.server
import json
import threading
import time

import pytest

from vlrft.models.remote_teacher import RemoteTeacherError, _answer
from vlrft.rewards.remote import RemoteRewardError, remote_reward


@contextlib.contextmanager
def fake_server(answer):
    """A loopback HTTP server whose every request `answer(handler)` answers; (its URL, the
    Authorization headers it was sent)."""
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.headers.get("Authorization"))
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                answer(self)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up: as it should

        do_GET = do_POST

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def send(handler, status: int, body: bytes, headers: dict | None = None, length: int | None = None):
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body) if length is None else length))
    for key, value in (headers or {}).items():
        handler.send_header(key, value)
    handler.end_headers()
    handler.wfile.write(body)


def test_an_answer_over_its_size_limit_is_one_line():
    huge = b'{"scores": [' + b"0, " * (1 << 20) + b"0]}"  # 3 MiB for one completion
    with fake_server(lambda h: send(h, 200, huge)) as (url, _):
        with pytest.raises(RemoteRewardError) as err:
            remote_reward(["a"], [{}], url, retries=0)
    assert str(err.value) == f"reward server {url}/score: the answer is over the limit of {64 + (1 << 20)} bytes"


def test_a_trickling_server_cannot_hold_the_call_past_its_deadline():
    def trickle(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", "400")
        handler.end_headers()
        for _ in range(400):  # 40 s in all, each byte well within timeout_s
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.1)

    with fake_server(trickle) as (url, _):
        with pytest.raises(RemoteRewardError) as err:
            remote_reward(["a"], [{}], url, retries=3, timeout_s=5, deadline_s=1.0)
    assert str(err.value).startswith(f"reward server {url}/score: ") and "deadline_s reached" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_redirect_is_refused_and_the_token_stays_home(tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    with fake_server(lambda h: send(h, 200, b'{"scores": [1]}')) as (elsewhere, seen_elsewhere):
        with fake_server(lambda h: send(h, 302, b"", {"Location": elsewhere + "/steal"})) as (url, seen):
            with pytest.raises(RemoteRewardError) as err:
                remote_reward(["a"], [{}], url, retries=2, token_file=str(tmp_path / "token"))
    assert str(err.value) == (f"reward server {url}/score: HTTP 302: redirect to '{elsewhere}/steal' refused "
                              "(after 1 attempt)")
    assert seen == ["Bearer s3cret"] and seen_elsewhere == []


def test_a_refusals_error_text_is_quoted_on_one_line():
    body = json.dumps({"error": "bad\n\x1b[31mFAKE LOG LINE" + "x" * 1000}).encode()
    with fake_server(lambda h: send(h, 422, body)) as (url, _):
        with pytest.raises(RemoteRewardError) as err:
            remote_reward(["a"], [{}], url, retries=0)
    message = str(err.value)
    assert message.startswith(f"reward server {url}/score: HTTP 422: bad\\n\\x1b[31mFAKE LOG LINE")
    assert "\n" not in message and "\x1b" not in message and "x" * 301 not in message


@pytest.mark.parametrize("raw", [
    b'{"logprobs": [[Infinity]], "argmax": [[1]]}',
    b'{"logprobs": [[-1e308]], "argmax": [[1]]}',  # -inf as a float32
    b'{"logprobs": [[0.5]], "argmax": [[1]]}',
    b'{"logprobs": [[-' + b"9" * 400 + b']], "argmax": [[1]]}',
    b'{"logprobs": [[-1.5]], "argmax": [[2]]}',
    b'{"logprobs": ' + b"[" * 100000 + b"]" * 100000 + b', "argmax": [[1]]}',
])
def test_a_teacher_answer_of_impossible_numbers_is_one_line(raw):
    with pytest.raises(RemoteTeacherError) as err:
        _answer("http://teacher/logprobs", raw)
    assert str(err.value).startswith("teacher.url http://teacher/logprobs: the answer is not JSON")


def test_a_teacher_answer_of_good_numbers_passes():
    assert _answer("u", b'{"logprobs": [[-1.5, 0, -3]], "argmax": [[1, 0, 1]]}')["logprobs"] == [[-1.5, 0, -3]]
