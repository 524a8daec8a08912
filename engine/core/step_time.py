"""How long a step takes, learned online from the steps the engine ran.

A step's time is modelled as `a + b * tokens + c * context`, where `tokens` are the tokens it
computes and `context` the tokens its sequences attend to (in thousands). The coefficients are a
least-squares fit over recent steps, older ones weighted down by `decay` per step, so the model
follows the machine (a model, a device, a neighbour's load) without a profiling pass. Pure
Python: the scheduler uses it to keep running requests within their TBT SLO.
"""

from __future__ import annotations

from dataclasses import dataclass

FEATURES = 3
# Steps between refits once the model is warm: one step moves the decayed fit by about 1 - decay,
# and the fit (pure Python) costs more than a small batch's whole scheduling.
REFIT_EVERY = 8


@dataclass(frozen=True)
class StepShape:
    tokens: int  # tokens computed in the step
    context: int  # tokens attended to, summed over its sequences

    def features(self) -> tuple[float, float, float]:
        return (1.0, float(self.tokens), self.context / 1000.0)


class StepTimeModel:
    def __init__(self, decay: float = 0.98, min_samples: int = 8, ridge: float = 1e-6) -> None:
        self.decay = decay
        self.min_samples = min_samples
        self.ridge = ridge
        self.samples = 0
        self._xtx = [[0.0] * FEATURES for _ in range(FEATURES)]
        self._xty = [0.0] * FEATURES
        self._coef: list[float] | None = None
        # Once ready: the sums of |predicted - measured| and of measured step seconds (how far the
        # guard's view of the machine is off, for the benchmarks' reports).
        self.abs_error_s = 0.0
        self.observed_s = 0.0

    @property
    def ready(self) -> bool:
        """Enough steps seen to trust a prediction."""
        return self.samples >= self.min_samples

    def observe(self, shape: StepShape, seconds: float) -> None:
        if self.ready:
            self.abs_error_s += abs(self.predict(shape) - seconds)
            self.observed_s += seconds
        x = shape.features()
        for i in range(FEATURES):
            self._xty[i] = self.decay * self._xty[i] + x[i] * seconds
            row = self._xtx[i]
            for j in range(FEATURES):
                row[j] = self.decay * row[j] + x[i] * x[j]
        self.samples += 1
        if self.samples <= 2 * self.min_samples or self.samples % REFIT_EVERY == 0:
            self._coef = None  # refit at the next prediction

    def coefficients(self) -> list[float]:
        """(seconds per step, per token, per thousand context tokens), none negative."""
        if self._coef is None:
            self._coef = _nonnegative_least_squares(self._xtx, self._xty, self.ridge)
        return self._coef

    @property
    def relative_error(self) -> float:
        """Mean |predicted - measured| over the measured step time, since the model was ready."""
        return self.abs_error_s / self.observed_s if self.observed_s > 0 else 0.0

    def predict(self, shape: StepShape) -> float:
        return self.time_for(shape.tokens, shape.context)

    def time_for(self, tokens: int, context: int) -> float:
        """predict(StepShape(tokens, context)), without building one (the guard asks often)."""
        base, per_token, per_context = self.coefficients()
        return base + per_token * tokens + per_context * (context / 1000.0)

    def tokens_within(self, seconds: float, context: int) -> int:
        """How many tokens a step attending to `context` tokens can compute in `seconds`."""
        base, per_token, per_context = self.coefficients()
        spare = seconds - base - per_context * context / 1000.0
        if per_token <= 0:
            return 1 << 30 if spare > 0 else 0
        return max(0, int(min(spare / per_token, 1 << 30)))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _nonnegative_least_squares(xtx: list[list[float]], xty: list[float], ridge: float) -> list[float]:
    """Least squares over the normal equations, refitted without any coefficient that comes out
    negative (a step never gets faster with more work)."""
    active = list(range(FEATURES))
    while active:
        a = [[xtx[i][j] + (ridge if i == j else 0.0) for j in active] for i in active]
        sol = _solve(a, [xty[i] for i in active])
        if sol is None:
            break
        if all(v >= 0 for v in sol):
            coef = [0.0] * FEATURES
            for i, v in zip(active, sol, strict=True):
                coef[i] = v
            return coef
        worst = min(range(len(active)), key=lambda k: sol[k])
        del active[worst]
    return [0.0] * FEATURES
