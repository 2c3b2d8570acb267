"""The time model of the twin: what a forward pass and a host<->device copy cost, and nothing else.

Everything the cache does is real; the GPU is not. A prefill batch costs
``a + sum_r(b * n_r + c * n_r * (p_r + n_r / 2))`` seconds, where request ``r`` computes ``n_r`` new
tokens on top of a cached prefix of ``p_r``: the linear term is the weight traffic and the MLP, the
second the attention of each new token over the tokens before it (``p_r + n_r / 2`` on average). A
decode step of a batch of ``B`` requests with contexts ``L_i`` costs ``d + e * B + f * sum(L_i)``. A
copy of ``t`` tokens costs ``copy_fixed_s + t * kv_bytes_per_token / rate`` on its direction's copy
engine. Loaded from JSON (``toolkv twin --profile FILE``); :func:`default_profile` until a GPU
calibration (``scripts/gpu_calibrate.sh``) replaces it.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from toolkv.errors import InputError


@dataclass(frozen=True)
class TimeProfile:
    """Seconds per forward and per copy (Llama-3.1-8B shape on one H200 by default)."""

    prefill_a: float  # s per prefill batch (launch, sampling, scheduler)
    prefill_b: float  # s per new token
    prefill_c: float  # s per new token per token attended
    decode_d: float  # s per decode step
    decode_e: float  # s per request in the step
    decode_f: float  # s per context token read in the step
    h2d_gbps: float  # host->device copy engine, GB/s (1e9 bytes)
    d2h_gbps: float  # device->host copy engine, GB/s
    kv_bytes_per_token: int  # bytes of KV per token (all layers, K and V)
    copy_fixed_s: float = 0.0  # per copy operation
    source: str = ""  # where the numbers come from

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and v < 0:
                raise ValueError(f"{f.name} must be >= 0, got {v}")
        if self.h2d_gbps <= 0 or self.d2h_gbps <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("copy rates and kv_bytes_per_token must be positive")

    def prefill_s(self, chunks: list[tuple[int, int]]) -> float:
        """One prefill batch; ``chunks`` holds (cached prefix, new tokens) per request."""
        return self.prefill_a + sum(self.prefill_b * n + self.prefill_c * n * (p + n / 2) for p, n in chunks)

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` requests whose contexts sum to ``context_tokens``."""
        return self.decode_d + self.decode_e * batch + self.decode_f * context_tokens

    def copy_s(self, tokens: float, direction: str) -> float:
        """One copy of ``tokens`` tokens; ``direction`` is ``h2d`` or ``d2h``."""
        rate = self.h2d_gbps if direction == "h2d" else self.d2h_gbps
        return self.copy_fixed_s + tokens * self.kv_bytes_per_token / (rate * 1e9)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TimeProfile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown profile fields {unknown}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> TimeProfile:
        """The profile in ``path`` (a profile object, or a calibration's JSON with one under
        ``"profile"``). Anything else is an :class:`InputError` naming the file and what is wrong
        with it, which ``toolkv`` prints as one line: a missing or unreadable file, text that is
        not JSON, missing or unknown fields, values that are not numbers or are out of range."""
        where = f"profile {str(path)!r}"
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise InputError(f"{where}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise InputError(f"{where}: not a text file (expected a JSON time profile)") from None
        try:
            data = json.loads(text)
        except ValueError as e:
            raise InputError(f"{where}: not JSON ({e})") from None
        if isinstance(data, dict) and isinstance(data.get("profile"), dict):
            data = data["profile"]
        if not isinstance(data, dict):
            raise InputError(f"{where}: expected a JSON object of profile fields, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise InputError(f"{where}: unknown field(s) {unknown}")
        missing = sorted(cls._required() - set(data))
        if missing:
            raise InputError(f"{where}: missing field(s) {missing}")
        for name, v in data.items():
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if name != "source" and not (number and math.isfinite(v)):
                raise InputError(f"{where}: {name} must be a finite number, got {v!r}")
        try:
            return cls.from_json(data)
        except (TypeError, ValueError) as e:
            raise InputError(f"{where}: {e}") from None

    @classmethod
    def _required(cls) -> frozenset[str]:
        """The fields without a default: a profile file must give every one of them."""
        return frozenset(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)


def profile_file(text: str) -> str:
    """``--profile``'s argparse type: the path, once :meth:`TimeProfile.load` has read it, so that a
    missing or malformed profile is a usage error before the twin builds anything."""
    try:
        TimeProfile.load(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def default_profile() -> TimeProfile:
    """Llama-3.1-8B shape (128 KiB of KV per token) on one H200, triton attention, no CUDA graph,
    the agent benchmark's constrained server: the constants ``scripts/gpu_calibrate.sh`` fitted on
    the H200 (``docs/results/calibration/profile.json``, raw points beside it). Worst relative fit
    error: prefill 46 %, decode 14 %, copies 44 % (d2h) and 21 % (h2d); the decode step came out
    flat in batch and context at the measured sizes. :func:`measured_profile` is the profile this
    one replaced, built from earlier single measurements."""
    return TimeProfile(
        prefill_a=0.056933968458401985,
        prefill_b=1.1905620538506871e-05,
        prefill_c=4.104885501477043e-09,
        decode_d=0.03206567199999455,
        decode_e=0.0,
        decode_f=0.0,
        h2d_gbps=52.92268655335052,
        d2h_gbps=48.0,
        kv_bytes_per_token=131072,
        copy_fixed_s=0.009349821850569342,
        source="calibrated on one H200 (scripts/gpu_calibrate.sh; docs/results/calibration/profile.json)",
    )


def measured_profile() -> TimeProfile:
    """Llama-3.1-8B shape (128 KiB of KV per token) on one H200, from measured numbers only:

    - prefill: torch eager over 32 such layers took 21.6 ms for 1,024 tokens and 447 ms for 16,384
      (bandwidth term 20.7 us/token, attention 0.81 ns per token pair); the live server (triton,
      no CUDA graph) answered an idle 1,024-token prefill in 45 ms and an 8,192-token one in 323 ms,
      which scales that shape by 1.59 and adds 10.6 ms per batch;
    - decode: 4 streams decoded 186 tokens/s (21.5 ms a step) on the same server; in the agent
      benchmark's constrained ``stock-large`` run a turn's tokens after the first came every
      22.2 ms (median, prefill pauses included) with 6.4 requests running over ~100K context
      tokens, which leaves ~10 ns per context token (the KV read at well above 10 TB/s would be
      less; the rest is per-step launch cost of a server without CUDA graphs);
    - copies: sglang's kernel io backend moved 1 GiB at 50.9 GB/s host->device and 52.5 GB/s
      device->host; toolkv's restore and offload of 8,192 tokens reached 48.7 and 48.0 GB/s.

    A GPU calibration run (``scripts/gpu_calibrate.sh``) replaces every coefficient.
    """
    return TimeProfile(
        prefill_a=0.0106,
        prefill_b=32.97e-6,
        prefill_c=1.285e-9,
        decode_d=0.0195,
        decode_e=0.0002,
        decode_f=1.0e-8,
        h2d_gbps=48.7,
        d2h_gbps=48.0,
        kv_bytes_per_token=131_072,
        copy_fixed_s=0.0,
        source="default: gpu-facts and the agent benchmark's probe (no calibration run)",
    )
