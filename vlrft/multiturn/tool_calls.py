"""Tool calls parsed from a policy's turn, Qwen/Hermes style:

    <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>

The turn is model-written, so hostile: the parse is linear in the turn (no regular expression
that backtracks), a call's JSON is bounded in length before it is read and in depth after
(vlrft.json_shape; nesting so deep that json's own recursion stops is refused alike).
Whatever cannot be read becomes a call {"error": why}, answered as the tool's result: the
policy learns the format from it, and the trajectory goes on.
"""

from __future__ import annotations

import json

from vlrft.json_shape import exceeds

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 65536  # a call's JSON, arguments included (a program for the `python` tool fits)
MAX_CALL_DEPTH = 32  # arrays and objects nested in a call, the call's own object included


def parse_tool_calls(text: str) -> list[dict]:
    """Each <tool_call> of a turn as {"name", "arguments"}; a malformed call becomes
    {"error": why}."""
    calls = []
    for body in call_bodies(text):
        try:
            calls.append(parse_call(body))
        except json.JSONDecodeError as err:
            calls.append({"error": f"tool call is not JSON ({err.msg})"})
        except ValueError as err:
            calls.append({"error": str(err)})
    return calls


def call_bodies(text: str) -> list[str]:
    """The text between each <tool_call> and the next </tool_call>, stripped, in order; an
    opening tag without a closing one is no call. One pass over the text."""
    bodies, at = [], 0
    while (start := text.find(OPEN, at)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            break
        bodies.append(text[start + len(OPEN) : end].strip())
        at = end + len(CLOSE)
    return bodies


def parse_call(body: str) -> dict:
    """{"name", "arguments"} of a call's text; JSONDecodeError or ValueError (the policy's error)."""
    call = bounded_json(body)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError("tool call has no 'name'")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some templates send arguments as a JSON string
        try:
            arguments = bounded_json(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call '{call['name']}' has arguments that are not an object")
    return {"name": call["name"], "arguments": arguments}


def bounded_json(text: str) -> object:
    """json.loads(text) within MAX_CALL_CHARS and MAX_CALL_DEPTH; ValueError past them (and for
    a number Python will not read: over 4300 digits), JSONDecodeError when it is not JSON."""
    if len(text) > MAX_CALL_CHARS:
        raise ValueError(f"tool call longer than {MAX_CALL_CHARS} characters")
    too_deep = ValueError(f"tool call nested more than {MAX_CALL_DEPTH} deep")
    try:
        value = json.loads(text)
    except RecursionError:
        raise too_deep from None
    except json.JSONDecodeError:
        raise
    except ValueError as err:  # "Exceeds the limit (4300 digits) for integer string conversion: ..."
        raise ValueError(f"tool call cannot be read ({str(err).partition(':')[0]})") from None
    if exceeds(value, MAX_CALL_DEPTH):
        raise too_deep
    return value
