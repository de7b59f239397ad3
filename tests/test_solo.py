"""worker/solo.py's gate, with threads and no engine: a solo job goes in only once the engine is
empty, nothing goes in beside it, jobs arriving while it waits wait behind it, and a waiting
job that is no longer wanted leaves without going in."""

from __future__ import annotations

import threading

from worker.solo import Gate


def _enter_in_thread(gate: Gate, solo: bool, log: list, name: str, wanted=lambda: True) -> threading.Thread:
    def run():
        log.append((name, gate.enter(solo, wanted, 0.01)))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_solo_job_runs_alone_and_goes_before_later_ones():
    gate, log = Gate(), []
    assert gate.enter(False, lambda: True, 0.01) and gate.enter(False, lambda: True, 0.01)
    solo = _enter_in_thread(gate, True, log, "solo")
    solo.join(0.2)
    assert solo.is_alive() and log == []  # two jobs still in the engine
    later = _enter_in_thread(gate, False, log, "later")
    later.join(0.2)
    assert later.is_alive()  # behind the waiting solo job
    gate.leave(False)
    solo.join(0.2)
    assert solo.is_alive()  # one job still in
    gate.leave(False)
    solo.join(2)
    assert log == [("solo", True)]
    later.join(0.2)
    assert later.is_alive()  # nothing beside a solo job
    gate.leave(True)
    later.join(2)
    assert log == [("solo", True), ("later", True)]


def test_a_waiting_job_no_longer_wanted_leaves_and_unblocks_the_others():
    gate, log = Gate(), []
    assert gate.enter(False, lambda: True, 0.01)
    wanted = threading.Event()
    wanted.set()
    solo = _enter_in_thread(gate, True, log, "solo", wanted.is_set)
    later = _enter_in_thread(gate, False, log, "later")
    later.join(0.2)
    assert later.is_alive()
    wanted.clear()  # the solo job was cancelled while it waited
    solo.join(2)
    later.join(2)
    assert sorted(log) == [("later", True), ("solo", False)]
