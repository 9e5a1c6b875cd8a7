"""The vLLM engine of an asynchronous run's rollout rank, in a process of its own.

vLLM's external-launcher start-up takes torch.distributed's whole world as its own: it builds
its world, tensor-parallel and data-parallel groups with `new_group` calls that every rank of
the job must make, all-reduces the KV-cache size over that world, and (on GPUs) meets it in
barriers of its all-reduce and autotuning set-up. An async run's trainer ranks are busy
training and never join those calls. So each rollout rank starts its engine in a child process
whose world is the rollout ranks' children alone: the layout a synchronous run's engines see,
with the same VLLMEngine code. The rollout rank talks to it over a pipe: requests and results
pickled, weights as shared-memory (CPU) or CUDA IPC tensors, a bucket at a time.

    rollout rank r (job's world: trainers + rollout ranks)      its engine process (world: rollout ranks)
    generate / score / evaluate  -- prompts, params -->          VLLMEngine.generate (TP group collectives)
                                 <-- rollouts --
    receive weights (broadcast)  -- bucket, bucket, ... -->      VLLMEngine.update_weights
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import os
import signal
import socket
from typing import Iterable, Iterator

import torch
import torch.multiprocessing as mp

from vlrft.engines.weight_digest import ENGINE_DIGEST_API
from vlrft.errors import ConfigError, VlrftError
from vlrft.workers import error_text, exit_text, one_line

# Weights travel to the engine process in buckets of about this size: one round trip each, and
# at most one bucket's tensors held for it at a time.
BUCKET_BYTES = 256 * 2**20
# torchrun's variables that tie a process to the job's rendezvous; the engine process has its own.
JOB_ONLY_PREFIXES = ("TORCHELASTIC_", "GROUP_", "ROLE_")
STOP_WAIT_S = 30  # how long a closing engine process gets before it is killed


class EngineProcessError(VlrftError, RuntimeError):
    """The engine process failed or exited; one-line message naming the rollout rank."""


def child_environment(env: dict[str, str], rank: int, world: int, address: str, port: int) -> dict[str, str]:
    """The environment of rollout rank `rank`'s engine process: a torchrun-like world of the
    `world` engine processes meeting at the store served at address:port (by rollout rank 0
    itself: they join it as clients, as torchrun's workers join their agent's), on the rollout
    rank's own device (LOCAL_RANK kept)."""
    child = {k: v for k, v in env.items() if not k.startswith(JOB_ONLY_PREFIXES)}
    child.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=address, MASTER_PORT=str(port),
                 TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",  # (torch releases that
                 VLLM_ENABLE_V1_MULTIPROCESSING="0")  # prefix an agent store's keys by restart read the count)
    child.setdefault("LOCAL_RANK", "0")  # (a rank started without torchrun: a world of one)
    return child


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], limit: int | None = None) -> Iterator[list]:
    """Consecutive runs of (name, tensor) of about `limit` bytes (default BUCKET_BYTES); a run
    ends with the tensor that reaches it."""
    limit = BUCKET_BYTES if limit is None else limit
    bucket, size = [], 0
    for name, tensor in named_tensors:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when the rollout rank's dies (kill -9 included)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: a closed pipe still ends the serving loop
    if os.getppid() != parent:  # it died before the call above
        os._exit(1)


class _Closed(BaseException):
    """The rollout rank closed the pipe, or asked the engine process to end, wherever the engine
    process was waiting for it (a BaseException: no engine code catches it on its way out)."""


def _next_message(conn):
    """The rollout rank's next message; _Closed at its end ("close", or the pipe closed)."""
    try:
        message = conn.recv()
    except EOFError:
        raise _Closed from None
    if isinstance(message, tuple) and message[0] == "close":
        raise _Closed
    return message


def _incoming(conn) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights the rollout rank streams: ask for each bucket, until the end mark."""
    while True:
        conn.send(("next", None))
        bucket = _next_message(conn)
        if bucket is None:
            return
        yield from bucket


def _error(error: Exception) -> tuple[str, tuple[str, bool]]:
    """The answer that carries `error` to the rollout rank: its one-line text, and whether it
    is a configuration error (raised there as one, with its own message)."""
    if isinstance(error, ConfigError):
        return "error", (one_line(str(error)), True)
    return "error", (error_text(error), False)


# What the rollout side reads of an engine besides its methods (absent: the engine default).
ENGINE_TRAITS = ("continues_image_prompts", "scores_images", "weight_dtype")


def _serve(conn, env: dict[str, str], parent: int, engine_name: str, cfg, tokenizer, stop_ids: list[int],
           banned_ids: list[int]) -> None:
    """The engine process: join the engine processes' world, build the engine, then answer
    calls until the rollout rank closes the pipe."""
    _die_with_parent(parent)
    # A Ctrl-C or a preemption's SIGTERM reaches every process of the rank's group: the rollout
    # rank stops after a checkpoint and still needs its engine until then. It ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(env)
    from vlrft.distributed import exit_process, init_distributed
    from vlrft.engines.base import ENGINES

    try:
        init_distributed()
        # Its world is the engines' alone: the factory builds the engine itself (vLLM: VLLMEngine).
        engine = ENGINES.get(engine_name)(cfg, tokenizer, stop_ids, banned_ids)
    except Exception as error:
        conn.send(_error(error))
        exit_process(1)
    traits = {name: getattr(engine, name) for name in ENGINE_TRAITS if hasattr(engine, name)}
    if not all(hasattr(engine, name) for name in ENGINE_DIGEST_API):  # (the digest check needs all of it)
        traits.pop("weight_dtype", None)
    conn.send(("ok", traits))

    def poll_rollout_rank() -> bool:
        """Partial rollouts' hook, between two decoding steps: the rollout rank's own hook runs
        there (it may send weights, or ask for an evaluation, meanwhile); whether it loaded
        newer weights."""
        conn.send(("poll", None))
        while True:
            method, args = _next_message(conn)
            if method == "polled":
                return args
            answer(method, args)

    def answer(method: str, args) -> None:
        try:
            if method == "update_weights":
                result = engine.update_weights(_incoming(conn))
            elif method == "partial":
                engine.new_weights, result = (poll_rollout_rank if args[0] else None), None
            elif method == "generate":
                prompts, params = args
                position = {id(p): i for i, p in enumerate(prompts)}
                # Each rollout names its prompt by position: the rollout rank has the prompts already.
                result = [(position[id(r.prompt)], dataclasses.replace(r, prompt=None)) for r in engine.generate(prompts, params)]
            else:
                result = getattr(engine, method)(*args)
        except Exception as error:
            conn.send(_error(error))
            return
        conn.send(("ok", result))

    try:
        while True:
            answer(*_next_message(conn))
    except _Closed:  # (also from inside a call: a poll, a weights stream the rollout rank abandoned)
        pass
    exit_process(0)


class EngineProcess:
    """A rollout rank's engine `engine_name` (a factory of ENGINES), running in a child process
    (module docstring). It offers what the rollout side calls: generate, score, update_weights,
    prefix_cache_counts, sleep, wake, and, when `keep_weights`, named_weights (the weights last
    sent, kept on the CPU, for the policy EMA's evaluation to put back)."""

    def __init__(self, engine_name: str, cfg, tokenizer, stop_ids: list[int], banned_ids: list[int],
                 keep_weights: bool = False):
        from vlrft.distributed import all_gather_objects, rank, serve_store, world_size

        self.rank, self.keep_weights, self.kept = rank(), keep_weights, []
        self.broken = ""  # why the pipe is out of step (an exception left a call half done)
        self._hook = None  # partial rollouts' new_weights, run here when the engine polls
        # The engines' store is served from rollout rank 0, bound here to a port the system picks:
        # a port found free now and bound by the engine process later, after seconds of imports,
        # could be taken by another program meanwhile.
        self.store = serve_store() if self.rank == 0 else None
        meeting = all_gather_objects((socket.gethostname(), socket.getfqdn(), self.store.port if self.store else 0))
        single_node = len({host for host, _, _ in meeting}) == 1
        address = "127.0.0.1" if single_node else meeting[0][1]
        env = child_environment(dict(os.environ), self.rank, world_size(), address, meeting[0][2])
        context = mp.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.process = context.Process(target=_serve, name=f"vlrft-{engine_name}-engine-{self.rank}",
                                       args=(child_end, env, os.getpid(), engine_name, cfg, tokenizer, stop_ids, banned_ids))
        self.process.start()
        child_end.close()  # only the child holds it now: its exit closes the pipe (EOF here)
        atexit.register(self.close)
        for name, value in self._reply(self._receive(starting=True)).items():
            setattr(self, name, value)

    @property
    def new_weights(self):
        """Partial rollouts' hook (async_roles): the engine, between two decoding steps, asks
        this process to run it (`_receive`)."""
        return self._hook

    @new_weights.setter
    def new_weights(self, hook) -> None:
        self._call("partial", hook is not None)
        self._hook = hook

    def _exited(self, starting: bool = False) -> EngineProcessError:
        self.process.join(5)
        return EngineProcessError(
            f"the engine process of rollout rank {self.rank} exited ({exit_text(self.process.exitcode)}) "
            f"{'while starting' if starting else 'during a call'}: its own error is in the run log above")

    def _send(self, message) -> None:
        if self.broken:
            raise EngineProcessError(f"engine process of rollout rank {self.rank}: {self.broken}")
        try:
            self.conn.send(message)
        except (OSError, ValueError):  # (BrokenPipeError: it is gone)
            raise self._exited() from None

    def _receive(self, starting: bool = False) -> tuple[str, object]:
        """The engine's next message, after running the hook for each poll it sends meanwhile."""
        while True:
            try:
                kind, value = self.conn.recv()
            except (EOFError, ConnectionError):
                raise self._exited(starting) from None
            if kind != "poll":
                return kind, value
            try:
                took = self._hook is not None and bool(self._hook())
            except BaseException as error:  # the engine waits for an answer that will not come
                self.broken = f"partial rollouts' hook failed ({type(error).__name__}) while the engine waited on it"
                raise
            self._send(("polled", took))

    def _reply(self, answer: tuple[str, object]):
        """The value of the engine's answer; its error raised here."""
        kind, value = answer
        if kind == "error":
            message, is_config = value
            if is_config:
                raise ConfigError(message)
            raise EngineProcessError(f"engine process of rollout rank {self.rank}: {message}")
        if kind != "ok":
            raise EngineProcessError(f"engine process of rollout rank {self.rank} answered {kind!r} out of turn")
        return value

    def _call(self, method: str, *args):
        self._send((method, args))
        return self._reply(self._receive())

    def generate(self, prompts: list, params) -> list:
        return [dataclasses.replace(r, prompt=prompts[i]) for i, r in self._call("generate", prompts, params)]

    def score(self, rollouts: list, temperature: float) -> list[torch.Tensor]:
        return self._call("score", rollouts, temperature)

    def prefix_cache_counts(self) -> tuple[float, float]:
        return self._call("prefix_cache_counts")

    def served_digests(self) -> dict[str, int]:
        """The engine's digests of what it serves (checked only where it has `weight_dtype`)."""
        return self._call("served_digests")

    def expected_digests(self, sent: dict[str, int]) -> dict[str, int]:
        return self._call("expected_digests", sent)

    def sleep(self) -> None:
        self._call("sleep")

    def wake(self) -> None:
        self._call("wake")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream the weights to the engine, a bucket each time it asks for one. The stream is
        read to its end whatever happens: it is a broadcast the trainers are sending."""
        stream, kept = iter(named_tensors), []
        try:
            self._send(("update_weights", ()))
            for bucket in buckets(stream):
                if self.keep_weights:  # (a CPU tensor is the stream's own, never written again: kept as it is)
                    kept += [(name, tensor.to("cpu")) for name, tensor in bucket]
                answer = self._receive()
                if answer[0] != "next":  # it stopped reading: an error, or done before the end
                    break
                self._send(bucket)
            else:
                answer = self._receive()
                if answer[0] == "next":
                    self._send(None)
                    self._reply(self._receive())
                    if torch.cuda.is_available():  # the engine has let go of the buckets' memory: free it here
                        torch.cuda.ipc_collect()
                    # (A version without tensors, a frozen actor's, leaves the weights as they were.)
                    self.kept = kept or self.kept
                    return
        except EngineProcessError:
            for _ in stream:
                pass
            raise
        except BaseException as error:  # the stream failed: the engine waits for a bucket
            self.broken = f"a weights stream failed ({type(error).__name__}) while the engine read it"
            raise
        for _ in stream:
            pass
        self._reply(answer)  # raises the engine's error
        raise EngineProcessError(f"the engine of rollout rank {self.rank} stopped reading weights before their end")

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.keep_weights:
            raise EngineProcessError("named_weights needs EngineProcess(keep_weights=True)")
        return iter(self.kept)

    def close(self) -> None:
        """End the engine process (at exit): ask, then wait, then kill."""
        if self.process.is_alive():
            try:
                self.conn.send(("close", None))
            except (OSError, ValueError):
                pass
            self.process.join(STOP_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
