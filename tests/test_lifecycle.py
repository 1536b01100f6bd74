"""die_with_parent: a child that asked dies when its parent is SIGKILLed; one that did not survives."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.server.supervised import alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    print(child.pid, flush=True)
    time.sleep(60)
""")
CHILD_ASKS = "from scratchlm.lifecycle import die_with_parent; import time; die_with_parent(); time.sleep(60)"
CHILD_IGNORES = "import time; time.sleep(60)"


def _orphan_after_parent_killed(child_code: str) -> tuple[int, bool]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, child_code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    time.sleep(1.0)  # let the child register its request
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and alive(child_pid):
        time.sleep(0.05)
    return child_pid, alive(child_pid)


def test_child_that_asked_dies_with_its_parent():
    pid, alive = _orphan_after_parent_killed(CHILD_ASKS)
    assert not alive


def test_control_child_that_did_not_ask_survives():
    pid, alive = _orphan_after_parent_killed(CHILD_IGNORES)
    try:
        assert alive  # the test above would pass without die_with_parent if this failed
    finally:
        os.kill(pid, signal.SIGKILL)


def test_parent_already_gone_exits_at_once():
    code = "from scratchlm.lifecycle import die_with_parent; die_with_parent(parent_pid=1); print('survived')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "survived" not in out.stdout
