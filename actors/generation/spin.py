"""SpinWait: a stage's event loop keeps polling for its next step a little while after
each step, instead of going to sleep at once, as onnxruntime's intra-op threads spin
before they sleep (``session.intra_op.allow_spinning``, on by default).

Why: at batch 1 a stage waits a whole step of the other stages' for its next one. On a
VM whose idle vCPU halts, the step after such a sleep runs cold: on the 2-core Intel VM
of bench/README.md a stage's step after a 2 ms sleep took 1.3-1.6x the same step back to
back, and 1.0-1.1x after a 2 ms spin (`bench/README.md`, 2026-12-07). A loop with a
ready callback polls its sockets without blocking, so the next step's frame is read the
moment it lands, on a core that never went idle.

How long: a spin that ends before the next step comes only burns the core (1 ms against
gaps of ~2 ms: 1.10x the time a token), so the window follows the gaps themselves: 1.5x
the median of the last few gaps between one step's end and the next one's start, at
most ``cap_s``; none when that median is over ``cap_s`` (steps that far apart, a spin
cannot bridge: a large model's, or a stage that is mostly idle). Before any gap is
known, the window is ``cap_s``. ``cap_s`` 0 turns it off: by default where the stage's
node has no core beyond its stages (`spin_cap_ms`). A stage spins only while it runs
one group alone (`SpinWait.done`).
"""

from __future__ import annotations

import asyncio
import collections
import time

#: how many recent gaps the window follows
GAPS_KEPT = 8
#: the window, against the median gap: a little over it, so that a gap a bit longer than
#: usual is still bridged
WINDOW_OVER_GAP = 1.5


#: a stage's spin cap by default, where its node has a core beyond its stages, and the most
#: ``stage_spin_ms`` may name
DEFAULT_SPIN_MS, MAX_SPIN_MS = 5.0, 100.0


def spin_cap_ms(given: float | None, cores: int, stages: int) -> float:
    """A stage's spin cap: ``given`` (``stage_spin_ms``), else `DEFAULT_SPIN_MS` where the
    stage's node has more ``cores`` than the ``stages`` on it, 0 where it has not (a
    spinning stage would hold a core the driver, the ingress or Ray's own processes need
    for each token: Serve's inter-token p50 at 1 stream on a 2-core VM,
    spinning against not: 0.90-1.33x, median 1.10x, over three paired runs of its two routes).

    >>> spin_cap_ms(None, 16, 2), spin_cap_ms(None, 2, 2), spin_cap_ms(0, 16, 2)
    (5.0, 0.0, 0)
    """
    if check_spin_ms(given) is None:
        return DEFAULT_SPIN_MS if cores > stages else 0.0
    return given


def check_spin_ms(given: float | None) -> float | None:
    """``stage_spin_ms`` as given, or ValueError naming what is wrong with it."""
    if given is not None and (isinstance(given, bool) or not isinstance(given, (int, float))
                              or not 0 <= given <= MAX_SPIN_MS):
        raise ValueError(f"stage_spin_ms must be a number of milliseconds from 0 (off) to "
                         f"{MAX_SPIN_MS:g}, or None (by the node's cores), got {given!r}")
    return given


class SpinWait:
    def __init__(self, cap_s: float):
        if not cap_s >= 0:
            raise ValueError(f"a spin cap must be >= 0 seconds, got {cap_s!r}")
        self.cap_s = float(cap_s)
        self.gaps: collections.deque[float] = collections.deque(maxlen=GAPS_KEPT)
        self.ended = 0.0  # when the last step ended (0: none yet)
        self.until = 0.0  # the current spin's end
        self.spinning = False
        self.spun_s = 0.0  # seconds spent polling (a stage's stats)
        self._started = 0.0

    def window(self) -> float:
        """How long to spin after a step, from the recent gaps.

        >>> s = SpinWait(0.005)
        >>> s.window()  # no gap known yet: the cap
        0.005
        >>> s.gaps.extend([0.002, 0.002, 0.0021]); round(s.window(), 6)
        0.003
        >>> s.gaps.extend([0.02] * 8); s.window()  # too far apart to bridge
        0.0
        """
        if self.cap_s <= 0:
            return 0.0
        if not self.gaps:
            return self.cap_s
        gap = sorted(self.gaps)[len(self.gaps) // 2]
        if gap > self.cap_s:
            return 0.0
        return min(self.cap_s, WINDOW_OVER_GAP * gap)

    def arrived(self, now: float | None = None) -> None:
        """A step begins: record the gap since the last one ended."""
        if self.cap_s <= 0:
            return
        now = time.perf_counter() if now is None else now
        if self.spinning:
            self.spun_s += max(min(now, self.until) - self._started, 0.0)
            self._started = self.until = now  # (the step's own time is not spinning)
        if self.ended:
            self.gaps.append(now - self.ended)
            self.ended = 0.0

    def done(self, alone: bool = True, now: float | None = None) -> None:
        """A step ended: keep the running loop polling for the window (no loop: nothing),
        when the stage runs one group alone; with others in flight its waits are the
        stages' imbalance, and its spin would slow the busier stage it shares the
        cores with (4 groups on a 2-core VM: 0.89-0.96x the tokens/s in four runs of
        five)."""
        if self.cap_s <= 0:
            return
        now = time.perf_counter() if now is None else now
        self.ended = now
        window = self.window() if alone else 0.0
        if window <= 0:
            return
        self.until, self._started = now + window, now
        if not self.spinning:  # (else its callback is still queued: it goes on)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self.spinning = True
            loop.call_soon(self._spin, loop)

    def _spin(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.perf_counter()
        if now < self.until:
            loop.call_soon(self._spin, loop)  # a ready callback: the loop polls, never blocks
        else:
            self.spun_s += max(self.until - self._started, 0.0)
            self.spinning = False
