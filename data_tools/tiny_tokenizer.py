"""The tiny checkpoints' tokenizer: a byte-level BPE trained offline on a small built-in
corpus, with Qwen's special tokens (same order, ids right after the BPE vocab), Qwen2's
pre-tokenisation and a Qwen2-VL style chat template (no default system prompt)."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from data_tools.synth_shapes import COLOURS, COLOUR_QUESTION, SHAPES

# Qwen special tokens, in Qwen's own order (they get the ids right after the BPE vocab,
# as in the real tokenizer).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# The answer tags are ordinary (non-special) added tokens: one token each, and they
# survive ``decode(skip_special_tokens=True)`` so reward functions can parse them.
ANSWER_TOKENS = ("<answer>", "</answer>")

BPE_VOCAB_SIZE = 768  # byte alphabet (256) + merges; small because the LM head cost matters

# Same pre-tokenisation as Qwen2 (digits are split one per token).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2-VL style template without the default system prompt (keeps prompts short).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    """Small built-in training corpus. BPE merges are frequency driven, so the task
    prompts and answer words are repeated to make sure they end up as whole tokens."""
    task = [
        COLOUR_QUESTION,
        "What is the shape? What colour is it? Answer with one word.",
        "system\nYou are a helpful assistant.\nuser\nassistant\n",
        "The answer is correct. The answer is wrong. Think step by step.",
    ]
    task += [f"What is {a} + {b}? Answer as <answer>number</answer>. {a + b}" for a in range(10) for b in range(10)]
    words = list(COLOURS) + list(SHAPES) + [
        "colour", "color", "number", "answer", "shape", "image", "picture", "question", "user",
        "assistant", "system", "square", "circle", "triangle", "background", "grey", "gray",
        "white", "black", "orange", "purple", "left", "right", "top", "bottom", "small", "large",
    ]
    english = (
        "the a an and or of to in on at is are was were be this that it its with for as by from "
        "what which who how why where when yes no not one two three four five six seven eight nine "
        "ten zero plus minus equals sum total look see describe count find please thank you hello "
        "i we they he she my your our their there here can will would should could do does did "
        "have has had make made get got give take say said think know want need use work good "
        "bad new old first last next final result reason because so then if else true false"
    ).split()
    # Bare words (line starts) too: answers put the word right after "<answer>", no space.
    bare = list(COLOURS) + ["colour", "number", "answer"]
    lines = task * 20 + bare * 20
    lines += [" ".join(words) for _ in range(20)] + [" ".join(f" {w}" for w in words) for _ in range(20)]
    lines += [" ".join(english) for _ in range(5)]
    lines += [" ".join(str(n) for n in range(200))]
    return lines


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the built-in corpus, with Qwen special tokens and template."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte string is encodable
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Specials in Qwen's order get the ids right after the BPE vocab; answer tags follow.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ANSWER_TOKENS])

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=4096,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    # Register the remaining specials so decode(skip_special_tokens=True) drops them (ids unchanged).
    extra = [t for t in SPECIAL_TOKENS if t not in (hf.eos_token, hf.pad_token)]
    hf.add_special_tokens({"additional_special_tokens": extra})
    hf.chat_template = CHAT_TEMPLATE
    return hf


def special_token_ids(tokenizer) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + ANSWER_TOKENS}
