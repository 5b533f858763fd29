"""One-line errors that name the file and the problem, and the entry point that prints them."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path


class InputError(Exception):
    """Bad input: printed as '<file>: <problem>' on one line, exit status 1."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {self.problem}")


def read_json(path: str | Path, missing: str = "file is missing"):
    """A JSON file's content, or an InputError naming the file: missing, or not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(path, missing) from None
    except json.JSONDecodeError as e:
        raise InputError(path, f"not valid JSON ({e.msg} at line {e.lineno})") from None


def run_main(main: Callable[[list[str] | None], None], argv: list[str] | None = None, teardown: bool = True) -> None:
    """Run a stage's main(); an InputError becomes one line on stderr instead of a traceback.

    teardown=False: once main() has returned, every output written, the process flushes its
    streams and ends at once (os._exit) instead of tearing the interpreter down. A GPU process's
    teardown (its CUDA graphs, pools and compiled kernels) can outlast the stage's time limit,
    and Snakemake deletes the outputs of a job it kills.

    A stage stopped by SIGTERM (a time limit: Snakemake's, the device tool's) first prints every
    thread's Python stack to stderr, the rule's log: where a stage that hung was waiting."""
    faulthandler.register(signal.SIGTERM, file=sys.__stderr__, all_threads=True, chain=True)  # fd 2, whatever replaced sys.stderr
    try:
        main(argv)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if not teardown:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
