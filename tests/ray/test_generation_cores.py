"""TurnCore (actors/generation/cores.py) on a real thread, without Ray: the thread that
steps goes onto the turn core while its stage runs one group alone, and back home when it
runs several; a core the OS refuses turns it off."""

from __future__ import annotations

import os
import threading

import pytest

from actors.generation.cores import TurnCore

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity")


def _on_a_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_thread_alone_goes_onto_the_turn_core_and_home_with_several():
    home = sorted(os.sched_getaffinity(0))
    turns = TurnCore(home[-1], home)

    def steps():
        seen = []
        for alone in (True, True, False, False, True):
            turns.update(alone)
            seen.append(sorted(os.sched_getaffinity(0)))
        return seen

    seen = _on_a_thread(steps)
    assert seen == [[home[-1]], [home[-1]], home, home, [home[-1]]]
    assert turns.moves == 2  # moved twice, not once a step
    assert sorted(os.sched_getaffinity(0)) == home  # the caller's thread: never moved


def test_a_core_the_os_refuses_turns_it_off():
    home = sorted(os.sched_getaffinity(0))
    turns = TurnCore(4096, home)

    def step():
        turns.update(True)
        return sorted(os.sched_getaffinity(0))

    assert _on_a_thread(step) == home
    assert turns.core is None and turns.moves == 0


def test_no_turn_core_moves_nothing():
    turns = TurnCore()
    assert _on_a_thread(lambda: (turns.update(True), sorted(os.sched_getaffinity(0)))[1]) \
        == sorted(os.sched_getaffinity(0))
    assert turns.moves == 0
