"""What a user sees of long phases: a moving clock in a terminal, few lines in a log file, and
a busy-machine warning only while other jobs really run."""

from __future__ import annotations

import io
import time

from drafttrain import distributed
from drafttrain.progress import heartbeat


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _redraws(stream: io.StringIO, monkeypatch) -> int:
    monkeypatch.setattr("sys.stderr", stream)
    with heartbeat("phase", every=0.02):
        time.sleep(0.5)
    return stream.getvalue().count("drafttrain: phase [")


def test_heartbeat_redraws_a_terminal_but_not_a_log_file(monkeypatch, capsys):
    assert _redraws(_Tty(), monkeypatch) >= 5  # the clock moves on a terminal
    assert _redraws(io.StringIO(), monkeypatch) <= 2  # a log keeps each redraw: none within 30 s
    assert capsys.readouterr().out.count("drafttrain: phase took ") == 2  # one closing line per phase


def test_busy_warning_needs_a_running_job_not_just_a_high_load_average(monkeypatch):
    monkeypatch.setattr(distributed.os, "getloadavg", lambda: (1.8, 1.0, 0.5))
    monkeypatch.setattr(distributed.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(distributed, "_others_running", lambda: 0)  # the job behind the load has ended
    assert distributed.busy_cores_warning(2) == ""
    monkeypatch.setattr(distributed, "_others_running", lambda: 1)
    warning = distributed.busy_cores_warning(2)
    assert "load average 1.8 on 2 cores" in warning and "threads=1" in warning
    assert distributed.busy_cores_warning(1) == ""
