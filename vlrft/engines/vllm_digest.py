"""What a vLLM engine serves, as digests for the exact weight-sync check (engines/weight_digest.py).

vLLM does not hold the checkpoint's tensors: it fuses q/k/v and gate/up into one parameter,
gives each tensor-parallel rank a shard (vocabularies padded with zero rows), and on CPU hands
each linear layer's weight to a packed GEMM kernel and frees the tensor. A digest is a sum over
elements that ignores order and zeros, so:

- a fused parameter's digest is the sum of its parts' (the trainer's names are mapped onto
  vLLM's by the model's own `hf_to_vllm_mapper`, or its `packed_modules_mapping`);
- a sharded parameter's is the sum over the ranks of the tensor-parallel group, a replicated
  one's (each rank holds as many elements as were sent) is one rank's, all ranks agreeing;
- on CPU the linear weight's digest is taken when vLLM packs it (`record_cpu_gemm_digests`):
  what was loaded into the layer, just before the kernel copies it;
- each tensor is digested as the engine's dtype holds it: vLLM keeps some tensors in fp32 in a
  bf16 engine (on CPU the biases of small GEMMs), loaded from the trainer's fp32 values, which
  serve as their bf16 rounding would.
"""

from __future__ import annotations

import torch

from vlrft.engines.weight_digest import add_digests, tensor_digest

PACKED_DIGEST = "vlrft_weight_digest"  # attribute of a CPU linear layer: (digest, numel) of its packed weight


def record_cpu_gemm_digests(utils, dtype: torch.dtype) -> None:
    """Wrap vLLM's CPU GEMM dispatch (`utils`: vllm.model_executor.layers.utils, handed over by
    vllm_engine.py, the one module that imports vllm; called for every linear layer after each
    load) so that it records the weight's digest (as `dtype` holds it) before it packs and frees
    it. Idempotent."""
    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "records_digest", False):
        return

    def recording_dispatch(layer, remove_weight: bool):
        weight = layer.weight
        if not weight.is_meta and weight.numel():
            setattr(layer, PACKED_DIGEST, (tensor_digest(weight, dtype), weight.numel()))
        return dispatch(layer, remove_weight)

    recording_dispatch.records_digest = True
    utils.dispatch_cpu_unquantized_gemm = recording_dispatch


def worker_digests(worker, dtype: torch.dtype) -> dict[str, tuple[int, int]]:
    """(digest as `dtype` holds it, element count) of each parameter of one vLLM worker's model:
    this rank's shard. Run inside the worker (`LLM.collective_rpc`)."""
    model = worker.model_runner.get_model()
    modules = dict(model.named_modules())
    digests = {}
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        packed = getattr(modules.get(owner), PACKED_DIGEST, None) if leaf == "weight" else None
        digests[name] = packed if packed is not None and param.numel() == 0 else (tensor_digest(param, dtype), param.numel())
    return digests


def engine_name_of(model) -> callable:
    """name -> the vLLM parameter a checkpoint tensor of that name is loaded into (None: vLLM
    drops it), by the model's own mapping."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    packed = getattr(model, "packed_modules_mapping", {}) or {}

    def engine_name(name: str) -> str | None:
        mapped = mapper.map_name(name) if mapper is not None else name
        if mapped is None:
            return None
        for fused, parts in packed.items():
            for part in parts:
                if f".{part}." in mapped:
                    return mapped.replace(f".{part}.", f".{fused}.", 1)
        return mapped

    return engine_name


def group_digests(per_rank: list[dict[str, tuple[int, int]]], sent_numel: dict[str, int]) -> dict[str, int]:
    """One digest per vLLM parameter from its tensor-parallel group's ranks: a parameter every
    rank holds whole counts once, when all ranks agree (else the sum, which then cannot match); a
    sharded one is the sum of its shards. Whole: each rank holds as many elements as were sent
    (`sent_numel`); before any sync, the ranks hold the same count with the same digest."""
    combined = {}
    for name in dict.fromkeys(name for rank in per_rank for name in rank):
        held = [rank[name] for rank in per_rank if name in rank]
        if name in sent_numel:
            whole = all(numel >= sent_numel[name] for _, numel in held)
        else:
            whole = len(set(held)) == 1
        if whole and len({digest for digest, _ in held}) == 1:
            combined[name] = held[0][0]
        else:
            combined[name] = add_digests(*(digest for digest, _ in held))
    return combined
