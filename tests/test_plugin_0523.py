"""The sglang plugin on sglang 0.5.23: start-up guards through sglang's real plugin loader, hook
targets read from the installed source, and the scheduler-side hooks end to end over the REAL
``UnifiedRadixCache`` (CPU harness): a real ``Req`` finishes through sglang's own
``release_kv_cache`` -> ``UnifiedRadixCache.checkpoint`` (hooked as the registry hooks it) -> the
turn is recorded -> tool_start -> write acks -> device tokens freed -> tool_end -> load -> Runnable,
with the restored bytes equal to the turn's KV.

Runs in the 0.5.23 environment (``make test-0523``); skips where an older sglang is installed (its
twin for 0.5.16 is ``tests/test_plugin.py``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

import torch

from toolkv.errors import Unsupported
from toolkv.sglang.cache_hooks import toolkv_cache_hooks
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.ipc import ToolKVReqInput, ToolKVReqOutput
from toolkv.sglang.plugin import after_scheduler_init, hooks
from toolkv.sglang.scheduler_side import SchedulerToolKV, check_server_args, unsupported_reasons
from toolkv.testing.unified_harness import (
    UnifiedCacheHarness,
    UnifiedHarnessConfig,
    ensure_process_group,
    make_server_args,
)

SGLANG = Path(str(__import__("sglang").__file__)).parent
UNIFIED = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
PROMPT = list(range(1, 41))
TREE_CORE = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"


# ---- the release table and the hook targets -----------------------------------------------------
def test_release_0523_is_the_installed_one_and_runs_on_either_tree_core() -> None:
    """toolkv no longer asks for the Python tree core: a stock 0.5.23 launch keeps sglang's
    default (Rust) core, and one that sets the Python core keeps working."""
    from toolkv.sglang.startup import SUPPORTED, check_sglang_version, environment_reasons

    assert sglang_version() == "0.5.23"
    release = check_sglang_version("0.5.23")
    assert release is SUPPORTED["0.5.23"] and release.tree == "unified"
    for env in ({}, {TREE_CORE: "rust"}, {TREE_CORE: "python"}):
        assert environment_reasons("0.5.23", env) == [], env


def test_hook_targets_exist_in_the_installed_0523_source() -> None:
    """Every target the 0.5.23 hook set names is a function of the installed sglang (the HTTP-side
    modules import uvloop, absent on this CPU box, so they are read as source)."""

    def defs(path: Path, cls: str | None) -> set[str]:
        tree = ast.parse(path.read_text())
        body: list[ast.stmt] = tree.body
        if cls is not None:
            body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        return {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    targets = [t for t, _, _ in hooks(main_process=True, config=ToolKVConfig(zero_change=True))]
    assert len(targets) == 14  # 10, and the kv_hints rows (tests/test_kv_hints_0523.py)
    assert f"{UNIFIED}.checkpoint" in targets and f"{UNIFIED}.reset" in targets
    assert not any(".RadixCache." in t for t in targets), "0.5.23 has no cache_finished_req to hook"
    sched = defs(SGLANG / "srt/managers/scheduler.py", "Scheduler")
    urc = defs(SGLANG / "srt/mem_cache/unified_radix_cache.py", "UnifiedRadixCache")
    chat = defs(SGLANG / "srt/entrypoints/openai/serving_chat.py", "OpenAIServingChat")
    http = defs(SGLANG / "srt/entrypoints/http_server.py", None)
    streamer = defs(
        SGLANG / "srt/managers/scheduler_components/output_streamer.py", "SchedulerOutputStreamer"
    )
    tm = defs(SGLANG / "srt/managers/tokenizer_manager.py", "TokenizerManager")
    for t in targets:
        owner, name = t.rsplit(".", 1)
        table = {
            "sglang.srt.managers.scheduler.Scheduler": sched,
            UNIFIED: urc,
            "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat": chat,
            "sglang.srt.entrypoints.http_server": http,
            "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer": streamer,
            "sglang.srt.managers.tokenizer_manager.TokenizerManager": tm,
        }[owner]
        assert name in table, t
    # the turn is captured where release_kv_cache hands a finished request to the tree
    common = (SGLANG / "srt/mem_cache/common.py").read_text()
    assert "tree_cache.checkpoint(req, up_to=owned_kv_len)" in common
    urc_src = (SGLANG / "srt/mem_cache/unified_radix_cache.py").read_text()
    assert "token_ids = req.full_untruncated_fill_ids[:up_to]" in urc_src


# ---- fail-closed start-up, through sglang's real loader ---------------------------------------------
_SCENARIOS = r"""
import json, os, sys
import sglang.srt.plugins as plugins
from sglang.srt.plugins.hook_registry import HookRegistry

def attempt(name, env):
    for k in [k for k in os.environ if k.startswith("TOOLKV_") or k == "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"]:
        del os.environ[k]
    os.environ.update(env)
    plugins._plugins_loaded = False  # load_plugins() runs once per process; each scenario is a launch
    if "toolkv.sglang.plugin" in sys.modules:
        sys.modules["toolkv.sglang.plugin"]._registered = False
    before = sum(len(v) for v in HookRegistry._hooks.values())
    try:
        plugins.load_plugins()  # sglang's loader: entry point -> register() -> apply_hooks()
        out = {"exit": None, "message": ""}
    except SystemExit as e:
        out = {"exit": type(e).__name__, "message": str(e.code)}
    out["hooks"] = sum(len(v) for v in HookRegistry._hooks.values()) - before
    print("SCENARIO " + json.dumps({"name": name, **out}), flush=True)

attempt("tree core unset", {"TOOLKV_ENABLE": "1"})
plugins._plugins_loaded = False
attempt("rust tree core", {"TOOLKV_ENABLE": "1", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "rust"})
attempt("disabled", {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "rust"})
import sglang.version
sglang.version.__version__ = "0.5.22"
attempt("unsupported sglang", {"TOOLKV_ENABLE": "1", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"})
sglang.version.__version__ = "0.5.23"
attempt("python tree core", {"TOOLKV_ENABLE": "1", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"})

from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from toolkv.sglang import plugin
patched = {
    "UnifiedRadixCache.checkpoint": hasattr(UnifiedRadixCache.checkpoint, "__wrapped__"),
    "UnifiedRadixCache.reset": hasattr(UnifiedRadixCache.reset, "__wrapped__"),
    "RadixCache.cache_finished_req": hasattr(getattr(RadixCache, "cache_finished_req", None), "__wrapped__"),
}
for n in ["__init__", "process_input_requests", "handle_generate_request", "get_internal_state"]:
    patched[f"Scheduler.{n}"] = hasattr(getattr(Scheduler, n), "__wrapped__")
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
patched["SchedulerOutputStreamer.stream_output"] = hasattr(SchedulerOutputStreamer.stream_output, "__wrapped__")
plugin._check_hooks_applied(main_process=False)  # raises if a registered target was not patched
print("PATCHED " + json.dumps(patched), flush=True)
"""


def entry_point_path(tmp_path: Path) -> str:
    """A dist-info carrying toolkv's entry point (what ``pip install`` writes), first on the path:
    ``importlib.metadata`` finds it whether or not this environment has toolkv installed."""
    info = tmp_path / "ep" / "toolkv-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toolkv\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\ntoolkv = toolkv.sglang.plugin:register\n")
    root = Path(__file__).resolve().parent.parent
    return os.pathsep.join([str(info.parent), str(root), os.environ.get("PYTHONPATH", "")])


def test_startup_refuses_a_half_configured_0523_launch_through_sglangs_loader(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=entry_point_path(tmp_path))
    p = subprocess.run(
        [sys.executable, "-c", _SCENARIOS], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    found: dict[str, dict[str, Any]] = {}
    patched: dict[str, bool] = {}
    for line in p.stdout.splitlines():
        if line.startswith("SCENARIO "):
            d = json.loads(line[len("SCENARIO ") :])
            found[d.pop("name")] = d
        elif line.startswith("PATCHED "):
            patched = json.loads(line[len("PATCHED ") :])
    assert p.returncode == 0 and patched, p.stdout[-2000:] + p.stderr[-4000:]
    for name, words in [
        ("unsupported sglang", "sglang 0.5.22 is not a release toolkv supports (supported: 0.5.16, 0.5.23)"),
    ]:
        r = found[name]
        assert r["exit"] == "StartupRefused" and "refusing to start" in r["message"], (name, r)
        assert words in r["message"], (name, r["message"])
        assert r["hooks"] == 0, "nothing may be hooked before the guards pass"
    assert found["disabled"] == {"exit": None, "message": "", "hooks": 0}
    # eight scheduler-side hooks, launch_server's and the three kv_hints ones of the HTTP side:
    # this script is a main process (they cannot be applied here, where the HTTP server's uvloop is
    # missing; the scheduler-side check passes)
    # the default (Rust) tree core, unset or named, starts as the Python one does; the hook
    # registry is process-wide, so only the first launch of the process registers new rows
    assert found["tree core unset"]["exit"] is None and found["tree core unset"]["hooks"] == 12
    for name in ("rust tree core", "python tree core"):
        assert found[name]["exit"] is None, (name, found[name])
    assert patched.pop("RadixCache.cache_finished_req") is False
    assert all(patched.values()), patched


def test_launch_server_with_the_default_tree_core_passes_toolkvs_start_up_checks(tmp_path: Path) -> None:
    """The launch an operator runs: ``python -m sglang.launch_server`` loads plugins before it
    parses its arguments (launch_server.py:79-81). With sglang's default tree core (the variable
    unset) toolkv's checks pass and the launch goes on to the model, which does not exist here:
    the process ends on sglang's own error, not on toolkv's."""
    env = dict(os.environ, TOOLKV_ENABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=entry_point_path(tmp_path))
    env.pop(TREE_CORE, None)
    p = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", "/nonexistent/model"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert p.returncode != 0, (p.returncode, p.stderr[-3000:])
    assert "toolkv: refusing to start" not in p.stderr, p.stderr[-3000:]
    assert "nonexistent" in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"enable_hierarchical_cache": False}, "--enable-hierarchical-cache is required with sglang 0.5.23"),
        ({"hicache_host_memory_mode": "buffer_only", "hicache_storage_backend": "file"}, "buffer_only"),
        ({"enable_session_radix_cache": True}, "session-radix-cache"),
    ],
)
def test_half_configured_server_args_are_refused(args: dict[str, Any], words: str) -> None:
    """0.5.23's ServerArgs is read-only once resolved, so each launch is its own ServerArgs, as
    the CLI builds it from the flags."""
    from sglang.srt.server_args import ServerArgs

    assert unsupported_reasons(make_server_args(UnifiedHarnessConfig())) == []
    sa = ServerArgs(model_path="dummy", **{"enable_hierarchical_cache": True, **args})
    with pytest.raises(Unsupported, match=words) as ei:
        check_server_args(sa)
    assert "TOOLKV_ENABLE" in ei.value.message


# ---- the scheduler side over the real UnifiedRadixCache -------------------------------------------
@pytest.fixture
def hooked() -> Iterator[None]:
    """Install toolkv's two UnifiedRadixCache hooks with sglang's own registry, as ``register``
    does in a scheduler process; restore the class and the registry afterwards (the registry
    patches process-wide)."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    with toolkv_cache_hooks("unified"):
        assert hasattr(UnifiedRadixCache.checkpoint, "__wrapped__")
        yield


@pytest.fixture
def h(hooked: None) -> Iterator[UnifiedCacheHarness]:
    from sglang.srt.runtime_context import get_parallel

    # get_parallel(): this process's place in its TP group, as publish() writes it in a scheduler
    with (
        UnifiedCacheHarness(UnifiedHarnessConfig(device_tokens=256)) as harness,
        get_parallel().override(tp_rank=0, attn_tp_rank=0),
    ):
        yield harness


def fake_scheduler(h: UnifiedCacheHarness) -> Any:
    """The attributes of sglang 0.5.23's Scheduler the init hook reads, with sglang's own types:
    the real ServerArgs, the real tree, a gloo group, the real dispatcher. No ``ps``: 0.5.23 keeps
    ranks in ``runtime_context.get_parallel()``."""
    from sglang.utils import TypeBasedDispatcher

    return SimpleNamespace(
        server_args=h.server_args,
        tree_cache=h.tree,
        tp_cpu_group=ensure_process_group(),
        _request_dispatcher=TypeBasedDispatcher([(int, lambda x: x)]),
    )


def call(sched: Any, op: str, **body: Any) -> ToolKVReqOutput:
    out = sched._request_dispatcher(ToolKVReqInput(rid=f"r-{op}", op=op, body=body))
    assert isinstance(out, ToolKVReqOutput) and out.rid == f"r-{op}"
    return out


_rids = iter(range(10**6))


def start_request(
    h: UnifiedCacheHarness,
    sid: str | None,
    prompt: list[int],
    output: list[int],
    cache_salt: str | None = None,
) -> Any:
    """A real sglang ``Req`` whose forward passes have run: the cached prefix matched and locked
    (``req.lock``, as schedule_policy.py:1690 takes it), a ``req_to_token`` row, device KV for
    every token but the last sampled one (it has none yet), written with the deterministic KV of
    its tokens."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        f"r{next(_rids)}",
        "",
        array("q", prompt),
        SamplingParams(max_new_tokens=len(output)),
        session_id=sid,
        cache_salt=cache_salt,
    )
    tokens = prompt + output
    kv_len = len(tokens) - 1
    m = h.match(tokens[:kv_len], None)
    prefix = h.tree.path_device_indices(m.last_device_node)[: m.device_prefix_len]
    req.last_node = m.last_device_node
    req.lock = h.tree.lock(m.last_device_node)
    assert h.req_pool.alloc([req]) is not None
    new = h.allocator.alloc(kv_len - len(prefix))
    assert new is not None
    h.fill_kv(new, tokens[len(prefix) : kv_len])
    row = torch.cat([prefix, new.to(prefix.device)]).to(torch.int32)
    h.req_pool.write((req.kv.req_pool_idx, slice(0, kv_len)), row)
    req.kv.cache_protected_len = len(prefix)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = kv_len
    req.output_ids.extend(output)
    return req


def finish(h: UnifiedCacheHarness, req: Any) -> None:
    """The request stops (max_new_tokens reached) and the scheduler releases it with sglang's own
    ``release_kv_cache(checkpoint=True)`` (batch_result_processor.py:129): refresh the fill ids,
    ``checkpoint`` (hooked) inserts the turn, the row and the lock are released."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
    release_kv_cache(req, h.tree, checkpoint=True)
    assert req.kv.req_pool_idx is None and req.lock is None


def finish_turn(h: UnifiedCacheHarness, sid: str | None, prompt: list[int], output: list[int]) -> None:
    finish(h, start_request(h, sid, prompt, output))


def writes_acked(h: UnifiedCacheHarness, tk: SchedulerToolKV) -> None:
    """Scheduler iterations: ``check_hicache_events`` submits the queued writes, the copy engine
    finishes them, the next one retires the acks, then the process_input_requests AFTER hook ticks."""
    h.check_events()
    h.complete("write")
    h.check_events()
    tk.tick()


def loads_acked(h: UnifiedCacheHarness, tk: SchedulerToolKV) -> None:
    tk.tick()  # toolkv's tick starts the queued load (the ring is idle)
    h.complete("load")
    h.check_events()
    tk.tick()


@pytest.mark.parametrize("lazy", ["1", "0"], ids=["lazy_free_default", "TOOLKV_LAZY_FREE=0"])
def test_turn_to_runnable_through_the_hooks_restores_the_same_bytes(
    h: UnifiedCacheHarness, lazy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin's default on 0.5.23 leaves the acknowledged GPU copy to sglang's eviction (lazy
    free): the copy stays, unlocked and evictable, until sglang evicts it; with
    ``TOOLKV_LAZY_FREE=0`` toolkv frees it at the ack. Either way the restore brings the same bytes."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    monkeypatch.setenv("TOOLKV_LAZY_FREE", lazy)
    initial = h.accounting()
    sched = fake_scheduler(h)
    after_scheduler_init(None, sched)
    tk: SchedulerToolKV = sched._toolkv
    assert h.tree._toolkv is tk and tk.manager.backend.name == "unified"
    assert (tk.status()["tp_rank"], tk.status()["tp_size"]) == (0, 1)

    # a request that is still running checkpoints (chunked prefill / decode): no turn yet
    running = start_request(h, "s1", PROMPT, [41, 42, 43, 44])
    h.tree.checkpoint(running, up_to=running.kv.kv_committed_len)
    assert call(sched, "kv_meta", session_id="s1").status == 404
    finish(h, running)  # it finishes: release_kv_cache -> checkpoint -> the turn is recorded
    meta = call(sched, "kv_meta", session_id="s1")
    assert meta.ok and meta.body["state"] == "Running" and meta.body["tokens"] == 43
    finish_turn(h, None, [900, 901, 902], [903])  # no session label: not tracked
    assert call(sched, "kv_meta").body["sessions"] == 1
    turn = [*PROMPT, 41, 42, 43]  # the 43 tokens with KV

    started = call(sched, "tool_start", session_id="s1")
    assert started.ok and started.body["epoch"] == 1 and started.body["state"] == "Offloading"
    free0 = h.allocator.available_size()
    h.check_events()
    tk.tick()  # the write is submitted, not acknowledged: nothing freed
    assert call(sched, "kv_meta", session_id="s1").body["state"] == "Offloading"
    assert h.allocator.available_size() == free0
    evictable0 = h.tree.evictable_size()
    writes_acked(h, tk)
    meta = call(sched, "kv_meta", session_id="s1")
    if lazy == "1":  # left on the GPU, unlocked: sglang's eviction takes it when it needs the room
        assert meta.body["state"] == "Offloaded" and meta.body["tier"] == "GPU"
        assert meta.body["device_tokens"] == 43 and h.allocator.available_size() == free0
        assert h.tree.evictable_size() - evictable0 >= 43
        h.tree.evict(EvictParams(num_tokens=h.tree.evictable_size()))
        meta = call(sched, "kv_meta", session_id="s1")
    assert meta.body["state"] == "Offloaded" and meta.body["tier"] == "CpuProtected"
    assert meta.body["device_tokens"] == 0 and meta.body["host_tokens"] == 43
    freed = h.allocator.available_size() - free0  # sglang's eviction also took the unlabelled turn
    assert freed == 43 if lazy == "0" else freed >= 43, "the session's device tokens were freed"
    assert h.scribble_unreferenced() > 0  # freed slots reused by others: no right bytes by luck

    stale = call(sched, "tool_end", session_id="s1", epoch=7)
    assert (stale.status, stale.body["error"]) == (409, "stale_epoch")
    ended = call(sched, "tool_end", session_id="s1", epoch=1)
    assert ended.ok and ended.body["state"] == "Restoring"
    loads_acked(h, tk)
    meta = call(sched, "kv_meta", session_id="s1")
    assert meta.body["state"] == "Handover" and meta.body["device_tokens"] == 43
    node = tk.manager.sessions["s1"].node
    restored = h.device_kv(h.tree.path_device_indices(node.id)).float()
    assert torch.equal(restored, h.expected_kv(turn)), "restored KV differs from the turn's KV"

    # the next turn extends the session; its record follows the new leaf
    finish_turn(h, "s1", [*turn, 44, 50, 51], [52, 53])
    assert call(sched, "kv_meta", session_id="s1").body["tokens"] == 47  # 46 + 2 - the last sampled

    assert call(sched, "close", session_id="s1").ok
    h.drain()
    assert h.accounting() == initial


def test_salted_and_unlabelled_requests_are_not_recorded(h: UnifiedCacheHarness) -> None:
    """A ``cache_salt`` keys the tree under the salt (radix_cache.py:245-247), which toolkv's key
    walk does not carry: such a turn is skipped and counted, never recorded against a wrong node."""
    sched = fake_scheduler(h)
    after_scheduler_init(None, sched)
    finish(h, start_request(h, "salted", PROMPT, [41], cache_salt="tenant-a"))
    finish_turn(h, None, [900, 901, 902], [903])
    meta = call(sched, "kv_meta").body
    assert meta["sessions"] == 0 and meta["skipped"] == {"skip:cache_salt": 1}
    assert call(sched, "tool_start", session_id="salted").status == 404


def test_tree_reset_hook_marks_offloaded_sessions_lost(h: UnifiedCacheHarness) -> None:
    sched = fake_scheduler(h)
    after_scheduler_init(None, sched)
    finish_turn(h, "s1", PROMPT, [41])
    call(sched, "tool_start", session_id="s1")
    writes_acked(h, sched._toolkv)  # flush_cache needs an idle scheduler: the offload has finished
    assert call(sched, "kv_meta", session_id="s1").body["state"] == "Offloaded"
    h.tree.reset()  # what flush_cache does; the AFTER hook on UnifiedRadixCache.reset runs
    assert call(sched, "kv_meta", session_id="s1").body["state"] == "Lost"
    assert call(sched, "tool_end", session_id="s1", epoch=1).status == 409


def test_scheduler_init_refuses_a_tree_it_cannot_drive(hooked: None) -> None:
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0, attn_tp_rank=0):
        for cfg, words in [
            (UnifiedHarnessConfig(hicache=False), "--enable-hierarchical-cache"),
            (UnifiedHarnessConfig(tree_core="rust", hicache=False), "--enable-hierarchical-cache"),
        ]:
            with UnifiedCacheHarness(cfg) as hh:
                sched = fake_scheduler(hh)
                with pytest.raises(Unsupported, match=words):
                    after_scheduler_init(None, sched)
                assert not hasattr(sched, "_toolkv")


def test_startup_line_has_the_pool_sizes_of_the_unified_tree(
    h: UnifiedCacheHarness, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="toolkv"):
        after_scheduler_init(None, fake_scheduler(h))
    line = next(r.getMessage() for r in caplog.records if "toolkv enabled on scheduler" in r.getMessage())
    assert "tp_rank=0 tp_size=1: backend=unified" in line
    # 2 layers x 2 KV heads x 4 dim x fp32 x (K, V) = 128 bytes; host ratio 2 over 256 device tokens
    host = h.host_pool.size
    assert f"device_pool_tokens=256 host_pool_tokens={host} kv_bytes_per_token=128" in line
    assert host > 256 and not [r for r in caplog.records if r.levelname == "WARNING"]
