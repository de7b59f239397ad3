"""The door between a worker's task threads and its engine: jobs go in together, or one alone.

A job whose worker was lost beside other jobs SOLO_AFTER_FORGIVEN times (tasks/jobs.py) runs
alone (worker/recovery.py says why): it waits until the jobs in the engine have ended, and no
job goes in beside it until it has ended. A job waiting for a solo one waits too (a solo job
waiting goes first), so a solo job is never starved by a stream of others.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Gate:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._inside = 0  # jobs in the engine
        self._solo_inside = False
        self._solo_waiting = 0

    def _open(self, solo: bool) -> bool:
        if self._solo_inside:
            return False
        return self._inside == 0 if solo else self._solo_waiting == 0

    def enter(self, solo: bool, wanted: Callable[[], bool], poll: float) -> bool:
        """Wait until the job may go in (True), asking `wanted()` every `poll` seconds of
        waiting whether it still should (False when not: cancelled, or taken elsewhere)."""
        with self._cv:
            self._solo_waiting += solo
        admitted = False
        try:
            while True:
                with self._cv:
                    if self._cv.wait_for(lambda: self._open(solo), poll):
                        self._solo_waiting -= solo
                        self._solo_inside = solo
                        self._inside += 1
                        admitted = True
                        return True
                if not wanted():
                    return False
        finally:
            if solo and not admitted:
                with self._cv:
                    self._solo_waiting -= 1
                    self._cv.notify_all()

    def leave(self, solo: bool) -> None:
        with self._cv:
            self._inside -= 1
            if solo:
                self._solo_inside = False
            self._cv.notify_all()

    def __repr__(self) -> str:
        return f"Gate(inside={self._inside}, solo_inside={self._solo_inside}, solo_waiting={self._solo_waiting})"
