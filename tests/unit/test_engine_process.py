"""A rollout engine in a child process (vlrft/engines/engine_process.py, how an async run's
rollout rank runs vLLM), exercised with the HF engine: the same answers as in-process, weights
streamed in buckets, errors named, and no engine process outliving its rollout rank."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from vlrft.config import Config
from vlrft.data.dataset import load_rows
from vlrft.engines import SamplingParams
from vlrft.engines import engine_process
from vlrft.engines.engine_process import EngineProcess, EngineProcessError, buckets, child_environment
from vlrft.engines.weight_digest import DigestCheck, WeightDigestError, tensor_digest
from vlrft.models.loader import banned_token_ids, load_model, stop_token_ids
from tests.process_env import fresh_process_env
from tests.unit.test_engine import make_engine

GREEDY = SamplingParams(n=2, max_new_tokens=5, temperature=1.0, greedy=True)


def test_the_engine_process_joins_its_own_world_on_its_rank_s_device():
    job = {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_RANK": "0", "ROLE_WORLD_SIZE": "6", "PATH": "/bin"}
    child = child_environment(job, 1, 2, "127.0.0.1", 4242)
    # The agent's store holds the job's keys: the engines' world gets a store of its own, which
    # rollout rank 0 serves (so every engine process joins it as a client).
    assert "GROUP_RANK" not in child and "ROLE_WORLD_SIZE" not in child
    assert child["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert (child["RANK"], child["WORLD_SIZE"], child["MASTER_ADDR"], child["MASTER_PORT"]) == ("1", "2", "127.0.0.1", "4242")
    assert child["LOCAL_RANK"] == "1" and child["PATH"] == "/bin" and child["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_weights_go_in_buckets_that_end_with_the_tensor_that_fills_them():
    tensors = [(str(i), torch.zeros(n)) for i, n in enumerate([10, 20, 50, 5, 1])]  # float32: 4 bytes each
    assert [[name for name, _ in b] for b in buckets(tensors, limit=100)] == [["0", "1"], ["2"], ["3", "4"]]
    assert [len(b) for b in buckets(tensors, limit=10**9)] == [5]


@pytest.fixture(scope="module")
def engines(tiny_text, addition_data):
    """The same engine in this process and in a child process (keeping the weights sent)."""
    local, encoder = make_engine(tiny_text)
    cfg = Config()
    cfg.model.path = tiny_text
    tok = encoder.tokenizer
    child = EngineProcess("hf", cfg, tok, stop_token_ids(tok), banned_token_ids(tok), keep_weights=True)
    prompts = [encoder.encode(r, i) for i, r in enumerate(load_rows(addition_data / "test.jsonl")[:3])]
    yield local, child, prompts
    child.close()


def moved_weights(path: str, scale: float) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach() * scale) for name, p in load_model(path).named_parameters()]


def test_it_answers_and_loads_weights_as_the_engine_in_process(engines, tiny_text, monkeypatch):
    local, child, prompts = engines
    assert child.store.num_keys() > 0  # the engine process's world met at the store served here
    answered = child.generate(prompts, GREEDY)
    assert [r.response_ids for r in answered] == [r.response_ids for r in local.generate(prompts, GREEDY)]
    assert all(r.prompt is prompts[r.group_id] for r in answered)  # the caller's prompts, not copies
    monkeypatch.setattr(engine_process, "BUCKET_BYTES", 4096)  # many buckets: each one asked for
    weights = moved_weights(tiny_text, 1.5)
    child.update_weights(iter(weights))
    local.update_weights(iter(weights))
    after = child.generate(prompts, GREEDY)
    assert [r.response_ids for r in after] == [r.response_ids for r in local.generate(prompts, GREEDY)]
    assert [r.response_ids for r in after] != [r.response_ids for r in answered]  # the weights did change it
    scores = child.score(after, 1.0)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(scores, local.score(after, 1.0)))
    child.update_weights(iter([]))  # a version without tensors (a frozen actor's): the weights stay
    kept = dict(child.named_weights())
    assert sorted(kept) == sorted(name for name, _ in weights)
    assert all(torch.equal(kept[name], tensor) for name, tensor in weights)


def test_digests_cross_the_pipe_and_name_a_layer_the_child_left_out(engines, tiny_text):
    """The exact sync check through an engine process: the child computes the digests of what it
    serves, the rollout rank those of what it sent; a sync that leaves a layer out is named."""
    local, child, _ = engines
    assert child.weight_dtype == local.weight_dtype == torch.float32
    weights = moved_weights(tiny_text, 1.25)
    DigestCheck(child, "hf").update(iter(weights), "at weights version 1")  # healthy: no error
    assert child.served_digests() == {name: tensor_digest(tensor) for name, tensor in weights}
    half = [(name, tensor * 2) for name, tensor in weights if ".layers.1." not in name]
    with pytest.raises(WeightDigestError, match=r"at weights version 2: the 'hf' engine .* \d+ of the engine's were not "
                                                r"sent \('model\.layers\.1\."):
        DigestCheck(child, "hf").update(iter(half), "at weights version 2")


def test_partial_rollouts_hook_runs_in_the_rollout_rank_between_the_engine_s_decoding_steps(engines, tiny_text):
    """The engine process asks its rollout rank between two decoding steps (a poll); the hook
    runs here, sends new weights meanwhile (a call nested inside the generate call), and the
    responses go on under them: the same tokens and logprobs as the engine in process."""
    local, child, prompts = engines
    start, moved = moved_weights(tiny_text, 1.0), moved_weights(tiny_text, 1.5)
    results = []
    for engine in (local, child):
        engine.update_weights(iter(start))
        polls = []

        def new_weights(engine=engine, polls=polls) -> bool:
            polls.append(1)
            if len(polls) == 2:
                engine.update_weights(iter(moved))
                return True
            return False

        engine.new_weights = new_weights
        results.append((engine.generate(prompts, GREEDY), len(polls)))
        engine.new_weights = None
    (here, here_polls), (there, there_polls) = results
    assert there_polls == here_polls > 2
    assert [r.response_ids for r in there] == [r.response_ids for r in here]
    assert all(torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6) for a, b in zip(there, here))
    # Without the update at the second poll the responses differ: the hook's weights were used.
    child.update_weights(iter(start))
    assert [r.response_ids for r in child.generate(prompts, GREEDY)] != [r.response_ids for r in there]


def test_an_engine_error_is_named_and_the_weights_stream_is_read_to_its_end(engines, tiny_text, monkeypatch):
    local, child, prompts = engines
    monkeypatch.setattr(engine_process, "BUCKET_BYTES", 4096)
    weights = moved_weights(tiny_text, 1.0)
    read = []

    def stream():  # a broadcast: the trainers send every tensor whatever the engine does
        for item in [weights[0], ("model.no_such_weight", torch.zeros(3)), *weights[1:]]:
            read.append(item[0])
            yield item

    with pytest.raises(EngineProcessError, match="rollout rank 0: KeyError: .*no parameter 'model.no_such_weight'"):
        child.update_weights(stream())
    assert len(read) == len(weights) + 1
    assert len(child.generate(prompts, GREEDY)) == 2 * len(prompts)  # it still serves


def hf_engine_process(tiny_text, addition_data):
    """A fresh HF engine process and three prompts."""
    _, encoder = make_engine(tiny_text)
    cfg = Config()
    cfg.model.path = tiny_text
    tok = encoder.tokenizer
    prompts = [encoder.encode(r, i) for i, r in enumerate(load_rows(addition_data / "test.jsonl")[:3])]
    return EngineProcess("hf", cfg, tok, stop_token_ids(tok), banned_token_ids(tok)), prompts


def test_an_engine_process_that_dies_stops_the_next_call(tiny_text, addition_data):
    child, prompts = hf_engine_process(tiny_text, addition_data)
    child.process.kill()
    child.process.join()  # gone before the call: the request cannot even be sent
    with pytest.raises(EngineProcessError, match="engine process of rollout rank 0 exited \\(killed by SIGKILL\\) during a call"):
        child.generate(prompts, GREEDY)
    cfg = Config()
    cfg.model.path = "/nonexistent/model"  # a start-up failure is raised too, with the engine's own message
    with pytest.raises(EngineProcessError, match="rank 0: FileNotFoundError: no HF checkpoint \\(config.json\\) in /nonexistent"):
        EngineProcess("hf", cfg, None, [0], [])


def test_a_stop_signal_leaves_the_engine_to_its_rollout_rank(tiny_text, addition_data):
    """Ctrl-C and a preemption's SIGTERM reach the whole process group: the rollout rank stops
    after a checkpoint and needs its engine until then."""
    child, prompts = hf_engine_process(tiny_text, addition_data)
    os.kill(child.process.pid, signal.SIGTERM)
    os.kill(child.process.pid, signal.SIGINT)
    assert len(child.generate(prompts, GREEDY)) == 2 * len(prompts)
    child.close()
    assert child.process.exitcode == 0


def test_a_call_failing_on_this_side_leaves_no_engine_waiting(tiny_text, addition_data):
    """An exception in the partial-rollouts hook (a broadcast that failed) or in a weights stream
    leaves the engine waiting inside a call: later calls say so, and closing ends it at once."""
    for failing in ("hook", "stream"):
        child, prompts = hf_engine_process(tiny_text, addition_data)

        def broken_hook():
            raise ConnectionError("broadcast failed")

        def broken_stream():
            yield from moved_weights(tiny_text, 1.0)[:2]
            raise ConnectionError("broadcast failed")

        with pytest.raises(ConnectionError, match="broadcast failed"):
            if failing == "hook":
                child.new_weights = broken_hook
                child.generate(prompts, GREEDY)
            else:
                child.update_weights(broken_stream())
        with pytest.raises(EngineProcessError, match="rank 0: .* failed \\(ConnectionError\\) while the engine"):
            child.generate(prompts, GREEDY)
        start = time.monotonic()
        child.close()
        assert child.process.exitcode == 0 and time.monotonic() - start < 10, failing


RANK = """
import sys
from vlrft.config import Config
from vlrft.engines.engine_process import EngineProcess
from transformers import AutoTokenizer
cfg = Config()
cfg.model.path = sys.argv[1]
child = EngineProcess("hf", cfg, AutoTokenizer.from_pretrained(sys.argv[1]), [0], [])
print(child.process.pid, flush=True)
input()
"""


def test_an_engine_process_ends_with_its_rollout_rank_killed(tiny_text):
    rank = subprocess.Popen([sys.executable, "-c", RANK, tiny_text], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    engine = psutil.Process(int(rank.stdout.readline()))
    assert engine.is_running()
    rank.kill()  # kill -9: no atexit handler runs
    rank.wait()
    engine.wait(timeout=20)  # the kernel's parent-death signal, not a timeout of ours


UNGUARDED_LAUNCH_SCRIPT = """
import sys
from transformers import AutoTokenizer
from vlrft.config import Config
from vlrft.distributed import init_distributed
from vlrft.engines.engine_process import EngineProcess
init_distributed()  # training at import, no `if __name__ == "__main__":`
cfg = Config()
cfg.model.path = sys.argv[1]
EngineProcess("hf", cfg, AutoTokenizer.from_pretrained(sys.argv[1]), [0], [])
"""


def test_a_launch_script_that_trains_at_import_is_told_to_guard_it(tiny_text, tmp_path):
    # The engine process starts by spawn, which imports the launch script again: without the
    # guard it would start a second training run inside the engine process.
    script = tmp_path / "train_task.py"
    script.write_text(UNGUARDED_LAUNCH_SCRIPT)
    done = subprocess.run([sys.executable, str(script), tiny_text], capture_output=True, text=True, timeout=300,
                          env=fresh_process_env(PYTHONPATH=os.getcwd()))
    assert done.returncode != 0
    assert ("LaunchError: the launch script starts training when it is imported, and a process vlrft started with "
            "`spawn` (an asynchronous run's engine process) imports it again: put the script's training code under "
            '`if __name__ == "__main__":`') in done.stderr
    assert "engine process of rollout rank 0 exited (exit code 1) while starting" in done.stderr


BUSY_RANK = """
import multiprocessing, os, sys, time
from vlrft.engines.engine_process import _die_with_parent

def busy(parent, ready):  # an engine process stuck in a call (a hung collective): it never reads its pipe
    _die_with_parent(parent)
    open(ready, "w").close()
    time.sleep(300)

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=busy, args=(os.getpid(), sys.argv[1]))
    child.start()
    print(child.pid, flush=True)
    time.sleep(300)
"""


def test_a_busy_engine_process_is_killed_with_its_rollout_rank(tmp_path):
    script = tmp_path / "busy_rank.py"
    script.write_text(BUSY_RANK)
    ready = tmp_path / "ready"
    rank = subprocess.Popen([sys.executable, str(script), str(ready)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    engine = psutil.Process(int(rank.stdout.readline()))
    while not ready.exists():  # started, and past the prctl call
        time.sleep(0.1)
    rank.kill()
    rank.wait()
    engine.wait(timeout=10)  # the kernel's SIGKILL, long before its sleep ends (no timeout error)
    assert not engine.is_running()
