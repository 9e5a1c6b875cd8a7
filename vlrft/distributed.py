"""The process group and every collective vlrft makes (the only module that calls
torch.distributed; a test checks that).

Device story: each rank binds the GPU `LOCAL_RANK` names before the process group exists, and
the group routes each tensor by its device (`cpu:gloo,cuda:nccl`), so DeepSpeed's and vLLM's
CUDA collectives go through NCCL while object collectives and CPU bookkeeping use gloo. The
helpers below run tensor collectives on `comm_device()` (the GPU under NCCL, the CPU under
gloo) and return results on the caller's device.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import multiprocessing
import os
import pickle
import socket
import sys
from typing import Callable, Iterable, Iterator, NoReturn

import torch
import torch.distributed as dist

from vlrft.cpu_memory import keep_freed_memory
from vlrft.errors import VlrftError

# Long enough for rank-0-only work between two collectives (writing a 7B final checkpoint, a
# checkpoint rotation on a slow shared file system); a hung collective still ends the job.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=60)


class LaunchError(VlrftError, RuntimeError):
    """The processes were started in a way that cannot form one run; one-line message."""


def lost_store(err: BaseException) -> bool:
    """Whether `err` is the job's key-value store gone (its host rank died): DistNetworkError."""
    return isinstance(err, dist.DistNetworkError)


def free_port() -> int:
    """A TCP port free on every interface of this host now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def serve_store() -> dist.TCPStore:
    """A key-value store served by this process on every interface, on a port the system
    picks as it binds it (`.port`): processes started later join it as clients, with no window
    in which another program could take a port found free first."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def launch_problem(env: dict[str, str]) -> str:
    """Why this process cannot join a run from its environment ("" when it can). A plain
    `srun python -m vlrft.cli ...` with several tasks starts N processes that each think they
    are a world of one, all writing one output directory: refuse it."""
    if "RANK" in env:
        return ""
    tasks = int(env.get("SLURM_NTASKS", "1") or 1)
    if tasks > 1:
        return (
            f"started as one of {tasks} Slurm tasks without torchrun's RANK/WORLD_SIZE: launch one torchrun per "
            "node (see examples/slurm/train.sbatch), or run a single task"
        )
    return ""


def device() -> torch.device:
    """This rank's compute device: the GPU `LOCAL_RANK` names, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed() -> tuple[int, int]:
    """Join the torchrun process group; a plain `python` run is a world of one. Returns
    (rank, world_size)."""
    if not dist.is_initialized():
        if getattr(multiprocessing.current_process(), "_inheriting", False):  # (multiprocessing's own flag)
            raise LaunchError(
                "the launch script starts training when it is imported, and a process vlrft started with "
                "`spawn` (an asynchronous run's engine process) imports it again: put the script's training "
                "code under `if __name__ == \"__main__\":`")
        problem = launch_problem(dict(os.environ))
        if problem:
            raise LaunchError(problem)
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        if torch.cuda.is_available():
            here = device()
            torch.cuda.set_device(here)  # before the group: NCCL binds the current device
            dist.init_process_group("cpu:gloo,cuda:nccl", timeout=PROCESS_GROUP_TIMEOUT, device_id=here)
        else:
            keep_freed_memory()  # CPU ranks: no page faults for every large activation (cpu_memory.py)
            dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def watch_store(timeout_s: float):
    """A connection of its own to the process group's key-value store (the TCPStore that
    torchrun or MASTER_ADDR:MASTER_PORT serves), for vlrft.rank_watch's thread. A clone may be
    used beside the group's own connection, and its timeout bounds each call (the group's is
    PROCESS_GROUP_TIMEOUT)."""
    # torch has no public accessor for the default group's store: this is vlrft's one private use.
    store = dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def shutdown_distributed() -> None:
    """Destroy the process group (in-process callers: tests, notebooks), after the callbacks
    `before_shutdown` registered. Only on a clean exit: a rank whose peers died mid-collective
    could hang here instead. A script's last line should be `exit_process()`, which does this
    and more."""
    while _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.pop()()
    if dist.is_initialized():
        dist.destroy_process_group()


_BEFORE_SHUTDOWN: list = []  # callbacks shutdown_distributed runs while the process group still exists


def before_shutdown(callback) -> None:
    """Have `shutdown_distributed` call `callback()` before it destroys the process group (an
    engine that built groups of its own in it tears them down then: vLLM)."""
    _BEFORE_SHUTDOWN.append(callback)


def exit_process(code: int = 0) -> NoReturn:
    """End a rank's process after its work is done and written: destroy the process group, run
    the atexit handlers (wandb, temporary files), flush, and exit through the C library, which
    runs C and C++ exit handlers (vLLM's CPU engine unlinks its shared-memory segments there)
    but not the interpreter's finalisation.

    Finalisation aborted finished runs now and then (SIGABRT, "terminate called without an
    active exception": 4-5 in 20 two-rank runs on a loaded machine): a gloo worker thread that
    is still releasing the tensors of the last collective waits for the GIL, and a thread that
    gets it while the interpreter finalises is ended inside a C++ destructor. Groups that other
    libraries still reference (DeepSpeed holds the default one) keep their threads until exit.
    The libc call releases the GIL, so such a thread finishes normally."""
    shutdown_distributed()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).exit(code)  # does not return


# Asynchronous training splits the ranks into roles (rollout, trainer): from `take_role` on,
# every helper here works within the rank's role group, so the phases' collectives (a rank
# balance, a metric's all-reduce, DeepSpeed's gradients) run among the ranks of one role.
# None = the whole world. Messages between the roles use the `*_to_rank` helpers below, which
# name global ranks.
_ROLE_GROUP = None
_SELF_GROUP = None  # a group of this rank alone (DeepSpeed's model-parallel group under roles)


def take_role(members: list[int], all_roles: list[list[int]]):
    """Make the group of `members` (this rank's role) the default of every helper here.
    `all_roles` lists every role's ranks: every rank creates every group, in the same order.
    Returns the group."""
    global _ROLE_GROUP, _SELF_GROUP
    groups = new_groups(all_roles)
    _SELF_GROUP = new_groups([[r] for r in range(dist.get_world_size())])[dist.get_rank()]
    _ROLE_GROUP = groups[all_roles.index(members)]
    return _ROLE_GROUP


def role_group():
    """The group this rank's helpers use (None: the whole world)."""
    return _ROLE_GROUP


def self_group():
    """A group of this rank alone, once roles are taken."""
    return _SELF_GROUP


def rank(group=None) -> int:
    """This rank's index in `group` (default: its role group, else the world)."""
    return dist.get_rank(group or _ROLE_GROUP) if dist.is_initialized() else 0


def world_size(group=None) -> int:
    """Ranks in `group` (default: this rank's role group, else the world)."""
    return dist.get_world_size(group or _ROLE_GROUP) if dist.is_initialized() else 1


def backend_name() -> str:
    """The world's torch.distributed backend (gloo, nccl)."""
    return dist.get_backend()


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def global_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_world_size() -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE; a world of one outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def comm_device() -> torch.device:
    """Where tensor collectives run: the rank's GPU when the group has NCCL, else the CPU."""
    return device() if torch.cuda.is_available() and dist.is_initialized() else torch.device("cpu")


def all_reduce_sum(values: torch.Tensor, out_device: torch.device | str | None = None) -> torch.Tensor:
    """Sum over ranks, as float32, on `out_device` (default: where `values` is)."""
    out = values.detach().to(comm_device(), dtype=torch.float32, copy=True)
    if world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_ROLE_GROUP)
    return out.to(out_device if out_device is not None else values.device)


def all_reduce_max_int(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long, device=comm_device())
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_ROLE_GROUP)
    return int(t.item())


def all_gather_1d(values: torch.Tensor) -> torch.Tensor:
    """Concatenate a 1-D tensor of any length from every rank (rank order), on `values`' device."""
    world = world_size()
    if world == 1:
        return values
    comm = comm_device()
    sizes = [torch.zeros(1, dtype=torch.long, device=comm) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([values.numel()], device=comm), group=_ROLE_GROUP)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=values.dtype, device=comm)
    padded[: values.numel()] = values.detach().to(comm)
    parts = [torch.zeros(longest, dtype=values.dtype, device=comm) for _ in range(world)]
    dist.all_gather(parts, padded, group=_ROLE_GROUP)
    return torch.cat([p[: int(s)] for p, s in zip(parts, sizes)]).to(values.device)


def all_gather_objects(obj, group=None) -> list:
    """Every rank's picklable `obj`, in rank order (within `group` when given)."""
    if world_size(group) == 1:
        return [obj]
    gathered: list = [None] * world_size(group)
    dist.all_gather_object(gathered, obj, group=group or _ROLE_GROUP)
    return gathered


def gather_objects_to_rank0(obj) -> list | None:
    """Every rank's `obj` on rank 0 (rank order); None on the other ranks."""
    if world_size() == 1:
        return [obj]
    gathered = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, gathered, dst=_to_global(0), group=_ROLE_GROUP)
    return gathered


def send_objects(transfers: list[tuple[int, int, list]]) -> list:
    """Point-to-point object transfers `(source rank, destination rank, objects)`; every rank
    passes the same list (the objects matter only on their source) and gets back what was sent
    to it, in list order. Transfers run one at a time in list order, so the earliest unfinished
    one always has both of its ranks waiting on it: no deadlock, and each object crosses the
    wire once (an all-gather would send it to every rank)."""
    me = rank()
    received: list = []
    for source, destination, objects in transfers:
        if me == source:
            dist.send_object_list([objects], dst=_to_global(destination))
        elif me == destination:
            box = [None]
            dist.recv_object_list(box, src=_to_global(source))
            received += box[0]
    return received


def broadcast_from_rank0(obj):
    """Rank 0's picklable `obj` on every rank (decisions one rank makes for all: resume)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=_to_global(0), group=_ROLE_GROUP)
    return box[0]


def barrier() -> None:
    if world_size() > 1:
        dist.barrier(group=_ROLE_GROUP)


def _to_global(role_rank: int) -> int:
    """The global rank of rank `role_rank` of this rank's role group."""
    return dist.get_global_rank(_ROLE_GROUP, role_rank) if _ROLE_GROUP is not None else role_rank


def new_groups(rank_lists: list[list[int]]) -> list:
    """A process group per rank list; every rank must create every group, in the same order."""
    return [dist.new_group(ranks) for ranks in rank_lists]


class PendingSend:
    """An object on its way to another rank; `wait()` before its buffers may go."""

    def __init__(self, works: list, buffers: list[torch.Tensor]):
        self.works, self.buffers = works, buffers

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.buffers = [], []


def isend_object_to(destination: int, obj) -> PendingSend:
    """Send picklable `obj` to global rank `destination` without waiting for it to arrive
    (messages between the roles of asynchronous training; CPU tensors, so gloo carries them)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    return PendingSend([dist.isend(size, destination), dist.isend(data, destination)], [size, data])


def recv_object_from(source: int):
    """The next object global rank `source` sent here with `isend_object_to` (waits for it)."""
    size = torch.zeros(1, dtype=torch.long)
    dist.recv(size, source)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, source)
    return pickle.loads(data.numpy().tobytes())


WEIGHTS_HEADER = "vlrft-weights"  # the first object of every weights broadcast
EMA_HEADER = "vlrft-ema-weights"  # ... of the policy EMA's, sent for an evaluation after the version it follows


def _broadcast_object(obj, source: int, group):
    box = [obj]
    dist.broadcast_object_list(box, src=source, group=group)
    return box[0]


def broadcast_weights(group, source: int, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]],
                      header: str = WEIGHTS_HEADER) -> None:
    """Send weights `version` from global rank `source` (this one) to the other ranks of
    `group`: a header, then each tensor after its name, shape and dtype, then an end mark. One
    tensor in flight at a time: a ZeRO-3 gather yields one full parameter after another."""
    _broadcast_object((header, version), source, group)
    for name, tensor in named_tensors:
        tensor = tensor.detach().to(comm_device()).contiguous()
        _broadcast_object((name, tuple(tensor.shape), tensor.dtype), source, group)
        dist.broadcast(tensor, src=source, group=group)
    _broadcast_object(None, source, group)


def received_weights(group, source: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the weights broadcast in progress (after its header), as they arrive."""
    while (meta := _broadcast_object(None, source, group)) is not None:
        name, shape, dtype = meta
        tensor = torch.empty(shape, dtype=dtype, device=comm_device())
        dist.broadcast(tensor, src=source, group=group)
        yield name, tensor


class WeightsError(VlrftError, RuntimeError):
    """A weights broadcast that is not the one expected; one-line message."""


def receive_weights(group, source: int, expected_version: int, load: Callable[[Iterator], None],
                    header: str = WEIGHTS_HEADER) -> int:
    """Receive the next weights broadcast (from global rank `source`) into `load` (an engine's
    update, streaming the (name, tensor) pairs); it must be version `expected_version` (versions
    arrive in order, none skipped) of the weights `header` names. Returns the version."""
    got = _broadcast_object(None, source, group)
    if not (isinstance(got, tuple) and got[0] == header and got[1] == expected_version):
        what = "weights" if header == WEIGHTS_HEADER else "EMA weights"
        raise WeightsError(f"rank {dist.get_rank()} expected {what} version {expected_version} from rank {source}, got {got!r}")
    load(received_weights(group, source))
    return expected_version



# Sequence parallelism (models/sequence_parallel.py): the collectives of the ranks that share a
# micro-batch, differentiable, so the backward runs the inverse exchange.


def sequence_groups(size: int) -> tuple[object, int]:
    """Groups of `size` consecutive ranks (each creates every group, in order): this rank's
    group and its place in it."""
    world, me = dist.get_world_size(), dist.get_rank()
    groups = new_groups([list(range(start, start + size)) for start in range(0, world, size)])
    return groups[me // size], me % size


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """`x` cut into equal pieces along `scatter_dim`, piece i sent to rank i of `group`; what
    arrives concatenated along `gather_dim` in rank order."""
    pieces = torch.stack(x.chunk(dist.get_world_size(group), dim=scatter_dim))  # [N, ...piece]
    arrived = torch.empty_like(pieces)
    dist.all_to_all_single(arrived, pieces, group=group)
    return torch.cat(arrived.unbind(0), dim=gather_dim)


def _anchor() -> torch.Tensor:
    """An input that puts a collective's backward into every rank's graph under grad mode. A
    Function's output requires grad only if an input does, and this rank's may not where a
    peer's does (a frozen vision tower's embeddings here, trained ones there; a rank with no
    image to encode): its backward, a collective, would then run on some ranks only."""
    return torch.zeros(0, requires_grad=torch.is_grad_enabled())


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group, anchor):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Ulysses' exchange: e.g. [1, H, T/N, D] -> [1, H/N, T, D] with scatter_dim 1 (heads),
    gather_dim 2 (tokens); its gradient goes back by the exchange with the dims swapped."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group, _anchor())


class _GatherPieces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes: tuple[int, ...], group, anchor):
        ctx.sizes, ctx.group = sizes, group
        longest = max(sizes)
        padded = torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])])
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad):
        sizes, longest = ctx.sizes, max(ctx.sizes)
        pieces = [torch.cat([g, g.new_zeros(longest - g.shape[0], *g.shape[1:])]) for g in grad.split(list(sizes))]
        mine = grad.new_empty(longest, *grad.shape[1:])
        # Every rank used the whole; the gradient of this rank's piece is the sum of their uses.
        dist.reduce_scatter_tensor(mine, torch.cat(pieces).contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return mine[: sizes[dist.get_rank(ctx.group)]], None, None, None


def gather_pieces(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every rank's `x` ([sizes[rank], ...]) concatenated along dim 0 in rank order, on every
    rank of `group`; backward: the sum over the ranks of each piece's gradient, to its owner."""
    return _GatherPieces.apply(x, tuple(sizes), group, _anchor())


def sum_over(values: torch.Tensor, group) -> torch.Tensor:
    """`values` summed over the ranks of `group` (no gradient): the pieces ranks computed of one
    whole, each zero where another rank's piece is."""
    out = values.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out
