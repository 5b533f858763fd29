"""Probe (ledger: probe 37): bf16's tensor-core GEMV body with the RMSNorm prologue at 8 rows, by how
many columns of x its norm's sum of squares reads a step (gemv.NORM_K; before: the weight tile's
BLOCK_K, 64 or 128): the fastest block of tuning's candidates for q/k/v (6144 x 4096) and gate_up with
its GLU (24576 x 4096), as tuning times them (20 calls from a CUDA graph, the weight out of L2).
In probe 36's tuning q/k/v took 41 us at 8 rows, ~2 x what FP8's weight-read rate would give.

    PYTHONPATH=. python benchmarks/probe_norm.py <out.json>
"""

import json
import sys
import time
from pathlib import Path

import torch

from workflow.engines import gemv, tuning
from workflow.engines.blocks import Fuse

USES = {"qkv 6144x4096 norm": (6144, Fuse.NORM), "gate_up 24576x4096 norm+glu": (24576, Fuse.NORM | Fuse.GLU)}


def main() -> None:
    out_path, t0 = Path(sys.argv[1]), time.perf_counter()
    out = {"device": torch.cuda.get_device_name(), "us": {}}
    for name, (n, fuse) in USES.items():
        w = (torch.randn(n, 4096, device="cuda") / 64).to(torch.bfloat16)
        copies = tuning.l2_copies(w)
        for norm_k in (128, 512, 1024):
            gemv.NORM_K = norm_k
            best = tuning.tune_use(w, fuse, 8, copies, 20, lambda: None)
            out["us"][f"{name}, NORM_K {norm_k}"] = [best.ms * 1e3, best.block.to_dict()]
            print(f"{name}, NORM_K {norm_k}: {best.ms * 1e3:.1f} us {best.block} ({time.perf_counter() - t0:.0f} s)", flush=True)
            out_path.write_text(json.dumps(out, indent=1))
        del copies, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
