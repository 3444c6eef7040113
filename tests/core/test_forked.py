"""``forked.Forked``, the suite's fork-based child process, behaves as ``subprocess.Popen`` does for
what the tests read: output, exit codes, signals and tracebacks."""

import signal
import sys

import pytest

from forked import Forked


def _talk(code: int) -> None:
    print("out line")
    print("err line", file=sys.stderr)
    raise SystemExit(code)


def _raise() -> None:
    raise ValueError("boom")


def _wait_forever() -> None:
    print("ready", flush=True)
    signal.pause()


def test_output_and_exit_codes_come_back():
    child = Forked(_talk, 3)
    out, err = child.communicate(timeout=30)
    assert (out, err, child.returncode) == ("out line\n", "err line\n", 3)


def test_an_exception_exits_1_with_its_traceback():
    child = Forked(_raise)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 1 and "ValueError: boom" in err and out == ""


def test_a_killed_child_reports_the_signal_and_a_hung_one_times_out():
    child = Forked(_wait_forever)
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    hung = Forked(_wait_forever)
    with pytest.raises(TimeoutError):
        hung.wait(timeout=0.2)
    assert hung.wait() == -signal.SIGKILL
