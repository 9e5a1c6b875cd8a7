"""Exact weight-sync check: a digest of every tensor the trainer sends, compared by name with a
digest the engine computes of the tensor it serves after the sync.

A logprob probe needs a limit loose enough for a bf16 engine, which a partial sync in fp32 slips
under (an fp32 engine missing one decoder layer moves the probe by 0.005-0.015). A digest has
no limit: the engine serves the bits sent, cast to its dtype, or the sync failed.

    y(x)      = m xor (m >> 16),  m = bits(float32(x)) * 0x9E3779B1   (signed 32-bit integers)
    digest(t) = (S1, S2) = (sum of y, sum of y^2) over the elements x of t, each mod 2^32

`y` is a bijection of 32-bit integers with y(0) = 0 (an odd multiplier, then a xor-shift): one
changed element always changes S1; several changes cancel in both sums with a chance of about
2^-64. The sums ignore element order and zeros, so the digests of a tensor's pieces add up (lane
by lane) to the whole's:
an engine that fuses q, k and v into one tensor, or holds a tensor-parallel shard per rank,
reports sums that compare with the trainer's per-tensor digests, and zero padding adds nothing.
The price: a permutation of one tensor's elements goes unseen (the logprob probe sees what that
does). Integer arithmetic that wraps, so every device and every summation order computes the
same digest. Each tensor is read in chunks on its own device, into two reused integer buffers:
on CPU about 1.5 times a copy of the tensor (bench/sync_digest.py), never a copy of the model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

from vlrft.errors import VlrftError

# The 32-bit golden-ratio multiplier, as a signed 32-bit integer (torch's int32 wraps).
_MULTIPLIER = 0x9E3779B1 - (1 << 32)
_CHUNK = 1 << 24  # elements per step: two int32 buffers of 64 MiB
_LANE = (1 << 32) - 1


class WeightDigestError(VlrftError, RuntimeError):
    """The engine does not serve the tensors the trainer sent; one-line message."""


_BUFFERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _buffers(device: torch.device, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two int32 buffers of at least `size` elements on `device`, kept between calls: a sync
    digests hundreds of tensors, and fresh CPU pages cost as much as the arithmetic."""
    held = _BUFFERS.get(device)
    if held is None or held[0].numel() < size:
        held = _BUFFERS[device] = tuple(torch.empty(size, dtype=torch.int32, device=device) for _ in range(2))
    return held


@torch.no_grad()
def tensor_digest(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """The digest of `tensor` as an engine holding it in `dtype` (default: its own) serves it,
    as one integer: S1 + S2 * 2^32."""
    flat = tensor.detach().reshape(-1)
    # A CPU tensor (the policy EMA, an engine process's bucket) is digested on the GPU where
    # there is one: the same integers, tens of times faster.
    work = torch.device("cuda") if flat.device.type == "cpu" and torch.cuda.is_available() else flat.device
    y, scratch = _buffers(work, min(flat.numel(), _CHUNK))
    s1 = s2 = torch.zeros((), dtype=torch.int32, device=work)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start:start + _CHUNK].to(work)
        if dtype is not None:
            chunk = chunk.to(dtype)
        bits = chunk.float().view(torch.int32)  # float32 bits: a bf16 value and the same value in fp32 digest alike
        yc, sc = y[:bits.numel()], scratch[:bits.numel()]
        torch.mul(bits, _MULTIPLIER, out=yc)
        torch.bitwise_right_shift(yc, 16, out=sc)
        yc.bitwise_xor_(sc)
        s1 = s1 + yc.sum(dtype=torch.int32)  # int32 sums wrap: mod 2^32 in any order
        torch.mul(yc, yc, out=sc)
        s2 = s2 + sc.sum(dtype=torch.int32)
    return (int(s1) & _LANE) | ((int(s2) & _LANE) << 32)


def add_digests(*digests: int) -> int:
    """The digest of the pieces' concatenation: their digests added lane by lane."""
    s1 = sum(d & _LANE for d in digests) & _LANE
    s2 = sum(d >> 32 for d in digests) & _LANE
    return s1 | (s2 << 32)


class SentDigests:
    """Wraps the stream of (name, tensor) a sync sends, recording each tensor's digest in the
    engine's dtype as it goes by."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype):
        self.stream, self.dtype = named_tensors, dtype
        self.digests: dict[str, int] = {}
        self.seconds = 0.0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.stream:
            start = time.perf_counter()
            self.digests[name] = tensor_digest(tensor, self.dtype)
            self.seconds += time.perf_counter() - start
            yield name, tensor


def by_engine_name(digests: dict[str, int], engine_name) -> dict[str, int]:
    """The trainer's digests summed per engine tensor (`engine_name(name)`: the tensor a sent one
    is loaded into, None if the engine drops it), for engines that fuse or rename tensors."""
    summed: dict[str, int] = {}
    for name, digest in digests.items():
        target = engine_name(name)
        if target is not None:
            summed[target] = add_digests(summed.get(target, 0), digest)
    return summed


def _listed(names: list[str], shown: int = 3) -> str:
    head = ", ".join(f"'{name}'" for name in names[:shown])
    return head + (f" and {len(names) - shown} more" if len(names) > shown else "")


def digest_problem(sent: dict[str, int], served: dict[str, int], before: dict[str, int], engine_name: str,
                   where: str) -> str:
    """The one-line stop message, or "" when the engine serves every tensor sent, bit for bit.
    `before`: the digests of the previous sync (or what the engine served before the first), to
    tell a tensor left stale from one changed on the way (rounded, partly written). Engine
    tensors the sync never sent are stale too."""
    unsent = sorted(set(served) - set(sent))
    absent = [name for name in sent if name not in served]
    wrong = [name for name in sent if name in served and served[name] != sent[name]]
    if not (unsent or absent or wrong):
        return ""
    stale = [name for name in wrong if before.get(name) == served[name]]
    changed = [name for name in wrong if name not in stale]
    parts = []
    if stale:
        parts.append(f"{len(stale)} still hold the previous sync's values ({_listed(stale)})")
    if changed:
        parts.append(f"{len(changed)} hold other values than were sent, e.g. rounded ({_listed(changed)})")
    if absent:
        parts.append(f"{len(absent)} sent are not in the engine ({_listed(absent)})")
    if unsent:
        parts.append(f"{len(unsent)} of the engine's were not sent ({_listed(unsent)})")
    return (f"weight sync check {where}: the '{engine_name}' engine does not serve the {len(sent)} tensors the "
            f"trainer sent: " + "; ".join(parts) + " (guards.sync_digest)")


# What an engine gives for the check: the dtype it holds weights in; its digest of each tensor
# it serves, by its own names; and the trainer's digests (by HF name) summed into those names.
ENGINE_DIGEST_API = ("weight_dtype", "served_digests", "expected_digests")


class DigestCheck:
    """Wraps an engine's weight updates: `update(named_tensors, where)` sends them and raises
    WeightDigestError unless the engine then serves exactly what was sent. Engines without
    ENGINE_DIGEST_API (the async trainers' delivery to the rollout ranks, which check on arrival)
    are updated unchecked.

    The engine digests each tensor as its `weight_dtype` holds it (tensor_digest(t, weight_dtype)):
    a tensor it keeps in a wider dtype, loaded from the trainer's values, serves them as their
    rounding would (vLLM's fp32 biases in a bf16 engine on CPU)."""

    def __init__(self, engine, engine_name: str, enabled: bool = True):
        self.engine, self.engine_name = engine, engine_name
        self.enabled = enabled and all(hasattr(engine, name) for name in ENGINE_DIGEST_API)
        self.previous: dict[str, int] = {}
        self.seconds = 0.0  # the last update's digests, both sides (metric perf/sync_digest_seconds)

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
        """Send `named_tensors` to the engine; `where` says when in the stop message ("after step 3")."""
        if not self.enabled:
            self.engine.update_weights(named_tensors)
            return
        if not self.previous:  # what it served before its first update: a tensor left at it is stale
            self.previous = self.engine.served_digests()
        sent = SentDigests(named_tensors, self.engine.weight_dtype)
        self.engine.update_weights(iter(sent))
        if not sent.digests:  # a version without tensors (a frozen actor's)
            return
        start = time.perf_counter()
        served = self.engine.served_digests()
        self.seconds = sent.seconds + time.perf_counter() - start
        expected = self.engine.expected_digests(sent.digests)  # (by the engine's names: vLLM fuses some)
        problem = digest_problem(expected, served, self.previous, self.engine_name, where)
        if problem:
            raise WeightDigestError(problem)
        self.previous = expected
