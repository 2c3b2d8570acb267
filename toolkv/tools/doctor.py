"""``toolkv doctor URL``: is toolkv on at that server, and what is it doing?

For an operator at a terminal (or a script, with ``--json``): one read of ``GET /session/status``
answers which toolkv and sglang releases run there, the backend, every ``TOOLKV_*`` setting in
force, whether the server drains, the sessions by state, and the sessions that hold KV with the
time left on their TTL. It changes nothing on the server.

Exit status: 0 when toolkv answers; 1 when it does not (not installed or not enabled there, the
server unreachable, a wrong API key, the scheduler not answering), with the reason in one line;
2 for a usage error (a URL that is not ``http(s)://HOST[:PORT]`` among them). The read is sent once (no retries): a doctor that waits minutes on a server
that does not answer is no help, and the answer "no answer within --timeout" is itself a finding.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from toolkv.argtypes import http_url, ints, positive_float

DEFAULT_TIMEOUT_S = 10.0


# ``--timeout``/``--wait``/``--every``: a finite number of seconds > 0; ``--limit``: the server's cap
# on the sessions it lists (argparse types: a bad one is a usage error, exit 2)
timeout_s = positive_float
limit = ints(0, 1000)


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments every operator command shares (doctor, drain)."""
    p.add_argument("url", type=http_url, help="the sglang server, e.g. http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument(
        "--timeout",
        type=timeout_s,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait for each answer (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_server_arguments(p)
    p.add_argument(
        "--limit",
        type=limit,
        default=20,
        metavar="N",
        help="list at most N of the sessions that hold KV, soonest expiry first (0-1000, default 20)",
    )


def client(args: argparse.Namespace) -> Any:
    """A client that sends each call once and waits at most ``--timeout`` for it."""
    from toolkv.client import NO_RETRY, ToolKVClient

    return ToolKVClient(args.url, api_key=args.api_key, timeout_s=args.timeout, retry=NO_RETRY)


def diagnosis(url: str, err: Exception) -> str:
    """Why toolkv did not answer at ``url``, in one line an operator can act on."""
    from toolkv.client import (
        SchedulerTimeout,
        ServerUnreachable,
        ToolKVNotRunning,
        ToolKVUnavailable,
        TransportError,
        Unauthorized,
    )

    if isinstance(err, ToolKVNotRunning):
        return (
            f"toolkv is off at {url}: the server answers, but not toolkv's routes (toolkv is not installed "
            "there, or the server was launched without TOOLKV_ENABLE=1)"
        )
    if isinstance(err, Unauthorized):
        return f"{url} refused the request (HTTP {err.http_status}): give the server's key with --api-key"
    if isinstance(err, ServerUnreachable):
        return f"no server at {url}: {err}"
    if isinstance(err, TransportError):
        return f"{url} did not answer: {err}"
    if isinstance(err, SchedulerTimeout):
        return f"toolkv is on at {url}, but its scheduler did not answer in time: {err}"
    if isinstance(err, ToolKVUnavailable):
        return f"toolkv is installed at {url} but not serving: {err}"
    code = getattr(err, "code", type(err).__name__)
    return f"toolkv at {url} answered with an error ({code}): {err}"


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 120:
        return f"{value / 60:.1f} min"
    return f"{value:.1f} s"


def _states(states: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(states.items(), key=lambda kv: (-kv[1], kv[0])))


def drain_line(d: Any) -> str:
    """The drain's state in words (a :class:`toolkv.client.DrainStatus`)."""
    if not d.draining:
        return "off (tool calls are accepted)"
    held = f"{_count(d.held_sessions, 'session')} holding KV ({d.held_tokens:,} tokens)"
    done = "drained: nothing held, toolkv can be switched off" if d.drained else held
    return f"ON, new tool calls refused ({d.drain_refused:,} so far); {done}"


def render(url: str, st: Any) -> str:
    """The human-readable report of a :class:`toolkv.client.ServerStatus`."""
    raw: dict[str, Any] = st.raw
    lines = [
        f"toolkv is on at {url}",
        f"  toolkv {st.version} on sglang {st.sglang}, backend {st.backend}, tp_size {st.tp_size}",
        f"  drain:     {drain_line(st.drain)}",
        f"  sessions:  {st.sessions:,} tracked" + (f" ({_states(st.states)})" if st.states else ""),
        f"  holding:   {_count(st.drain.held_sessions, 'session')}, {st.drain.held_tokens:,} tokens",
    ]
    if st.held:
        rows = [("session", "state", "tier", "tokens", "TTL left")]
        rows += [
            (h.meta.session_id, h.meta.state, h.meta.tier, f"{h.meta.tokens:,}", _seconds(h.ttl_left_s))
            for h in st.held
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        for r in rows:
            cells = [r[i].ljust(widths[i]) if i < 3 else r[i].rjust(widths[i]) for i in range(5)]
            lines.append("    " + "  ".join(cells))
        more = st.drain.held_sessions - len(st.held)
        if more > 0:
            lines.append(f"    ... and {_count(more, 'more session')} (--limit)")
    if raw.get("host_total_tokens") is not None:
        lines.append(
            f"  host pool: {int(raw['host_total_tokens']):,} tokens, {int(raw.get('host_free_tokens') or 0):,} free"
        )
    if raw.get("device_free_tokens") is not None:
        lines.append(
            f"  device:    {int(raw['device_free_tokens']):,} tokens free, "
            f"{int(raw.get('device_evictable_tokens') or 0):,} evictable, "
            f"{int(raw.get('device_locked_tokens') or 0):,} locked"
        )
    lines += settings_lines(st.settings)
    return "\n".join(lines)


def _env_text(value: Any) -> str:
    """A setting's value as its variable would be written (``TOOLKV_LAZY_FREE=0``)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None or value == "":
        return "unset"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def settings_lines(settings: dict[str, Any]) -> list[str]:
    """The settings in force, by their ``TOOLKV_*`` names (``toolkv.core.settings``): those that
    differ from the declared default, each with its default and its one-line reason; the rest
    counted. A name this toolkv does not declare (a newer server's) is listed as the server said it."""
    from toolkv.core.settings import SETTINGS

    declared = {s.field for s in SETTINGS}
    changed = [
        f"{s.name}={_env_text(settings[s.field])} (default {_env_text(s.default)}): {s.reason}"
        for s in SETTINGS
        if s.field != "enable" and s.field in settings and settings[s.field] != s.default
    ]
    other = [f"{k}={v}" for k, v in settings.items() if k not in declared]
    same = sum(1 for s in SETTINGS if s.field != "enable" and s.field in settings) - len(changed)
    head = f"  settings:  {len(changed)} changed, {same} at the default"
    out = [head + (":" if changed or other else "")]
    out += [f"    {line}" for line in changed]
    if other:
        out.append(
            textwrap.fill(" ".join(other), width=100, initial_indent="    not known here: ",
                          subsequent_indent=" " * 6, break_long_words=False, break_on_hyphens=False)
        )  # fmt: skip
    return out


def run(args: argparse.Namespace) -> int:
    from toolkv.errors import ToolKVError

    url = args.url.rstrip("/")
    with client(args) as kv:
        try:
            st = kv.server_status(limit=args.limit)
        except ToolKVError as e:
            line = diagnosis(url, e)
            if args.json:
                print(json.dumps({"url": url, "on": False, "error": e.code, "message": line}, indent=2))
            else:
                print(line, file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"url": url, "on": True, "status": st.raw}, indent=2))
    else:
        print(render(url, st))
    return 0
