"""An agent loop on the OpenAI client that lets toolkv park its KV cache while tools run.

Copy the part you need. The agent talks to sglang's OpenAI route (``/v1/chat/completions``) and
labels every request with its session (``extra_body={"session_id": ...}``); what else it does
depends on how much it may change:

``zero_change``
    Nothing. The server runs with ``TOOLKV_ZERO_CHANGE=1``: a turn that ends in tool calls
    (``finish_reason == "tool_calls"``) offloads the session's KV, the session's next request
    restores it. Works on sglang 0.5.16 and 0.5.23.
``kv_hints``
    The request that ends in a tool call carries a toolkv action in sglang's own ``kv_hints``
    envelope (``toolkv.client.kv_hints``, sglang 0.5.23): toolkv applies it when the turn
    finishes, with the tool's name and expected duration, and answers in the response's
    ``meta_info`` (``return_meta_info: true``) with the outcome and the epoch for ``tool_end``. No
    extra round trip. On sglang 0.5.16 the field is dropped and no outcome comes back: the loop
    then falls back to ``explicit``.
``explicit``
    ``with kv.tool_call(session_id, tool=name):`` around each tool: toolkv's HTTP calls
    ``tool_start``/``tool_end`` (two round trips per tool call).

Whatever toolkv answers, the agent goes on: toolkv only makes the next turn faster. Close the
session when the agent is done (``kv.close_session``): a session whose last turn carried a hint but
answered instead of calling a tool is otherwise held until toolkv's TTL.

Run against a server (``TOOLKV_ENABLE=1``; add ``TOOLKV_ZERO_CHANGE=1`` for that mode), or, without
a GPU, against ``toolkv serve`` (a stand-in model over sglang's real caches; it answers like
sglang 0.5.16, so ``kv_hints`` falls back to ``explicit`` there)::

    python examples/agent_openai.py --base-url http://127.0.0.1:30000 --model MODEL --mode kv_hints

Needs ``pip install openai 'dist/toolkv-0.1.0-py3-none-any.whl[client]'`` (toolkv's wheel with its
client extra, built in a checkout: README, "Operating it"). ``tests/test_agent_example_0523.py`` runs
all three modes in CI against a CPU stand-in of an sglang 0.5.23 server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from openai import APIConnectionError, OpenAI

from toolkv.client import ToolKVClient, kv_hints, kv_hints_outcome
from toolkv.errors import ToolKVError

MODES = ("zero_change", "kv_hints", "explicit")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
]
EXPECTED_S = {"search": 2.0}  # what the agent knows about its tools' durations (a hint, not a promise)


def run_tool(name: str, arguments: str, *, delay_s: float = 0.0) -> str:
    """The agent's tools. Here one fake search; a real agent runs code, calls an API, ..."""
    time.sleep(delay_s)
    args = json.loads(arguments or "{}")
    return f"{name} results for {args.get('q', '')!r}"


@dataclass
class AgentRun:
    """What one session did: the answer, and toolkv's answer to each tool call."""

    answer: str | None = None
    tool_calls: int = 0
    outcomes: list[dict[str, Any]] = field(default_factory=list)  # kv_hints mode
    epochs: list[int] = field(default_factory=list)  # the epochs tool_end was called with
    cached_tokens: list[int] = field(default_factory=list)  # per turn: prompt tokens the server reused


def run_agent(
    llm: OpenAI,
    kv: ToolKVClient | None,
    *,
    model: str,
    mode: str,
    question: str,
    session_id: str | None = None,
    max_steps: int = 8,
    tool_delay_s: float = 0.0,
) -> AgentRun:
    """One agent session: ask, run the tools the model calls, until it answers."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    sid = session_id or f"agent-{uuid.uuid4().hex[:12]}"
    run = AgentRun()
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    hints = mode == "kv_hints"
    for _ in range(max_steps):
        extra: dict[str, Any] = {"session_id": sid}
        if hints:
            # one tool here, so the agent knows which tool the turn will call; name it if you can
            extra["kv_hints"] = kv_hints("tool_start", tool="search", expected_s=EXPECTED_S["search"])
            extra["return_meta_info"] = True  # meta_info (with toolkv's outcome) in each choice
        resp = llm.chat.completions.create(model=model, messages=messages, tools=TOOLS, extra_body=extra)  # type: ignore[arg-type]
        choice = resp.choices[0]
        details = resp.usage.prompt_tokens_details if resp.usage is not None else None
        run.cached_tokens.append(int(getattr(details, "cached_tokens", None) or 0))
        calls = choice.message.tool_calls or []
        outcome = kv_hints_outcome((choice.model_extra or {}).get("meta_info")) if hints else None
        if hints and outcome is None:
            hints = False  # sglang 0.5.16 or toolkv off: no outcome came back; use the HTTP calls
            mode = "explicit"
        if not calls:
            run.answer = choice.message.content
            break
        messages.append(choice.message.model_dump(exclude_none=True))
        if outcome is not None:
            run.outcomes.append(outcome)
        for call in calls:
            name, args = call.function.name, call.function.arguments  # type: ignore[union-attr]
            run.tool_calls += 1
            if mode == "explicit" and kv is not None:
                with kv.tool_call(sid, tool=name, expected_s=EXPECTED_S.get(name)) as tc:
                    result = run_tool(name, args, delay_s=tool_delay_s)
                if tc.start is not None:
                    run.epochs.append(tc.start.epoch)
            else:
                result = run_tool(name, args, delay_s=tool_delay_s)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if outcome is not None and outcome["outcome"] != "rejected" and kv is not None:
            # optional: start the restore now; without it the next request restores the KV
            try:
                kv.tool_end(sid, int(outcome["epoch"]))
                run.epochs.append(int(outcome["epoch"]))
            except ToolKVError:
                pass  # e.g. device memory full: the next request's prefill loads it back
    if kv is not None:
        with contextlib.suppress(ToolKVError):  # done: release whatever toolkv still holds
            kv.close_session(sid)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default="default")
    p.add_argument("--api-key", default="none")
    p.add_argument("--mode", choices=MODES, default="kv_hints")
    p.add_argument("--question", default="What is the KV cache?")
    a = p.parse_args()
    llm = OpenAI(base_url=f"{a.base_url}/v1", api_key=a.api_key)
    try:
        with ToolKVClient(a.base_url, api_key=None if a.api_key == "none" else a.api_key) as kv:
            before = toolkv_counters(kv)
            run = run_agent(llm, kv, model=a.model, mode=a.mode, question=a.question)
            after = toolkv_counters(kv)
    except APIConnectionError:
        raise SystemExit(
            f"agent_openai.py: no server answers at {a.base_url}; start one (no GPU needed) with: toolkv serve"
        ) from None
    did = {k: after.get(k, 0) - before.get(k, 0) for k in TOOLKV_DID}
    print(
        json.dumps(
            {
                "answer": run.answer,
                "tool_calls": run.tool_calls,
                "outcomes": run.outcomes,
                # prompt tokens the server found in its cache, per turn (usage.prompt_tokens_details)
                "tokens_reused": run.cached_tokens,
                # what toolkv did on the server while this agent ran (its server-wide counters; other
                # sessions running at the same time count too); empty if toolkv is not on there
                "toolkv": did if after else {},
            },
            indent=2,
        )
    )


# toolkv's server-wide counters the example reports: tool calls seen, KV offloaded to host memory,
# KV restored to the device
TOOLKV_DID = ("tool_start", "tool_end", "offloaded_tokens", "restored_tokens")


def toolkv_counters(kv: ToolKVClient) -> dict[str, int]:
    """toolkv's lifetime counters on the server, or {} where toolkv does not answer."""
    try:
        return kv.server_meta().counters
    except ToolKVError:
        return {}


if __name__ == "__main__":
    main()
