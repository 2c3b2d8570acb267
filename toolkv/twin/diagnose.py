"""Why two twin runs differ: counts of one configuration's scheduler decisions.

``python -m toolkv.twin.diagnose [toolkv twin run options]`` runs each configuration once, as
``toolkv twin`` does, and prints per configuration: prefill batches, decode steps, decode steps
with requests waiting behind ``running_batch.batch_is_full``, ``PrefillAdder.add_one_req``'s
answers, and how many requests reached ``add_one_req`` with a host hit (and its answer for them).
Run it under each sglang (``.venv`` and ``.venv-0523``) to compare their admission on one plan.
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any


def counts(a: argparse.Namespace, name: str) -> dict[str, Any]:
    from toolkv.twin.cli import _opts, _profile, configs, workload
    from toolkv.twin.run import Twin
    from toolkv.twin.scheduler import Batch
    from toolkv.twin.sessions import Sessions

    a.configs = name
    twin = Twin(Sessions.lazy(workload(a)), configs(a, None)[0], _profile(a), _opts(a))
    from sglang.srt.managers import schedule_policy as sp

    c: collections.Counter[str] = collections.Counter()
    timed = twin._batch_time
    add = sp.PrefillAdder.add_one_req

    def batch_time(b: Batch) -> float:
        s = twin.sched
        if b.mode == "prefill":
            c["prefill batches"] += 1
        else:
            c["decode steps"] += 1
            if s.waiting_queue and s.running_batch.batch_is_full:
                c["decode steps with requests waiting behind batch_is_full"] += 1
        return timed(b)

    def add_one_req(self: Any, req: Any, *args: Any, **kw: Any) -> Any:
        host_hit = int(getattr(req, "host_hit_length", 0) or 0)
        res = add(self, req, *args, **kw)
        c[f"add_one_req {res.name}"] += 1
        if host_hit:
            c[f"add_one_req with a host hit: {res.name}"] += 1
        return res

    twin._batch_time = batch_time  # type: ignore[method-assign]
    sp.PrefillAdder.add_one_req = add_one_req  # type: ignore[method-assign]
    try:
        out = twin.run()
    finally:
        sp.PrefillAdder.add_one_req = add  # type: ignore[method-assign]
    return {"config": name, "run": out.crashed or "completed", **dict(sorted(c.items()))}


def main(argv: list[str] | None = None) -> int:
    from importlib.metadata import version

    from toolkv.twin.cli import VALIDATED, add_arguments
    from toolkv.workload.plan import Workload

    p = argparse.ArgumentParser(prog="python -m toolkv.twin.diagnose", description=__doc__.splitlines()[0])
    add_arguments(p)
    a = p.parse_args(argv)
    a.sessions = Workload().initial_sessions if a.sessions is None else a.sessions  # as toolkv twin run
    a.duration = 45.0 if a.duration is None else a.duration
    print(f"sglang {version('sglang')}")
    for name in (a.configs or VALIDATED).split(","):
        for k, v in counts(a, name.strip()).items():
            print(f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
