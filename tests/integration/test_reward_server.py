"""A real `vlrft reward-server` process on loopback, scored through the `remote` recipe inside
a reward mix: normal scoring, server down, slow server, bad requests, concurrency limit; and its
guards: the token, the refused starts, 4xx JSON refusals the client does not retry, 200
concurrent requests in bounded memory."""

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image

from vlrft.config import RecipeSpec, RewardConfig
from vlrft.rewards import RewardMix
from vlrft.rewards import wire
from vlrft.rewards.remote import RemoteRewardError, remote_reward
from vlrft.rewards.server_checks import TOKEN_ENV
from tests.marks import needs_sandbox
from tests.ports import free_port

pytestmark = pytest.mark.integration

SERVER_RECIPES = '''
import threading, time

_lock = threading.Lock()
_in_flight = [0, 0]  # now, most seen


def image_sizes(completions, samples):
    return [float(sum(img.size[0] * img.size[1] for img in s["images"])) for s in samples]


def slow(completions, samples):
    time.sleep(5)
    return [1.0] * len(completions)


def nap(completions, samples):
    time.sleep(0.05)
    return [1.0] * len(completions)


def in_flight(completions, samples):
    with _lock:
        _in_flight[0] += 1
        _in_flight[1] = max(_in_flight)
    time.sleep(0.3)
    with _lock:
        _in_flight[0] -= 1
        return [float(_in_flight[1])] * len(completions)


in_flight.runs_in_trainer = True  # in the server's threads, which share _in_flight (not worker processes)
'''


def server_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}  # a developer's token must not leak in
    return {**env, "PYTHONPATH": os.getcwd(), **extra}


def start_server(recipe: str, tmp_path, threads: int = 4, extra: tuple = (), token: str | None = None):
    """The server process, its URL; its stdout and stderr go to proc.log (one line per refusal)."""
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vlrft.cli", "reward-server", "--recipe", recipe, "--port", str(port),
             "--threads", str(threads), *extra],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True, env=server_env(),
        )
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=headers), timeout=1) as r:
                assert json.loads(r.read()) == {"status": "ok", "recipe": recipe}
                return proc, url
        except OSError:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("reward server did not come up")


def refusals(proc) -> list[str]:
    """The server's one-line log of each request it refused (4xx/5xx)."""
    return [line for line in proc.log.read_text().splitlines() if re.match(r"vlrft reward server: [45]\d\d ", line)]


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, str, dict]:
    """(status, content type, JSON body) of a raw POST /score."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url + "/score", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.headers["Content-Type"], json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], json.loads(err.read())


@pytest.fixture()
def recipes_file(tmp_path):
    (tmp_path / "server_recipes.py").write_text(SERVER_RECIPES)
    return tmp_path


def mix_with(url: str, **kwargs) -> RewardMix:
    spec = RecipeSpec(recipe="remote", kwargs={"url": url, **kwargs}, fallback=0.0, timeout_s=10)
    return RewardMix(RewardConfig(default=[spec]))


def test_remote_scores_match_local_and_carry_images(recipes_file):
    proc, url = start_server("exact_match", recipes_file)
    try:
        samples = [{"answer": a, "data_source": "x"} for a in ["red", "blue", "7"]]
        totals, components, _ = mix_with(url, batch_size=2).score(["<answer>red</answer>", "green", "7"], samples)
        assert totals == [1.0, 0.0, 1.0] and components[0] == {"remote": 1.0}
    finally:
        proc.kill()
    proc, url = start_server("server_recipes.py:image_sizes", recipes_file)
    try:
        samples = [{"images": [Image.new("RGB", (4, 3)), Image.new("RGB", (2, 2))]}, {"images": []}]
        assert remote_reward(["a", "b"], samples, url) == [16.0, 0.0]  # PNG round trip kept the pixels
        status, kind, answer = post(url, b'{"completions": ["a"]}')
        assert (status, kind) == (422, "application/json") and "completions" in answer["error"]
        # A recipe failing on the server is a 500 and a wrong URL a 404: neither is retried.
        with pytest.raises(RemoteRewardError, match=r"HTTP 500: recipe .* failed: raised KeyError: 'images' \(after 1 attempt\)"):
            remote_reward(["a"], [{"id": 1}], url, retries=2, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match=r"HTTP 404: 404 Not Found: .* \(after 1 attempt\)"):
            remote_reward(["a"], [{"id": 1}], url + "/nowhere", retries=3)
        assert len(refusals(proc)) == 3  # one request each: nothing was retried
    finally:
        proc.kill()


def test_server_down_falls_back_and_counts(capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    mix = mix_with(url, retries=2, backoff_s=0.05, timeout_s=1)
    start = time.perf_counter()
    totals, components, _ = mix.score(["a", "b"], [{"answer": "a", "data_source": "x"}] * 2)
    assert totals == [0.0, 0.0] and components == [{"remote": 0.0}] * 2
    assert mix.take_failures() == {"remote": 1}
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    assert "reward recipe 'remote' failed (raised RemoteRewardError: reward server " in err
    assert "Connection refused (after 3 attempts)" in err


def test_slow_server_timeout_is_honoured(recipes_file):
    proc, url = start_server("server_recipes.py:slow", recipes_file)
    try:
        start = time.perf_counter()
        with pytest.raises(RemoteRewardError, match="timed out .after 2 attempts."):
            remote_reward(["a"], [{}], url, timeout_s=0.5, retries=1, backoff_s=0.1)
        assert time.perf_counter() - start < 2.5  # 2 x 0.5 s + 0.1 s backoff, not 2 x 5 s
        mix = mix_with(url, timeout_s=5, retries=0)
        mix.default[0][0].timeout_s = 1.0  # the guard's limit is below the client's own
        start = time.perf_counter()
        totals, _, _ = mix.score(["a"], [{"data_source": "x"}])
        assert totals == [0.0] and mix.take_failures() == {"remote": 1}
        assert time.perf_counter() - start < 2.0
    finally:
        proc.kill()


def test_concurrency_limit(recipes_file):
    proc, url = start_server("server_recipes.py:in_flight", recipes_file, threads=8)
    try:
        scores = remote_reward(["a"] * 6, [{}] * 6, url, batch_size=1, max_concurrency=2)
        assert max(scores) == 2.0  # two requests overlapped, never more
    finally:
        proc.kill()


def test_server_reports_a_busy_port(recipes_file):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "vlrft.cli", "reward-server", "--recipe", "exact_match",
                               "--port", str(port)], capture_output=True, text=True, timeout=60, env=server_env())
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"vlrft: error: reward server cannot listen on 127.0.0.1:{port}")


@needs_sandbox  # without it the code recipe is refused first, for that
def test_non_loopback_start_needs_a_token_and_code_needs_opt_in(tmp_path):
    def start(*args, **env):
        cmd = [sys.executable, "-m", "vlrft.cli", "reward-server", "--port", str(free_port()), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=server_env(**env))

    refused = start("--recipe", "exact_match", "--host", "0.0.0.0")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == ("vlrft: error: reward server: --host 0.0.0.0 is not a loopback address, so a token is "
                              f"required: give --token-file PATH or set {TOKEN_ENV} (clients send 'Authorization: "
                              "Bearer TOKEN')\n")
    (tmp_path / "token").write_text("t0ken\n")
    code = start("--recipe", "code_unit_tests", "--host", "0.0.0.0", "--token-file", str(tmp_path / "token"))
    assert code.returncode == 2
    assert code.stderr == ("vlrft: error: reward server: recipe 'code_unit_tests' executes the completions it is "
                           "sent; serving it on --host 0.0.0.0 needs --allow-code-recipe\n")
    code = start("--recipe", "code_unit_tests", "--host", "0.0.0.0", **{TOKEN_ENV: "t0ken"})  # env token: same
    assert code.returncode == 2 and "--allow-code-recipe" in code.stderr


def test_token_is_required_and_sent(tmp_path, monkeypatch):
    (tmp_path / "token").write_text("s3cret\n")
    proc, url = start_server("exact_match", tmp_path, extra=("--token-file", str(tmp_path / "token")), token="s3cret")
    try:
        body = json.dumps({"completions": ["7"], "samples": [{"answer": "7"}]}).encode()
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}]:
            assert post(url, body, headers) == (401, "application/json",
                                                {"error": "missing or wrong token: send 'Authorization: Bearer TOKEN'"})
        assert post(url, body, {"Authorization": "Bearer s3cret"})[::2] == (200, {"scores": [1.0]})
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        with pytest.raises(RemoteRewardError, match=r"HTTP 401: missing or wrong token.* \(after 1 attempt\)$"):
            remote_reward(["7"], [{"answer": "7"}], url, retries=3, backoff_s=0.01)
        assert remote_reward(["7"], [{"answer": "7"}], url, token_file=str(tmp_path / "token")) == [1.0]
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        assert remote_reward(["7", "8"], [{"answer": "7"}] * 2, url) == [1.0, 0.0]
        assert len(refusals(proc)) == 4  # the three raw 401s and the client's single attempt
    finally:
        proc.kill()


def test_refusals_are_json_4xx_and_not_retried(tmp_path, monkeypatch):
    limits = ("--max-body-mb", "1", "--max-items", "4", "--max-image-pixels", "1000000", "--max-json-depth", "16")
    proc, url = start_server("exact_match", tmp_path, extra=limits)
    sample = {"answer": "a"}

    def refused(completions, samples, status, message):
        start = time.perf_counter()
        with pytest.raises(RemoteRewardError, match=rf"HTTP {status}: {message}.* \(after 1 attempt\)$"):
            remote_reward(completions, samples, url, batch_size=8, retries=3, backoff_s=0.5)
        assert time.perf_counter() - start < 1.0  # no backoff slept: not retried

    try:
        refused(["x" * 1_500_000], [sample], 413,
                r"request body of 1500\d\d\d bytes is over the limit of 1048576 \(--max-body-mb\)")
        refused(["a"] * 5, [sample] * 5, 413, r"5 completions are over the limit of 4 \(--max-items\)")
        bomb = Image.new("1", (5000, 5000))  # 25 M pixels (75 MB as RGB) ...
        assert len(wire.encode_samples([{"images": [bomb]}])[0]["images"][0]["png_base64"]) < 20_000  # ... in < 20 KB
        refused(["a"], [{"images": [bomb]}], 413,
                r"sample 0 image 0: 5000x5000 is over the limit of 1000000 pixels \(--max-image-pixels\)")
        nested: dict = {}
        for _ in range(40):
            nested = {"n": [nested]}
        refused(["a"], [{"meta": nested}], 413, r"request JSON nests deeper than 16 levels \(--max-json-depth\)")
        with monkeypatch.context() as patch:
            patch.setattr(wire, "_png", lambda image: "not*base64!")
            refused(["a"], [{"images": [Image.new("RGB", (2, 2))]}], 422,
                    "sample 0 image 0: png_base64 is not valid base64")
        assert len(refusals(proc)) == 5  # the server saw exactly one request per refusal
        # The same refusals as a raw client sees them: JSON, never an HTML page.
        assert post(url, b"[" * 5000)[:2] == (413, "application/json")
        assert post(url, b"{not json")[:2] == (400, "application/json")
        connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
        connection.request("POST", "/score", body=iter([b"x" * 2**19] * 3), encode_chunked=True,  # no Content-Length
                           headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        assert (answer.status, answer.getheader("Content-Type")) == (413, "application/json")
        assert "--max-body-mb" in json.loads(answer.read())["error"]
        ok = {"images": [Image.new("RGB", (999, 1000))], "answer": "a"}
        assert remote_reward(["a"], [ok], url) == [1.0]  # under every limit
    finally:
        proc.kill()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_200_concurrent_requests_in_bounded_memory(recipes_file):
    """200 clients at once, 480 KB each (under waitress's 512 KiB in-memory buffer, so a held
    body costs its size in RAM): waitress holds at most --max-connections of them, the rest
    wait in the kernel's listen backlog, and the server's memory stays bounded. Measured here:
    +16 MB with --max-connections 16; +91 MB with 1000 (no bound); about 3 s."""
    proc, url = start_server("server_recipes.py:nap", recipes_file, threads=4,
                             extra=("--max-connections", "16", "--backlog", "256"))
    body = json.dumps({"completions": ["x" * 480_000], "samples": [{}]}).encode()
    try:
        post(url, body)  # warm: first-request imports and allocations are not the load's
        baseline = peak = rss_mb(proc.pid)
        done = threading.Event()

        def watch():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, rss_mb(proc.pid))
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=200) as pool:
            answers = list(pool.map(lambda _: post(url, body)[::2], range(200)))
        elapsed = time.perf_counter() - start
        done.set()
        watcher.join()
        growth = peak - baseline
        print(f"200 x {len(body) / 1e3:.0f} KB in {elapsed:.1f} s; server RSS {baseline:.0f} MB -> peak {peak:.0f} MB")
        assert all(a == (200, {"scores": [1.0]}) or (a[0] in (429, 503) and "error" in a[1]) for a in answers)
        assert growth < 50, f"server RSS grew {growth:.0f} MB (16 connections x 512 KiB + 4 requests parsed)"
    finally:
        proc.kill()
