"""``toolkv fuzz-http URL``: schemathesis over toolkv's routes of a running server.

schemathesis reads the OpenAPI document (toolkv's routes in the server's own ``/openapi.json``)
and generates requests with Hypothesis: bodies and queries that fit the schema (positive) and
that break it (negative). For every request two properties must hold:

1. no answer is a server error (status >= 500 other than the contract's 503/504);
2. a refusal (any 4xx, and 503) changes nothing: every known session's ``kv_meta`` and the
   server-wide count of sessions by state are the same before and after.

Half of the generated session ids are swapped for ones the server knows (``--session``), so that
requests reach the manager's decisions instead of stopping at ``unknown_session``. The same
:func:`fuzz` runs in CI against the app over the real CPU cache (``tests/test_http_fuzz.py``),
with ``prepare`` re-creating sessions and finishing copies between requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from toolkv.argtypes import http_url, positive_int, seed
from toolkv.errors import InputError

ALLOWED_5XX = frozenset({503, 504})  # device memory full / toolkv unavailable; scheduler timeout


@dataclass
class FuzzReport:
    requests: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    by_operation: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "by_operation": dict(sorted(self.by_operation.items())),
            "failures": self.failures,
        }


def _swap_session(case: Any, known: list[str]) -> None:
    """Deterministically (by the generated id's CRC) point half the cases at a known session."""
    if not known:
        return
    for holder in (case.body, case.query):
        if isinstance(holder, dict) and isinstance(holder.get("session_id"), str):
            crc = zlib.crc32(holder["session_id"].encode("utf-8", "surrogatepass"))
            if crc % 2 == 0:
                holder["session_id"] = known[(crc >> 1) % len(known)]


# Routes the campaign leaves alone: a valid drain request switches the whole server into refusing
# tool calls (or out of it), so fuzzing it against a live server would leave that server draining, or
# end an operator's drain. Its refusals are tested in tests/test_drain.py.
NOT_FUZZED = frozenset({("POST", "/session/drain")})


def fuzz(
    schema: Any,
    *,
    call: Callable[[Any], Any],
    snapshot: Callable[[], Any],
    known: Iterable[str] = (),
    prepare: Callable[[], None] = lambda: None,
    examples: int = 50,
    seed: int | None = 0,
) -> FuzzReport:
    """Run ``examples`` positive and ``examples`` negative cases per operation of ``schema``
    (toolkv's ``/session/`` routes). ``call(case)`` sends one case and returns the response."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from schemathesis import GenerationMode

    known_ids = list(known)
    report = FuzzReport()
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [
        op for op in ops if op.path.startswith("/session/") and (op.method.upper(), op.path) not in NOT_FUZZED
    ]
    if not ops:
        raise ValueError("the schema has no /session/ routes: is toolkv enabled on this server?")

    def campaign(op: Any, mode: Any) -> None:
        label = f"{op.method.upper()} {op.path} {mode.value}"

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=seed is not None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],
            report_multiple_bugs=False,
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def one(case: Any) -> None:
            prepare()
            _swap_session(case, known_ids)
            before = snapshot()
            response = call(case)
            status = int(response.status_code)
            report.requests += 1
            report.by_status[status] += 1
            report.by_operation[label] += 1
            where = f"{label}: {case.body if case.body is not None else case.query!r:.200} -> {status}"
            if status >= 500 and status not in ALLOWED_5XX:
                report.failures.append(f"server error: {where}: {response.text[:300]}")
            elif status >= 400 and status != 504 and snapshot() != before:
                report.failures.append(f"refusal changed kv_meta: {where}: {response.text[:300]}")

        (hseed(seed)(one) if seed is not None else one)()

    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            campaign(op, mode)
    return report


# ---- against a running server -----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", type=http_url, help="the sglang server, e.g. http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None, help="the server's --api-key")
    p.add_argument(
        "--session", action="append", default=[], help="a session id the server tracks (repeatable)"
    )
    p.add_argument(
        "--examples", type=positive_int, default=100, help="examples per route and mode (default 100)"
    )
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    try:
        import schemathesis
    except ImportError:
        from toolkv.tools.cli import install_hint

        print(f"toolkv fuzz-http: error: needs schemathesis, which is not installed here: {install_hint('schemathesis')}",
              file=sys.stderr)  # fmt: skip
        return 2
    import httpx
    from schemathesis.core.errors import LoaderError

    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=headers)
    except (LoaderError, httpx.HTTPError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(
            f"cannot load {base}/openapi.json ({first}): is the server running at {base}?"
        ) from None
    http = httpx.Client(base_url=base, headers=headers, timeout=60)

    def snapshot() -> Any:
        metas = {s: http.get("/session/kv_meta", params={"session_id": s}).json() for s in args.session}
        states = http.get("/session/kv_meta").json().get("states")
        return metas, states

    report = fuzz(
        schema,
        call=lambda case: case.call(base_url=base, headers=headers),
        snapshot=snapshot,
        known=args.session,
        examples=args.examples,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(
            f"fuzz-http: {report.requests} requests, status counts {dict(sorted(report.by_status.items()))}"
        )
        for f in report.failures[:20]:
            print("  FAIL " + f)
        print(f"failures: {len(report.failures)}")
    return 1 if report.failures else 0
