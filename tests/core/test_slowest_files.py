"""The suite's own report of its slowest files (``tests/slowest.py``, printed by ``tests/conftest.py``)."""

from types import SimpleNamespace

from slowest import slowest_files


def test_slowest_files_sum_every_phase_per_file_most_first():
    reports = [
        SimpleNamespace(nodeid="tests/a.py::t1", when="setup", duration=1.0),
        SimpleNamespace(nodeid="tests/a.py::t1", when="call", duration=2.0),
        SimpleNamespace(nodeid="tests/b.py::t[x]", when="call", duration=4.0),
        SimpleNamespace(nodeid="tests/c.py::t", when="call", duration=0.5),
    ]
    assert slowest_files(reports) == [("tests/b.py", 4.0), ("tests/a.py", 3.0), ("tests/c.py", 0.5)]
    assert slowest_files(reports, count=1) == [("tests/b.py", 4.0)]
