"""Model loading and the shared logprob forward."""
