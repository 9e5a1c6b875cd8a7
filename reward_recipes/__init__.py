"""Built-in reward recipes: small modules of plain functions (see vlrft.rewards.mix)."""
