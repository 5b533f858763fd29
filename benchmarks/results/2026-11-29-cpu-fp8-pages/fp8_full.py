"""fp8 flow pages at the codec's true shape (random weights), on the CPU: one stream of a 46-code prompt
pushed 5 codes at a time to N codes through CodecBatch with one flow slot, its pools float32 (exact), bf16
(as served) and float8; each call's mel and the PCM against float32's, and how many pool values saturated."""

import json
import sys
import time

import torch

from workflow.codec.batch import CodecBatch
from workflow.codec.timing import CodecTiming, stream_decoder
from workflow.detokenize import Piece

N = int(sys.argv[1]) if len(sys.argv) > 1 else 60
torch.set_num_threads(2)
t = CodecTiming(preset="full", prompt_codes=46, seed=0, baseline=False)
dec, voice = stream_decoder(t, torch.device("cpu"))
codes = torch.randint(0, 16384, (N,), generator=torch.Generator().manual_seed(3)).tolist()


def run(dtype: torch.dtype, fp8: bool) -> tuple[list[torch.Tensor], torch.Tensor, float]:
    d = stream_decoder(t, torch.device("cpu"))[0]
    d.flow.to(dtype)
    d.estimator.to(dtype)
    batch = CodecBatch(d, voice, slots=1, max_codes=N + 10, fp8_pages=fp8)
    mels, pcm, sat = [], [], 0.0
    start = time.time()
    for i in range(0, N, 5):
        last = i + 5 >= N
        work = batch.flows([Piece(7, torch.tensor(codes[i : i + 5]), i, last)])
        mels += [m.float() for m in work[0][1]]
        if fp8 and last and batch.slots is not None:
            pools = [x for step in batch.slots.kv for x in step.values()]
            sat = sum((x.float().abs() >= 448).sum().item() for x in pools) / sum((x.float() != 0).sum().item() for x in pools)
        pcm += batch.vocodes(work)
    print(f"{dtype} fp8={fp8}: {len(mels)} calls in {time.time() - start:.0f} s", flush=True)
    return mels, torch.cat(pcm), sat


exact, pcm0, _ = run(torch.float32, False)
out = {"codes": N, "prompt_codes": 46, "calls": len(exact)}
for name, dtype, fp8 in (("fp8 pages (float32 flow)", torch.float32, True), ("bf16 flow", torch.bfloat16, False), ("bf16 flow, fp8 pages", torch.bfloat16, True)):
    mels, pcm, sat = run(dtype, fp8)
    per = [((m - e).norm() / e.norm()).item() for m, e in zip(mels, exact, strict=True)]
    snr = (10 * torch.log10(pcm0.pow(2).sum() / (pcm - pcm0).pow(2).sum())).item()
    out[name] = {"mel_rel_rms_per_call": [round(x, 5) for x in per], "mel_rel_rms_max": max(per), "pcm_snr_db": snr, "saturated": sat}
    print(name, json.dumps({k: v for k, v in out[name].items() if k != "mel_rel_rms_per_call"}), [round(x, 4) for x in per], flush=True)
print(json.dumps(out))
