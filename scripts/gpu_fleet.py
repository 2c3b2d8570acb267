"""Sessions that move between servers: two sglang servers with toolkv behind sglang's router, one shared L3.

Run by scripts/gpu_fleet.sh on the GPU machine (it installs the bundle and sets the environment);
this process launches the servers and the router itself, because the scenario stops one server and
starts another in the middle. Exit 0 only if every check passed. Writes OUT/fleet.json and
OUT/summary.txt.

The picture being checked (docs/architecture.md, "More than one server"): each server runs its own
toolkv; the only thing they share is HiCache's L3 tier (``--hicache-storage-backend file`` on one
directory); sglang's router sends a session's turns to one server by its id. Steps:

1. twins: every conversation (turn 1, tool result, turn 2; temperature 0, one request at a time)
   runs first on server 0 without toolkv calls, for reference tokens. Their KV is then flushed from
   both servers and deleted from L3, so that nothing the sessions later find there is the twins'.
2. round ``l3``: sessions start through the router (``X-SMG-Routing-Key: <session id>``, policy
   ``manual``: sticky per key, random first assignment), until each server owns at least two. After
   turn 1 each session's owner is found by asking every server's ``kv_meta`` (exactly one must know
   it), and ``tool_start`` goes to the owner directly: the router does not forward ``/session/*``
   (checked, recorded). ``TOOLKV_HOST_BUDGET_TOKENS`` (about 2.5 sessions per server) makes
   toolkv demote earlier offloaded sessions to L3 when later ones offload (``tier`` ``l3``).
3. the server owning more sessions is drained: removed from the router (``DELETE /workers/{id}``),
   then stopped. The survivor's own sessions: ``tool_end``, restore, turn 2 through the router,
   tokens equal to the twins', prefix reused. The moved sessions: ``tool_end`` on the survivor
   answers 404 ``unknown_session`` (it never saw them: a clear answer, never another server's
   state); turn 2 through the router lands on the survivor, reports the prefix as cached and served
   from storage (``meta_info.cached_tokens_details.storage``), and its tokens equal the twins'.
4. round ``baseline`` (``--baseline``, default on, skipped when the deadline is near): the same
   with no L3 (the survivor's storage detached at run time, the drained server relaunched without
   one, the L3 directory emptied): moved sessions recompute (cached tokens about 0). Token equality
   is recorded there but not checked: a recomputed prefix is one long prefill instead of a prefill
   and single-token decodes, and with dummy weights (near-flat logits) that alone may flip a token.

Why the requests run one at a time: batch composition changes the numerics, and the twins are
compared token for token. For the same reason the servers run with
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``: the router polls ``/health``, and sglang's
default answers it by generating one token, which could share a batch with a session's turn.

sglang-router 0.3.2 drops ``session_id`` from the bodies it forwards; the servers run with
``TOOLKV_SESSION_HEADER=X-SMG-Routing-Key``, so toolkv labels a request with the router's routing key
instead (docs/operations.md, "Behind sglang's router").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import NEW_TOKENS, PROMPT_TOKENS, RESTORED, prompt, tool_result, wait_state

from toolkv import errors
from toolkv.client import NO_RETRY, ToolKVClient

ROUTING_HEADER = "X-SMG-Routing-Key"
PREFIX_SLACK = 64  # tokens a "prefix reused" check allows below the full prefix (as scripts/gpu_e2e.py)
MIN_PER_SERVER = 2  # sessions each server must own before the drain (more are started until then)
BASELINE_NEEDS_S = 150.0  # time the baseline round needs (relaunch overlaps round l3)


# ---- plain HTTP ---------------------------------------------------------------------------------------
def http(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 300
) -> tuple[int, Any]:
    """(status, parsed JSON body or raw text or None); never raises on an HTTP status."""
    data = None if body is None else json.dumps(body).encode()
    hdrs = (
        {"Content-Type": "application/json", **(headers or {})} if data is not None else dict(headers or {})
    )
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    if not raw:
        return status, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class Turn:
    """One generate answer: the tokens and how much of the prompt the server found cached, and where."""

    output_ids: list[int]
    cached: int
    details: dict[str, Any] | None
    status: int = 200

    @property
    def storage(self) -> int:
        return int((self.details or {}).get("storage") or 0)

    def row(self) -> dict[str, Any]:
        return {"cached_tokens": self.cached, "cached_tokens_details": self.details}


def generate(url: str, ids: list[int], sid: str | None, *, routed: bool) -> Turn:
    """A greedy turn. Through the router the session goes in the routing header (the router picks
    the server by it); the body's ``session_id`` is sent too, for a router that would keep it."""
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    }
    if sid is not None:
        body["session_id"] = sid
    status, out = http("POST", url + "/generate", body, {ROUTING_HEADER: sid} if routed and sid else None)
    if status != 200 or not isinstance(out, dict):
        raise RuntimeError(f"generate {sid} via {url}: HTTP {status}: {str(out)[:300]}")
    meta = out.get("meta_info") or {}
    return Turn(
        list(out["output_ids"]), int(meta.get("cached_tokens") or 0), meta.get("cached_tokens_details")
    )


# ---- processes ----------------------------------------------------------------------------------------
@dataclass
class Server:
    """One sglang server with toolkv; ``storage``: whether it runs with the shared L3."""

    name: str
    port: int
    storage: bool
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    log_cut: int | None = None  # log size when it was stopped: what a stop prints is not a failure

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Fleet:
    """Everything the run launched, so that it can all be stopped (and the shell's trap can too)."""

    args: argparse.Namespace
    work: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start ``cmd`` in its own process group (stopped as a group), its output in ``log``."""
        with open(log, "ab") as fh:
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                 start_new_session=True)  # fmt: skip
        self.procs.append(p)
        with open(self.work / "pids", "a") as fh:  # the shell's EXIT trap stops these groups
            fh.write(f"{p.pid}\n")
        return p

    def server_cmd(self, s: Server) -> list[str]:
        a = self.args
        if a.dry_run_stub is not None:  # CPU dry run: a stand-in that answers what the run asks
            stub = [sys.executable, str(a.dry_run_stub), "--port", str(s.port), "--model", a.model]
            return (
                stub
                + ["--l3-dir", str(a.l3_dir), "--budget", str(a.host_budget)]
                + (["--storage"] if s.storage else [])
            )
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--load-format", "dummy",
               "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
               "--grammar-backend", "none", "--disable-cuda-graph", "--context-length", "8192",
               "--mem-fraction-static", str(a.mem_fraction), "--max-total-tokens", str(a.max_total_tokens),
               "--page-size", str(a.page_size), "--enable-hierarchical-cache", "--hicache-ratio", str(a.host_ratio),
               "--host", "127.0.0.1", "--port", str(s.port)]  # fmt: skip
        if s.storage:
            cmd += ["--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete"]
        return cmd

    def launch(self, s: Server) -> None:
        env = {
            "TOOLKV_ENABLE": "1",
            "TOOLKV_TTL_S": "300",
            # the clock every iteration: demotion ranks offloaded sessions by how long their tool has
            # run on toolkv's clock, and two tool_starts one turn apart must see it move
            "TOOLKV_SWEEP_EVERY": "1",
            "TOOLKV_HOST_BUDGET_TOKENS": str(self.args.host_budget),
            # the router forwards no session_id, only its routing key: the session of a turn
            "TOOLKV_SESSION_HEADER": ROUTING_HEADER,
            "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(self.args.l3_dir),
            "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
        }
        s.proc = self.spawn(self.server_cmd(s), s.log, env)

    def launch_router(self, port: int, workers: list[Server], log: Path) -> subprocess.Popen[bytes]:
        # manual: sticky per X-SMG-Routing-Key, remapped only when the worker leaves; random first
        # assignment (min_group / min_load count keys with requests in flight: one at a time, every
        # key would go to the first worker). No retries: a failed turn must show, not be re-sent.
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *[w.url for w in workers], "--policy", "manual", "--assignment-mode", "random",
               "--disable-retries", "--prometheus-port", str(port + 100), "--log-level", "info",
               "--request-timeout-secs", "600"]  # fmt: skip
        return self.spawn(cmd, log, {})

    def stop(self, p: subprocess.Popen[bytes] | None, grace_s: float = 20) -> None:
        """TERM the process group, KILL it after ``grace_s``."""
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def stop_all(self, grace_s: float = 15) -> None:
        """TERM every group at once, then KILL what is left after ``grace_s``."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)


# ---- waiting ------------------------------------------------------------------------------------------
class Deadline:
    """The run's hard end (the shell kills the process a little later): every wait is capped by it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def cap(self, limit_s: float) -> float:
        return max(0.0, min(limit_s, self.left() - 5))


def wait_healthy(servers: list[Server], deadline: Deadline, limit_s: float = 420) -> dict[str, float]:
    """Seconds until each server answered /health; raises if one exited or the time ran out."""
    t0, done = time.monotonic(), dict[str, float]()
    limit = deadline.cap(limit_s)
    while len(done) < len(servers):
        for s in servers:
            if s.name in done:
                continue
            if not s.alive():
                raise RuntimeError(f"server {s.name} exited during start-up: {tail(s.log)}")
            try:
                if urllib.request.urlopen(s.url + "/health", timeout=5).status == 200:
                    done[s.name] = round(time.monotonic() - t0, 1)
            except OSError:
                pass
        if time.monotonic() - t0 > limit:
            raise TimeoutError(
                f"servers not healthy after {limit:.0f} s: {sorted(set(s.name for s in servers) - set(done))}"
            )
        time.sleep(1)
    return done


def router_workers(router: str) -> list[dict[str, Any]]:
    status, out = http("GET", router + "/workers", timeout=10)
    return list(out.get("workers", [])) if status == 200 and isinstance(out, dict) else []


def tail(path: Path, n: int = 8) -> str:
    """The last lines of a log, for an error message."""
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_router(
    router: str,
    urls: list[str],
    deadline: Deadline,
    limit_s: float = 60,
    proc: subprocess.Popen[bytes] | None = None,
) -> float:
    """Until the router lists exactly ``urls``, all healthy (it registers workers in the background)."""
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the router exited ({proc.returncode})")
        try:
            ws = router_workers(router)
        except OSError:
            ws = []
        if sorted(w["url"] for w in ws) == sorted(urls) and all(w.get("is_healthy") for w in ws):
            return round(time.monotonic() - t0, 1)
        if time.monotonic() - t0 > deadline.cap(limit_s):
            raise TimeoutError(
                f"router lists {[(w.get('url'), w.get('is_healthy')) for w in ws]}, wanted {urls}"
            )
        time.sleep(0.5)


def l3_files(d: Path) -> tuple[int, int]:
    """(pages, writes in flight) in the L3 directory: HiCacheFile writes ``KEY.bin`` via a temp file."""
    pages = tmp = 0
    with os.scandir(d) as it:
        for e in it:
            if ".tmp." in e.name:
                tmp += 1
            elif e.name.endswith(".bin"):
                pages += 1
    return pages, tmp


def wait_l3_quiet(d: Path, deadline: Deadline, stable_s: float = 3, limit_s: float = 60) -> int:
    """Until no write is in flight and the page count has not moved for ``stable_s``: HiCache writes
    to storage in a background thread after the host write's ack. Returns the page count."""
    t0 = time.monotonic()
    last, since = -1, time.monotonic()
    while True:
        pages, tmp = l3_files(d)
        if pages != last or tmp:
            last, since = pages, time.monotonic()
        elif time.monotonic() - since >= stable_s:
            return pages
        if time.monotonic() - t0 > deadline.cap(limit_s):
            return pages
        time.sleep(0.5)


def owner_of(servers: list[Server], sid: str) -> tuple[list[str], dict[str, Any]]:
    """The servers whose toolkv knows ``sid`` (exactly one after a turn), and each one's answer."""
    owners, answers = [], {}
    for s in servers:
        c = ToolKVClient(s.url, timeout_s=30, retry=NO_RETRY)
        try:
            m = c.kv_meta(sid)
            owners.append(s.name)
            answers[s.name] = m.state
        except errors.ToolKVError as e:
            answers[s.name] = f"{e.http_status} {e.code}"
        finally:
            c.close()
    return owners, answers


# ---- the run ------------------------------------------------------------------------------------------
class Run:
    """The scenario; every check lands in ``self.checks`` (name -> passed) and the numbers in ``self.res``."""

    def __init__(self, args: argparse.Namespace, fleet: Fleet, deadline: Deadline) -> None:
        self.a, self.fleet, self.deadline = args, fleet, deadline
        self.res: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "rounds": {}}
        self.checks: dict[str, bool] = {}
        self.res["checks"] = self.checks
        self.twins: list[tuple[list[int], Turn, Turn]] = []
        self.t0 = time.monotonic()

    def check(self, name: str, ok: bool) -> bool:
        self.checks[name] = bool(ok)
        print(("PASS " if ok else "FAIL ") + name, flush=True)
        return bool(ok)

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:5.0f} s] {msg}", flush=True)

    def client(self, s: Server) -> ToolKVClient:
        return ToolKVClient(s.url, timeout_s=120)

    # -- 1. twins
    def run_twins(self, server: Server, n: int) -> None:
        for i in range(n):
            p = prompt(i)
            t1 = generate(server.url, p, None, routed=False)
            t2 = generate(server.url, p + t1.output_ids + tool_result(i), None, routed=False)
            self.twins.append((p, t1, t2))
        self.res["twins"] = [{"slot": i, "turn2": t[2].row()} for i, t in enumerate(self.twins)]

    def clean_slate(self, servers: list[Server], storage_server: Server | None) -> int:
        """Flush every server's cache and empty the L3 directory; returns the pages left (0 wanted)."""
        if storage_server is not None:
            wait_l3_quiet(self.a.l3_dir, self.deadline)
        for s in servers:
            status, _ = http("POST", s.url + "/flush_cache?timeout=60", {})
            self.check(f"flush {s.name}", status == 200)
        if storage_server is not None:
            status, _ = http("POST", storage_server.url + "/hicache/storage-backend/clear", {})
            self.res.setdefault("l3_clear_http", []).append(status)
        for e in os.scandir(self.a.l3_dir):  # what the backend's clear left (or a baseline's own)
            if e.is_file():
                os.remove(e.path)
        return l3_files(self.a.l3_dir)[0]

    # -- 2./3. one round
    def round(
        self, name: str, servers: list[Server], router: str, first_slot: int, *, l3: bool
    ) -> Server | None:
        """Sessions through the router until each server owns MIN_PER_SERVER; drain the server owning
        more; the survivor's sessions restore, the moved ones take their turn on the survivor.
        Returns the drained server (stopped), or None when the round could not get that far."""
        rnd: dict[str, Any] = {"sessions": []}
        self.res["rounds"][name] = rnd
        rows: dict[str, dict[str, Any]] = {}
        owned: dict[str, list[str]] = {s.name: [] for s in servers}
        by_name = {s.name: s for s in servers}
        slot_of: dict[str, int] = {}
        for k in range(self.a.max_sessions):
            slot = (first_slot + k) % len(self.twins)
            sid = f"{name}-s{k}"
            p, tw1, _ = self.twins[slot]
            t1 = generate(router, p, sid, routed=True)
            owners, answers = owner_of(servers, sid)
            row: dict[str, Any] = {"session": sid, "slot": slot, "owners_after_turn1": owners, "kv_meta_answers": answers,
                                   "turn1 equals twin": t1.output_ids == tw1.output_ids}  # fmt: skip
            rows[sid], slot_of[sid] = row, slot
            rnd["sessions"].append(row)
            self.check(f"{name} {sid}: exactly one server knows it after turn 1", len(owners) == 1)
            self.check(f"{name} {sid}: turn 1 equals twin", row["turn1 equals twin"])
            if len(owners) != 1:
                continue
            owner = by_name[owners[0]]
            row["owner"] = owner.name
            row["turn1_output"] = t1.output_ids
            if l3:  # HiCache writes the turn to L3 in the background: a demotion waits for whole copies
                wait_l3_quiet(self.a.l3_dir, self.deadline, stable_s=0.5, limit_s=10)
            c = self.client(owner)
            try:
                m = c.tool_start(sid)
                row["epoch"] = m.epoch
                off, _ = wait_state(c, sid, ("Offloaded",), limit_s=60)
                row["tool_start"] = {
                    "state": off.state,
                    "tokens": off.tokens,
                    "device_tokens": off.device_tokens,
                }
                owned[owner.name].append(sid)
            except Exception as e:
                row["tool_start_error"] = f"{type(e).__name__}: {e}"
            finally:
                c.close()
            self.check(f"{name} {sid}: tool_start on its server offloads it", "tool_start" in row)
            if k + 1 >= self.a.sessions and all(len(v) >= MIN_PER_SERVER for v in owned.values()):
                break
        rnd["owned"] = owned
        spread = all(len(v) >= MIN_PER_SERVER for v in owned.values())
        self.check(f"{name}: router spread sessions over both servers (>= {MIN_PER_SERVER} each)", spread)
        counts = {k: len(v) for k, v in owned.items()}
        self.log(f"{name}: sessions per server {counts}")
        if not all(owned.values()):
            return None

        # the state just before the drain: where each session's KV is, and what L3 holds
        if l3:
            rnd["l3_pages_before_drain"] = wait_l3_quiet(self.a.l3_dir, self.deadline)
        for s in servers:
            c = self.client(s)
            try:
                for sid in owned[s.name]:
                    m = c.kv_meta(sid)
                    rows[sid]["before_drain"] = {"state": m.state, "tier": m.tier, "l3": m.extra.get("l3"),
                                                 "host_tokens": m.host_tokens}  # fmt: skip
                rnd.setdefault("server_meta_before_drain", {})[s.name] = c.server_meta().raw
            finally:
                c.close()
        if l3:
            stored = sum(1 for r in rows.values() if (r.get("before_drain") or {}).get("tier") == "l3")
            rnd["sessions_in_l3_before_drain"] = stored
            self.check(f"{name}: toolkv moved offloaded sessions to L3 (host budget full)", stored >= 1)
            tokens = sum(
                len(self.twins[slot_of[sid]][0]) + NEW_TOKENS - 1 for v in owned.values() for sid in v
            )
            self.check(f"{name}: L3 holds a page per session token ({rnd['l3_pages_before_drain']} >= {tokens})",
                       rnd["l3_pages_before_drain"] >= tokens // self.a.page_size)  # fmt: skip

        # 3. drain: the server owning more sessions leaves the router, then stops
        victim = max(servers, key=lambda s: (len(owned[s.name]), s.name))
        survivor = next(s for s in servers if s is not victim)
        rnd["drained"], rnd["survivor"] = victim.name, survivor.name
        wid = next((w["id"] for w in router_workers(router) if w["url"] == victim.url), None)
        status, _ = http("DELETE", f"{router}/workers/{wid}") if wid else (0, None)
        try:
            wait_router(router, [survivor.url], self.deadline, limit_s=30)
            removed = True
        except TimeoutError:
            removed = False
        self.check(
            f"{name}: router removed {victim.name} (DELETE /workers/{{id}} {status})",
            removed and status == 202,
        )
        victim.log_cut = victim.log.stat().st_size
        self.fleet.stop(victim.proc)
        self.check(f"{name}: {victim.name} stopped", not victim.alive())
        self.log(f"{name}: drained {victim.name}; survivor {survivor.name}")
        self.after_drain(name, rnd, rows, owned, slot_of, victim, survivor, router, l3=l3)
        return victim

    def after_drain(self, name: str, rnd: dict[str, Any], rows: dict[str, dict[str, Any]], owned: dict[str, list[str]],
                    slot_of: dict[str, int], victim: Server, survivor: Server, router: str, *, l3: bool) -> None:  # fmt: skip
        c = self.client(survivor)
        try:
            # the survivor's own sessions: an ordinary tool_end, restore, next turn
            for sid in owned[survivor.name]:
                row, (p, _, tw2) = rows[sid], self.twins[slot_of[sid]]
                row["moved"] = False
                try:
                    ended = c.tool_end(sid, row["epoch"])
                    row["tool_end"] = ended.state
                    got, row["restore_s"] = wait_state(c, sid, RESTORED, limit_s=60)
                    row["state_after_restore"] = got.state
                    ok = True
                except Exception as e:
                    row["tool_end"], ok = f"{type(e).__name__}: {e}", False
                self.check(f"{name} {sid}: survivor restores it", ok)
                t2 = generate(router, p + row["turn1_output"] + tool_result(slot_of[sid]), sid, routed=True)
                row["turn2"] = t2.row()
                row["turn2 equals twin"] = t2.output_ids == tw2.output_ids
                self.check(f"{name} {sid}: turn 2 equals twin", row["turn2 equals twin"])
                self.check(f"{name} {sid}: prefix reused", t2.cached >= len(p) + NEW_TOKENS - PREFIX_SLACK)
            # the moved sessions: the survivor never saw them
            for sid in owned[victim.name]:
                row, (p, _, tw2) = rows[sid], self.twins[slot_of[sid]]
                row["moved"] = True
                try:
                    c.tool_end(sid, row["epoch"])
                    row["tool_end"], status, code = "accepted", 200, ""
                except errors.ToolKVError as e:
                    row["tool_end"], status, code = f"{e.http_status} {e.code}", e.http_status, e.code
                self.check(f"{name} {sid}: tool_end on the survivor is 404 unknown_session",
                           status == 404 and code == errors.UnknownSession.code)  # fmt: skip
                t0 = time.perf_counter()
                t2 = generate(router, p + row["turn1_output"] + tool_result(slot_of[sid]), sid, routed=True)
                row["turn2_latency_s"] = round(time.perf_counter() - t0, 3)
                row["turn2"] = t2.row()
                row["turn2 equals twin"] = t2.output_ids == tw2.output_ids
                owners, _ = owner_of([survivor], sid)
                row["survivor knows it after turn 2"] = owners == [survivor.name]
                prefix = len(p) + NEW_TOKENS - 1
                if l3:
                    self.check(f"{name} {sid}: turn 2 equals twin", row["turn2 equals twin"])
                    self.check(
                        f"{name} {sid}: prefix found cached ({t2.cached} of {prefix})",
                        t2.cached >= prefix - PREFIX_SLACK,
                    )
                    self.check(
                        f"{name} {sid}: ... read from L3 (storage {t2.storage})",
                        t2.storage >= prefix - PREFIX_SLACK,
                    )
                else:
                    self.check(
                        f"{name} {sid}: recomputed without L3 ({t2.cached} cached of {prefix})",
                        t2.cached < 0.05 * prefix,
                    )
                self.check(
                    f"{name} {sid}: the survivor took the session over", row["survivor knows it after turn 2"]
                )
            for sid in owned[survivor.name] + owned[victim.name]:
                with contextlib.suppress(errors.ToolKVError):
                    c.close_session(sid)
            meta = rnd["survivor_meta_end"] = c.server_meta().raw
            held = {k: meta.get(k) for k in HELD_KEYS}
            self.check(f"{name}: nothing held on {survivor.name} at the end {held}",
                       all(v == 0 for v in held.values()))  # fmt: skip
        finally:
            c.close()

    def probe_router_forwarding(self, router: str) -> None:
        """Whether the router forwards toolkv's routes (0.3.2: no, 404 with an empty body)."""
        status, body = http("GET", router + "/session/kv_meta", timeout=10)
        self.res["router_forwards_session_routes"] = {"GET /session/kv_meta": status, "body": body}
        status, body = http("POST", router + "/session/tool_end", {"session_id": "probe", "epoch": 1},
                            {ROUTING_HEADER: "probe"}, timeout=10)  # fmt: skip
        self.res["router_forwards_session_routes"]["POST /session/tool_end"] = status
        self.log(f"router answers /session/*: {self.res['router_forwards_session_routes']}")


def server_log_problems(servers: list[Server]) -> dict[str, list[str]]:
    """Lines that mean something broke inside a server, up to the moment it was stopped (what a
    process prints while it is being killed is not a failure of the run)."""
    out: dict[str, list[str]] = {}
    for s in servers:
        if not s.log.exists():
            continue
        with open(s.log, "rb") as fh:
            text = fh.read(s.log_cut if s.log_cut is not None else -1).decode(errors="replace")
        bad = [ln.strip()[:300] for ln in text.splitlines()
               if any(k in ln for k in ("Traceback", "AssertionError", "out of memory", "Out of memory"))]  # fmt: skip
        out[s.name] = bad[:20]
    return out


#: What the survivor's ``GET /session/kv_meta`` must show once every session is closed: toolkv holds
#: nothing (no session, no protected host copy, no device lock) after the sessions moved.
HELD_KEYS = ("held_sessions", "protected_tokens", "device_locked_tokens")


def summary(res: dict[str, Any], checks: bool = True) -> str:
    """The table a person reads: one row per session, what the survivor held at the end of each
    round, then (``checks``) the checks."""
    lines = [f"fleet run: {'PASS' if res.get('passed') else 'FAIL'}   ({res.get('elapsed_s')} s)"]
    hdr = f"{'round':9} {'session':14} {'owner':6} {'moved':5} {'tier@drain':10} {'tool_end':26} {'cached':>6} {'storage':>7} {'=twin':5}"
    lines += ["", hdr, "-" * len(hdr)]
    for rname, rnd in res.get("rounds", {}).items():
        for r in rnd.get("sessions", []):
            t2 = r.get("turn2") or {}
            det = t2.get("cached_tokens_details") or {}
            eq = r.get("turn2 equals twin")
            lines.append(
                f"{rname:9} {r['session']:14} {r.get('owner', '?'):6} {r.get('moved', '')!s:5} "
                f"{(r.get('before_drain') or {}).get('tier', '')!s:10} {str(r.get('tool_end', ''))[:26]:26} "
                f"{t2.get('cached_tokens', ''):>6} {det.get('storage', ''):>7} {'' if eq is None else str(eq):5}"
            )
    lines.append("")
    for rname, rnd in res.get("rounds", {}).items():
        meta = rnd.get("survivor_meta_end")
        if meta is not None:
            lines.append(f"{rname}: the survivor at the end, sessions closed: "
                         + ", ".join(f"{k} {meta.get(k)}" for k in HELD_KEYS))  # fmt: skip
    if checks:
        lines += [""] + [("PASS " if ok else "FAIL ") + k for k, ok in res.get("checks", {}).items()]
    return "\n".join(lines).rstrip("\n") + "\n"


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM (the shell's timeout): raise, so that the run's ``finally`` stops the servers and
    writes what it has."""
    raise TimeoutError("terminated by the shell's deadline")


def report(argv: list[str]) -> int:
    """``gpu_fleet.py --report DIR``: print the table of a finished run from DIR/fleet.json (without its
    check list: what docs/benchmarks.md shows), without starting anything."""
    ap = argparse.ArgumentParser(prog="gpu_fleet.py --report", description=report.__doc__)
    ap.add_argument("--report", type=Path, required=True, metavar="DIR")
    a = ap.parse_args(argv)
    try:
        res = json.loads((a.report / "fleet.json").read_text())
    except (OSError, ValueError) as e:
        print(f"gpu_fleet.py: error: cannot read {a.report / 'fleet.json'}: {e}", file=sys.stderr)
        return 2
    print(summary(res, checks=False), end="")
    return 0


def main() -> int:
    if "--report" in sys.argv[1:]:
        return report(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model config directory (dummy weights)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True, help="logs, pid file")
    ap.add_argument("--l3-dir", type=Path, required=True, help="the directory both servers' L3 shares")
    ap.add_argument("--deadline-s", type=float, default=480, help="hard end of this process's work")
    ap.add_argument(
        "--port", type=int, default=30000, help="server 0; server 1 +1000, relaunch +2000, router +3000"
    )
    ap.add_argument("--sessions", type=int, default=8, help="sessions to start at least (round l3)")
    ap.add_argument(
        "--max-sessions", type=int, default=12, help="started at most, until each server owns two"
    )
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="also the round without L3 (moved sessions recompute)")  # fmt: skip
    ap.add_argument("--mem-fraction", type=float, default=0.3)
    ap.add_argument("--max-total-tokens", type=int, default=24000, help="device KV pool per server, tokens")
    ap.add_argument("--host-ratio", type=float, default=2.0, help="--hicache-ratio: host pool / device pool")
    ap.add_argument("--host-budget", type=int, default=int(2.5 * (PROMPT_TOKENS + NEW_TOKENS)),
                    help="TOOLKV_HOST_BUDGET_TOKENS: about 2.5 sessions, so later offloads demote earlier ones")  # fmt: skip
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--dry-run-stub", type=Path, default=None,
                    help="CPU dry run: launch this stand-in (scripts/stage/fleet_stub.py) instead of sglang")  # fmt: skip
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    a.l3_dir.mkdir(parents=True, exist_ok=True)
    deadline = Deadline(a.deadline_s)
    signal.signal(signal.SIGTERM, _terminated)  # the shell's backstop: still write the results
    fleet = Fleet(a, a.work)
    run = Run(a, fleet, deadline)
    res = run.res
    s0 = Server("srv0", a.port, True, a.work / "srv0.log")
    s1 = Server("srv1", a.port + 1000, True, a.work / "srv1.log")
    # the baseline's server without L3 starts with the others (it idles until then, outside the
    # router): starting it after the drain would add a whole start-up to the run
    s2 = Server("srv2", a.port + 2000, False, a.work / "srv2.log")
    servers = [s0, s1] + ([s2] if a.baseline else [])
    router_port = a.port + 3000
    router = f"http://127.0.0.1:{router_port}"
    survivor = s0
    try:
        for e in os.scandir(a.l3_dir):
            os.remove(e.path)
        for s in servers:
            fleet.launch(s)
        res["healthy_after_s"] = wait_healthy([s0, s1], deadline)
        run.log(f"servers healthy: {res['healthy_after_s']}")
        router_log = a.work / "router.log"
        router_proc = fleet.launch_router(router_port, [s0, s1], router_log)
        try:
            res["router_ready_s"] = wait_router(router, [s0.url, s1.url], deadline, proc=router_proc)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{e}: {tail(router_log)}") from None
        run.log(f"router lists both servers after {res['router_ready_s']} s")
        run.probe_router_forwarding(router)

        run.run_twins(s0, a.max_sessions)
        pages = run.clean_slate([s0, s1], s0)
        run.check("twins' KV gone from both servers and from L3 before the sessions", pages == 0)
        run.log(f"twins done ({len(run.twins)}); L3 emptied")

        drained = run.round("l3", [s0, s1], router, 0, l3=True)
        survivor = s1 if drained is s0 else s0
        if a.baseline and drained is not None:
            if deadline.left() < BASELINE_NEEDS_S:
                res["rounds"]["baseline"] = {"skipped": f"deadline: {deadline.left():.0f} s left"}
                run.log("baseline skipped: not enough time left")
            else:
                # the survivor's L3 goes: detached (recorded; the directory is emptied either way, so
                # nothing is there to read), and the third server has none
                wait_l3_quiet(a.l3_dir, deadline)
                status, body = http("DELETE", survivor.url + "/hicache/storage-backend", timeout=60)
                res["baseline_l3_detach"] = {"http": status, "body": body}
                run.clean_slate([survivor], None)
                res["healthy_after_s"].update(wait_healthy([s2], deadline))
                status, _ = http("POST", router + "/workers", {"url": s2.url})
                wait_router(router, [survivor.url, s2.url], deadline)
                run.log(f"baseline: {s2.name} (no L3) joined the router")
                pair = [survivor, s2]
                drained = run.round("baseline", pair, router, 0, l3=False)
                if drained is not None:
                    survivor = next(x for x in pair if x is not drained)
        run.check(f"survivor {survivor.name} healthy at the end",
                  urllib.request.urlopen(survivor.url + "/health", timeout=10).status == 200)  # fmt: skip
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        run.check(f"run completed ({type(e).__name__})", False)
        print(f"ERROR {res['error']}", flush=True)
    finally:
        for s in servers:
            if s.log_cut is None and s.log.exists():
                s.log_cut = s.log.stat().st_size
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second TERM must not cut the write below
        fleet.stop_all(grace_s=10)
        problems = server_log_problems(servers)
        res["server_log_problems"] = problems
        run.check(
            "no Traceback / AssertionError / out of memory in the server logs", not any(problems.values())
        )
        res["elapsed_s"] = round(time.monotonic() - run.t0, 1)
        res["passed"] = bool(run.checks) and all(run.checks.values())
        (a.out / "fleet.json").write_text(json.dumps(res, indent=2, default=str))
        table = summary(res)
        (a.out / "summary.txt").write_text(table)
        print(table)
        print("TOOLKV_FLEET", "PASS" if res["passed"] else "FAIL")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
