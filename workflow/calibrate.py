"""calibrate: the checkpoint build will use, at the configured precision.

bf16: the converted checkpoint, passed through unchanged (hard links).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from workflow import artifacts, trtckpt
from workflow.errors import InputError, run_main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, required=True, help="convert's bf16 checkpoint")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--precision", required=True)
    args = ap.parse_args(argv)
    if args.precision != "bf16":
        raise InputError("config: engine.precision", f"precision {args.precision} is not supported")
    trtckpt.read_config(args.ckpt)
    with artifacts.atomic_dir(args.out) as tmp:
        (tmp / "checkpoint").mkdir()
        for name in (trtckpt.CONFIG, trtckpt.WEIGHTS, artifacts.MANIFEST):
            artifacts.link_or_copy(args.ckpt / name, tmp / "checkpoint" / name)
    print(f"bf16: passed {args.ckpt} through to {args.out}")


if __name__ == "__main__":
    run_main(main)
