"""One-line errors that name the file and the problem, and the entry point that prints them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


class InputError(Exception):
    """Bad input: printed as '<file>: <problem>' on one line, exit status 1."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {self.problem}")


def run_main(main: Callable[[list[str] | None], None], argv: list[str] | None = None) -> None:
    """Run a stage's main(); an InputError becomes one line on stderr instead of a traceback."""
    try:
        main(argv)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
