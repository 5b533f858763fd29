"""Why the later lane's graphs fail on a green context at the true shape (`load.later_sms`: "cluster
misconfiguration" as the first later-lane solve's graph is instantiated, H200 at cbc4fea), with no engine: the
codec's lanes as `h200.yaml` makes them, the later lane confined to PROBE_SMS (default 64) SMs, then `warm` at
two streams. Each arm in a process of its own (a CUDA error may leave the context unusable):

- `capture`: as serving does it (the failure again);
- `eager`: the confined graphs' work run eagerly on the green stream instead, with CUDA_LAUNCH_BLOCKING=1, so an
  op whose launch the green context refuses fails where it is called (the traceback names it);
- `flags2`: the SMs split with CU_DEV_SM_RESOURCE_SPLIT_MAX_POTENTIAL_CLUSTER_SIZE;
- `sdpa`: scaled_dot_product_attention kept to the memory-efficient and math backends;
- `nopdl`: the slots' Triton kernels launched plainly, not as programmatic dependent launches;
- `nokernels`, `nocompile`: `benchmark.codec.kernels` or `compile` off (the tiny preset's CUDA test, which passes,
  has neither).

A line an arm: ok, or the error and the workflow frames it passed through.

    PYTHONPATH=. python benchmarks/probe_green.py config/full.yaml config/h200.yaml
"""

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import yaml
from probe_lanes import merged

ARMS = os.environ.get("PROBE_GREEN_ARMS", "capture,eager,nopdl,nokernels,nocompile,sdpa,flags2").split(",")
SMS = int(os.environ.get("PROBE_SMS", "64"))


def arm(name: str, configs: list[str]) -> None:
    from workflow import cudagraphs
    from workflow.benchmark import speech_of
    from workflow.serve import load

    cfg: dict = {}
    for f in ["config/config.yaml", *configs]:
        cfg = merged(cfg, yaml.safe_load(Path(f).read_text()))
    p = cfg["benchmark"]
    if name in ("nokernels", "nocompile"):
        p["codec"] = p["codec"] | {name.removeprefix("no"): False}
    if name == "nopdl":
        from workflow.codec import kernels

        kernels.dependent_launch = lambda x: False
    if name == "flags2":
        from cuda.bindings import driver

        split = driver.cuDevSmResourceSplitByCount
        driver.cuDevSmResourceSplitByCount = lambda n, whole, flags, sms: split(n, whole, 2, sms)
    if name == "eager":
        run = cudagraphs.Graphs.run

        def eager(self, key, fn):
            if self.confined is not None and self.confined(key):
                with torch.cuda.stream(self.green.stream):
                    return fn()
            return run(self, key, fn)

        cudagraphs.Graphs.run = eager
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke test, no green context
    t0 = time.perf_counter()
    _, _, serving, _, _ = speech_of(p, device, torch.bfloat16, None, load.LoadConfig.from_dict(p["load"]))
    lanes = serving()
    got = lanes.confine_later(SMS)
    print(f"{name}: lanes made in {time.perf_counter() - t0:.0f} s, the later lane on {got} SMs", flush=True)
    try:
        if name == "sdpa":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                calls = lanes.warm(2, p["chunk_tokens"], 40)
        else:
            calls = lanes.warm(2, p["chunk_tokens"], 40)
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"{name}: ok, {calls} batches warmed in {time.perf_counter() - t0:.0f} s", flush=True)
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in tb]
        ours = [f for f, t in zip(frames, tb, strict=True) if "/workflow/" in t.filename]
        print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
        print(f"{name}: through {' > '.join(ours)} | last {' > '.join(frames[-4:])}", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--arm"]:
        arm(sys.argv[2], sys.argv[3:])
        return
    for name in ARMS:
        env = os.environ | ({"CUDA_LAUNCH_BLOCKING": "1"} if name == "eager" else {})
        subprocess.run([sys.executable, __file__, "--arm", name, *sys.argv[1:]], env=env, check=False)


if __name__ == "__main__":
    main()
