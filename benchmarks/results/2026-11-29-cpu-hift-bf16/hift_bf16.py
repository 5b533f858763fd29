"""HiFT's network in bf16 (weights and activations; the F0 predictor, the NSF source, the STFT, exp/sin and
the iSTFT in float32) against float32, at the codec's true shape (random weights), on the CPU: the PCM of
one utterance's mel (a 46-code prompt's voice, 60 codes, the flow in float32)."""

import copy
import json
import sys
import time

import torch

import workflow.codec.hift as H
from workflow.codec.timing import CodecTiming, stream_decoder

N = int(sys.argv[1]) if len(sys.argv) > 1 else 60
torch.set_num_threads(2)
t = CodecTiming(preset="full", prompt_codes=46, seed=0, baseline=False)
dec, voice = stream_decoder(t, torch.device("cpu"))
codes = torch.randint(0, 16384, (N,), generator=torch.Generator().manual_seed(3))
start = time.time()
with torch.inference_mode():
    mel = dec.mel(codes, voice, streaming=True, finalize=True).float()
print(f"mel {tuple(mel.shape)} in {time.time() - start:.0f} s, mean {mel.mean():.2f} std {mel.std():.2f}", flush=True)
out = {"codes": N, "mel_frames": mel.shape[1]}
for fused in (False,):  # the fused channels-last pass does the same arithmetic (its Snakes in Triton: CUDA only here)
    dec.hift.fuse(fused)
    with torch.inference_mode():
        want = dec.vocode(mel)
    b = copy.deepcopy(dec)
    net = [m for n, m in b.hift.named_children() if n not in ("f0_predictor", "m_source")]
    for m in net:
        m.to(torch.bfloat16)
    orig = H.conv

    def conv_bf16(m, x, *, bias=True):
        y = orig(m, x.to(m.weight.dtype), bias=bias)
        return y.float() if m is b.hift.conv_post else y  # exp, sin and the iSTFT in float32

    H.conv = conv_bf16
    try:
        with torch.inference_mode():
            got = b.vocode(mel)
    finally:
        H.conv = orig
    err = got - want
    snr = (10 * torch.log10(want.pow(2).sum() / err.pow(2).sum())).item()
    name = "channels-last, fused" if fused else "[B, C, T]"
    out[name] = {"pcm_snr_db": snr, "max_abs_err": err.abs().max().item(), "peak": want.abs().max().item(), "rms": want.pow(2).mean().sqrt().item()}
    print(name, json.dumps(out[name]), flush=True)
print(json.dumps(out))
