"""``toolkv trace-check --decisions``: decision logs of REAL runs replayed against the spec's session
table (``toolkv.verify.toolkv.decisions``).

The logs come from real runs on CPU: the soak driver (``toolkv.tools.soak``: the scheduler side and
the HTTP routes over sglang's real HiRadixCache / RadixCache, with aborts, races, lost replies,
abandoned sessions and deferred flushes) and the plugin's scheduler side driven over a real cache
(stale tool_ends, a closed id reused, an unknown session, a flush). Each is written through the
``toolkv`` logger with sglang's line prefix, as a server log is. Every real log must pass; a copy with
one line made illegal must be reported at that line, and only there.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from _turns import finish_turn, iteration

from toolkv.core import lifecycle
from toolkv.tools.cli import main
from toolkv.verify.toolkv import decisions as dc
from toolkv.verify.toolkv.decisions import Violation, check_logs

SPEC = Path(__file__).resolve().parents[1] / "spec" / "ToolKV.tla"
SGLANG_FORMAT = "[%(asctime)s TP0] %(message)s"  # sglang's configure_logger, TP rank prefix


class _Capture:
    """Write the ``toolkv`` logger's records to ``path`` as a server log (INFO and up)."""

    def __init__(self, path: Path, fmt: str = SGLANG_FORMAT) -> None:
        self.path = path
        self.handler = logging.FileHandler(path, mode="w", encoding="utf-8")
        self.handler.setFormatter(logging.Formatter(fmt))
        self.handler.setLevel(logging.INFO)
        self.logger = logging.getLogger("toolkv")

    def __enter__(self) -> Path:
        self.level = self.logger.level
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        self.handler.close()


# ---- real runs --------------------------------------------------------------------------------------
SOAKS = {
    # policy offload on the HiRadixCache: copies in flight, acks, restores, flushes, TTL expiries
    "hiradix": ("hiradix", "offload", 3.0),
    # the per-call policy on a plain RadixCache (pin): keep, hand-over, early restores
    "pin-auto": ("pin", "auto", 4.0),
}


@pytest.fixture(scope="module")
def soak_logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import toolkv.tools.soak as soak
    from toolkv.sglang.config import ToolKVConfig

    out = {}
    for name, (stack, policy, ttl) in SOAKS.items():
        path = tmp_path_factory.mktemp("soak") / f"{name}.log"
        with pytest.MonkeyPatch.context() as mp, _Capture(path):
            if policy != "offload":
                mp.setattr(
                    soak, "ToolKVConfig", functools.partial(ToolKVConfig, policy=policy, keep_ttl_s=3.0)
                )
            r = soak.run_soak(
                soak.SoakConfig(stack=stack, tool_calls=240, flush_every=80, ttl_s=ttl, abandon_p=0.15)  # type: ignore[arg-type]
            )
        assert r.tool_calls == 240 and not r.error_logs, (r.tool_calls, r.error_logs)
        out[name] = path
        COUNTERS[name] = r.counters
    return out


COUNTERS: dict[str, dict[str, int]] = {}  # the manager's counters at the end of each soak


P = list(range(1, 41))
P2 = list(range(500, 530))


def _scheduler_run(path: Path, body: Callable[..., None]) -> Path:
    from toolkv.sglang.config import ToolKVConfig
    from toolkv.sglang.scheduler_side import SchedulerToolKV
    from toolkv.testing.harness import CacheHarness, HarnessConfig

    with CacheHarness(HarnessConfig()) as h, _Capture(path):
        tk = SchedulerToolKV(h.tree, config=ToolKVConfig(ttl_s=5.0, sweep_every=1, lazy_free=False))
        h.tree._toolkv = tk
        body(h, tk)
    return path


def _plugin_scenario(h: object, tk: object) -> None:
    from toolkv.sglang.plugin import after_tree_reset

    t: dict[str, object]
    call: Callable[..., dict[str, object]] = lambda op, **b: tk.handle(op, b)[1]  # type: ignore[attr-defined]  # noqa: E731
    assert finish_turn(h, "s1", P, [41, 42])  # type: ignore[arg-type]
    assert finish_turn(h, "s2", P2, [531], slot=1)  # type: ignore[arg-type]
    assert call("tool_start", session_id="s1")["state"] == "Offloading"
    iteration(h, tk, writes=True)  # type: ignore[arg-type]  # write ack: Offloaded, no line
    assert call("tool_end", session_id="s1", epoch=0)["error"] == "stale_epoch"
    assert call("tool_end", session_id="s1", epoch=1)["state"] == "Restoring"
    iteration(h, tk, loads=True)  # type: ignore[arg-type]  # load ack: Handover, no line
    assert finish_turn(h, "s1", [*P, 41, 42, 43], [44])  # type: ignore[arg-type]  # admitted: a line
    assert call("tool_start", session_id="s1")["epoch"] == 2
    iteration(h, tk, writes=True)  # type: ignore[arg-type]
    assert call("tool_end", session_id="s1", epoch=1)["error"] == "stale_epoch"
    assert call("tool_start", session_id="ghost")["error"] == "unknown_session"
    assert call("close", session_id="s2")["state"] == "Closed"
    assert call("tool_start", session_id="s2")["error"] == "wrong_state"
    assert finish_turn(h, "s2", [*P2, 531, 532], [533], slot=1)  # type: ignore[arg-type]  # the id is reused
    t = call("tool_start", session_id="s2")
    assert t["epoch"] == 1, t  # continues the closed record's epochs
    assert call("tool_end", session_id="s1", epoch=2)["state"] == "Restoring"
    iteration(h, tk, loads=True)  # type: ignore[arg-type]
    assert call("close", session_id="s1")["state"] == "Closed"
    iteration(h, tk, writes=True)  # type: ignore[arg-type]  # flush_cache runs on an idle scheduler
    h.tree.reset()  # type: ignore[attr-defined]
    after_tree_reset(None, h.tree)  # type: ignore[attr-defined]
    iteration(h, tk)  # type: ignore[arg-type]  # the tick logs the protection the reset ended
    assert call("tool_end", session_id="s2", epoch=1)["error"] == "wrong_state"


@pytest.fixture(scope="module")
def plugin_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _scheduler_run(tmp_path_factory.mktemp("plugin") / "plugin.log", _plugin_scenario)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def _edit(src: Path, dst: Path, pick: Callable[[str], bool], change: Callable[[str], str]) -> int:
    """Copy ``src`` to ``dst`` with the first line ``pick`` accepts changed; its 1-based number."""
    lines = _lines(src)
    i = next(i for i, line in enumerate(lines) if pick(line))
    new = change(lines[i])
    assert new != lines[i]
    lines[i] = new
    dst.write_text("".join(lines))
    return i + 1


def _session(line: str) -> str:
    m = re.search(r" session=(\S+)", line)
    assert m
    return m.group(1)


# ---- real logs pass -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SOAKS))
def test_soak_decision_log_is_a_spec_behaviour(soak_logs: dict[str, Path], name: str) -> None:
    path = soak_logs[name]
    r = check_logs([path])
    assert r.ok, dc.render(r)
    assert r.ranks == [0] and r.sessions >= 20 and r.lines >= 400, (r.sessions, r.lines)
    text = path.read_text()
    assert text.count("TP0] toolkv decision ") == r.lines  # the prefix was there, and skipped
    seen = set(re.findall(r"toolkv decision op=(\w+) .* outcome=(\w+)", text))
    need = {("tool_start", "ok"), ("tool_end", "ok"), ("admit", "ok"), ("close", "ok"), ("tree_reset", "ok")}
    need |= {("ttl_sweep", "ok"), ("tool_end", "refused"), ("tool_start", "skipped")}
    if name == "hiradix":
        need |= {("restore_on_request", "ok")}
    assert need <= seen, sorted(need - seen)
    # one line per protection the TTL or a flush ended, in-flight copies included (observe.py)
    c = COUNTERS[name]
    assert text.count("op=tree_reset ") == c.get("lost", 0) > 0, c
    assert text.count("op=ttl_sweep ") == c.get("expired", 0) > 0, c
    if name == "pin-auto":
        assert re.search(r"op=tool_start \S+ \S+ state=Kept .*outcome=ok", text), "the policy kept nothing"


def test_plugin_decision_log_is_a_spec_behaviour(plugin_log: Path) -> None:
    r = check_logs([plugin_log])
    assert r.ok, dc.render(r)
    assert (r.sessions, r.lines) == (3, 14)
    text = plugin_log.read_text()
    assert "reason=stale_epoch rank=0 asked=0" in text and "reason=stale_epoch rank=0 asked=1" in text


# ---- one line made illegal: reported at that line -----------------------------------------------------
def _only_error(path: Path, line: int, kind: Violation, session: str) -> dc.IllegalDecision:
    r = check_logs([path])
    assert [(e.line, e.kind, e.session) for e in r.errors] == [(line, kind, session)], dc.render(r)
    (e,) = r.errors
    assert e.trace[-1].line == line
    assert all(getattr(dc.parse_line(t.text), "session", None) == session for t in e.trace)
    assert [t.line for t in e.trace] == sorted(t.line for t in e.trace)
    return e


def _older(line: str) -> str:
    n = int(re.search(r" epoch=(\d+)", line).group(1))  # type: ignore[union-attr]
    return re.sub(r" asked=\d+", f" asked={n - 1}", re.sub(r" epoch=\d+", f" epoch={n - 1}", line))


@pytest.mark.parametrize("name", list(SOAKS))
def test_accepted_tool_end_with_a_stale_epoch_is_reported(
    soak_logs: dict[str, Path], tmp_path: Path, name: str
) -> None:
    bad = tmp_path / "stale.log"

    def pick(line: str) -> bool:
        return bool(re.search(r"op=tool_end \S+ epoch=([2-9]|\d\d+) .*outcome=ok", line))

    no = _edit(soak_logs[name], bad, pick, _older)
    e = _only_error(bad, no, Violation.EPOCH, _session(_lines(bad)[no - 1]))
    assert "current epoch" in e.message


def test_accepted_tool_end_asking_a_stale_epoch_is_reported(plugin_log: Path, tmp_path: Path) -> None:
    """The line's epoch is the session's; ``asked`` is what the call carried."""
    bad = tmp_path / "asked.log"
    no = _edit(
        plugin_log,
        bad,
        lambda line: "op=tool_end session=s1 epoch=2" in line and "outcome=ok" in line,
        lambda line: line.replace("asked=2", "asked=1"),
    )
    e = _only_error(bad, no, Violation.EPOCH, "s1")
    assert e.message == "tool_end accepted epoch 1; the session's epoch is 2"


def test_stale_epoch_refusal_of_the_current_epoch_is_reported(plugin_log: Path, tmp_path: Path) -> None:
    bad = tmp_path / "refused.log"
    no = _edit(
        plugin_log, bad, lambda line: "asked=0" in line, lambda line: line.replace("asked=0", "asked=1")
    )
    _only_error(bad, no, Violation.EPOCH, "s1")


@pytest.mark.parametrize("name", list(SOAKS))
def test_state_jump_the_table_forbids_is_reported(
    soak_logs: dict[str, Path], tmp_path: Path, name: str
) -> None:
    """An accepted tool_start that "restores": no ToolStart/Keep/LetGo row leads to Restoring."""
    bad = tmp_path / "jump.log"
    no = _edit(
        soak_logs[name],
        bad,
        lambda line: bool(
            re.search(r"op=tool_start \S+ \S+ state=(Offloading|Offloaded|Kept) .*outcome=ok", line)
        ),
        lambda line: re.sub(r" state=\w+", " state=Restoring", line),
    )
    e = _only_error(bad, no, Violation.TRANSITION, _session(_lines(bad)[no - 1]))
    assert "cannot lead to Restoring" in e.message


def test_an_accepted_call_shows_its_own_step_not_later_ones(plugin_log: Path, tmp_path: Path) -> None:
    """A line is written right after its call: an accepted tool_start that shows the session
    Running again (offloaded, demoted, a turn: all later, without a line) is not a ToolStart."""
    bad = tmp_path / "later.log"
    no = _edit(
        plugin_log,
        bad,
        lambda line: "op=tool_start session=s1 epoch=2 state=Offloading" in line,
        lambda line: line.replace("state=Offloading", "state=Running"),
    )
    _only_error(bad, no, Violation.TRANSITION, "s1")


def test_refused_call_that_changed_the_state_is_reported(soak_logs: dict[str, Path], tmp_path: Path) -> None:
    """A refused tool_end whose line shows the session Offloaded: nothing but a tool_start gets it there."""
    bad = tmp_path / "refused.log"
    no = _edit(
        soak_logs["hiradix"],
        bad,
        lambda line: bool(
            re.search(r"op=tool_end \S+ \S+ state=(Lost|Expired|Handover) .*outcome=refused", line)
        ),
        lambda line: re.sub(r" state=\w+", " state=Offloaded", line),
    )
    e = _only_error(bad, no, Violation.REFUSED_CHANGED, _session(_lines(bad)[no - 1]))
    assert "without a decision it can only be in" in e.message


def test_no_way_back_after_closed_without_a_new_tool_start(plugin_log: Path, tmp_path: Path) -> None:
    """After Closed a reused id is a new spec session: Running until its ToolStart. An accepted
    tool_end right after the close is no row of the table, whatever happened in between."""
    lines = _lines(plugin_log)
    i = next(i for i, line in enumerate(lines) if "op=close session=s1" in line)
    fake = lines[i].replace("op=close", "op=tool_end").replace("state=Closed", "state=Restoring")
    bad = tmp_path / "closed.log"
    bad.write_text("".join([*lines[: i + 1], fake, *lines[i + 1 :]]))
    e = _only_error(bad, i + 2, Violation.TRANSITION, "s1")
    assert "Closed at epoch 2" in e.message


def test_flush_during_a_copy_is_reported(tmp_path: Path) -> None:
    """A tree reset while an offload's writes are in flight: toolkv closes the session (an ERROR
    line); the spec's TreeReset is not enabled then."""
    from toolkv.sglang.plugin import after_tree_reset

    def body(h: object, tk: object) -> None:
        assert finish_turn(h, "s1", P, [41, 42])  # type: ignore[arg-type]
        tk.handle("tool_start", {"session_id": "s1"})  # type: ignore[attr-defined]
        h.tree.reset()  # type: ignore[attr-defined]
        after_tree_reset(None, h.tree)  # type: ignore[attr-defined]
        iteration(h, tk)  # type: ignore[arg-type]

    path = _scheduler_run(tmp_path / "midcopy.log", body)
    no = next(i for i, line in enumerate(_lines(path), 1) if "closing it" in line)
    e = _only_error(path, no, Violation.RESET_MID_COPY, "s1")
    assert "Offloading" in e.message


# ---- ranks, restarts, the parser ------------------------------------------------------------------------
def _as_rank(line: str, rank: int) -> str:
    return line.replace(" rank=0", f" rank={rank}").replace("TP0]", f"TP{rank}]")


def test_ranks_must_agree(plugin_log: Path, tmp_path: Path) -> None:
    lines = [x for x in _lines(plugin_log) if "toolkv decision" in x]
    both = tmp_path / "tp2.log"
    both.write_text("".join(x + _as_rank(x, 1) for x in lines))
    r = check_logs([both])
    assert r.ok and r.ranks == [0, 1] and r.lines == len(lines), dc.render(r)
    k = 5  # rank 1 logged another epoch for the 6th decision
    out = [
        x + (_as_rank(x, 1) if i != k else re.sub(r" epoch=\d+", " epoch=7", _as_rank(x, 1)))
        for i, x in enumerate(lines)
    ]
    assert out[k] != lines[k] + _as_rank(lines[k], 1)
    bad = tmp_path / "tp2bad.log"
    bad.write_text("".join(out))
    r = check_logs([bad])
    assert [(e.kind, e.line) for e in r.errors] == [(Violation.RANKS_DISAGREE, 2 * k + 2)], dc.render(r)


def test_a_restarted_server_knows_no_session(plugin_log: Path, tmp_path: Path) -> None:
    """After the scheduler's start-up line every session is unknown (a new record starts at
    Running): the tool_end that ends s2's offload is legal in one server, not after a restart."""
    lines = _lines(plugin_log)
    i = next(i for i, line in enumerate(lines) if "op=tool_start session=s2 epoch=1" in line)
    end = lines[i].replace("op=tool_start", "op=tool_end").replace("state=Offloading", "state=Restoring")
    end = end.rstrip("\n") + " asked=1\n"
    same = tmp_path / "same.log"
    same.write_text("".join([*lines[: i + 1], end]))
    assert check_logs([same]).ok
    start = "[2026-12-01 10:00:00 TP0] toolkv enabled on scheduler tp_rank=0 tp_size=1: backend=hiradix\n"
    restarted = tmp_path / "restarted.log"
    restarted.write_text("".join([*lines[: i + 1], start, end]))
    e = _only_error(restarted, i + 3, Violation.TRANSITION, "s2")
    assert "unknown (no record)" in e.message


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        "[2026-12-01 19:27:04 TP0] ",
        "[2026-12-01 19:27:04 DP1 TP0 EP0] ",
        "INFO:toolkv:",
        "2026-12-01 INFO toolkv ",
    ],
)
def test_parser_tolerates_prefixes_and_quoted_ids(prefix: str) -> None:
    line = (
        prefix
        + 'toolkv decision op=tool_end session="a \\"b\\" c" epoch=3 state=Restoring tokens=7 outcome=ok reason=- rank=0 asked=3\n'
    )
    d = dc.parse_line(line, "f", 9)
    assert d is not None
    assert (d.op, d.session, d.epoch, d.state, d.outcome, d.reason, d.rank, d.asked) == (
        "tool_end", 'a "b" c', 3, "Restoring", "ok", "", 0, 3,
    )  # fmt: skip
    assert dc.parse_line(prefix + "some other sglang line\n") is None


# ---- derived from the table, not copied --------------------------------------------------------------------
def test_checker_steps_are_table_rows() -> None:
    rel = lifecycle.relation(lifecycle.SESSION_TRANSITIONS)
    assert rel == dc.REL and rel >= dc.SILENT
    triggers = {t for _, _, t in rel}
    assert {t for ts in dc.OP_TRIGGERS.values() for t in ts} <= triggers
    assert set(dc.SILENT_WHY) <= triggers and triggers >= dc.EPOCH_RAISING
    # a client's decisions are never silent: they are logged
    assert not {t for _, _, t in dc.SILENT} & {"tool_start", "keep", "let_go", "tool_end"}
    assert ("Handover", "Runnable", "ttl_sweep") in dc.SILENT and (
        "Offloaded",
        "Expired",
        "ttl_sweep",
    ) not in dc.SILENT
    assert ("Running", "Closed", "close") in dc.SILENT and ("Offloaded", "Closed", "close") not in dc.SILENT
    from toolkv.core.manager import IDLE

    assert dc.IDLE == IDLE


def _spec_actions() -> dict[str, str]:
    text = SPEC.read_text()
    heads = list(re.finditer(r"^([A-Z]\w*)(\([^)]*\))? ==", text, re.M))
    return {
        m.group(1): text[m.end() : (heads[k + 1].start() if k + 1 < len(heads) else len(text))]
        for k, m in enumerate(heads)
    }


def test_epoch_raising_actions_are_the_specs() -> None:
    """ToolKV.tla raises a session's epoch in exactly these actions."""
    raise_ = re.compile(r"epoch' = \[epoch EXCEPT !\[s\] = @ \+ 1\]")
    spec = {name for name, body in _spec_actions().items() if raise_.search(body)}
    camel = {"".join(p.capitalize() for p in t.split("_")) for t in dc.EPOCH_RAISING}
    assert spec == camel


# ---- the command ----------------------------------------------------------------------------------------------
def test_cli_summary_json_and_exit_status(
    plugin_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace-check", "--decisions", str(plugin_log)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("1 log(s), rank(s) 0: 3 sessions, 14 decision lines, 0 illegal")
    bad = tmp_path / "bad.log"
    no = _edit(
        plugin_log, bad, lambda line: "asked=0" in line, lambda line: line.replace("asked=0", "asked=1")
    )
    assert main(["trace-check", "--decisions", str(plugin_log), str(bad), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ok"], doc["sessions"], doc["lines"], doc["illegal"]) == (False, 6, 28, 1)
    (err,) = doc["errors"]
    assert (err["file"], err["line"], err["kind"], err["session"]) == (str(bad), no, "epoch", "s1")
    assert err["trace"][-1]["line"] == no
    assert main(["trace-check", "--decisions", str(bad)]) == 1
    text = capsys.readouterr().out
    assert text.startswith(f"ILLEGAL {bad}:{no} session 's1' op tool_end [epoch]")


def test_cli_input_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "server.log"
    empty.write_text("[2026-12-01 TP0] Load weight end.\n")
    assert main(["trace-check", "--decisions", str(empty)]) == 2
    assert "no 'toolkv decision' line" in capsys.readouterr().err
    assert main(["trace-check", "--decisions", str(tmp_path / "nope.log")]) == 2
    assert "No such file or directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trace-check"])
    assert "give trace files, or --decisions" in capsys.readouterr().err


def test_a_demotion_inside_another_call_is_its_own_line(tmp_path: Path) -> None:
    """A full host demotes an offloaded session predicted back later than the caller (whose client
    says its tool returns in 30 s, the other's in 10 minutes) inside the caller's tool_start, when
    queued requests need the device room the caller holds. The demoted session's next turn
    recomputes, so the demotion is a decision line of its own (op=demote, reason host_room), before
    the call's own line, and the log stays a spec behaviour."""
    from toolkv.sglang.config import ToolKVConfig
    from toolkv.sglang.scheduler_side import SchedulerToolKV
    from toolkv.testing.harness import CacheHarness, HarnessConfig

    path = tmp_path / "demote.log"
    a, b = list(range(1, 301)), list(range(1000, 1300))
    with CacheHarness(HarnessConfig(device_tokens=768, host_ratio=0.5)) as h, _Capture(path):
        tk = SchedulerToolKV(h.tree, config=ToolKVConfig(ttl_s=60.0, sweep_every=1, lazy_free=False))
        h.tree._toolkv = tk
        call: Callable[..., dict[str, object]] = lambda op, **kw: tk.handle(op, kw)[1]  # noqa: E731
        assert finish_turn(h, "s1", a, [301]) and finish_turn(h, "s2", b, [1300], slot=1)
        assert call("tool_start", session_id="s1", expected_s=600.0)["state"] == "Offloading"
        iteration(h, tk, writes=True)
        assert tk.manager.kv_meta("s1")["state"] == "Offloaded"
        tk.manager.queued_demand = lambda: 10**6  # the waiting queue needs the room s2 holds
        out = call("tool_start", session_id="s2", tool="quick", expected_s=30.0)
        assert out.get("state") in ("Offloading", "Offloaded"), out
        assert tk.manager.kv_meta("s1")["state"] == "Released"
    text = path.read_text()
    demotes = re.findall(r"toolkv decision op=demote session=(\S+) .*outcome=ok reason=host_room", text)
    assert demotes == ["s1"] and tk.manager.counters["demoted"] == 1, text
    assert text.index("op=demote session=s1") < text.index("op=tool_start session=s2")
    r = check_logs([path])
    assert r.ok, dc.render(r)
