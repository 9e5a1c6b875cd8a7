"""The HF engine's static-shape decoding (`rollout.hf_decode: static`): what a GPU can make fast.

The dynamic path (hf_engine.py) grows its KV cache by one position per step and drops stopped
responses from the batch, so every step has new shapes and runs eagerly: on a GPU one forward
per token is bound by launching its kernels. Here every step has the same shapes: the KV cache
is transformers' `StaticCache`, sized once for the batch and prompt + new tokens; a stopped
response stays in the batch (its outputs are ignored); the attention mask is fixed for the
whole decode (padding zeros, then ones: the causal mask hides positions not yet written). On
CUDA the one-token step is compiled with transformers' `get_compiled_call` in mode
"reduce-overhead" (CUDA graphs: one launch per step). Rows and cache length are rounded up to
powers of two, so a run meets few distinct shapes and compiles few times.

Sampling is the dynamic path's own `_sample`, over the rows still running in the same order,
so both paths draw the same random numbers and (up to float rounding of the logits) the same
tokens. The prefill is the dynamic path's too (each distinct prompt once, images included);
its keys and values are copied into the static cache. Partial rollouts: when the weights
change mid-response, every row is prefilled again from its prompt and its tokens so far,
which fits the same cache (prompt width + tokens so far + tokens left is unchanged).

Why a loop of our own and not `generate(cache_implementation="static")`: `generate` samples
every row until the longest ends (a different draw of random numbers from the dynamic
path's), cannot prefill a prompt once for its n responses, takes no M-RoPE positions from the
caller, and has no point between two steps where new weights could come in and the responses
in flight be prefilled again.
"""

from __future__ import annotations

import torch
from transformers import CompileConfig, StaticCache

from vlrft.models.attention import decoder_autocast
from vlrft.models.compile_cache import use_private_compile_cache

HF_DECODE_MODES = ("auto", "dynamic", "static")


def resolve_decode(setting: str, device: torch.device) -> str:
    """`auto`: static on CUDA (compiled, CUDA graphs), dynamic elsewhere: on CPU the static
    path computes stopped rows and attends over the whole cache, and measured slower (docs/engines.md)."""
    if setting == "auto":
        return "static" if device.type == "cuda" else "dynamic"
    return setting


def shape_bucket(n: int) -> int:
    """`n` rounded up to a power of two (at least 8): the batch rows and cache lengths a
    compiled step sees, so that a run with varying prompt widths recompiles a few times only."""
    return max(8, 1 << (n - 1).bit_length())


def cuda_graphs() -> CompileConfig:
    """The step compiled by inductor and captured as CUDA graphs ("reduce-overhead"); static
    shapes (each bucket compiles once); graph breaks allowed (one costs a launch, not a result)."""
    return CompileConfig(fullgraph=False, dynamic=False, backend="inductor", mode="reduce-overhead")


class StaticDecoder:
    """Decodes batches of the engine's prompts with a static cache and a fixed-shape step."""

    def __init__(self, engine, compile_config: CompileConfig | None):
        """`compile_config`: how transformers' `get_compiled_call` compiles the step (CUDA:
        `cuda_graphs()`); None: the step runs eagerly."""
        self.engine = engine
        model = engine.model
        self.compiled = compile_config is not None
        if self.compiled:
            use_private_compile_cache()  # where inductor writes and loads the step's code
        self.step_forward = model.get_compiled_call(compile_config) if self.compiled else model.__call__
        # The last batch's cache and its (rows, length): reused while the shape stays, so a
        # captured graph keeps reading the same addresses.
        self.cache: StaticCache | None = None
        self.cache_shape: tuple[int, int] | None = None

    def _cache_for(self, rows: int, length: int) -> StaticCache:
        if self.cache_shape != (rows, length):
            self.cache = None  # (its memory goes before the next is allocated)
            self.cache = StaticCache(config=self.engine.model.config, max_cache_len=length)
            self.cache_shape = (rows, length)
        else:
            self.cache.reset()
        return self.cache

    def _prefill(self, prompts, length: int):
        """The engine's prefill, its keys and values copied into the static cache of `length`
        positions. Returns (cache, last logits [B, V], mask [B, length], next positions)."""
        engine = self.engine
        prefilled, logits, mask, next_position = engine._prefill(prompts)
        cache = self._cache_for(len(prompts), length)
        for index, layer in enumerate(prefilled.layers):
            cache.update(layer.keys, layer.values, index)  # written at positions [0, width)
        mask = torch.cat([mask, mask.new_ones((len(prompts), length - mask.shape[1]))], dim=1)
        return cache, logits, mask, next_position

    def generate_batch(self, prompts, params) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled tokens [B, N] (pad after a stop) and their logprobs [B, N] for `prompts`."""
        from vlrft.engines.hf_engine import continued

        engine = self.engine
        here = engine.model.device
        real = len(prompts)
        # Filler rows (the first prompt again: prefilled once, never sampled) up to the bucket.
        padded = prompts + [prompts[0]] * (shape_bucket(real) - real)
        width = max(len(p.prompt_ids) for p in prompts)
        length = shape_bucket(width + params.max_new_tokens)
        tokens = torch.full((len(padded), params.max_new_tokens), engine.pad_id, dtype=torch.long, device=here)
        logprobs = torch.zeros(tokens.shape, device=here)
        stop_ids = torch.tensor(engine.stop_ids, device=here)
        running = torch.arange(real, device=here)  # rows still decoding, in order (as the dynamic path keeps them)
        last = torch.full((len(padded),), engine.pad_id, dtype=torch.long, device=here)  # each row's next input
        with decoder_autocast(engine.model):
            cache, logits, mask, next_position = self._prefill(padded, length)
            for step in range(params.max_new_tokens):
                token, logprob = engine._sample(logits[running], params)
                tokens[running, step], logprobs[running, step] = token, logprob
                going = ~torch.isin(token, stop_ids)
                if step + 1 == params.max_new_tokens or not going.any():
                    break
                running, token = running[going], token[going]
                last[running] = token
                loads = engine.loads
                if engine.new_weights is not None and engine.new_weights() and engine.loads != loads:
                    # Partial rollouts: every row from a fresh prefill of its prompt and tokens
                    # so far under the new weights (stopped rows too: the shapes stay).
                    sofar = [continued(p, tokens[row, : step + 1].tolist()) for row, p in enumerate(padded)]
                    cache, logits, mask, next_position = self._prefill(sofar, length)
                    continue
                if self.compiled:  # the last step's outputs are dead (a CUDA graph may overwrite them)
                    torch.compiler.cudagraph_mark_step_begin()
                out = self.step_forward(
                    input_ids=last[:, None], attention_mask=mask, position_ids=next_position,
                    use_cache=True, **{engine.cache_name: cache},
                )
                logits = out.logits[:, -1]
                next_position = next_position + 1
        return tokens[:real], logprobs[:real]
