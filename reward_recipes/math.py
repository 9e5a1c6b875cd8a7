"""Math accuracy by symbolic equivalence, using the `math-verify` package.

Scoring rule of `math_accuracy`, per completion:

* gold: `sample["answer"]`. A gold with LaTeX delimiters (`$`, `\\(`, `\\[`) or a `\\boxed{}` is
  parsed as written; a bare gold ("0.5", "\\frac{1}{2}", "x^2+2x+1") is parsed as `$gold$`. A gold
  that yields no mathematical object (empty, "$$", "\\frac{1}{") scores None: not applicable, it is
  a data problem rather than the policy's fault.
* prediction: the content of the last `<answer>...</answer>` tag if there is one, else the whole
  completion. Text with delimiters or a `\\boxed{}` goes through math-verify's own extraction (the
  boxed answer first, then "final answer is ...", then the last LaTeX / plain expression). Bare
  tag content is parsed as `$content$` first (so `<answer>2\\sqrt{2}</answer>` is 2*sqrt(2), not
  the 2 that plain extraction would pick), bare untagged text by math-verify's extraction first;
  either way the other reading is the fallback.
* score: 1.0 if `verify(gold, prediction)`, else 0.0; an unparsable prediction ("I don't know",
  an unbalanced "\\boxed{3", "") scores 0.0.

Thread safety: math-verify's default timeouts use `signal.alarm`, which raises outside the main
thread, so this recipe always passes `parsing_timeout=None` / `timeout_seconds=None` and relies on
the caller's timeout: the trainer (vlrft.rewards.guard) and the reward server (its worker
processes) both run it in a worker process killed at the timeout. That is needed: sympy
evaluates what it parses, and `\\boxed{9^{9^{9}}}` (24 bytes) is a power of 370 million digits,
computed in C holding the GIL. No lock is held, so concurrent calls cannot block each other.
"""

from __future__ import annotations

from reward_recipes.tags import last_answer

_INSTALL_HINT = "math_accuracy needs math-verify: pip install 'vlrft[rewards]'"
_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


def _math_verify():
    """(parse, verify) from math_verify, imported at call time with a one-line install hint."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError(_INSTALL_HINT) from None
    return parse, verify


def _has_delimiters(text: str) -> bool:
    return any(d in text for d in _DELIMITERS)


def _parsed(parse, text: str) -> list:
    """math_verify.parse without its signal-based timeout; [] unless it found a math object
    (a parse that only echoes the raw string back, as its fallback does, counts as a failure)."""
    found = parse(text, parsing_timeout=None)
    return found if any(not isinstance(item, str) for item in found) else []


def parse_gold(parse, answer) -> list:
    """The parsed gold answer ([] when unparsable): as written when delimited, else as `$answer$`."""
    text = "" if answer is None else str(answer).strip()
    if not text:
        return []
    return _parsed(parse, text) if _has_delimiters(text) else _parsed(parse, f"${text}$")


def parse_prediction(parse, completion: str) -> list:
    """The parsed prediction ([] when unparsable); see the module docstring for the order."""
    tagged = last_answer(completion)
    text = (tagged if tagged is not None else completion).strip()
    if not text:
        return []
    if _has_delimiters(text):
        return _parsed(parse, text)  # math_verify's extraction: boxed first, balanced braces only
    wrapped, plain = (lambda: _parsed(parse, f"${text}$")), (lambda: _parsed(parse, text))
    first, second = (wrapped, plain) if tagged is not None else (plain, wrapped)
    return first() or second()


def math_accuracy(completions: list[str], samples: list[dict]) -> list[float | None]:
    """1.0 if math-verify finds the prediction equivalent to the gold answer, 0.0 if not or if
    the prediction is unparsable, None if the gold answer is unparsable (see the module docstring).
    Raises ImportError (with the install command) when math-verify is not installed."""
    parse, verify = _math_verify()
    scores: list[float | None] = []
    for completion, sample in zip(completions, samples):
        gold = parse_gold(parse, sample.get("answer"))
        if not gold:
            scores.append(None)
            continue
        pred = parse_prediction(parse, completion or "")
        ok = bool(pred) and verify(gold, pred, timeout_seconds=None)
        scores.append(1.0 if ok else 0.0)
    return scores


# Checked when a config naming this recipe loads (vlrft/config_checks.py), not on every call.
math_accuracy.requires = {"math_verify": _INSTALL_HINT}
