"""LoRA policies through peft: adapters injected into the HF model in place, the reference as
the same modules with adapters off, merged weights for the rollout engine and for export.

The model stays the HF class (peft's `inject_adapter_in_model`, not a `PeftModel` wrapper), so
every forward in vlrft runs unchanged. peft renames a wrapped linear's tensors:
`...q_proj.weight` becomes `...q_proj.base_layer.weight`, next to
`...q_proj.lora_A.default.weight` and `...q_proj.lora_B.default.weight`. `merged_weights` turns
that stream back into the HF names an engine or a checkpoint expects, W + scaling * B @ A.
Linear layers and Conv3d (the vision patch embedding) take adapters.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch

from vlrft.models.patch_conv import use_patchwise_conv3d

ADAPTER = "default"  # peft's adapter name; vlrft trains one adapter
BASE = ".base_layer."
LORA_PARTS = (f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight")


def add_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str]) -> dict[str, float]:
    """Inject LoRA adapters into `model`'s `target_modules` (peft name matching: a module whose
    name ends with one of them) and freeze everything else. Returns {module name: scaling} of
    the adapted layers: linears, and Conv3d such as the vision patch embedding (its adapter is
    a rank-r patch conv, then a 1x1x1 conv back to the width). Raises ValueError naming what did
    not match or is another kind of layer."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import Conv3d as LoraConv3d
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model ..."
        raise ValueError(f"model.lora.target_modules {list(target_modules)}: {str(err).splitlines()[0]}") from None
    scalings = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            linear = isinstance(module, LoraLinear) and isinstance(module.base_layer, torch.nn.Linear)
            conv = isinstance(module, LoraConv3d) and isinstance(module.base_layer, torch.nn.Conv3d)
            if not (linear or conv):
                raise ValueError(
                    f"model.lora.target_modules: {name} is a {type(module.get_base_layer()).__name__}; "
                    "vlrft trains LoRA on linear and Conv3d layers only"
                )
            scalings[name] = float(module.scaling[ADAPTER])
            module.eval()  # peft builds its modules in training mode: dropout would be on everywhere
    use_patchwise_conv3d(model)  # the adapters' patch convs as matmuls too (models/patch_conv.py)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), "peft left non-adapter parameters trainable"
    return scalings


def optimizer_groups(model: torch.nn.Module, lr: float, lr_ratio: float) -> list[dict]:
    """LoRA+ (Hayou et al., 2024) parameter groups: the B matrices at `lr * lr_ratio`, every other
    trainable parameter (the A matrices) at `lr`, in that order (group 0 carries train.lr); one
    group at ratio 1 (plain LoRA, whose checkpoints hold one group).
    B starts at zero, so at first only B moves and B·A grows at the rate B does; a faster B
    learns features sooner, before GRPO's sampling has locked onto one answer (docs/models.md, "LoRA")."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if lr_ratio == 1:
        return [{"params": [p for _, p in trainable], "lr": lr}]
    a = [p for n, p in trainable if ".lora_B." not in n]
    b = [p for n, p in trainable if ".lora_B." in n]
    return [{"params": a, "lr": lr}] + ([{"params": b, "lr": lr * lr_ratio}] if b else [])


def lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Forwards inside run the base model: each LoRA layer returns its base layer's output.
    Sets peft's own switch (`disable_adapters` reads it) rather than calling
    `enable_adapters`, which also flips the adapters' requires_grad: switching back would make
    adapters trainable that were frozen on purpose (model.freeze_vision)."""
    layers = lora_layers(model)
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


@contextmanager
def dropout_active(model: torch.nn.Module, active: bool):
    """LoRA dropout on for the update's forwards only. vlrft keeps models in eval mode so that
    rollout-time and training-time logprobs are the same function; dropout on the adapter
    input (model.lora.dropout) is the one deliberate exception, limited to the gradient pass."""
    dropouts = [d for layer in lora_layers(model) for d in layer.lora_dropout.values()] if active else []
    for d in dropouts:
        d.train()
    try:
        yield
    finally:
        for d in dropouts:
            d.eval()


class BaseModelView:
    """The reference of a LoRA policy: the policy's own modules with the adapters off, so the
    base weights exist once in memory. `policy_forward` calls it like a model: `module` is the
    HF model, `forward_context()` wraps the forward."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def forward_context(self):
        return adapters_disabled(self.module)


def hf_name(name: str) -> str:
    """A base-layer tensor's name in the plain HF model."""
    return name.replace(BASE, ".")


def merged_weights(
    named: Iterable[tuple[str, torch.Tensor]], scalings: dict[str, float], adapters: dict | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the model with every adapter merged: W + scaling * B @ A for the
    adapted linears, other tensors as they come. peft registers a layer's base weight before
    its A and B, so a weight waits only until its own adapter has arrived. With `adapters`,
    the adapter tensors are also stored there by name (export)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        part = next((p for p in LORA_PARTS if name.endswith(p)), None)
        if part is not None:
            layer = name[: -len(part)]
            if adapters is not None:
                adapters[name] = tensor
        elif name.endswith(BASE + "weight") and name[: -len(BASE + "weight")] in scalings:
            layer, part = name[: -len(BASE + "weight")], "W"
        else:
            yield hf_name(name), tensor
            continue
        slots = pending.setdefault(layer, {})
        slots[part] = tensor
        if len(slots) == 3:
            del pending[layer]
            weight, a, b = slots["W"], slots[LORA_PARTS[0]], slots[LORA_PARTS[1]]
            # B @ A over the flattened input (a conv's B is 1x1x1), in the weight's shape.
            delta = (b.float().flatten(1) @ a.float().flatten(1)).reshape(weight.shape) * scalings[layer]
            yield f"{layer}.weight", (weight.float() + delta).to(weight.dtype)
    if pending:
        raise RuntimeError(f"LoRA merge: incomplete layers {sorted(pending)[:3]}")


def save_adapter(out_dir: Path, adapters: dict[str, torch.Tensor], rank: int, alpha: float, dropout: float,
                 target_modules: list[str], base_model: str) -> None:
    """The adapter in peft's format (adapter_config.json + adapter_model.safetensors), loadable
    with `peft.PeftModel.from_pretrained(base, out_dir)`: tensor names as a PeftModel saves
    them, `base_model.model.<module>.lora_A.weight`."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        base_model_name_or_path=base_model)
    config.save_pretrained(str(out_dir))
    state = {"base_model.model." + n.replace(f".{ADAPTER}.", "."): t.detach().cpu().contiguous() for n, t in adapters.items()}
    save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})


def export_lora(named, scalings: dict[str, float], module: torch.nn.Module, out_dir: Path, lora, base_model: str,
                write: bool) -> None:
    """`out_dir`: the merged model (HF checkpoint) and `out_dir/adapter` (peft format). Every
    rank walks the (under ZeRO-3 collective) parameter stream; the one with `write` keeps the
    copy and writes. `lora` is the model.lora config section."""
    adapters: dict[str, torch.Tensor] = {}
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in merged_weights(named, scalings, adapters):
        if write:
            merged[name] = tensor.detach().cpu()
    if write:
        module.save_pretrained(out_dir, state_dict=merged)
        save_adapter(out_dir / "adapter", adapters, lora.rank, lora.alpha, lora.dropout, lora.target_modules, base_model)
