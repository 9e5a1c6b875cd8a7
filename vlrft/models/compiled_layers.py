"""`model.compile`: each decoder layer and vision block compiled in place by torch.compile.

Per layer, not the whole model: the layers of a model are one class, so with torch's inlined
module parameters (the default) they share one compiled graph: a 28-layer model compiles a
layer once, not 28 times, and a change elsewhere in the model (the vision tower called or not,
a LoRA adapter switched off) never recompiles the decoder. In place (`Module.compile`): the
parameters keep their names and objects, so DeepSpeed, checkpoints and weight sync see the same
model. Order: gradient checkpointing, then compile (transformers' checkpointing wraps the layer's
call, so the compiled forward is what gets recomputed), then sharding.

What stays eager, inside a compiled layer, and why:
- The attention of a packed micro-batch on the CPU path (`sdpa_segments`) walks the segments in
  Python (one SDPA call per segment shape): traced, each new set of segment lengths would be a
  new graph, until torch's recompile limit (8) silently sends the layer back to eager. It runs
  eagerly between the layer's two compiled halves.
- A vision block's attention, except on a varlen kernel (flash_attention_2): transformers splits
  the image windows by their lengths in Python, the same problem.

Lengths: a micro-batch's token count varies from one to the next. The first change of a shape
recompiles once with that dimension symbolic (torch's automatic dynamic shapes); later lengths
reuse the symbolic graph. `compiled_frames` counts compilations, so the trainer can report them
(`perf/compiles`) and warn when they keep growing (a guard that fails on every step).
"""

from __future__ import annotations

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from vlrft.models.compile_cache import use_private_compile_cache
from vlrft.models.loader import vision_tower
from vlrft.models.sdpa_segments import SDPA_SEGMENTS

COMPILE_CHOICES = ("auto", "on", "off")
# Compiled entries every layer of one class shares, before torch gives up and runs it eagerly
# (its default: 8). A run needs several: the policy's layers with and without gradients (update,
# experience pass), the frozen reference's (parameters without requires_grad), each at its first
# shape and then symbolic, and the critic's under other modes.
RECOMPILE_LIMIT = 32


def compile_config_problem(choice: str, zero_stage: int) -> str:
    """Why `model.compile` cannot be used as configured ("" when it can)."""
    if choice not in COMPILE_CHOICES:
        return f"config key 'model.compile' is '{choice}'; valid: {', '.join(COMPILE_CHOICES)}"
    if choice == "on" and zero_stage == 3:
        return ("config key 'model.compile' on: not with train.zero_stage 3 (DeepSpeed's ZeRO-3 parameter "
                "gathering does not run under compiled layers); use train.zero_stage 2 or model.compile: auto|off")
    return ""


def compile_wanted(choice: str, zero_stage: int) -> bool:
    """`on`, or `auto` on a CUDA device outside ZeRO-3 (on the CPU a compiled layer measured no
    faster: inductor's CPU kernels against oneDNN's matmuls; see docs/scaling.md)."""
    if choice == "on":
        return True
    return choice == "auto" and torch.cuda.is_available() and zero_stage != 3


def compile_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer and vision block of `model` (a causal LM, an image-text model
    or a critic's backbone) in place. Returns how many were compiled."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers to compile")
    use_private_compile_cache()  # before anything compiles: where inductor writes and loads its code
    limit = torch._dynamo.config
    limit.recompile_limit = max(limit.recompile_limit, RECOMPILE_LIMIT)
    tower = vision_tower(model)
    in_tower = {id(m) for m in tower.modules()} if tower is not None else set()
    varlen_vision = tower is not None and "flash" in (tower.config._attn_implementation or "")
    for layer in layers:
        attention = getattr(layer, "attn", None)
        if id(layer) in in_tower and attention is not None and not varlen_vision:
            attention.forward = torch.compiler.disable(attention.forward)  # its windows split in Python
        layer.compile()
    return len(layers)


def eager_under_checkpointing(model: torch.nn.Module) -> str:
    """Why `model`'s checkpointed decoder layers run uncompiled ("" when they do not): a
    checkpointed layer compiles only when its whole forward traces, and the CPU's packed
    attention (sdpa_segments) runs eagerly by design."""
    checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    implementation = model.config.get_text_config()._attn_implementation or ""
    if checkpointed and implementation == SDPA_SEGMENTS:
        return ("model.compile with model.gradient_checkpointing and model.attention sdpa_segments: the decoder "
                "layers stay eager (their packed attention runs outside the graph, and a checkpointed layer "
                "compiles only whole); use model.attention sdpa or torch_varlen, or turn one of the two off")
    return ""


def compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far (first compiles and
    recompiles), from dynamo's own counter: a number that keeps growing step after step means
    a guard fails every time (a shape or a Python value that should be stable is not)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])
