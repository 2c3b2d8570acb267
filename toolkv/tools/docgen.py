"""``toolkv docs``: the generated parts of docs/, rebuilt from what the tools wrote.

Numbers in docs are never typed in: a tool writes JSON, this command renders it into the marked
block of the document, and ``tests/test_docs.py`` fails when the two disagree. Today that is the
model-checking table of docs/spec.md::

    toolkv spec-check --json > spec-check.json      # minutes: every config and mutant
    toolkv docs --spec-check spec-check.json         # docs/spec-check.json + the table in docs/spec.md

A config added later need not re-run the whole set (half an hour on one TLC worker):
``toolkv spec-check --only NEW --json > new.json && toolkv docs --spec-check-add new.json`` merges its
rows into the stored summary (a row of the same name is replaced, the seconds are added, the runs
counted, and the table says so).

The JSON is stored without machine-specific fields (the spec directory's absolute path).

``toolkv docs --layout`` rewrites the layout measures in docs/architecture.md instead (file sizes,
import cycles, upward imports: :mod:`toolkv.tools.layout`, read from the package itself).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from toolkv.errors import InputError

DOCS = Path(__file__).resolve().parents[2] / "docs"
SPEC_JSON = DOCS / "spec-check.json"
SPEC_MD = DOCS / "spec.md"
OPS_MD = DOCS / "operations.md"
ARCH_MD = DOCS / "architecture.md"
BEGIN, END = "<!-- BEGIN spec-check (generated: toolkv docs) -->", "<!-- END spec-check -->"
MACHINE_FIELDS = ("spec_dir",)


def clean(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in MACHINE_FIELDS}


def spec_table(summary: dict[str, Any]) -> str:
    """The block docs/spec.md shows: the command, the totals, and spec-check's own table."""
    from toolkv.verify.spec_check import ConfigResult, format_table

    results = [ConfigResult(**r) for r in summary["configs"]]
    ok = "all as expected" if summary["ok"] else "NOT all as expected"
    runs = int(summary.get("runs", 1))
    merged = f" (over {runs} runs, merged by `toolkv docs --spec-check-add`)" if runs > 1 else ""
    return "\n".join(
        [
            BEGIN,
            f"`toolkv spec-check --json` ({summary['workers']} TLC worker): {len(results)} configs in "
            f"{summary['seconds']:.0f} s{merged}, {ok}.",
            "",
            "```",
            format_table(results),
            "```",
            END,
        ]
    )


def merge_summaries(base: dict[str, Any], added: dict[str, Any]) -> dict[str, Any]:
    """``added``'s configs over ``base``'s: a config of the same name is replaced in place, a new one
    appended; seconds add up and the runs are counted, so the table never presents two runs as one.
    Both must have run with the same number of TLC workers (their seconds would not compare)."""
    if base.get("workers") != added.get("workers"):
        raise InputError(
            f"the runs used {base.get('workers')} and {added.get('workers')} TLC workers: "
            "merge only runs with the same --workers"
        )
    rows = {r["name"]: r for r in base["configs"]}
    new = {r["name"]: r for r in added["configs"]}
    configs = [new.get(r["name"], r) for r in base["configs"]]
    for name, row in new.items():  # a new config goes after the last of its kind (safe, mutant, ...)
        if name not in rows:
            same = [i for i, r in enumerate(configs) if r.get("kind") == row.get("kind")]
            configs.insert(same[-1] + 1 if same else len(configs), row)
    return {
        **base,
        "ok": all(r["ok"] for r in configs),
        "seconds": round(float(base["seconds"]) + float(added["seconds"]), 1),
        "runs": int(base.get("runs", 1)) + int(added.get("runs", 1)),
        "configs": configs,
    }


def replace_block(text: str, block: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no generated block ({BEGIN}) in the document")
    return pattern.sub(lambda _: block, text)


def replace_layout_block(text: str, block: str) -> str:
    from toolkv.tools.layout import BEGIN as L_BEGIN
    from toolkv.tools.layout import END as L_END

    pattern = re.compile(re.escape(L_BEGIN) + r".*?" + re.escape(L_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no generated block ({L_BEGIN}) in the document")
    return pattern.sub(lambda _: block, text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spec-check", type=Path, metavar="FILE", help="JSON written by `toolkv spec-check --json`"
    )
    p.add_argument(
        "--spec-check-add",
        type=Path,
        metavar="FILE",
        help="JSON of a `toolkv spec-check --only ... --json` run whose configs join or replace the stored rows",
    )
    p.add_argument(
        "--layout",
        action="store_true",
        help="rewrite the layout measures (file sizes, import cycles, upward imports) in docs/architecture.md",
    )
    p.add_argument(
        "--settings",
        action="store_true",
        help="rewrite the TOOLKV_* settings table in docs/operations.md (from toolkv/core/settings.py)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"source", "written", "changed"} as JSON: what was read and which files were written',
    )


def load_summary(path: Path) -> tuple[dict[str, Any], str]:
    """A spec-check summary and the table it renders to, or an :class:`InputError`: both are
    computed before anything is written, so a bad file changes nothing in docs/."""
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise InputError(f"{path}: not JSON ({e}): expected `toolkv spec-check --json` output") from None
    if not isinstance(data, dict) or not isinstance(data.get("configs"), list):
        raise InputError(f"{path}: not `toolkv spec-check --json` output (no 'configs' list)")
    summary = clean(data)
    try:
        return summary, spec_table(summary)
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"{path}: not `toolkv spec-check --json` output ({type(e).__name__}: {e})") from None


def run_layout(args: argparse.Namespace) -> int:
    from toolkv.tools.layout import block

    if not ARCH_MD.is_file():
        raise InputError(
            f"no {ARCH_MD}: `toolkv docs --layout` rewrites the docs/ of a toolkv checkout; run it there"
        )
    before = ARCH_MD.read_text()
    text = replace_layout_block(before, block())
    ARCH_MD.write_text(text)
    if args.json:
        print(
            json.dumps({"source": "toolkv", "written": [str(ARCH_MD)], "changed": text != before}, indent=2)
        )
    else:
        print(f"{ARCH_MD.name}: layout measures regenerated")
    return 0


def replace_settings_block(text: str) -> str:
    from toolkv.core.settings import BEGIN as S_BEGIN
    from toolkv.core.settings import END as S_END
    from toolkv.core.settings import table

    pattern = re.compile(re.escape(S_BEGIN) + r".*?" + re.escape(S_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no generated block ({S_BEGIN}) in the document")
    return pattern.sub(lambda _: table(), text, count=1)


def run_settings(args: argparse.Namespace) -> int:
    if not OPS_MD.is_file():
        raise InputError(
            f"no {OPS_MD}: `toolkv docs --settings` rewrites the docs/ of a toolkv checkout; run it there"
        )
    before = OPS_MD.read_text()
    text = replace_settings_block(before)
    OPS_MD.write_text(text)
    if args.json:
        print(json.dumps({"source": "toolkv", "written": [str(OPS_MD)], "changed": text != before}, indent=2))
    else:
        print(f"{OPS_MD.name}: settings table regenerated")
    return 0


def run(args: argparse.Namespace) -> int:
    add = getattr(args, "spec_check_add", None)
    if getattr(args, "settings", False):
        if args.spec_check is not None or add is not None or getattr(args, "layout", False):
            raise InputError("--settings is a separate run: give it alone")
        return run_settings(args)
    if getattr(args, "layout", False):
        if args.spec_check is not None or add is not None:
            raise InputError("--layout and --spec-check are separate runs: give one")
        return run_layout(args)
    if add is not None and args.spec_check is not None:
        raise InputError(
            "--spec-check replaces the stored summary, --spec-check-add merges into it: give one"
        )
    if not SPEC_MD.is_file():  # an installed toolkv: there is no docs/ to regenerate
        raise InputError(
            f"no {SPEC_MD}: `toolkv docs` regenerates the docs/ of a toolkv checkout; run it there"
        )
    source = args.spec_check if args.spec_check is not None else SPEC_JSON
    summary, table = load_summary(source)
    if add is not None:
        summary = merge_summaries(summary, load_summary(add)[0])
        table, source = spec_table(summary), add
    before = SPEC_MD.read_text()
    text = replace_block(before, table)
    written = [SPEC_MD]
    if args.spec_check is not None or add is not None:
        SPEC_JSON.write_text(json.dumps(summary, indent=2) + "\n")
        written.insert(0, SPEC_JSON)
    SPEC_MD.write_text(text)
    if args.json:
        out = {"source": str(source), "written": [str(w) for w in written], "changed": text != before}
        print(json.dumps(out, indent=2))
    else:
        print(f"{SPEC_MD.name}: table regenerated from {source.name}")
    return 0
