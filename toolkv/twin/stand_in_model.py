"""STAND-IN MODEL: a small deterministic "model" for the CPU server (``toolkv serve``) and the tests'
sglang stand-ins. It is not a language model and knows nothing; it exists so that an agent loop
(``examples/agent_openai.py``) sees the shape of a real conversation: a tool call on the turns that
call for one, then a plain-text answer.

Why deterministic: a test (and a newcomer comparing with the docs) must see the same turns, the
same tool calls and the same token counts on every run, as a real model at temperature 0 would give.

Its rules, all of them:

* **tokenizer** (:func:`tokenize`): one id per character of each message's JSON (ids 1..500), so
  the next turn's prompt *extends* this turn's prompt and a cache can reuse its prefix, as a chat
  template does with a real tokenizer;
* **tool calls** (:func:`tool_to_call`): while the request offers tools, does not say
  ``tool_choice: "none"``, and the conversation holds fewer than :data:`TOOL_RESULTS_WANTED` tool
  results, it calls a tool (the forced one, else the first offered); otherwise it answers in text;
* **output ids** (:func:`output_ids`): ``n`` ids derived from the prompt, so the answer's KV is
  deterministic too.

Standard library only: the tests' stand-ins of sglang 0.5.16 and 0.5.23 import it, and so does the
server of :mod:`toolkv.twin.serve`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

NAME = "toolkv-stand-in"  # what /v1/models lists and responses name as their model
TOOL_RESULTS_WANTED = 2  # tool results the stand-in wants before it answers in text
OUTPUT_TOKENS = 8  # ids per answer (a tool call or the text)


def tokenize(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """One id per character of each message's JSON (ids 1..500): a prompt extends the previous
    turn's prompt, so the cached prefix of a conversation is reused turn after turn."""
    out: list[int] = []
    for m in messages:
        keep = {k: m.get(k) for k in ("role", "content", "tool_call_id", "name") if m.get(k) is not None}
        out += [1 + ord(c) % 500 for c in json.dumps(keep, sort_keys=True)]
    return out


def tokenize_text(text: str) -> list[int]:
    """``/generate``'s ``text``: the same one id per character."""
    return [1 + ord(c) % 500 for c in text]


def tool_results(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for m in messages if m.get("role") == "tool")


def tool_to_call(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any
) -> str | None:
    """The tool this turn calls, or None for a plain-text answer (the module docstring's rule)."""
    if not tools or tool_choice == "none" or tool_results(messages) >= TOOL_RESULTS_WANTED:
        return None
    forced = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, Mapping) else None
    if forced:
        return str(forced)
    first = tools[0].get("function", {}) if isinstance(tools[0], Mapping) else {}
    name = first.get("name") if isinstance(first, Mapping) else None
    return str(name) if name else None


def tool_arguments(messages: Sequence[Mapping[str, Any]]) -> str:
    """The call's arguments (JSON): the user's question and which step this is."""
    question = next((str(m.get("content")) for m in messages if m.get("role") == "user"), "")
    return json.dumps({"q": f"{question} (step {tool_results(messages) + 1})".strip()})


def answer_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The plain-text answer: says it is the stand-in, and what it was given."""
    n = tool_results(messages)
    return f"[{NAME}] answer after {n} tool result{'s' if n != 1 else ''}"


def output_ids(prompt: Sequence[int], n: int = OUTPUT_TOKENS) -> list[int]:
    """``n`` answer ids derived from the prompt (1000..9999, inside any vocabulary the caches use)."""
    seed = sum(prompt) % 9000
    return [1000 + (seed + 7 * k) % 9000 for k in range(n)]
