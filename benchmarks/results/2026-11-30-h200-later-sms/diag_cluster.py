import sys, torch, torch.nn.functional as F
from cuda.bindings import driver
torch.cuda.init(); dev = driver.cuDeviceGet(0)[1]
whole = driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)[1]
def green(sms, flags):
    err, groups, n, rem = driver.cuDevSmResourceSplitByCount(1, whole, flags, sms)
    if int(err): return None, f"split err {err}"
    desc = driver.cuDevResourceGenerateDesc([groups[0]], 1)[1]
    ctx = driver.cuGreenCtxCreate(desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)[1]
    raw = driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0)[1]
    return (torch.cuda.ExternalStream(int(raw)), ctx), int(groups[0].sm.smCount)
b = torch.bfloat16
cases = {}
for m in (160, 320, 1280, 2560, 5120):
    for k, n in ((256, 1024), (1024, 256), (512, 256), (256, 768), (80, 256), (320, 256), (768, 256)):
        a, w = torch.randn(m, k, device="cuda", dtype=b), torch.randn(k, n, device="cuda", dtype=b)
        cases[f"mm {m}x{k}x{n}"] = (lambda a=a, w=w: a @ w)
x = torch.randn(16, 256, 160, device="cuda", dtype=b); cw = torch.randn(256, 256, 3, device="cuda", dtype=b)
cases["conv1d bf16"] = lambda: F.conv1d(x, cw, padding=1)
xf = torch.randn(64, 512, 1, 200, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
wf = torch.randn(256, 512, 1, 7, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
cases["conv2d fp16 cl"] = lambda: F.conv2d(xf, wf, padding=(0, 3))
for flags in (0,):
    for sms in (64, 32):
        s, got = green(sms, flags)
        print(f"flags {flags} sms {sms}: {got}", flush=True)
        if s is None: continue
        bad = []
        for name, fn in cases.items():
            try:
                side = torch.cuda.Stream()
                with torch.cuda.stream(side): fn()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s[0]): fn()
                g.replay(); torch.cuda.synchronize()
            except Exception as e:
                bad.append(name); print("  FAIL", name, str(e)[:300], flush=True); break
        print(f"  {len(bad)} of {len(cases)} failed", flush=True)
