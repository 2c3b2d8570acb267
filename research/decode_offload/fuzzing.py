"""Hypothesis stateful testing of sglang's REAL ``DecodeKVCacheOffloadManager`` (CPU harness).

Every step is one action of ``spec/decode/DecodeOffload.tla`` run by
:class:`research.decode_offload.world.DecodeWorld`: admit, decode, offload, finish, the scheduler's
per-iteration ``check_offload_progress``, and the two engines the test controls, the copy
engine (a device->host copy finishes) and the storage backup thread (an increment is written).
Pools are small, so the host pool refuses writes and admission waits for freed slots.

After every step, on the real objects (``DecodeWorld.check_real``): device and request slots
conserved (no double free), every decoding request reads exactly the KV it computed (freed
slots are scribbled over first, as other requests reusing them would), host slots conserved,
in-flight counts exact, no release while an increment is in flight, ``protected_size_``
untouched, the page hashes handed to storage are each request's hash chain in order, every host
copy and every stored page holds the KV that was written. At teardown every request is finished
and every ack drained: everything is released, every counter is back to its initial value, and
storage holds exactly the offloaded pages of every request's chain.

Each step can be written to a JSON-lines trace for ``research.decode_offload.tracecheck``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from research.decode_offload import mutants as decode_mutants
from research.decode_offload.harness import DecodeHarnessConfig, DecodeOffloadHarness
from research.decode_offload.world import DecodeWorld, Step

RIDS = ("r1", "r2", "r3")


@dataclasses.dataclass
class DecodeStats:
    examples: int = 0
    steps: int = 0
    actions: dict[str, int] = dataclasses.field(default_factory=dict)
    first_failure_example: int | None = None


class DecodeMachine(RuleBasedStateMachine):
    """Configured by :func:`machine_class`."""

    cfg: ClassVar[DecodeHarnessConfig] = DecodeHarnessConfig(device_tokens=24, host_ratio=0.125)
    prompt_len: ClassVar[int] = 3
    max_new: ClassVar[int] = 12
    trace_dir: ClassVar[Path | None] = None
    swarm: ClassVar[bool] = True
    stats: ClassVar[DecodeStats] = DecodeStats()

    WEIGHTS: ClassVar[dict[str, int]] = {
        "admit": 2, "decode": 6, "offload": 4, "finish": 1, "check": 4, "copy": 3, "store": 3,
    }  # fmt: skip
    _CHOICES: ClassVar[list[str]] = [a for a, w in WEIGHTS.items() for _ in range(w)]

    def __init__(self) -> None:
        super().__init__()
        self.stats.examples += 1
        self.h = DecodeOffloadHarness(self.cfg)
        try:
            self.w = DecodeWorld(self.h, RIDS, prompt_len=self.prompt_len, max_new=self.max_new)
        except BaseException:
            self.h.close()
            raise
        self.trace: list[dict[str, Any]] = []
        self.header = {
            "reqs": list(RIDS),
            "ranks": [self.w.rank],
            "pre": self.prompt_len // self.w.ps,
            "max_len": (self.prompt_len + self.max_new) // self.w.ps,
            "stride": self.h.stride // self.w.ps,
            "dev_slots": self.cfg.device_tokens // self.w.ps,
            "host_slots": int(self.h.host_pool.size) // self.w.ps,
        }
        self._swarm: list[str] | None = None
        if self.trace_dir is not None:
            self.trace.append({"act": ["Init"], "fits": True, "s": self.w.abstract()})

    def _record(self, step: Step) -> None:
        self.stats.steps += 1
        key = step.act[0] + ("" if step.fits else "!refused") + (f"!{step.outcome}" if step.outcome else "")
        self.stats.actions[key] = self.stats.actions.get(key, 0) + 1
        if self.trace_dir is not None:
            self.trace.append({"act": step.act, "fits": step.fits, "s": self.w.abstract()})

    def _pick(self, data: st.DataObject, phases: tuple[str, ...]) -> str:
        hot = [r for r in RIDS if self.w.phase(r) in phases]
        return str(data.draw(st.sampled_from(hot * 3 + list(RIDS)), label="request"))

    OPTIONAL: ClassVar[tuple[str, ...]] = ("copy", "store", "offload")

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One scheduler or engine step, drawn by weight. Swarm testing: each example leaves out
        a random subset of the optional actions (no backups: the host pool fills and refuses
        writes; no copies: every copy waits for the check's synchronize; no offloads between
        decode steps: increments grow to several strides and are written at finish)."""
        if self._swarm is None:
            everything = st.just(frozenset(self.OPTIONAL))
            keep = data.draw(
                st.frozensets(st.sampled_from(self.OPTIONAL)) if self.swarm else everything, label="swarm"
            )
            self._swarm = [a for a in self._CHOICES if a not in self.OPTIONAL or a in keep]
        action = data.draw(st.sampled_from(self._swarm), label="action")
        w = self.w
        try:
            if action == "admit":
                res = w.admit(self._pick(data, ("Waiting",)))
            elif action in ("decode", "offload", "finish"):
                res = getattr(w, action)(self._pick(data, ("Decoding",)))
            else:
                res = getattr(w, action)()
        except Exception:
            self._note_failure()
            raise
        if res.changed or not res.fits:
            self._record(res)

    def _note_failure(self) -> None:
        if self.stats.first_failure_example is None:
            self.stats.first_failure_example = self.stats.examples

    @invariant()
    def real_objects(self) -> None:
        try:
            self.w.check_real()
        except Exception:
            self._note_failure()
            raise

    def teardown(self) -> None:
        try:
            self.w.drain()
            self.w.check_quiescent()
        except Exception:
            self._note_failure()
            raise
        finally:
            self.h.close()
            if self.trace_dir is not None and len(self.trace) > 1:
                self.write_trace(self.trace_dir / f"decode-{self.stats.examples:05d}.jsonl")

    def write_trace(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.write(json.dumps({"header": self.header}) + "\n")
            for rec in self.trace:
                f.write(json.dumps(rec) + "\n")


def machine_class(
    *,
    cfg: DecodeHarnessConfig | None = None,
    prompt_len: int = 3,
    max_new: int = 12,
    trace_dir: Path | None = None,
    swarm: bool = True,
) -> type[DecodeMachine]:
    """A configured subclass (Hypothesis instantiates it once per example)."""
    return type(
        "DecodeMachine_configured",
        (DecodeMachine,),
        {
            "cfg": cfg or DecodeMachine.cfg,
            "prompt_len": prompt_len,
            "max_new": max_new,
            "trace_dir": trace_dir,
            "swarm": swarm,
            "stats": DecodeStats(),
        },
    )


def campaign(
    *,
    examples: int,
    steps: int,
    mutant: str | None = None,
    cfg: DecodeHarnessConfig | None = None,
    prompt_len: int = 3,
    max_new: int = 12,
    trace_dir: Path | None = None,
    seed: int | None = None,
    shrink: bool = False,
    swarm: bool = True,
) -> dict[str, Any]:
    """Run one campaign, with ``mutant`` patched into the real class; returns a summary
    (``failure`` is None when nothing was found)."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import seed as hseed
    from hypothesis.stateful import run_state_machine_as_test

    cls = machine_class(cfg=cfg, prompt_len=prompt_len, max_new=max_new, trace_dir=trace_dir, swarm=swarm)
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    s = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=seed is not None,
        print_blob=False,
        phases=phases,
        report_multiple_bugs=False,
    )
    failure: str | None = None
    t0 = time.monotonic()
    with decode_mutants.apply(mutant):
        try:
            # @seed on the machine class: run_state_machine_as_test copies it to the test it builds
            run_state_machine_as_test(cls if seed is None else hseed(seed)(cls), settings=s)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a found failure is the campaign's result
            text = str(exc).strip()
            failure = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    stats = cls.stats
    return {
        "mutant": mutant or "none",
        "examples": stats.examples,
        "steps": stats.steps,
        "actions": dict(sorted(stats.actions.items())),
        "seconds": round(time.monotonic() - t0, 1),
        "failure": failure,
        "examples_to_kill": stats.first_failure_example,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--mutants", action="store_true", help="run the kill table instead")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--stride", type=int, default=None, help="offload stride in tokens (default: one page)")
    p.add_argument("--trace-dir", type=Path, default=None, help="write one JSON-lines trace per example here")


def run(args: argparse.Namespace) -> int:
    """One JSON line per campaign on stdout; exit 1 unless the shipped class survives, every
    mutant is killed and the equivalent mutant survives."""
    import logging

    if (
        args.examples < 1
        or args.steps < 1
        or args.page_size < 1
        or (args.stride is not None and args.stride < 1)
    ):
        print("decode fuzz: --examples, --steps, --page-size and --stride must be >= 1", file=sys.stderr)
        return 2
    logging.disable(logging.ERROR)  # sglang logs every write the host pool refuses
    cfg = DecodeHarnessConfig(
        page_size=args.page_size,
        device_tokens=24 * args.page_size,
        host_ratio=0.125,
        stride_tokens=args.stride,
    )
    runs: list[tuple[str | None, bool]] = [(None, False)]
    if args.mutants:
        runs = [(m, True) for m in sorted(decode_mutants.MUTANTS)]
        runs += [(m, False) for m in sorted(decode_mutants.EQUIVALENT)]
    bad = 0
    for name, must_fail in runs:
        r = campaign(
            examples=args.examples,
            steps=args.steps,
            mutant=name,
            cfg=cfg,
            seed=args.seed,
            trace_dir=args.trace_dir,
        )
        print(json.dumps(r), flush=True)
        bad += (r["failure"] is None) if must_fail else (r["failure"] is not None)
    print(
        f"{len(runs)} campaign(s): " + ("as expected" if not bad else f"{bad} not as expected"),
        file=sys.stderr,
    )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m research.decode_offload.fuzzing [--examples N] [--steps M] [--mutants]``."""
    p = argparse.ArgumentParser(prog="python -m research.decode_offload.fuzzing")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
