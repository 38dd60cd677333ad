"""The slow marker follows from the code (``tests/conftest.py``): a test that starts a process, itself or
through a function or fixture of tests/ it uses, is found, one that does not is not; and in a test without
the marker every way to start a process fails. The samples are reached through ``SAMPLES`` (a dict, which
the hook does not follow), and the ways to start a process come in as parameters, so that the hook finds
no process in these tests themselves."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from types import SimpleNamespace

import pytest

from tests.conftest import starts_processes


def _starts() -> None:
    subprocess.run(["true"], check=True)


def _pure() -> int:
    return 2


def _through_a_helper() -> None:
    _starts()


def _alone() -> int:
    return _pure()


SAMPLES = {"helper": _through_a_helper, "alone": _alone, "starts": _starts, "pure": _pure}


def item(test: str, **fixtures: str) -> SimpleNamespace:
    """What the hook reads of a collected test: its function, its fixtures' names and functions."""
    defs = {name: [SimpleNamespace(func=SAMPLES[sample])] for name, sample in fixtures.items()}
    return SimpleNamespace(obj=SAMPLES[test], fixturenames=list(fixtures),
                           _fixtureinfo=SimpleNamespace(name2fixturedefs=defs))


def test_a_test_that_starts_a_process_is_found_through_its_helpers_and_fixtures():
    assert starts_processes(item("helper")) == "subprocess"
    assert starts_processes(item("alone")) is None
    assert starts_processes(item("alone", server="starts")) == "subprocess"
    assert starts_processes(item("alone", launch_run="pure")) == "launch_run"


@pytest.mark.parametrize("start", [
    lambda: subprocess.run(["true"], check=True),
    lambda: multiprocessing.Process(target=print).start(),
    lambda: os.fork(),
], ids=["subprocess", "multiprocessing", "fork"])
def test_a_quick_test_cannot_start_a_process(request, start):
    assert request.node.get_closest_marker("slow") is None
    with pytest.raises(AssertionError, match="starts a process"):
        start()
