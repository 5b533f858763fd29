"""A stage's entry point (`errors.run_main`): without the interpreter's teardown (the benchmark's,
a GPU process), and its Python stacks printed when a time limit stops it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT

STAGE = """
import atexit, sys
from workflow.errors import InputError, run_main
atexit.register(lambda: print(" teardown ran"))
def main(argv):
    print("report", end="")  # still in stdout's buffer when main returns
    if argv == ["bad"]:
        raise InputError("in.json", "not valid JSON")
run_main(main, sys.argv[2:], teardown=sys.argv[1] == "teardown")
"""


def stage(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", STAGE, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("teardown", [True, False])
def test_a_stage_without_teardown_flushes_what_it_printed_and_skips_the_rest(teardown: bool):
    r = stage("teardown" if teardown else "at once")
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("report teardown ran\n" if teardown else "report")


def test_bad_input_still_exits_1_with_its_line_without_teardown():
    r = stage("at once", "bad")
    assert r.returncode == 1
    assert r.stderr.strip() == "error: in.json: not valid JSON"


HANGS = """
import time
from workflow.errors import run_main
def wait_for_the_device(argv):
    print("started", flush=True)
    time.sleep(60)
run_main(wait_for_the_device)
"""


def test_a_stage_stopped_by_sigterm_prints_where_it_waited_and_still_dies_of_it():
    proc = subprocess.Popen([sys.executable, "-c", HANGS], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "started\n"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert "line 6 in wait_for_the_device" in err  # the sleep, where it waited
