"""Worker of test_vllm_partial: partial rollouts on the vLLM engine, run as an async rollout rank
runs it (an EngineProcess; its polls between decoding steps come back here). New weights are
sent at the 4th poll; each response's recorded logprobs are written with the trainer's forward's
logprobs of the same tokens under the old and the new weights.
Usage: vllm_partial_worker.py MODEL DATA_JSONL OUT_JSON"""

import json
import sys

import torch


def main(model_path: str, data: str, out_file: str) -> None:
    from transformers import AutoTokenizer

    from vlrft.config import Config
    from vlrft.data.dataset import load_rows
    from vlrft.data.encoding import PromptEncoder
    from vlrft.engines import SamplingParams
    from vlrft.engines.engine_process import EngineProcess
    from vlrft.models.collate import gather_responses
    from vlrft.models.forward import policy_forward
    from vlrft.models.loader import load_model, stop_token_ids
    from vlrft.models.packing import pack

    cfg = Config()
    cfg.model.path = model_path
    cfg.rollout.vllm_memory_fraction = 0.15
    encoder = PromptEncoder(model_path, 3136, 12544, 512)
    tok = AutoTokenizer.from_pretrained(model_path)
    # No banned ids: vLLM's logprobs are then the full softmax's, as the trainer's forward scores them.
    engine = EngineProcess("vllm", cfg, tok, stop_token_ids(tok), [])
    model = load_model(model_path)
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(1)
    new = {n: t + 0.05 * torch.randn_like(t) for n, t in old.items()}
    polls = []

    def new_weights() -> bool:
        polls.append(len(polls))
        if len(polls) == 4:
            engine.update_weights(new.items())
            return True
        return False

    engine.new_weights = new_weights
    prompts = [encoder.encode(r, i) for i, r in enumerate(load_rows(data)[:3])]
    params = SamplingParams(n=3, max_new_tokens=10, temperature=0.8, seed=7)
    rollouts = engine.generate(prompts, params)
    engine.new_weights = None

    def scored(weights):
        model.load_state_dict(weights, strict=False)
        with torch.no_grad():
            batch = pack(rollouts)
            return gather_responses(batch, policy_forward(model, batch, params.temperature).logp)

    under_old, under_new = scored(old), scored(new)
    result = [{"recorded": r.logprobs, "old": a.tolist(), "new": b.tolist()} for r, a, b in zip(rollouts, under_old, under_new)]
    with open(out_file, "w") as f:
        json.dump({"polls": len(polls), "responses": result}, f)
    engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
