"""The agent-load results table in docs, generated from the JSON that ``toolkv bench agent``
writes (``python -m toolkv.tools.agent_report FILE...``). Docs embed its output verbatim and a test
checks they still agree, so a figure can never go stale."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from toolkv.tools.agent_bench import REFUSALS, unexpected_5xx

COLUMNS = (
    ("mode", "mode"),
    ("s", "wall s"),
    ("turns", "turns"),
    ("tps", "turns/s"),
    ("hit", "resumed prompt tokens from cache"),
    ("zero", "resumed turns with 0 cached"),
    ("p50", "resumed TTFT p50 s"),
    ("p90", "resumed TTFT p90 s"),
    ("refused", "refusals (409/503/507)"),
    ("bad", "other 5xx"),
    ("twins", "twins identical"),
    ("end", "protected/locked at end"),
)


def row(res: dict[str, Any]) -> dict[str, str]:
    s = res["summary"]
    calls = s["calls"]
    refused = {k: v for k, v in calls.items() if k.split()[1] in REFUSALS}
    end = res["server_meta"]["end"] or {}
    twins = res.get("twins") or []
    return {
        "mode": res["mode"],
        "s": f"{s['wall_s']:.0f}",
        "turns": str(s["turns_ok"]),
        "tps": f"{s['turns_per_s']:.2f}",
        "hit": f"{100 * s['resumed_cache_hit']:.1f} %",
        "zero": f"{s['resumed_zero_cached']} of {s['resumed_turns']}",
        "p50": f"{s['resumed_ttft_p50_s']:.2f}",
        "p90": f"{s['resumed_ttft_p90_s']:.2f}",
        "refused": ", ".join(f"{k}: {v}" for k, v in sorted(refused.items())) or "0",
        "bad": str(unexpected_5xx(calls)),
        "twins": f"{sum(p['identical'] for p in twins)} of {len(twins)}" if twins else "-",
        "end": f"{int(end.get('protected_tokens') or 0)}/{int(end.get('device_locked_tokens') or 0)}",
    }


def table(paths: list[Path]) -> str:
    rows = [row(json.loads(p.read_text())) for p in paths]
    head = "| " + " | ".join(t for _, t in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(r[k] for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m toolkv.tools.agent_report RESULTS.json...", file=sys.stderr)
        return 2
    missing = [a for a in args if not Path(a).is_file()]
    if missing:
        print(f"no such results file: {', '.join(missing)}", file=sys.stderr)
        return 2
    print(table([Path(a) for a in args]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
