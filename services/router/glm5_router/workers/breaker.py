"""A circuit breaker per worker: closed -> open -> half-open -> closed, as Envoy's outlier detection does it.

Opens (ejects the worker) on an error rate over a sliding window (with a minimum number of calls). The soft
signals (KV fragmentation, attention-entropy drift, per-token latency jitter, and for a worker that speculates
its acceptance against its own baseline: AcceptanceWatch) lower the worker's weight in picking while one is over
its threshold; one that stays over for a sustained time may eject it too. Either
ejection happens only when the pool allows it (`may_eject`: Envoy's max_ejection_percent; never the last
worker): a pool with no routable worker serves nobody, so a struggling worker is better than none. After the
open period it goes half-open and admits a capped share of traffic as probes; enough successes close it, a
failure reopens it with a doubled open period (up to a maximum).
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable

from glm5.v1 import worker_pb2

from glm5_router.config import BreakerConfig


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


SIGNALS = ("kv_fragmentation", "attention_entropy_drift", "token_latency_jitter_ms", "spec_acceptance")
BASELINE_WINDOWS = 3  # windows that only build a worker's acceptance baseline
BASELINE_WEIGHT = 0.2  # each later healthy window's weight in it


class AcceptanceWatch:
    """Speculative decoding's acceptance rate as a soft signal. The drafts of a healthy replica are accepted at a
    rate set by its model and its traffic; numerics that went wrong (a bad weight sync, a broken kernel, a
    corrupted KV block) change what the target predicts, and the drafts stop matching, so the rate falls
    (Z.ai's post-mortem: accepted length < 1.4); a rate near 1 is as suspicious (> 0.96: the target degenerated
    to what the draft predicts, e.g. repeating). The worker's counters (WorkerStats.speculative) are cumulative:
    their increase is summed into windows of `spec_window_tokens` draft tokens, and each full window's rate is
    judged against the baseline of the worker's own earlier healthy windows (an exponential average), so a
    model or a workload with a low rate is not flagged for being itself."""

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self._reset()

    def _reset(self) -> None:
        self.baseline: float | None = None
        self.windows = 0  # full windows seen since the counters started (or restarted)
        self.rate: float | None = None  # the last full window's acceptance rate
        self.anomalous = False  # the last full window's verdict
        self._last: tuple[int, int] | None = None  # cumulative (draft tokens, accepted) at the last sample
        self._drafted = 0
        self._accepted = 0

    def update(self, stats: worker_pb2.WorkerStats) -> bool | None:
        """The verdict of a window this sample completed (True: anomalous), None while a window fills."""
        if not stats.HasField("speculative"):
            return None
        spec = stats.speculative
        now = (spec.draft_tokens_total, spec.accepted_tokens_total)
        last, self._last = self._last, now
        if last is None or now[0] < last[0] or now[1] < last[1]:  # first sample, or the worker restarted
            self._reset()
            self._last = now
            return None
        self._drafted += now[0] - last[0]
        self._accepted += now[1] - last[1]
        if self._drafted < self.config.spec_window_tokens:
            return None
        rate = self._accepted / self._drafted
        self._drafted = self._accepted = 0
        self.windows += 1
        c = self.config
        low = (
            self.baseline is not None
            and self.windows > BASELINE_WINDOWS
            and rate < c.spec_acceptance_drop * self.baseline
        )
        self.rate, self.anomalous = rate, low or rate > c.spec_acceptance_max
        if not self.anomalous:  # a sick window never drags the baseline toward itself
            b = self.baseline
            self.baseline = rate if b is None else b + (BASELINE_WEIGHT if self.windows > BASELINE_WINDOWS else
                                                        1 / self.windows) * (rate - b)  # fmt: skip
        return self.anomalous


class CircuitBreaker:
    def __init__(
        self,
        config: BreakerConfig,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Callable[[State, str], None] | None = None,
        may_eject: Callable[[], bool] = lambda: True,
    ) -> None:
        self.config = config
        self.clock = clock
        self.on_transition = on_transition
        self.may_eject = may_eject  # the pool's say: enough other workers would stay routable
        self.degraded: dict[str, float] = {}  # soft signals over their threshold now -> value
        self.ejections_withheld = 0
        self.state = State.CLOSED
        self.reason = ""
        self.transitions = 0
        self._calls: collections.deque[tuple[float, bool]] = collections.deque()
        self._failures = 0  # failed calls in _calls (kept up to date: no scan per call)
        self._over_since: dict[str, float] = {}
        self._open_until = 0.0
        self._open_s = config.open_s
        self._probe_credit = 0.0
        self._probe_successes = 0
        self._probes_in_flight = 0
        self.acceptance = AcceptanceWatch(config)

    # -- admission ------------------------------------------------------------------------------------

    def current(self) -> State:
        """The state now: an open breaker whose open period is over is half-open."""
        if self.state is State.OPEN and self.clock() >= self._open_until:
            self._to(State.HALF_OPEN, "open period over: probing")
        return self.state

    def allow(self) -> bool:
        """Whether a new request may go to this worker now (a half-open breaker admits a share as probes)."""
        self.current()
        if self.state is State.CLOSED:
            return True
        if self.state is State.OPEN:
            return False
        self._probe_credit += self.config.half_open_share
        if self._probe_credit >= 1.0 or self._probes_in_flight == 0:
            self._probe_credit = max(0.0, self._probe_credit - 1.0)
            self._probes_in_flight += 1
            return True
        return False

    # -- outcomes -------------------------------------------------------------------------------------

    def record(self, ok: bool) -> None:
        now = self.clock()
        if self.state is State.HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)
            if not ok:
                self._open_s = min(self._open_s * 2 or self.config.open_s, self.config.max_open_s)
                self._open(now, "a probe failed")
                return
            self._probe_successes += 1
            if self._probe_successes >= self.config.half_open_successes:
                self._open_s = self.config.open_s
                self._to(State.CLOSED, f"{self._probe_successes} probes succeeded")
            return
        self._calls.append((now, ok))
        self._failures += not ok
        self._trim(now)
        if self.state is State.CLOSED and len(self._calls) >= self.config.min_calls:
            failed = self._failures
            if failed / len(self._calls) >= self.config.error_rate:
                self._eject(now, f"{failed}/{len(self._calls)} calls failed in {self.config.window_s:g}s")

    def forget(self) -> None:
        """An admitted request ended without an outcome (cancelled by its client)."""
        if self.state is State.HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)

    def observe(self, stats: worker_pb2.WorkerStats) -> None:
        """A worker stats sample: a signal over its threshold lowers the worker's weight at once, and after
        `sustained_s` ejects it if the pool can spare it."""
        now = self.clock()
        limits = {
            "kv_fragmentation": self.config.kv_fragmentation,
            "attention_entropy_drift": self.config.entropy_drift,
            "token_latency_jitter_ms": self.config.token_jitter_ms,
        }
        verdicts = {name: (float(getattr(stats, name)), f"> {limit:g}") for name, limit in limits.items()
                    if float(getattr(stats, name)) > limit}  # fmt: skip
        for name in limits:
            if name not in verdicts:
                self._clear(name)
        watch = self.acceptance
        watch.update(stats)
        if stats.HasField("speculative") and watch.anomalous and watch.rate is not None:
            # over until a full window says otherwise (a restart's reset clears it)
            c = self.config
            band = (
                f"not in {c.spec_acceptance_drop:g} x baseline {watch.baseline or 0:.3g} .. {c.spec_acceptance_max:g}"
            )
            verdicts["spec_acceptance"] = (watch.rate, band)
        else:
            self._clear("spec_acceptance")
        for name, (value, limit_text) in verdicts.items():
            self.degraded[name] = value
            since = self._over_since.setdefault(name, now)
            if self.state is State.CLOSED and now - since >= self.config.sustained_s:
                self._eject(now, f"{name} {value:.3g} {limit_text} for {now - since:.0f}s")

    def _clear(self, name: str) -> None:
        self._over_since.pop(name, None)
        self.degraded.pop(name, None)

    @property
    def weight(self) -> float:
        """Share of the traffic a healthy worker would get that this one should: halved per soft signal over its
        threshold (the picker divides a worker's load by it)."""
        return 0.5 ** len(self.degraded)

    # -- internals ------------------------------------------------------------------------------------

    def _trim(self, now: float) -> None:
        while self._calls and now - self._calls[0][0] > self.config.window_s:
            self._failures -= not self._calls.popleft()[1]

    def _eject(self, now: float, reason: str) -> None:
        if not self.may_eject():
            self.reason = f"kept in rotation (the pool cannot spare it): {reason}"  # shown on /health
            self.ejections_withheld += 1
            self._calls.clear()
            self._failures = 0
            self._over_since.clear()
            return
        self._open(now, reason)

    def _open(self, now: float, reason: str) -> None:
        self._open_until = now + self._open_s
        self._calls.clear()
        self._failures = 0
        self._over_since.clear()
        self._to(State.OPEN, reason)

    def _to(self, state: State, reason: str) -> None:
        self.state = state
        self.reason = reason
        self.transitions += 1
        if self.on_transition is not None:
            self.on_transition(state, reason)
        self._probe_successes = 0
        self._probes_in_flight = 0
        self._probe_credit = 0.0
