"""Fit the time profile's coefficients to measured points (least squares, standard library only,
so the GPU machine fits its own measurements with nothing installed).

Each model is linear in its coefficients, so ordinary least squares on the features below gives
them; a coefficient that comes out negative (noise on a term too small to see) is fixed at zero
and the others refitted, because a negative cost would let the twin run faster with more work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def lstsq_nonneg(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares ``min |X c - y|`` with ``c >= 0`` by dropping negative coefficients."""
    k = len(rows[0])
    active = list(range(k))
    while True:
        coef = _lstsq([[r[j] for j in active] for r in rows], ys)
        if all(c >= 0 for c in coef) or not active:
            out = [0.0] * k
            for j, c in zip(active, coef, strict=True):
                out[j] = max(0.0, c)
            return out
        worst = min(range(len(coef)), key=lambda i: coef[i])
        active.pop(worst)


def _lstsq(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Normal equations, Gaussian elimination with partial pivoting (k <= 3 here)."""
    k = len(rows[0]) if rows else 0
    if k == 0:
        return []
    # scale columns so that tokens (1e4) and token pairs (1e9) do not swamp the elimination
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    xs = [[r[j] / scale[j] for j in range(k)] for r in rows]
    a = [
        [sum(x[i] * x[j] for x in xs) for j in range(k)]
        + [sum(x[i] * y for x, y in zip(xs, ys, strict=True))]
        for i in range(k)
    ]
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-15:
            raise ValueError("the points do not determine the model (too few distinct sizes)")
        a[col], a[piv] = a[piv], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col], strict=True)]
    return [a[i][k] / a[i][i] / scale[i] for i in range(k)]


def fit(points: Sequence[Sequence[float]], features: Callable[[Sequence[float]], list[float]]) -> list[float]:
    """``points``: (inputs..., seconds); ``features`` maps the inputs to the model's terms."""
    if len(points) < 3:
        raise ValueError(f"need at least 3 points, got {len(points)}")
    return lstsq_nonneg([features(p[:-1]) for p in points], [float(p[-1]) for p in points])


def prefill_terms(x: Sequence[float]) -> list[float]:
    """(cached prefix p, new tokens n) -> [1, n, n * (p + n/2)] for (a, b, c)."""
    p, n = float(x[0]), float(x[1])
    return [1.0, n, n * (p + n / 2)]


def decode_terms(x: Sequence[float]) -> list[float]:
    """(batch B, summed context L) -> [1, B, L] for (d, e, f)."""
    return [1.0, float(x[0]), float(x[1])]


def copy_terms(x: Sequence[float]) -> list[float]:
    """(tokens) -> [1, tokens] for (fixed seconds, seconds per token)."""
    return [1.0, float(x[0])]


def residual(points: Sequence[Sequence[float]], features: Callable[[Sequence[float]], list[float]],
             coef: Sequence[float]) -> float:  # fmt: skip
    """The largest relative error of the fitted model over the points."""
    worst = 0.0
    for p in points:
        pred = sum(c * f for c, f in zip(coef, features(p[:-1]), strict=True))
        worst = max(worst, abs(pred - p[-1]) / max(abs(p[-1]), 1e-9))
    return worst
