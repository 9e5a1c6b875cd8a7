"""A real `vlrft reward-server` under the attacks a server on a network meets: slow connections
and floods of them crowding out a token holder, token holders' uploads trickling to hold every
connection, a body built to make the JSON checks slow, numbers out of range, web pages sending
requests (cross-site, DNS rebinding), a code request that runs long, a recipe computing past its
timeout while holding the GIL, and a path built to forge log lines. Deadlines are generous (a
loaded 2-core machine); on a server without these defences each of these takes from minutes to
hours, or is answered when it should be refused."""

import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.reward_server_attacks import Strangers
from tests.integration.test_reward_server import post, refusals, start_server
from tests.marks import needs_sandbox

pytestmark = pytest.mark.integration

SCORE = json.dumps({"completions": ["7"], "samples": [{"answer": "7"}]}).encode()


def raw_post(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    """A POST /score with exactly these headers (Host included: http.client sends no other)."""
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    connection.putrequest("POST", "/score", skip_host=True, skip_accept_encoding=True)
    for name, value in {"Content-Length": str(len(body)), **headers}.items():
        connection.putheader(name, value)
    connection.endheaders(body)
    answer = connection.getresponse()
    return answer.status, json.loads(answer.read())


class Slowloris:
    """`count` connections that each send a request's first line and then one header byte every
    half second, never finishing; a connection the server closes is opened again at once."""

    def __init__(self, url: str, count: int):
        self.address = url.removeprefix("http://").split(":")
        self.address[1] = int(self.address[1])
        self.stop = threading.Event()
        self.sockets = [self.open() for _ in range(count)]
        self.reopened = 0
        self.thread = threading.Thread(target=self.trickle, daemon=True)
        self.thread.start()

    def open(self) -> socket.socket:
        sock = socket.create_connection(tuple(self.address), timeout=5)
        sock.sendall(f"POST /score HTTP/1.1\r\nHost: {self.address[0]}\r\nX-Slow: ".encode())
        return sock

    def trickle(self):
        while not self.stop.wait(0.5):
            for i, sock in enumerate(self.sockets):
                try:
                    sock.sendall(b"a")
                except OSError:
                    sock.close()
                    try:
                        self.sockets[i] = self.open()
                        self.reopened += 1
                    except OSError:
                        pass

    def close(self):
        self.stop.set()
        self.thread.join()
        for sock in self.sockets:
            sock.close()


def test_slow_connections_do_not_keep_a_token_holder_out(tmp_path):
    """40 slow connections (more than --max-connections) stay open, reopened when closed; the
    token holder's requests are still answered, each within 5 s."""
    (tmp_path / "token").write_text("s3cret\n")
    proc, url = start_server("exact_match", tmp_path, token="s3cret",
                             extra=("--token-file", str(tmp_path / "token"), "--max-connections", "16"))
    attack = Slowloris(url, 40)
    try:
        time.sleep(1.5)  # every connection the server takes is a slow one now
        auth = {"Authorization": "Bearer s3cret"}
        for _ in range(5):
            start = time.monotonic()
            with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=auth), timeout=5) as r:
                assert json.loads(r.read())["status"] == "ok"
            assert post(url, SCORE, auth)[::2] == (200, {"scores": [1.0]})
            assert time.monotonic() - start < 5
            time.sleep(0.3)
    finally:
        attack.close()
        proc.kill()
    log = proc.log.read_text()
    assert "the server is at --max-connections 16" in log  # it was full, and made room


def test_a_request_must_arrive_within_the_read_timeout(tmp_path):
    """A trickle keeps no connection beyond --read-timeout-s, neither before its headers are in
    nor after (a request let in, sending its body slowly)."""
    proc, url = start_server("exact_match", tmp_path, extra=("--read-timeout-s", "2"))
    headers_only = Slowloris(url, 1)
    body = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30)
    try:
        body.sendall(f"POST /score HTTP/1.1\r\nHost: {url.removeprefix('http://')}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
        body.setblocking(False)
        start = time.monotonic()
        while True:  # a byte of body every 0.2 s, until the server closes the connection
            try:
                body.send(b" ")
                if body.recv(1) == b"":
                    break
            except BlockingIOError:  # nothing to read: still open
                pass
            except OSError:  # reset
                break
            assert time.monotonic() - start < 15, "the slow body was never cut off"
            time.sleep(0.2)
        assert time.monotonic() - start >= 1.5
        while headers_only.reopened == 0:  # the headers-only trickle is cut off too
            assert time.monotonic() - start < 15, "the slow headers were never cut off"
            time.sleep(0.2)
    finally:
        headers_only.close()
        body.close()
        proc.kill()
    assert proc.log.read_text().count("did not arrive in full within 2s (--read-timeout-s)") >= 2


def test_hostile_bodies_are_refused_at_once(tmp_path):
    proc, url = start_server("exact_match", tmp_path)
    try:
        quotes = b'{"completions": ["' + b'\\"' * (2**19)  # 1 MiB of escaped quotes, never closed
        start = time.monotonic()
        status, kind, answer = post(url, quotes)
        assert (status, kind) == (400, "application/json") and "Unterminated string" in answer["error"]
        assert time.monotonic() - start < 5
        closed = b'{"completions": ["' + b'\\"' * (2**19) + b'"], "samples": [{"answer": "7"}]}'
        assert post(url, closed)[::2] == (200, {"scores": [0.0]})  # a long string is no problem
        for number, message in [(b"9" * 5000, "an integer of 5000 digits, over the limit of 4300"),
                                (b"1e999", "a number out of range: 1e999"), (b"NaN", "NaN, which is not a JSON number")]:
            body = b'{"completions": ["a"], "samples": [{"answer": ' + number + b"}]}"
            assert post(url, body) == (422, "application/json", {"error": f"request JSON holds {message}"})
    finally:
        proc.kill()
    assert "Traceback" not in proc.log.read_text()


def test_web_pages_cannot_reach_the_token_less_server(tmp_path):
    proc, url = start_server("exact_match", tmp_path)
    here = url.removeprefix("http://")
    port = here.rsplit(":", 1)[1]
    try:
        # A page on another site posting text/plain (a "simple" request: no preflight).
        status, answer = raw_post(url, SCORE, {"Host": here, "Content-Type": "text/plain",
                                               "Origin": "http://evil.example"})
        assert status == 403 and "Origin: 'http://evil.example'" in answer["error"]
        # DNS rebinding: the page's own name now points at 127.0.0.1, so the request is same-origin.
        status, answer = raw_post(url, SCORE, {"Host": f"evil.example:{port}", "Content-Type": "application/json"})
        assert status == 403 and answer["error"].startswith(f"Host 'evil.example:{port}' is not this machine")
        status, answer = raw_post(url, SCORE, {"Host": here, "Content-Type": "text/plain"})
        assert status == 415 and "application/json" in answer["error"]
        for host in (here, f"localhost:{port}"):
            assert raw_post(url, SCORE, {"Host": host, "Content-Type": "application/json"}) == (200, {"scores": [1.0]})
    finally:
        proc.kill()
    assert len(refusals(proc)) == 3


def test_with_a_token_any_host_name_but_no_web_page(tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    proc, url = start_server("exact_match", tmp_path, extra=("--token-file", str(tmp_path / "token")), token="s3cret")
    auth = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}
    try:
        assert raw_post(url, SCORE, {"Host": "rm-host.example:8000", **auth}) == (200, {"scores": [1.0]})
        status, answer = raw_post(url, SCORE, {"Host": "rm-host.example:8000", "Origin": "http://rm-host.example", **auth})
        assert status == 403 and "web pages" in answer["error"]
    finally:
        proc.kill()


def code_body(program: str) -> bytes:
    completion = f"```python\n{program}\n```"
    return json.dumps({"completions": [completion], "samples": [{"meta": {"tests": "assert f() == 1"}}]}).encode()


@needs_sandbox
def test_a_slow_code_request_costs_only_its_own_time(tmp_path):
    """A request whose program sleeps 30 s (the recipe allows each program 60 s): other requests
    are answered while it runs, and it is stopped at --max-code-seconds, answered 413."""
    proc, url = start_server("code_unit_tests", tmp_path, threads=3,
                             extra=("--kwargs", '{"timeout_s": 60}', "--max-code-seconds", "6"))
    fast = code_body("def f():\n    return 1")
    try:
        with ThreadPoolExecutor(2) as pool:  # two workers started (a start is not a request's time)
            assert [a[::2] for a in pool.map(lambda _: post(url, fast), range(2))] == [(200, {"scores": [1.0]})] * 2
        slow: dict = {}
        started = time.monotonic()
        runner = threading.Thread(target=lambda: slow.update(answer=post(url, code_body(
            "import time\ntime.sleep(30)\ndef f():\n    return 1"))))
        runner.start()
        time.sleep(1.0)  # its program is asleep now
        for _ in range(3):
            start = time.monotonic()
            assert post(url, fast)[::2] == (200, {"scores": [1.0]})
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                assert r.status == 200
            assert time.monotonic() - start < 5
        runner.join(timeout=40)
        status, _, answer = slow["answer"]
        assert status == 413 and "ran past 6s (--max-code-seconds)" in answer["error"]
        assert time.monotonic() - started < 20  # stopped at 6 s, not at the end of its 30 s sleep
        assert post(url, fast)[::2] == (200, {"scores": [1.0]})  # its killed worker was replaced
    finally:
        proc.kill()


def test_a_recipe_computing_past_its_timeout_costs_only_its_own_request(tmp_path):
    """`\\boxed{9^{9^{9}}}` (24 bytes) makes sympy compute a power of 370 million digits, in C,
    holding the GIL. The recipe runs in a worker process: other requests are answered while it
    computes, it is killed at --timeout-s (500), and the requests after it are scored (no
    "not run" while an abandoned call goes on)."""
    pytest.importorskip("math_verify")
    proc, url = start_server("math_accuracy", tmp_path, threads=2, extra=("--timeout-s", "3"))
    good = json.dumps({"completions": ["\\boxed{2}"], "samples": [{"answer": "2"}]}).encode()
    tower = json.dumps({"completions": ["\\boxed{9^{9^{9}}}"], "samples": [{"answer": "1"}]}).encode()
    try:
        with ThreadPoolExecutor(2) as pool:  # both workers started (a start is not a request's time)
            assert [a[::2] for a in pool.map(lambda _: post(url, good), range(2))] == [(200, {"scores": [1.0]})] * 2
        answer: dict = {}
        runner = threading.Thread(target=lambda: answer.update(tower=post(url, tower)))
        started = time.monotonic()
        runner.start()
        time.sleep(0.5)  # the power is being computed
        for _ in range(3):
            start = time.monotonic()
            assert post(url, good)[::2] == (200, {"scores": [1.0]})
            assert time.monotonic() - start < 10
        runner.join(timeout=60)
        status, _, error = answer["tower"]
        assert status == 500 and error["error"].endswith("failed: timed out after 3s (--timeout-s) and was stopped")
        assert time.monotonic() - started < 30
        assert post(url, good)[::2] == (200, {"scores": [1.0]})  # its worker was replaced
    finally:
        proc.kill()


class SlowUploads:
    """`count` connections, each a token holder's POST /score (valid headers, Content-Length
    10000) whose body then comes one byte every half second; one the server closes is opened
    again at once. `answers` holds what the server sent those it cut off."""

    def __init__(self, url: str, count: int, token: str):
        host, port = url.removeprefix("http://").split(":")
        self.address = (host, int(port))
        self.head = (f"POST /score HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 10000\r\n\r\n{").encode()
        self.answers: list[bytes] = []
        self.stop = threading.Event()
        self.sockets = [self.open() for _ in range(count)]
        self.thread = threading.Thread(target=self.trickle, daemon=True)
        self.thread.start()

    def open(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(self.address, timeout=5)
            sock.sendall(self.head)
            sock.setblocking(False)
            return sock
        except OSError:
            return None

    def trickle(self):
        while not self.stop.wait(0.5):
            for i, sock in enumerate(self.sockets):
                try:
                    if sock is None:
                        raise OSError
                    try:
                        answer = sock.recv(4096)
                    except BlockingIOError:  # nothing to read: still open
                        sock.send(b" ")
                        continue
                    if answer:
                        self.answers.append(answer)
                    raise OSError
                except OSError:
                    if sock is not None:
                        sock.close()
                    self.sockets[i] = self.open()

    def close(self):
        self.stop.set()
        self.thread.join()
        for sock in self.sockets:
            if sock is not None:
                sock.close()


def test_slow_bodies_do_not_keep_a_token_holder_out(tmp_path):
    """12 token holders' uploads at 2 bytes/s hold every one of 8 connections with a request the
    checks let in; each is answered 408 once its body falls under the floor, and slow uploads are
    shed for a new connection: another token holder's requests are answered, each within 8 s."""
    (tmp_path / "token").write_text("s3cret\n")
    proc, url = start_server("exact_match", tmp_path, token="s3cret",
                             extra=("--token-file", str(tmp_path / "token"), "--max-connections", "8"))
    attack = SlowUploads(url, 12, "s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    try:
        time.sleep(1.0)  # every connection the server has is a slow upload now
        for _ in range(3):
            start = time.monotonic()
            assert post(url, SCORE, auth)[::2] == (200, {"scores": [1.0]})
            assert time.monotonic() - start < 8
            time.sleep(0.5)
        deadline = time.monotonic() + 15
        while not any(b" 408 " in a for a in attack.answers):
            assert time.monotonic() < deadline, f"no slow upload was answered 408: {attack.answers[:2]}"
            time.sleep(0.2)
    finally:
        attack.close()
        proc.kill()
    answer = next(a for a in attack.answers if b" 408 " in a)
    assert b"Content-Type: application/json" in answer and b"under the floor of 32 KiB/s" in answer
    assert "408 POST /score from 127.0.0.1: request body arrived at" in proc.log.read_text()


def test_a_flood_of_strangers_delays_a_token_holder_little(tmp_path):
    """300 strangers' connections, reopened as soon as closed, against --max-connections 16: the
    server accepts them in batches and sheds them as fast, and the kernel's queue (--backlog,
    1024) holds them all, so no connection waits for TCP to retry. A token holder's requests are
    answered, each within 5 s."""
    (tmp_path / "token").write_text("s3cret\n")
    proc, url = start_server("exact_match", tmp_path, token="s3cret",
                             extra=("--token-file", str(tmp_path / "token"), "--max-connections", "16"))
    flood = Strangers(int(url.rsplit(":", 1)[1]), 300)
    auth = {"Authorization": "Bearer s3cret"}
    try:
        time.sleep(1.5)
        for _ in range(3):
            start = time.monotonic()
            assert post(url, SCORE, auth)[::2] == (200, {"scores": [1.0]})
            assert time.monotonic() - start < 5
            time.sleep(0.3)
        assert flood.opened > 300  # the server closed (and the flood reopened) connections
    finally:
        flood.close()
        proc.kill()
    assert re.search(r"closed \d+ connection\(s\) that sent no request let in", proc.log.read_text())


def test_what_a_client_sent_is_logged_escaped(tmp_path):
    """A path holding a newline and a terminal escape cannot forge a log line or drive the
    operator's terminal: refused by the header checks (401) or by the app (404)."""
    (tmp_path / "token").write_text("s3cret\n")
    proc, url = start_server("exact_match", tmp_path, token="s3cret", extra=("--token-file", str(tmp_path / "token")))
    forged = "/x%0avlrft%20reward%20server:%20recipe%20'evil'%20(no%20token)%0a%1b[2J"
    try:
        for headers in ({}, {"Authorization": "Bearer s3cret"}):
            request = urllib.request.Request(url + forged, headers=headers)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code in (401, 404)
    finally:
        proc.kill()
    log = proc.log.read_text()
    assert "\x1b" not in log
    assert not any(line.startswith("vlrft reward server: recipe 'evil'") for line in log.splitlines())
    assert log.count("/x\\nvlrft reward server: recipe 'evil' (no token)\\n\\x1b[2J") == 2
