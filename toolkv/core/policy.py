"""What to do with a session's KV when its agent calls a tool: keep it, offload it, or let it go.

The cost model behind the three actions:

* **keep** pins the KV on the GPU for the length of the tool call, so it costs device
  token-seconds (``kv_tokens × tool duration``) that no other request can use. It is the right
  call for short tools while the device pool has room: the next turn finds its prefix in place.
* **offload** writes the KV to pinned host memory and frees the GPU copy. It costs two transfers
  (device→host now, host→device later) and host room; the restore sits on the critical path of
  the next turn unless it is *prefetched*, i.e. started early enough to finish as the tool
  returns. It is the right call for long tools, where the device token-seconds saved dwarf the
  transfers.
* **let_go** does nothing special: the KV stays in the ordinary cache and may be evicted, in which
  case the next turn recomputes it (a prefill). For tiny KV that recompute is cheaper than two
  transfers, and when neither the device nor the host can afford the KV it is the only option.

Tool durations are modelled per tool name as log-normal (:class:`DurationModel`), fitted online
with a prior that counts as a few pseudo-observations. The defaults are calibrated to published
agent traces: per-call tool latency has a median of ~125 ms (Claude Code) to ~626 ms (Codex) with a
heavy tail (about half of all tool time is spent in calls of 1-10 minutes), and 86 % of an agent's
next requests arrive within 1 s of the previous answer. Hence the prior median of 0.6 s with a
log-space sigma of 1.5 (p75 ≈ 1.6 s, p90 ≈ 4.1 s, p99 ≈ 20 s) and a keep limit of 2 s: an
unseen tool is kept when the device has room, and a tool whose history shows minutes is offloaded.

Everything here is pure and deterministic — no clock, no randomness, no I/O — because
:func:`decide` runs on every tensor-parallel rank with the same inputs and all ranks must reach
the same decision without talking to each other. The model itself must be fed the same
observations in the same order on every rank (the manager does so from agreed events).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Literal

from toolkv.core.settings import MAX_DURATION_S, MIN_DURATION_S, PolicySettings

Action = Literal["keep", "offload", "let_go"]

_LOG_MIN = math.log(MIN_DURATION_S)
_LOG_MAX = math.log(MAX_DURATION_S)
_STD_NORMAL = NormalDist()


def _is_real(value: object) -> bool:
    """True for an int or float that is not a bool (``True`` is an ``int`` in Python)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_quantile(name: str, q: float) -> None:
    if not _is_real(q) or not 0.0 < q < 1.0:
        raise ValueError(f"{name} must be a number strictly between 0 and 1, got {q!r}")


@dataclass(frozen=True)
class PolicyConfig(PolicySettings):
    """Tunables of the tool-call policy (``toolkv.core.settings.PolicySettings``: one field per
    declared knob); every field is validated on construction."""

    def __post_init__(self) -> None:
        """Reject any value that would make a decision meaningless, naming the field and the value.

        Bools are refused where numbers are expected (``True`` would silently read as 1).
        """
        for name in (
            "prior_median_s",
            "prior_sigma",
            "prior_weight",
            "keep_max_s",
            "keep_quantile",
            "device_reserve",
            "prefetch_quantile",
            "prefetch_margin_s",
            "l3_store_margin_s",
            "l3_write_tokens_per_s",
        ):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                raise ValueError(f"PolicyConfig.{name} must be a finite number, got {value!r}")
        if not MIN_DURATION_S <= self.prior_median_s <= MAX_DURATION_S:
            raise ValueError(
                f"PolicyConfig.prior_median_s must be between {MIN_DURATION_S} and {MAX_DURATION_S} "
                f"seconds, got {self.prior_median_s!r}"
            )
        if self.prior_sigma <= 0:
            raise ValueError(f"PolicyConfig.prior_sigma must be > 0, got {self.prior_sigma!r}")
        if self.prior_weight <= 0:
            raise ValueError(f"PolicyConfig.prior_weight must be > 0, got {self.prior_weight!r}")
        if self.keep_max_s < 0:
            raise ValueError(f"PolicyConfig.keep_max_s must be >= 0, got {self.keep_max_s!r}")
        _check_quantile("PolicyConfig.keep_quantile", self.keep_quantile)
        _check_quantile("PolicyConfig.prefetch_quantile", self.prefetch_quantile)
        if not 0.0 <= self.device_reserve <= 1.0:
            raise ValueError(
                f"PolicyConfig.device_reserve must be between 0 and 1, got {self.device_reserve!r}"
            )
        if self.prefetch_margin_s < 0:
            raise ValueError(f"PolicyConfig.prefetch_margin_s must be >= 0, got {self.prefetch_margin_s!r}")
        if self.l3_store_margin_s < 0:
            raise ValueError(f"PolicyConfig.l3_store_margin_s must be >= 0, got {self.l3_store_margin_s!r}")
        if self.l3_write_tokens_per_s <= 0:
            raise ValueError(
                f"PolicyConfig.l3_write_tokens_per_s must be > 0, got {self.l3_write_tokens_per_s!r}"
            )
        if not _is_int(self.min_offload_tokens) or self.min_offload_tokens < 0:
            raise ValueError(
                f"PolicyConfig.min_offload_tokens must be an int >= 0, got {self.min_offload_tokens!r}"
            )
        if not _is_int(self.max_tools) or self.max_tools < 1:
            raise ValueError(f"PolicyConfig.max_tools must be an int >= 1, got {self.max_tools!r}")


class _LogStats:
    """Running count, mean and sum of squared deviations (Welford) of log-durations."""

    __slots__ = ("m2", "mean", "n")

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)


class DurationModel:
    """Online log-normal fit of tool durations per tool name, with a conjugate-style prior.

    Per tool it keeps the count, mean and squared deviations of ``log(seconds)``. The prior
    (``log(prior_median_s)``, ``prior_sigma``) counts as ``prior_weight`` pseudo-observations,
    as in a normal-inverse-gamma update::

        mu      = (k·mu0 + n·mean) / (k + n)
        sigma²  = (k·sigma0² + M2 + k·n/(k+n)·(mean − mu0)²) / (k + n)

    so an unseen tool gets exactly the prior, a tool seen once moves only part of the way (one
    fast call does not prove a tool fast), and after many calls the fit is the sample's: the
    median tends to the geometric mean of the observations and sigma to their log-space spread.

    The tool name ``None`` (a call whose tool is unknown) reads and feeds the *pooled* model of
    all observations, whatever their tool. Per-tool statistics are bounded by ``max_tools``; the
    least recently *observed* tool is dropped first (reads do not count, so reading is pure). A
    dropped tool's observations stay in the pooled model.
    """

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._mu0 = math.log(config.prior_median_s)
        self._tools: OrderedDict[str, _LogStats] = OrderedDict()
        self._pooled = _LogStats()

    def observe(self, tool: str | None, seconds: float) -> None:
        """Record one finished call of ``tool`` that took ``seconds``.

        Non-finite and negative durations are ignored (a clock glitch must not poison the fit);
        values are clamped to [``MIN_DURATION_S``, ``MAX_DURATION_S``] so their log is finite.
        """
        if not _is_real(seconds) or not math.isfinite(seconds) or seconds < 0:
            return
        x = math.log(min(max(float(seconds), MIN_DURATION_S), MAX_DURATION_S))
        self._pooled.add(x)
        if tool is None:
            return
        stats = self._tools.get(tool)
        if stats is None:
            stats = self._tools[tool] = _LogStats()
        else:
            self._tools.move_to_end(tool)
        stats.add(x)
        while len(self._tools) > self._config.max_tools:
            self._tools.popitem(last=False)

    def _stats(self, tool: str | None) -> _LogStats | None:
        return self._pooled if tool is None else self._tools.get(tool)

    def _posterior(self, tool: str | None) -> tuple[float, float]:
        """Posterior (mu, sigma) of log-duration for ``tool`` (the prior for an unseen tool)."""
        k = self._config.prior_weight
        sigma0 = self._config.prior_sigma
        stats = self._stats(tool)
        if stats is None or stats.n == 0:
            return self._mu0, sigma0
        n = stats.n
        mu = (k * self._mu0 + n * stats.mean) / (k + n)
        shift = stats.mean - self._mu0
        var = (k * sigma0 * sigma0 + stats.m2 + k * n / (k + n) * shift * shift) / (k + n)
        return mu, math.sqrt(var)

    def quantile(self, tool: str | None, q: float) -> float:
        """The ``q``-quantile of ``tool``'s duration in seconds; ``None`` → the pooled model.

        Clamped to [``MIN_DURATION_S``, ``MAX_DURATION_S``]; non-decreasing in ``q``.
        """
        _check_quantile("q", q)
        mu, sigma = self._posterior(tool)
        log_q = mu + sigma * _STD_NORMAL.inv_cdf(q)
        return math.exp(min(max(log_q, _LOG_MIN), _LOG_MAX))

    def residual_median(self, tool: str | None, elapsed: float, median: float | None = None) -> float:
        """The median total duration of a call of ``tool`` that has already run ``elapsed`` seconds:
        the median of the log-normal conditioned on ``T > elapsed``. For a heavy tail it grows with
        ``elapsed`` (a call far past its median is likely a long one), which is what ranks offloaded
        sessions by predicted return for demotion. ``median`` replaces the model's median (a
        client's ``expected_s`` hint), keeping the model's spread."""
        mu, sigma = self._posterior(tool)
        if median is not None and _is_real(median) and median > 0:
            mu = math.log(min(max(float(median), MIN_DURATION_S), MAX_DURATION_S))
        if not _is_real(elapsed) or not math.isfinite(elapsed) or elapsed <= 0:
            return math.exp(min(max(mu, _LOG_MIN), _LOG_MAX))
        z = (math.log(min(max(float(elapsed), MIN_DURATION_S), MAX_DURATION_S)) - mu) / sigma
        survive = 1.0 - _STD_NORMAL.cdf(z)
        q = 1.0 - 0.5 * survive
        if survive <= 0.0 or q >= 1.0:  # beyond float resolution: it is as long as it has run
            return float(elapsed)
        log_q = mu + sigma * _STD_NORMAL.inv_cdf(q)
        return max(float(elapsed), math.exp(min(max(log_q, _LOG_MIN), _LOG_MAX)))

    def median(self, tool: str | None) -> float:
        """The median duration of ``tool`` in seconds (``exp(mu)``)."""
        mu, _ = self._posterior(tool)
        return math.exp(min(max(mu, _LOG_MIN), _LOG_MAX))

    def count(self, tool: str | None) -> int:
        """Real observations held for ``tool`` (0 if unseen or dropped); ``None`` → all of them."""
        stats = self._stats(tool)
        return 0 if stats is None else stats.n

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per tool held, least recently observed first: ``n``, ``median_s``, ``sigma``, ``p90_s``.

        For ``kv_meta`` and metrics; the pooled model is not included (``count(None)`` and
        ``quantile(None, q)`` read it).
        """
        out: dict[str, dict[str, float]] = {}
        for tool, stats in self._tools.items():
            _, sigma = self._posterior(tool)
            out[tool] = {
                "n": float(stats.n),
                "median_s": self.median(tool),
                "sigma": sigma,
                "p90_s": self.quantile(tool, 0.9),
            }
        return out


@dataclass(frozen=True)
class Pressure:
    """The memory state a decision is made against, in tokens."""

    device_total_tokens: int
    device_available_tokens: int  # free + evictable (unlocked) on the GPU
    host_total_tokens: int  # the host budget (or the host pool size)
    host_available_tokens: int  # room left under that budget (free + what HiCache can evict)
    # free on the GPU after what running requests were promised and queued requests will need:
    # the room a pin takes from nobody. None: unknown, ``device_available_tokens`` is used.
    device_spare_tokens: int | None = None

    def __post_init__(self) -> None:
        """Counts must be ints >= 0 and what is available cannot exceed the total: a violation is
        a bookkeeping bug upstream, and deciding on it would keep or offload what does not fit."""
        for name in (
            "device_total_tokens",
            "device_available_tokens",
            "host_total_tokens",
            "host_available_tokens",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"Pressure.{name} must be an int >= 0, got {value!r}")
        if self.device_spare_tokens is not None and (
            not _is_int(self.device_spare_tokens) or self.device_spare_tokens < 0
        ):
            raise ValueError(
                f"Pressure.device_spare_tokens must be None or an int >= 0, got {self.device_spare_tokens!r}"
            )
        if self.device_available_tokens > self.device_total_tokens:
            raise ValueError(
                f"Pressure.device_available_tokens ({self.device_available_tokens}) exceeds "
                f"device_total_tokens ({self.device_total_tokens})"
            )
        if self.host_available_tokens > self.host_total_tokens:
            raise ValueError(
                f"Pressure.host_available_tokens ({self.host_available_tokens}) exceeds "
                f"host_total_tokens ({self.host_total_tokens})"
            )


def with_queued(pressure: Pressure, queued_tokens: int) -> Pressure:
    """``pressure`` with what queued requests will need taken off the spare device room: a pin
    must leave it free, or a kept session is paid for by somebody else's recompute."""
    if pressure.device_spare_tokens is None:
        return pressure
    return replace(pressure, device_spare_tokens=max(0, pressure.device_spare_tokens - queued_tokens))


def keep_fits(pressure: Pressure, kv_tokens: int, device_reserve: float) -> bool:
    """The keep rule, the one copy of it: pinning ``kv_tokens`` more on the GPU must leave
    ``device_reserve`` of the pool *free* after what running requests were promised and queued
    requests will need (``device_spare_tokens``, see :func:`with_queued`), or free and evictable
    when the backend cannot tell promised tokens apart. Evictable cache does not count where it
    can be told apart: it is other sessions' KV, and a pin taken from it under load is a prefix
    somebody else recomputes. :func:`decide` keeps by it, the manager's early restore goes only
    into the room it leaves, and kv_hints' ``retain`` keeps by it."""
    spare = (
        pressure.device_available_tokens
        if pressure.device_spare_tokens is None
        else min(pressure.device_spare_tokens, pressure.device_available_tokens)
    )
    return spare - kv_tokens >= device_reserve * pressure.device_total_tokens


@dataclass(frozen=True)
class Decision:
    """What to do with one session's KV at ``tool_start``, and why."""

    action: Action
    reason: str  # short snake_case; ends in "_hint" when the client's expected_s was used
    expected_s: float  # the duration estimate used (at keep_quantile, or the hint)
    restore_s: float  # the estimated restore time of this KV
    prefetch_after_s: float | None  # seconds after tool_start to begin an early restore (offload only)


def decide(
    *,
    kv_tokens: int,
    tool: str | None,
    expected_s: float | None,
    pressure: Pressure,
    model: DurationModel,
    config: PolicyConfig,
    restore_tokens_per_s: float,
    host_need_tokens: int | None = None,
) -> Decision:
    """Choose keep / offload / let_go for a session whose agent just started ``tool``.

    ``host_need_tokens`` is what an offload would add on the host (the path tokens without a host
    copy yet, or the host budget's share); default ``kv_tokens``. With HiCache's write-through most
    of a path is usually backed up already, so the whole KV size overstates the room needed.

    Pure and deterministic (it runs on every tensor-parallel rank and all must agree). The rules,
    in order:

    0. ``kv_tokens == 0`` → ``let_go`` (``no_kv``): there is nothing to keep or move.
    1. The duration estimate is the client's ``expected_s`` when given — the client knows what it
       launched better than the history of the tool name does — else
       ``model.quantile(tool, keep_quantile)``, an upper-ish quantile because keeping through a
       call that runs long wastes device token-seconds. A hint is used for the prefetch time as
       well, and every reason then ends in ``_hint``.
    2. ``kv_tokens < min_offload_tokens`` and the host cannot take it → ``let_go`` (``small_kv``),
       unless the tool is short and keeping is affordable (rule 3's test). A session the host can
       take is never let go: under load a recompute of even a small prefix queues behind every
       other prefill, while its two copies run on the copy engines.
    3. A short tool (estimate ≤ ``keep_max_s``) is kept (``short_tool``) only when the device has
       real spare room: after pinning this KV, ``device_reserve`` of the pool must stay *free*
       once running requests got what they were promised and queued requests what they need
       (``device_spare_tokens``). Evictable cache does not count: it is other sessions' KV, and a
       pin taken from it under load is a prefix somebody else recomputes (measured: keeping under
       pressure lost to stock sglang). A short tool on a device under pressure is offloaded
       (``device_pressure``) if the host has room, with an early restore.
    4. Otherwise (a long tool) ``offload`` (``long_tool``) when the host has room for all of it
       (free plus the unprotected copies HiCache can evict, plus what demotions can free).
       The early restore starts ``prefetch_after_s = max(0, t_q − restore_s − prefetch_margin_s)``
       after ``tool_start``, with ``t_q`` the ``prefetch_quantile`` of the duration (or the hint)
       and ``restore_s = kv_tokens / restore_tokens_per_s``, so that the KV is back as the tool
       returns rather than after.
    5. Otherwise the host is full: ``keep`` (``host_full_keep``) if the device can afford it,
       else ``let_go`` (``host_full``).

    Raises ``ValueError`` for negative ``kv_tokens``, a non-finite or negative ``expected_s``,
    or a ``restore_tokens_per_s`` that is not a finite number > 0.
    """
    if not _is_int(kv_tokens) or kv_tokens < 0:
        raise ValueError(f"kv_tokens must be an int >= 0, got {kv_tokens!r}")
    if expected_s is not None and (
        not _is_real(expected_s) or not math.isfinite(expected_s) or expected_s < 0
    ):
        raise ValueError(f"expected_s must be None or a finite number >= 0, got {expected_s!r}")
    if (
        not _is_real(restore_tokens_per_s)
        or not math.isfinite(restore_tokens_per_s)
        or restore_tokens_per_s <= 0
    ):
        raise ValueError(f"restore_tokens_per_s must be a finite number > 0, got {restore_tokens_per_s!r}")

    hinted = expected_s is not None
    suffix = "_hint" if hinted else ""
    expected = float(expected_s) if expected_s is not None else model.quantile(tool, config.keep_quantile)
    restore_s = kv_tokens / restore_tokens_per_s

    def made(action: Action, reason: str, prefetch_after_s: float | None = None) -> Decision:
        return Decision(action, reason + suffix, expected, restore_s, prefetch_after_s)

    if kv_tokens == 0:
        return made("let_go", "no_kv")

    short = expected <= config.keep_max_s
    device_fits = keep_fits(pressure, kv_tokens, config.device_reserve)
    host_fits = pressure.host_available_tokens >= (
        kv_tokens if host_need_tokens is None else host_need_tokens
    )

    if kv_tokens < config.min_offload_tokens and not host_fits:
        if short and device_fits:
            return made("keep", "short_tool")
        return made("let_go", "small_kv")

    if short and device_fits:
        return made("keep", "short_tool")
    if host_fits:
        t_q = float(expected_s) if expected_s is not None else model.quantile(tool, config.prefetch_quantile)
        prefetch_after = max(0.0, t_q - restore_s - config.prefetch_margin_s)
        return made("offload", "device_pressure" if short else "long_tool", prefetch_after)
    if device_fits:
        return made("keep", "host_full_keep")
    return made("let_go", "host_full")


def demotion_order(candidates: list[tuple[str, float, float, int]], now: float) -> list[str]:
    """candidates: (session_id, started_at, expected_end_at, tokens). Returns session ids, the least
    valuable first, for demotion when the host budget is reached.

    The value of holding a session's KV is that its next turn comes soon, so:

    1. Sessions still expected to run (``expected_end_at > now``) come first, the largest
       expected remaining time first: they will hold their room longest before paying it back.
       An unknown end may be given as ``+inf`` (most remaining).
    2. Sessions at or past their expected end come last — the tool is likely to return any
       moment. Among them the most overdue comes first: a heavy-tailed (log-normal) call that
       has overrun by far is the one likeliest to run much longer still, or to be abandoned.
    3. Ties break on the oldest ``started_at``, then on the session id, so every rank produces
       the same order.

    ``tokens`` does not affect the order (the caller demotes until enough room is freed).
    Raises ``ValueError`` for a non-finite ``now`` or ``started_at``, a NaN ``expected_end_at``,
    negative ``tokens`` or a duplicate session id.
    """
    if not _is_real(now) or not math.isfinite(now):
        raise ValueError(f"now must be a finite number, got {now!r}")
    seen: set[str] = set()
    keyed: list[tuple[int, float, float, str]] = []
    for sid, started_at, expected_end_at, tokens in candidates:
        if sid in seen:
            raise ValueError(f"duplicate session id in demotion candidates: {sid!r}")
        seen.add(sid)
        if not _is_real(started_at) or not math.isfinite(started_at):
            raise ValueError(f"started_at of {sid!r} must be a finite number, got {started_at!r}")
        if not _is_real(expected_end_at) or math.isnan(expected_end_at):
            raise ValueError(
                f"expected_end_at of {sid!r} must be a number (not NaN), got {expected_end_at!r}"
            )
        if not _is_int(tokens) or tokens < 0:
            raise ValueError(f"tokens of {sid!r} must be an int >= 0, got {tokens!r}")
        remaining = expected_end_at - now
        if remaining > 0:
            keyed.append((0, -remaining, started_at, sid))
        else:
            keyed.append((1, remaining, started_at, sid))
    keyed.sort()
    return [sid for *_, sid in keyed]


def l3_horizon_s(tokens: int, config: PolicyConfig, read_tokens_per_s: float) -> float:
    """How long an offloaded session of ``tokens`` must be predicted to stay away for a copy in L3
    to pay: the time to write it to L3 and read it back, plus ``l3_store_margin_s`` (the
    prediction is a median; a call that returns early must not find its KV still on the way).
    Pure, like :func:`decide`: every TP rank computes the same horizon."""
    if not _is_int(tokens) or tokens < 0:
        raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
    if not _is_real(read_tokens_per_s) or not math.isfinite(read_tokens_per_s) or read_tokens_per_s <= 0:
        raise ValueError(f"read_tokens_per_s must be a finite number > 0, got {read_tokens_per_s!r}")
    return tokens / config.l3_write_tokens_per_s + tokens / read_tokens_per_s + config.l3_store_margin_s


def l3_store_early(remaining_s: float, tokens: int, config: PolicyConfig, read_tokens_per_s: float) -> bool:
    """Whether an offloaded session predicted back in ``remaining_s`` (agreed clock) goes to L3
    now rather than waiting for a full host to pick it as a victim: only when it stays away longer
    than :func:`l3_horizon_s`. A session due sooner keeps its protected host copy: storing it
    would free room for a moment and then cost an L3 read on the critical path of its next turn."""
    if not _is_real(remaining_s) or math.isnan(remaining_s):
        raise ValueError(f"remaining_s must be a number (not NaN), got {remaining_s!r}")
    return remaining_s > l3_horizon_s(tokens, config, read_tokens_per_s)
