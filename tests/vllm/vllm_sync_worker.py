"""Worker of test_vllm_training: train under torchrun with rollout.engine vllm, then check that
the engine serves the trained weights. vLLM's logprobs of fixed token sequences are compared
with the exported (final/) policy's and with the initial checkpoint's.
Usage: vllm_sync_worker.py OUT_JSON override [override ...]; rank 0 writes OUT_JSON.
"""

import hashlib
import json
import sys

import torch


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1] logprob of each token after the first, temperature 1."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()[0, :-1]  # [L-1, V]
    return torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]


def vllm_logprobs(llm, sequences: list[list[int]]) -> list[torch.Tensor]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    # prompt_logprobs[t] holds the logprob of token t (None for the first token).
    return [torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in outputs]


def main(out_file: str, overrides: list[str]) -> None:
    import torch.distributed as dist

    from vlrft.config import load_config
    from vlrft.models.loader import load_model
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    cfg = load_config(None, overrides)
    trainer = SPMDTrainer(cfg)
    # Each rank's torch stream after start-up (vLLM reseeds every generator as it starts).
    torch_stream = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    trainer.train()  # ends with the HF export to output.dir/final (collective)
    # The same fixed sequences on every rank (a TP group must send identical requests): a
    # training prompt followed by arbitrary response tokens.
    prompt = trainer.encoder.encode(trainer.train_rows[0], 0).prompt_ids
    sequences = [prompt + [10, 11, 12, 13], prompt + [40, 7, 300, 2, 90]]
    served = vllm_logprobs(trainer.engine.llm, sequences)
    # A prompt sent again is served from vLLM's prefix cache (whole KV blocks: 128 tokens on
    # CPU). Requests for prompt logprobs bypass the cache: these ask for one sampled token.
    from vllm import SamplingParams

    long = (prompt * (300 // len(prompt) + 1))[:300]
    before = trainer.engine.prefix_cache_counts()
    for ids in (long, long + [10]):
        trainer.engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    hits, queries = (b - a for a, b in zip(before, trainer.engine.prefix_cache_counts()))
    trained, initial = load_model(f"{cfg.output.dir}/final"), load_model(cfg.model.path)
    result = {
        "rank": dist.get_rank(),
        "torch_stream": torch_stream,
        "engine_dtype": str(trainer.engine.llm.llm_engine.model_config.dtype),
        "prefix_cache": [hits, queries],
        "diff_to_trained": max(float((s - hf_logprobs(trained, q)).abs().max()) for s, q in zip(served, sequences)),
        "diff_to_initial": max(float((s - hf_logprobs(initial, q)).abs().max()) for s, q in zip(served, sequences)),
    }
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        with open(out_file, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":  # vLLM's external launcher re-imports the main module
    from vlrft.distributed import exit_process

    main(sys.argv[1], sys.argv[2:])
    exit_process()
