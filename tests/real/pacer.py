"""Run as a script by `client.Pacer`: `python pacer.py ON_S OFF_S PID...` lets the
processes run ON_S (SIGCONT), then stops them (SIGSTOP) for OFF_S, in turn, until it is
sent SIGTERM; it then leaves them stopped and exits. If the test process that started it
dies, it continues them and exits.

It runs outside the test process, at real-time priority where it may: while a real vLLM
engine generates on this 2-core box, other processes at the same priority go unscheduled
for up to half a second (a 10 ms sleep overshot by 550 ms), so a pacer in the test
process let the model run for seconds instead of milliseconds (a 1500-token stream was
all made in one 2 ms "step" of 2.4 s).

Standard library only: it must start fast and not import the test suite.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def send_signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass  # killed meanwhile: the crash tests do that


def _raise_priority() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except OSError:
        try:
            os.nice(-20)
        except OSError:
            pass  # unprivileged: pace at the normal priority


def main(argv: list[str]) -> int:
    on_s, off_s = float(argv[0]), float(argv[1])
    pids = [int(pid) for pid in argv[2:]]
    parent = os.getppid()
    halted = False

    def halt(signum: int, frame: object) -> None:
        nonlocal halted
        halted = True

    signal.signal(signal.SIGTERM, halt)
    _raise_priority()
    while not halted:
        if os.getppid() != parent:  # orphaned: leave nothing stopped behind
            send_signal(pids, signal.SIGCONT)
            return 1
        send_signal(pids, signal.SIGCONT)
        time.sleep(on_s)  # a SIGTERM meanwhile ends the loop after this slice
        send_signal(pids, signal.SIGSTOP)
        if not halted:
            time.sleep(off_s)
    send_signal(pids, signal.SIGSTOP)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
