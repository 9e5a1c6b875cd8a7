"""The SPMD training loop and its steps."""
