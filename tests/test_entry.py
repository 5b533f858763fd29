"""A stage's entry point (`errors.run_main`) without the interpreter's teardown: the benchmark's,
whose GPU process can take minutes to tear down after every output is written."""

from __future__ import annotations

import subprocess
import sys

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
