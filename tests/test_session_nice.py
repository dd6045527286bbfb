"""`bench.service_procs.set_session_nice`: a child started in a session of its own gets the
niceness of that session (its scheduler autogroup), the one that orders it against other
sessions' work (docs/simulate.md §5.2)."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.service_procs import set_session_nice

pytestmark = pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="kernel without autogroups")


def test_a_new_session_takes_the_niceness_given():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        before = Path(f"/proc/{child.pid}/autogroup").read_text()
        if not before.strip():  # in no autogroup (a container's cgroup, or autogroups off)
            assert set_session_nice(child.pid, 7) is False
            assert Path(f"/proc/{child.pid}/autogroup").read_text() == before
            return
        # A group of its own. This process may itself be in none (CI's container reads empty
        # here while its new-session children still get one).
        mine = Path("/proc/self/autogroup").read_text().split()
        assert not mine or before.split()[0] != mine[0]
        assert set_session_nice(child.pid, 7) is True  # a positive niceness needs no privilege
        assert Path(f"/proc/{child.pid}/autogroup").read_text().split() == [before.split()[0], "nice", "7"]
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_changes_nothing():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert set_session_nice(child.pid, 7) is False
