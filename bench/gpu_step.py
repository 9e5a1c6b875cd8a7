"""Packed bf16 policy-update throughput and MFU for Qwen2.5-VL-shaped policies on one GPU.

    python bench/gpu_step.py                      # 0.5B, 1.5B, 3B shapes; ZeRO-2/3 x checkpointing
    python bench/gpu_step.py --shapes 1.5B --zero 3 --checkpointing on
    python bench/gpu_step.py --shapes 1.5B --zero 2 --checkpointing on --weights bf16   # DeepSpeed's bf16 mode under ZeRO-2
    python bench/gpu_step.py --shapes 1.5B --zero 2 --checkpointing on --fused-head chunked   # Liger's head off
    python bench/gpu_step.py --shapes 1.5B --zero 2 --checkpointing on --budget 32768 \
        --compile off on --fused-head chunked liger       # compile x LM head: one process per setting
    python bench/gpu_step.py --shapes tiny --device cpu --compute-dtype float32 --samples 8 --budget 2048 \
        --repeats 1 --rollout-prompts 4 --new-tokens 16   # smoke run: a minute on a CPU

Each shape is a Qwen2.5-VL model built from its published text dimensions with random weights
(vision tower included in memory; the batch is text-only, so the tower does no work: a run
over text-only data never calls it). The update is vlrft's own: DeepSpeed backend (ZeRO-2, or
ZeRO-3 in bf16 mode; `--weights bf16` puts ZeRO-2 in bf16 mode too, where vlrft keeps fp32
weights under autocast), packed micro-batches of `--budget` tokens through `policy_forward`
(varlen attention, the LM head on response tokens: `--fused-head`, as model.fused_head), a
token-mean policy-gradient loss, backward and optimizer step. Rollouts have a 256-token prompt
and response lengths skewed between 64 and 1024 tokens.

Memory: activations without checkpointing are ~96 KB per token and decoder layer at the 1.5B
shape (bf16, saved-tensor bytes counted on CPU), so the default 8192-token micro-batch holds
~22 GB at 28 layers; ZeRO-2 keeps ~20 bytes per parameter (fp32 weights, DeepSpeed's fp32
copy, gradients, Adam's two states): 44 GB for the 2.2B parameters with the vision tower.
Measured, the LM head's chunks and autocast's weight copies on top: a 75.1 GiB peak on an H200,
out of memory on an 80 GB H100. Each setting runs in a process of its own; one that runs out
of memory prints one line saying so and the others go on.

Printed per setting: update tokens/s, MFU and peak GPU memory, and a profile of one more
update: how busy the GPU was, the shares of matmuls, attention, copies, communication, the
optimizer and the rest, and the costliest kernels (where the time goes when MFU is low); and
the host's side: kernels launched and the time it waited for the GPU (a seldom busy GPU and a
host that seldom waits: the update is bound by launching kernels).
MFU counts model FLOPs (a checkpointed layer's recomputation is not counted): 6 x (decoder
matmul parameters) per token, plus causal attention 6 x 2 x layers x hidden x s^2 / 2 per
sequence of length s (QK^T and AV, forward and backward), plus the LM head 6 x hidden x vocab
per response token (vlrft/metrics/flops.py, the count behind a run's perf/mfu), divided by the
update time and `--peak-tflops` (989: H100 SXM dense bf16); beside it "6N only", the matmul
parameters' share alone (no attention). `--compile on` compiles each decoder layer
(`model.compile`; the warm-up update pays the compilation). Then the HF engine's rollout
throughput (vlrft's HFEngine on the shape saved to a temporary directory; sampled, 64 prompts x
256 tokens, every response to the end), once per `--hf-decode` (rollout.hf_decode: dynamic |
static, the compiled CUDA-graph step; its first call, compilation included, printed beside it);
and the optimizer step, torch's fused AdamW (vlrft's) against its foreach form and the memory
bound. Last, whether pinned host memory pays for moving a VL update's pixel inputs to the GPU.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from vlrft.backends.deepspeed_backend import DeepSpeedBackend, uses_bf16_weights
from vlrft.distributed import exit_process, init_distributed
from vlrft.models.packing import pack, split_by_token_budget
from vlrft.models.attention import COMPUTE_DTYPES, resolve_attention
from vlrft.models.forward import policy_forward
from vlrft.models.fused_head import FUSED_HEADS, fused_head_problem, resolve_fused_head
from vlrft.metrics.flops import FlopCount
from vlrft.models.compiled_layers import compile_layers
from vlrft.models.loader import enable_gradient_checkpointing
from vlrft.models.vision_calls import declare_modalities
from vlrft.types import Prompt, Rollout

# Qwen2.5 text dimensions: hidden, layers, attention heads, kv heads, MLP width.
SHAPES = {
    "tiny": (128, 2, 4, 2, 256),
    "0.5B": (896, 24, 14, 2, 4864),
    "1.5B": (1536, 28, 12, 2, 8960),
    "3B": (2048, 36, 16, 2, 11008),
}
# Qwen2.5-VL's vision tower (0.67B, the same at every size). Left to transformers' defaults it
# would be 3B: a "1.5B" model of 4.6B parameters.
VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16}
VOCAB = 151_936
PROMPT_TOKENS = 256


def build_model(shape: str, attention: str, compute_dtype: str, device: str, narrow: bool = False) -> torch.nn.Module:
    """The shape's Qwen2.5-VL with random weights; `narrow`: its depths (decoder and vision
    tower) at tiny widths, whose kernel launches are the same in number (bench/kernel_launches.py)."""
    hidden, layers, heads, kv_heads, mlp = SHAPES[shape]
    if narrow:
        hidden, _, heads, kv_heads, mlp = SHAPES["tiny"]
    head_dim = hidden // heads
    section = head_dim // 2 // 4  # M-RoPE sections (t, h, w) summing to head_dim / 2
    text = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=mlp, vocab_size=VOCAB, max_position_embeddings=32768,
                rope_scaling={"type": "mrope", "mrope_section": [head_dim // 2 - 2 * section, section, section]})
    vision = {"depth": 2, "hidden_size": 128, "intermediate_size": 256, "num_heads": 4} if shape == "tiny" else VISION
    if narrow:
        vision = {**vision, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4}
    vision = {**vision, "out_hidden_size": hidden}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)  # as Qwen2.5 up to 3B
    config._attn_implementation = attention
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.config.use_cache = False
    model.compute_dtype = COMPUTE_DTYPES[compute_dtype]
    return model


def rollouts(n: int, seed: int = 0) -> list[Rollout]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        longest = 1025 if i % 4 == 0 else 385  # one in four responses runs long
        length = int(torch.randint(64, longest, (1,), generator=g))
        prompt = Prompt(id=str(i), data_source="bench", answer="", meta={}, prompt_text="",
                        prompt_ids=torch.randint(10, VOCAB, (PROMPT_TOKENS,), generator=g).tolist(), index=i)
        rollout = Rollout(prompt, i, torch.randint(10, VOCAB, (length,), generator=g).tolist(), "", False)
        out.append(rollout)
    return out


def model_flops(model: torch.nn.Module, samples: list[Rollout], attention: bool = True) -> float:
    """Training FLOPs (forward + backward) of one update over `samples`, as the docstring counts
    them (vlrft's own count, the one behind a run's perf/mfu); without `attention`, 6N only."""
    lengths = [len(r.prompt.prompt_ids) + len(r.response_ids) for r in samples]
    return FlopCount.of(model).flops(lengths, None, sum(len(r.response_ids) for r in samples), attention)


def one_update(backend: DeepSpeedBackend, batches, device: str) -> None:
    """A token-mean policy-gradient update over `batches`, finished on the device."""
    for i, batch in enumerate(batches):
        logp = policy_forward(backend.model, batch, 1.0).logp  # [1, T]
        loss = -(logp * batch.response_mask.to(logp.device)).sum() / batch.response_mask.sum()
        backend.backward(loss / len(batches), boundary=i == len(batches) - 1)
    backend.step()
    if device == "cuda":
        torch.cuda.synchronize()


def best_seconds(call, device: str, repeats: int = 3) -> float:
    """The shortest of `repeats` timed calls, each finished on the device."""
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def time_updates(backend: DeepSpeedBackend, batches, repeats: int, device: str) -> float:
    """Seconds of one update (best of `repeats`, after one warm-up)."""
    one_update(backend, batches, device)
    return best_seconds(lambda: one_update(backend, batches, device), device, repeats)


# Kinds of work an update's time goes to, matched in this order against CUDA kernel names (on
# a CPU, aten op names); the rest is "other" (elementwise, norms, rotary embeddings, ...).
WORK_KINDS = (
    ("communication", r"nccl|all_?reduce|reduce_?scatter|all_?gather|broadcast"),
    ("attention", r"flash|fmha|varlen|attention|sdpa"),  # (a softmax kernel is the vocabulary's: other)
    ("matmul", r"gemm|gemv|cutlass|xmma|nvjet|cublas|aten::(mm|addmm|bmm|baddbmm|matmul|linear)$"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("copies", r"memcpy|memset|copy|aten::(cat|index|index_select|gather|scatter)"),
)


def work_shares(times: dict[str, float]) -> dict[str, float]:
    """Each kind of work's fraction of the summed `times` (name -> time)."""
    total = sum(times.values()) or 1.0
    shares = dict.fromkeys([kind for kind, _ in WORK_KINDS] + ["other"], 0.0)
    for name, spent in times.items():
        kind = next((kind for kind, pattern in WORK_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")
        shares[kind] += spent / total
    return shares


# CUDA runtime calls the host makes during an update: kernel launches, and the calls in which it
# waits for the GPU (a synchronize; a copy, which waits when it reads to or from pageable memory:
# .item(), .tolist(), a .to(device) of a CPU tensor).
LAUNCH_CALLS = r"LaunchKernel|LaunchCooperativeKernel|GraphLaunch"
WAIT_CALLS = {"synchronize": r"Synchronize", "copies": r"^cu(da)?Memcpy"}


def host_side(calls: dict[str, tuple[int, float]], wall: float, micro_batches: int) -> str:
    """What the host did during an update of `wall` seconds, from the CUDA runtime calls
    (name -> (count, microseconds in the call)): kernels launched, per micro-batch, and the
    seconds it waited for the GPU. A GPU that is seldom busy while the host rarely waits means
    the host is the bottleneck: launching small kernels one Python op at a time."""
    launches = sum(count for name, (count, _) in calls.items() if re.search(LAUNCH_CALLS, name))
    waits = {kind: sum(spent for name, (_, spent) in calls.items() if re.search(pattern, name)) / 1e6
             for kind, pattern in WAIT_CALLS.items()}
    waited = ", ".join(f"{kind} {seconds:.2f} s" for kind, seconds in waits.items())
    return (f"host: {launches} kernel launches ({launches // max(1, micro_batches)} per micro-batch, "
            f"{1e6 * wall / max(1, launches):.0f} us of wall time each); waited for the GPU {sum(waits.values()):.2f} s "
            f"of {wall:.2f} s ({waited})")


def profile_update(backend: DeepSpeedBackend, batches, device: str) -> str:
    """Where one update's time goes: how busy the GPU (on a CPU: the aten ops) was over its wall
    time, each kind of work's share of that, and the three costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as profiled:
        one_update(backend, batches, device)
    wall = time.perf_counter() - start
    events = profiled.key_averages()
    if device == "cuda":
        times = {e.key: e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA}
    else:
        times = {e.key: e.self_cpu_time_total for e in events if e.key.startswith("aten::")}
    times = {name: spent for name, spent in times.items() if spent > 0}
    total = sum(times.values()) or 1.0
    shares = ", ".join(f"{kind} {100 * share:.0f}%" for kind, share in work_shares(times).items())
    top = ", ".join(f"{name[:50]} {100 * spent / total:.0f}%" for name, spent in sorted(times.items(), key=lambda t: -t[1])[:3])
    line = (f"profile of one update: {'GPU' if device == 'cuda' else 'aten ops'} busy {min(100.0, total / 1e4 / wall):.0f}% "
            f"of {wall:.2f} s; of that {shares}; costliest: {top}")
    if device == "cuda":
        calls = {e.key: (e.count, e.self_cpu_time_total) for e in events
                 if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("cu")}
        line += "\n        " + host_side(calls, wall, len(batches))
    return line


def bench_update(shape, zero, checkpointing, compiled, args) -> str:
    start = time.perf_counter()
    model = build_model(shape, args.attention_impl, args.compute_dtype, args.device)
    model.fused_head = head = resolve_fused_head(args.fused_head[0], args.compute_dtype, model.lm_head)
    declare_modalities(model.model, ())  # text-only data, as a run over it declares: the tower never runs
    if checkpointing:
        enable_gradient_checkpointing(model)
    if compiled:
        compile_layers(model)  # after checkpointing, before DeepSpeed: vlrft's order
    bf16_weights = uses_bf16_weights(args.compute_dtype, zero) or (args.compute_dtype == "bfloat16" and args.weights == "bf16")
    backend = DeepSpeedBackend(model, lr=1e-6, weight_decay=0.0, grad_clip=1.0, zero_stage=zero, bf16_weights=bf16_weights)
    samples = rollouts(args.samples)
    batches = [pack(group) for group in split_by_token_budget(samples, args.budget)]
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timing = time.perf_counter()
    seconds = time_updates(backend, batches, args.repeats, args.device)
    profiling = time.perf_counter()
    profile = profile_update(backend, batches, args.device)
    # where a device session's minutes go: building the model and DeepSpeed, the timed updates, the profile
    spent = (f"setting took {timing - start:.0f} s to build, {profiling - timing:.0f} s to time, "
             f"{time.perf_counter() - profiling:.0f} s to profile")
    tokens = sum(b.input_ids.numel() for b in batches)
    mfu, mfu_6n = (model_flops(model, samples, attention) / seconds / (args.peak_tflops * 1e12) for attention in (True, False))
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    del backend, model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return (f"{shape:>5} ZeRO-{zero} checkpointing {'on ' if checkpointing else 'off'}  {'compiled' if compiled else 'eager'}  "
            f"{'bf16' if bf16_weights else 'fp32'} weights  {head} head  {len(batches)} micro-batches  "
            f"{tokens / seconds:9.0f} tokens/s  MFU {100 * mfu:5.1f}% (6N only {100 * mfu_6n:4.1f}%)  peak {peak:6.2f} GiB  update {seconds:.3f} s\n"
            f"        {profile}\n        {spent}")


@torch.no_grad()
def bench_rollout(shape, args) -> str:
    import tempfile

    from data_tools.tiny_tokenizer import build_tokenizer
    from vlrft.engines.base import SamplingParams
    from vlrft.engines.hf_engine import HFEngine
    from vlrft.engines.static_decode import shape_bucket

    decode = args.hf_decode[0]
    tokenizer = build_tokenizer()  # (decodes the rollouts' text only: ids past its vocabulary decode to "")
    g = torch.Generator().manual_seed(0)
    prompts = [Prompt(id=str(i), data_source="bench", answer="", meta={}, prompt_text="", index=i,
                      prompt_ids=torch.randint(10, VOCAB, (PROMPT_TOKENS,), generator=g).tolist())
               for i in range(args.rollout_prompts)]
    with tempfile.TemporaryDirectory() as model_dir:
        model = build_model(shape, "sdpa", args.compute_dtype, args.device).to(COMPUTE_DTYPES[args.compute_dtype])
        model.save_pretrained(model_dir)
        del model
        # Stop id VOCAB: no model samples it, so every response runs to --new-tokens.
        engine = HFEngine(model_dir, tokenizer, [VOCAB], [], max_batch=args.rollout_prompts,
                          compute_dtype=args.compute_dtype, decode=decode)
    # Warm-up (static: compiles and captures its step) on the same shapes, fewer tokens where
    # the cache length rounds to the same bucket.
    warm = 8 if shape_bucket(PROMPT_TOKENS + 8) == shape_bucket(PROMPT_TOKENS + args.new_tokens) else args.new_tokens
    first = best_seconds(lambda: engine.generate(prompts, SamplingParams(1, warm, temperature=1.0)), args.device, repeats=1)
    params = SamplingParams(n=1, max_new_tokens=args.new_tokens, temperature=1.0)
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    rollouts = engine.generate(prompts, params)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = sum(len(r.response_ids) for r in rollouts)
    return (f"{shape:>5} HF engine rollout (hf_decode {decode:7s}) {generated} tokens in {seconds:.2f} s = "
            f"{generated / seconds:8.0f} tokens/s (first call, {warm} tokens, compilation included: {first:.1f} s)")


PATCHES_PER_IMAGE = 5184  # a 1008 x 1008 image: 72 x 72 patches of 14 x 14 (1,296 tokens after the 2 x 2 merge)


def bench_transfer(args) -> str:
    """Host-to-device time of one update's pixel inputs (`--samples` images of ~1M pixels, fp32
    patches of 3 x 2 x 14 x 14 = 1,176 values), from pageable memory and from pinned memory; the
    update moves each micro-batch's share the same way. Token ids and per-token floats are a
    few hundred KB per micro-batch and are not worth timing."""
    if args.device != "cuda":
        return "host-to-device copies: measured on a GPU only"
    pixels = torch.randn(args.samples * PATCHES_PER_IMAGE, 1176)
    pageable = best_seconds(lambda: pixels.to("cuda"), "cuda")
    start = time.perf_counter()
    pinned = pixels.pin_memory()
    pinning = time.perf_counter() - start
    from_pinned = best_seconds(lambda: pinned.to("cuda", non_blocking=True), "cuda")
    return (f"pixel inputs of {args.samples} images, {pixels.nbytes / 2**30:.2f} GiB per update: pageable "
            f"{1e3 * pageable:.0f} ms, pinned {1e3 * from_pinned:.0f} ms (pinning them: {1e3 * pinning:.0f} ms)")


def bench_optimizer(shape, args) -> str:
    """One AdamW step over the shape's parameters (vision tower included) as DeepSpeed's ZeRO
    stages 1-3 hand them to vlrft's optimizer: one flat fp32 partition and its gradient. torch's
    fused kernel (vlrft's choice) against its foreach form, and against the memory bound: the
    step reads weight, gradient and both moments and writes weight and moments, 28 bytes per
    parameter, at the bandwidth a device copy reaches here."""
    count = sum(p.numel() for p in build_model(shape, "sdpa", args.compute_dtype, "meta").parameters())
    source = torch.empty(2**28, device=args.device)  # 1 GiB
    target = torch.empty_like(source)
    bandwidth = 2 * source.nbytes / best_seconds(lambda: target.copy_(source), args.device)  # bytes read and written
    del source, target
    seconds = {}
    for form in ("fused", "foreach"):
        weight = torch.zeros(count, device=args.device, requires_grad=True)
        weight.grad = torch.randn(count, device=args.device)
        optimizer = torch.optim.AdamW([weight], lr=1e-6, **{form: True})
        optimizer.step()  # creates the moments
        seconds[form] = best_seconds(optimizer.step, args.device)
        del weight, optimizer
        if args.device == "cuda":
            torch.cuda.empty_cache()
    bound = 28 * count / bandwidth
    return (f"{shape:>5} AdamW step over {count / 1e9:.2f}B fp32 parameters (one ZeRO partition): fused "
            f"{1e3 * seconds['fused']:.1f} ms, foreach {1e3 * seconds['foreach']:.1f} ms "
            f"({seconds['foreach'] / seconds['fused']:.2f}x fused); memory bound {1e3 * bound:.1f} ms at "
            f"{bandwidth / 1e12:.2f} TB/s copied (fused {seconds['fused'] / bound:.2f}x the bound)")


def child_command(args, shape: str, zero: int = 0, checkpointing: str = "off", only: str = "update",
                  compiled: str = "off", head: str = "auto") -> list[str]:
    """This script, measuring one setting in a process of its own."""
    return [sys.executable, __file__, "--only", only, "--shapes", shape, "--zero", str(zero), "--checkpointing",
            checkpointing, "--compile", compiled, "--device", args.device, "--attention", args.attention, "--compute-dtype", args.compute_dtype,
            "--samples", str(args.samples), "--budget", str(args.budget), "--repeats", str(args.repeats),
            "--peak-tflops", str(args.peak_tflops), "--rollout-prompts", str(args.rollout_prompts),
            "--new-tokens", str(args.new_tokens), "--weights", args.weights, "--fused-head", head]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["0.5B", "1.5B", "3B"], choices=list(SHAPES))
    parser.add_argument("--zero", nargs="+", type=int, default=[2, 3])
    parser.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--compile", nargs="+", default=["off"], choices=["off", "on"],
                        help="model.compile: each decoder layer compiled (ZeRO-3: off only)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention", default="auto", help="model.attention (auto picks a varlen kernel on GPU)")
    parser.add_argument("--compute-dtype", default="bfloat16", choices=list(COMPUTE_DTYPES))
    parser.add_argument("--samples", type=int, default=64, help="rollouts per update")
    parser.add_argument("--budget", type=int, default=8192, help="micro_batch_tokens")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense peak of the GPU (H100 SXM bf16: 989)")
    parser.add_argument("--rollout-prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--weights", default="vlrft", choices=["vlrft", "bf16"],
                        help="vlrft: fp32 weights under autocast for ZeRO 0-2, bf16 mode for ZeRO-3; bf16: bf16 mode "
                             "for ZeRO-2 too")
    parser.add_argument("--fused-head", nargs="+", default=["auto"], choices=FUSED_HEADS,
                        help="model.fused_head: the update's LM head")
    parser.add_argument("--hf-decode", nargs="+", default=["dynamic", "static"], choices=["dynamic", "static"],
                        help="rollout.hf_decode of the HF engine rollout lines")
    parser.add_argument("--only", choices=["update", "rollout", "optimizer", "transfer"], help=argparse.SUPPRESS)  # a child
    args = parser.parse_args()
    if args.weights == "bf16" and min(args.zero) < 2:
        parser.error("--weights bf16 needs --zero 2 or 3 (DeepSpeed sums bf16 weights' gradients in fp32 there only)")
    for head in args.fused_head:
        if problem := fused_head_problem(head, args.compute_dtype):
            parser.error(problem.replace("config key 'model.fused_head'", "--fused-head"))
    if args.only:
        init_distributed()  # a world of one: DeepSpeed needs a process group
        args.attention_impl = resolve_attention(args.attention, args.compute_dtype)
        shape = args.shapes[0]
        if args.only == "transfer":
            print(bench_transfer(args), flush=True)
        else:
            bench = {"update": lambda: bench_update(shape, args.zero[0], args.checkpointing[0] == "on", args.compile[0] == "on", args),
                     "rollout": lambda: bench_rollout(shape, args), "optimizer": lambda: bench_optimizer(shape, args)}
            try:
                print(bench[args.only](), flush=True)
            except torch.OutOfMemoryError:  # one line, not a traceback: the next setting goes on
                what = f"ZeRO-{args.zero[0]} checkpointing {args.checkpointing[0]}" if args.only == "update" else args.only
                total = torch.cuda.get_device_properties(0).total_memory / 2**30
                print(f"{shape:>5} {what}: out of memory (peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB "
                      f"of {total:.1f})", flush=True)
                exit_process(1)
        exit_process()
    print(f"device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, attention "
          f"{resolve_attention(args.attention, args.compute_dtype)}, compute {args.compute_dtype}, "
          f"{args.samples} rollouts/update, budget {args.budget} tokens", flush=True)
    # Each setting in a fresh process: DeepSpeed keeps a ZeRO-3 engine's parameters referenced
    # after it is deleted, so in one process a setting would start with its predecessor's memory;
    # and one setting's out-of-memory ends only its own line.
    for shape in args.shapes:
        for zero in args.zero:
            for ckpt in args.checkpointing:
                for compiled in args.compile if zero != 3 else ["off"]:
                    for head in args.fused_head:
                        run_child(child_command(args, shape, zero, ckpt, compiled=compiled, head=head),
                                  f"{shape:>5} ZeRO-{zero} checkpointing {ckpt} compile {compiled} {head} head")
        for decode in args.hf_decode:
            run_child(child_command(args, shape, only="rollout") + ["--hf-decode", decode],
                      f"{shape:>5} HF engine rollout (hf_decode {decode})")
        run_child(child_command(args, shape, only="optimizer"), f"{shape:>5} AdamW step")
    run_child(child_command(args, args.shapes[0], only="transfer"), "host-to-device copies")


def run_child(command: list[str], label: str) -> None:
    done = subprocess.run(command)
    if done.returncode:
        print(f"{label}: failed (exit status {done.returncode})", flush=True)


if __name__ == "__main__":
    main()
