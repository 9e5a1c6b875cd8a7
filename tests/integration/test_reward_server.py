"""A real `vlrft reward-server` process on loopback, scored through the `remote` recipe inside
a reward mix: normal scoring, server down, slow server, bad requests, concurrency limit."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from PIL import Image

from vlrft.config import RecipeSpec, RewardConfig
from vlrft.rewards import RewardMix
from vlrft.rewards.remote import RemoteRewardError, remote_reward

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


def in_flight(completions, samples):
    with _lock:
        _in_flight[0] += 1
        _in_flight[1] = max(_in_flight)
    time.sleep(0.3)
    with _lock:
        _in_flight[0] -= 1
        return [float(_in_flight[1])] * len(completions)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(recipe: str, tmp_path, threads: int = 4):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlrft.cli", "reward-server", "--recipe", recipe, "--port", str(port),
         "--threads", str(threads)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                assert json.loads(r.read()) == {"status": "ok", "recipe": recipe}
                return proc, url
        except OSError:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("reward server did not come up")


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
        bad = urllib.request.Request(url + "/score", data=b'{"completions": ["a"]}',
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(bad, timeout=5)
        assert err.value.code == 400 and "completions" in json.loads(err.value.read())["error"]
        # A recipe failing on the server is a 500, retried; a 4xx (wrong URL) is not retried.
        with pytest.raises(RemoteRewardError, match=r"HTTP 500: recipe .* failed: raised KeyError: 'images' \(after 3 attempts\)"):
            remote_reward(["a"], [{"id": 1}], url, retries=2, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match=r"HTTP 404: .* \(after 1 attempts\)"):
            remote_reward(["a"], [{"id": 1}], url + "/nowhere", retries=3)
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
                               "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"vlrft: error: reward server cannot listen on 127.0.0.1:{port}")
