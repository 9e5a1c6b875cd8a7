"""vlrft: reinforcement fine-tuning of vision-language and text policies.

Importing vlrft never requires vllm, deepspeed, flash-attn or a GPU: heavy dependencies are
imported inside the one module that uses them.
"""

__version__ = "0.1.0"
