"""SpinWait (actors/generation/spin.py) on a real asyncio loop, without Ray: after a step
the loop keeps polling for the window the recent gaps give, a step that comes meanwhile
is read at once, and then the loop sleeps again."""

from __future__ import annotations

import asyncio
import socket

import pytest

from actors.generation.spin import SpinWait


def test_the_loop_polls_for_the_window_then_stops():
    async def main() -> SpinWait:
        spin = SpinWait(0.005)
        spin.gaps.extend([0.002] * 3)  # the window: 1.5x the median gap, 3 ms
        spin.done()
        assert spin.spinning
        await asyncio.sleep(0.02)
        return spin

    spin = asyncio.run(main())
    assert not spin.spinning
    assert spin.spun_s == pytest.approx(0.003)


def test_a_step_that_comes_while_spinning_is_read_at_once_and_its_gap_kept():
    async def main() -> tuple[SpinWait, list[float]]:
        loop = asyncio.get_running_loop()
        spin = SpinWait(0.05)
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        came: list[float] = []

        def readable() -> None:  # the next step's frame
            a.recv(16)
            spin.arrived()
            came.append(loop.time())
            spin.done()

        loop.add_reader(a, readable)
        spin.done()  # a step ended: no gap known yet, so the cap (50 ms)
        await asyncio.sleep(0.005)
        b.send(b"x")
        await asyncio.sleep(0.1)  # past the next window
        loop.remove_reader(a)
        a.close()
        b.close()
        return spin, came

    spin, came = asyncio.run(main())
    assert len(came) == 1
    assert len(spin.gaps) == 1 and 0.004 < spin.gaps[0] < 0.1
    assert not spin.spinning  # the second window ended too
    assert spin.spun_s > 0


def test_steps_too_far_apart_or_a_zero_cap_do_not_spin():
    async def main(spin: SpinWait) -> bool:
        spin.done()
        return spin.spinning

    far = SpinWait(0.005)
    far.gaps.extend([0.02] * 5)
    assert not asyncio.run(main(far))
    assert not asyncio.run(main(SpinWait(0.0)))
    with pytest.raises(ValueError, match="a spin cap must be >= 0 seconds"):
        SpinWait(-1)


def test_without_a_running_loop_a_step_end_starts_nothing():
    spin = SpinWait(0.005)
    spin.done()
    assert not spin.spinning and spin.ended > 0
