"""The codec decoder's A/B with no engine, so a device call of its own on a fresh machine (~1 min an arm on an
H200 at the true shape, the first longer for its compiles): the benchmark's codec section (`timing.measure`)
of `benchmark.codec` as the configs give it (config/config.yaml, then each file named; the held call at
`load.detokenize_hold` chunks, as the benchmark times it), then with each arm's settings over it. An arm that
fails is recorded with its error and the next one runs. The eager baseline is left out. A line per call, variant
and batch as it is timed, then every arm's calls as JSON.
`gpu_pair.sh c` runs it.

    CODEC_ARMS='{"float32 HiFT": {"hift_dtype": "float32"}}' PYTHONPATH=. \\
        python benchmarks/probe_codec.py <out.json> config/full.yaml config/h200.yaml
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import yaml

from workflow.codec.settings import CodecTiming
from workflow.codec.timing import measure

ARMS: dict[str, dict] = {"as configured": {}} | json.loads(os.environ.get("CODEC_ARMS", "{}"))


def main() -> None:
    out = Path(sys.argv[1])
    codec: dict = {}
    held = 1
    for f in ["config/config.yaml", *sys.argv[2:]]:
        bench = yaml.safe_load(Path(f).read_text()).get("benchmark") or {}
        codec |= bench.get("codec") or {}
        held = (bench.get("load") or {}).get("detokenize_hold", held)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for name, over in ARMS.items():
        t0 = time.perf_counter()
        t = CodecTiming.from_dict(codec | {"baseline": False, "held": held} | over)
        try:
            calls = measure(t, device)["calls"]
        except Exception as e:  # one arm that cannot run must not cost the arms after it
            print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
            results[name] = {"settings": over, "error": f"{type(e).__name__}: {e}"}
            continue
        for c in calls:
            print(
                f"{name} | {c['variant']} | {c['call']} | batch {c['batch']} | front end {c['front_end_ms']:.2f} | "
                f"ODE step {c['ode_step_ms']:.2f} | solve {c['solve_ms']:.2f} | HiFT {c['hift_ms']:.2f} | "
                f"chunk {c['chunk_ms']:.2f} ms",
                flush=True,
            )
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        results[name] = {"settings": over, "calls": calls}
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
