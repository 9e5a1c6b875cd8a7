"""DeepSpeed training backend (ZeRO 0/2/3). The only vlrft module that imports deepspeed."""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import warnings
from pathlib import Path
from typing import Iterator

import torch

# DeepSpeed warns at import that it found no GPU whenever it falls back to its CPU
# accelerator; without CUDA that is the plan, so name the accelerator ourselves.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
# ZeRO's partitioned all-gathers and reduce-scatters call torch collectives that torch marks
# deprecated, once per step and rank. vlrft's own code calls neither (vlrft/distributed.py).
warnings.filterwarnings(
    "ignore",
    message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    category=FutureWarning,
)

import deepspeed  # noqa: E402  (after the environment above)
from deepspeed.runtime import compiler as deepspeed_compiler  # noqa: E402
from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup  # noqa: E402

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine  # noqa: E402

from vlrft.distributed import backend_name, barrier, rank, role_group, self_group, world_size  # noqa: E402
from vlrft.trainer.checkpoint_read import DEEPSPEED_STATE_CLASSES, load_state  # noqa: E402


def _import_deepspeed_muon_uncompiled() -> None:
    """ZeRO imports DeepSpeed's Muon optimizer to compare every optimizer's type with it, and
    that module wraps its kernels in torch.compile at import: torch's whole inductor stack
    loads, 1.1 s of every rank's start-up, for an optimizer vlrft never builds. Import it
    once with DeepSpeed's compile decorator as the identity (Muon would still run, eagerly)."""
    compile_decorator = deepspeed_compiler.compile
    deepspeed_compiler.compile = lambda: deepspeed_compiler.dummy_decorator
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    finally:
        deepspeed_compiler.compile = compile_decorator


_import_deepspeed_muon_uncompiled()


def _skip_deepspeed_shm_allreduce() -> None:
    """On CPU ranks DeepSpeed's communication backend compiles, on a machine's first run, a
    shared-memory all-reduce (C++, 40-60 s on 2 cores) that only its inference all-reduce uses;
    vlrft's collectives are torch.distributed's. Without the build a first CPU run starts that
    much sooner, and a run stopped mid-compile cannot leave torch's extension-build lock behind,
    on which every later run would wait forever without a word."""
    # (importlib: `import deepspeed.comm.torch as m` binds deepspeed.comm's attribute `torch`,
    # which is PyTorch itself.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


_skip_deepspeed_shm_allreduce()


# DeepSpeed compiles its CPU Adam (train.offload) on a machine's first use, under torch's
# extension-build lock: a file that a build interrupted by a kill leaves behind, and on which
# every later build waits forever, printing nothing.
CPU_ADAM_EXTENSION = "cpu_adam"


def extension_build_lock(name: str) -> Path:
    """Where torch's build lock of extension `name` lies for this process: under
    TORCH_EXTENSIONS_DIR, else in torch's default root, in the folder of this Python version
    and accelerator (as torch.utils.cpp_extension names it)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return Path(root) / name / "lock"


CHECKPOINT_TAG = "state"  # DeepSpeed's sub-directory name inside a vlrft checkpoint

# Parameters gathered per all-gather when streaming full weights out of ZeRO-3 (weight sync):
# large enough to amortise the collective, small enough to bound the extra memory.
GATHER_BUCKET_BYTES = 256 * 2**20


def size_buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive index runs whose sizes sum to at most `limit` (a larger item is alone)."""
    buckets: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not buckets or total + size > limit:
            buckets.append([])
            total = 0
        buckets[-1].append(i)
        total += size
    return buckets


def route_world_collectives(group) -> None:
    """DeepSpeed takes the whole job for its world: its collectives without a group (the
    barriers and tag checks of save_checkpoint, ZeRO-3's set-up) would wait for ranks that
    never join them (an async run's rollout ranks). From here on, in this process, every call
    of DeepSpeed's communication backend without a group runs in `group`, the trainer ranks'.
    (The trainers are global ranks 0..M-1, so DeepSpeed's "global rank 0" stays the same rank.)"""
    from deepspeed import comm as ds_comm

    ds_comm.init_distributed(dist_backend=backend_name(), verbose=False)  # over the existing world
    backend = ds_comm.comm.cdb  # every deepspeed.comm function calls this object's method
    if getattr(backend, "vlrft_world", None) is not None:
        return
    for name in dir(type(backend)):
        function = getattr(type(backend), name)
        if name.startswith("_") or name == "destroy_process_group" or not inspect.isfunction(function):
            continue
        signature = _declared_signature(function, name)
        if "group" in signature.parameters:
            setattr(backend, name, _in_group(getattr(backend, name), signature, group))
    backend.vlrft_world = group


def _declared_signature(function, name: str) -> inspect.Signature:
    """The signature `name` was declared with: DeepSpeed's decorators (timers, CPU staging)
    wrap it in a (self, *args, **kwargs) function without functools.wraps, so look inside."""
    function = inspect.unwrap(function)
    for cell in function.__closure__ or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner) and inner.__name__ == name:
            return _declared_signature(inner, name)
    return inspect.signature(function)


def _in_group(method, signature: inspect.Signature, group):
    """`method` (bound; `signature` includes self) with `group` where it is called without one."""

    @functools.wraps(method)
    def routed(*args, **kwargs):
        bound = signature.bind_partial(None, *args, **kwargs)  # None: self's place
        if bound.arguments.get("group") is None:
            bound.arguments["group"] = group
        return method(*bound.args[1:], **bound.kwargs)

    return routed


class RoleParallelism:
    """DeepSpeed's model-parallel interface (`mpu`) for data parallelism over one role's ranks
    and no model parallelism: asynchronous training hands it the trainer ranks' group."""

    def __init__(self, group):
        self.group = group

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_rank(self) -> int:
        return rank(self.group)

    def get_data_parallel_world_size(self) -> int:
        return world_size(self.group)

    def get_model_parallel_group(self):
        return self_group()  # no model parallelism: DeepSpeed's reductions over it are no-ops

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


class DeepSpeedBackend:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float,
        grad_clip: float,
        zero_stage: int,
        lr_schedule: str = "constant",
        total_optimizer_steps: int = 1,
        warmup_steps: int = 0,
        offload: str = "none",
        bf16_weights: bool = False,
        param_groups: list[dict] | None = None,
    ):
        """`param_groups`: torch optimizer groups with their own "lr" (LoRA+); group 0's lr is
        the one reported. Default: every trainable parameter at `lr`."""
        config = deepspeed_config(zero_stage, grad_clip, offload, bf16_weights)
        params = param_groups or [{"params": [p for p in model.parameters() if p.requires_grad], "lr": lr}]

        def schedule(opt):
            return lr_scheduler(opt, lr_schedule, warmup_steps, total_optimizer_steps)

        if offload == "none":
            # fused: one kernel over all tensors (CPU and GPU); on CPU the default per-tensor
            # loop took 6x as long (68 vs 11 ms a step for 19M parameters, 2 threads).
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
            scheduler = schedule(optimizer)
        else:
            # The optimizer steps on the CPU: DeepSpeed builds its vectorised CPU AdamW from the
            # config (torch's AdamW there would be several times slower).
            config["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}}
            optimizer = None
            scheduler = schedule
            lock = extension_build_lock(CPU_ADAM_EXTENSION)
            if lock.exists():
                print(f"vlrft: DeepSpeed's CPU Adam (train.offload) waits for {lock} to go: another process is "
                      "building it, or a build was interrupted (then delete the file)", flush=True)
        group = role_group()  # async training: the trainer ranks are DeepSpeed's data-parallel world
        if group is not None:
            route_world_collectives(group)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=params, optimizer=optimizer, lr_scheduler=scheduler, config=config,
            mpu=RoleParallelism(group) if group is not None else None,
        )
        use_weights_only_loads(self.engine)  # a resume never unpickles code
        self.zero_stage = zero_stage

    @property
    def model(self) -> torch.nn.Module:
        return self.engine

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped HF model (parameters may be shards under ZeRO-3)."""
        return self.engine.module

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        # The loss already carries its global normaliser: no rescaling by accumulation steps.
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, scale_wrt_gas=False)
        # ZeRO-3 counts micro-batches in the engine's own forward (from the second on, a
        # micro-batch adds its gradient to the partition buffer instead of overwriting it); our
        # forwards call the HF module inside the engine, so the count advances here, after each
        # backward. Without it every micro-batch but the last is lost (test_split_invariance).
        # ZeRO-1/2 accumulate without that count (and clear their buffers there: not called).
        if self.zero_stage == 3:
            self.engine.optimizer.clear_backward_seen_flag()

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def step(self) -> float:
        self.engine.step()  # also advances the lr scheduler
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def skip_step(self) -> None:
        """End the step without an update: drop the accumulated gradients, keep parameters,
        optimizer state and lr schedule. The caller guarantees the gradients are non-finite on
        some rank (trainer/update.py backpropagates NaN for a non-finite loss)."""
        if self.zero_stage == 0:
            # Gradients live in param.grad only (already all-reduced at the boundary).
            self.engine.zero_grad()
            return
        # ZeRO 1-3 keep gradients in their own partition buffers; DeepSpeed's overflow path
        # clears those: a non-finite global gradient norm (all-reduced, so every rank sees it)
        # makes its optimizer skip the update and the engine skip the lr-scheduler step.
        self.engine.step()
        if self.engine.was_step_applied():
            raise RuntimeError("DeepSpeed applied an optimizer step that had non-finite gradients")

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, unsharded, by HF name. Under ZeRO-3 a collective: every rank gathers
        the same buckets in the same order, one all-gather per bucket rather than per tensor."""
        if self.zero_stage != 3:
            for name, param in self.module.named_parameters():
                yield name, param.data.detach()
            return
        named = list(self.module.named_parameters())
        sizes = [p.ds_numel * p.element_size() for _, p in named]  # full (unpartitioned) bytes
        for bucket in size_buckets(sizes, GATHER_BUCKET_BYTES):
            with deepspeed.zero.GatheredParameters([named[i][1] for i in bucket]):
                for i in bucket:
                    # A copy: consumers may keep it after the partition is released (vLLM
                    # holds a layer's tensors until the whole layer has arrived).
                    yield named[i][0], named[i][1].data.detach().clone()

    def full_state_dict(self) -> dict:
        """The unsharded state dict (collective; complete on rank 0 under ZeRO-3)."""
        if self.zero_stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()
        return self.module.state_dict()

    def save_checkpoint(self, out_dir: Path) -> None:
        """Model, optimizer and lr-scheduler state, sharded as trained (collective)."""
        self.engine.save_checkpoint(str(out_dir), tag=CHECKPOINT_TAG, save_latest=False)

    def load_checkpoint(self, in_dir: Path, schedule: bool = True) -> None:
        path, _ = self.engine.load_checkpoint(
            str(in_dir), tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=schedule
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {in_dir}")
        if not schedule:  # the optimizer state brought its step's learning rates: the schedule's own, from now on
            for group, lr in zip(self.scheduler.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr

    def scale_lr(self, factor: float) -> None:
        # The schedule's base rates too: its later steps, and a checkpoint of it, keep the factor.
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        self.scheduler._last_lr = [lr * factor for lr in self.scheduler.get_last_lr()]
        for group, lr in zip(self.scheduler.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr

    def save_hf(self, out_dir: Path) -> None:
        state = self.full_state_dict()
        if rank() == 0:
            self.module.save_pretrained(out_dir, state_dict=state)
        barrier()

    def save_state_dict(self, out_file: Path) -> None:
        """torch.save of the full state dict (for modules that are not HF models: the critic)."""
        state = self.full_state_dict()
        if rank() == 0:
            out_file.parent.mkdir(parents=True, exist_ok=True)
            torch.save({name: tensor.cpu() for name, tensor in state.items()}, out_file)
        barrier()


def gathered_for_reading(params: list[torch.nn.Parameter]):
    """A context in which ZeRO-3 partitioned `params` are whole on every rank (a collective: every
    rank enters it), for code that reads them without calling their module (the fused LM head,
    models/fused_head.py); changes made inside are not kept. Outside ZeRO-3 it does nothing."""
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def uses_bf16_weights(compute_dtype: str, zero_stage: int) -> bool:
    """Whether vlrft runs a trained model (policy, critic) in DeepSpeed's bf16 mode: bf16 compute
    under ZeRO-3 (models/attention.py says why); ZeRO 0-2 keep fp32 weights under autocast."""
    return compute_dtype == "bfloat16" and zero_stage == 3


def deepspeed_config(zero_stage: int, grad_clip: float, offload: str, bf16_weights: bool) -> dict:
    """The DeepSpeed config for a vlrft model.

    `offload`: optimizer = Adam states and fp32 master weights in CPU memory (ZeRO-Offload,
    stages 1-3); all = parameters too (ZeRO-Infinity, stage 3). `bf16_weights`: DeepSpeed's
    bf16 mode, bf16 parameters and backward, gradients summed in fp32, fp32 master weights in
    the optimizer (how bf16 compute runs under ZeRO-3, where autocast would keep a bf16 copy of
    every gathered weight for the backward)."""
    if bf16_weights and zero_stage < 2:
        # (DeepSpeed has no fp32 gradient sums for bf16 weights without ZeRO, and at stage 1
        # swaps in another optimizer for them.)
        raise ValueError(f"bf16 weights need ZeRO stage 2 or 3, not {zero_stage}")
    zero: dict = {"stage": zero_stage}
    pin = torch.cuda.is_available()  # page-locked host memory speeds up GPU<->CPU copies
    if offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    config = {
        "train_micro_batch_size_per_gpu": 1,  # unused: vlrft sizes micro-batches by tokens
        "gradient_accumulation_steps": 1,  # accumulation boundaries are set explicitly
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch AdamW runs on CPU and GPU alike
        "steps_per_print": 1 << 30,
    }
    if bf16_weights:
        config["bf16"] = {"enabled": True}
        # Gradients are summed in fp32, as Megatron and FSDP's usual settings do: over a step's
        # micro-batches (DeepSpeed's default adds them in the parameters' bf16, where 16 equal
        # gradients summed are up to 1.5% off) and over the ranks (its reduce-scatter would add
        # in bf16 too). Costs: the gradient partition in fp32 (4 bytes per parameter / ranks),
        # a reduce-scatter of twice the bytes (parameter gathers stay bf16) and, with
        # offload, twice the host<->GPU bytes to add a micro-batch's gradients. The reduce
        # bucket, allocated whole in the reduction's dtype, is halved to keep its bytes (1 GB).
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = "fp32"
        zero["reduce_bucket_size"] = 250_000_000
    return config


def lr_scheduler(optimizer, schedule: str, warmup_steps: int, total_steps: int):
    """transformers' schedules, counted in optimizer steps: a linear warm-up from 0 over
    `warmup_steps`, then `constant`, or `cosine`: half a cosine down to 0.1 x lr, reached at the
    last of `total_steps` steps (the last updates are small, which steadies the final policy)."""
    if schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup_steps)
    if schedule == "cosine":
        # The cosine spans the steps after warm-up up to the last one (step total - 1).
        last = max(total_steps - 1, warmup_steps + 1)
        return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup_steps, last, min_lr_rate=0.1)
    raise ValueError(f"unknown lr schedule '{schedule}'")


# ---- DeepSpeed's checkpoint files, read without unpickling code
#
# DeepSpeed reads every file of a checkpoint (the model states, each rank's ZeRO optimizer
# partition) through its engine's `checkpoint_engine`, whose `torch.load` unpickles anything
# (weights-only loading off): a pickle planted there would run when a run resumes. vlrft puts
# its own engine in its place: DeepSpeed's (saves unchanged), loading weights-only with an
# explicit allow-list, the few DeepSpeed classes its states hold (DEEPSPEED_STATE_CLASSES,
# trainer/checkpoint_read.py). A file holding anything else is refused in one line naming it
# (ConfigError), before any of it runs. Rank 0 has probed every file already
# (trainer/checkpoint.py, `check_checkpoint`).


def state_classes() -> list[type]:
    """The classes DEEPSPEED_STATE_CLASSES names, imported from DeepSpeed."""
    classes = []
    for name in DEEPSPEED_STATE_CLASSES:
        module, _, attribute = name.rpartition(".")
        classes.append(getattr(importlib.import_module(module), attribute))
    return classes


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save engine whose load unpickles tensors, plain data and
    DEEPSPEED_STATE_CLASSES only."""

    classes = state_classes()

    def load(self, path: str, map_location=None):
        return load_state(Path(path), map_location, self.classes)


def use_weights_only_loads(engine) -> None:
    """Load `engine`'s (a DeepSpeedEngine's) checkpoints with WeightsOnlyCheckpointEngine. Its
    state is taken over as it is (DeepSpeed's serialization settings: saves are unchanged)."""
    current = engine.checkpoint_engine
    if type(current) is not TorchCheckpointEngine:  # DeepSpeed picks another only for config keys vlrft never sets
        raise RuntimeError(f"DeepSpeed chose checkpoint engine {type(current).__name__}; vlrft loads through TorchCheckpointEngine only")
    safe = WeightsOnlyCheckpointEngine.__new__(WeightsOnlyCheckpointEngine)
    safe.__dict__.update(current.__dict__)
    engine.checkpoint_engine = safe
