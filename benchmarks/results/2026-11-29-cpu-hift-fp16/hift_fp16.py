"""HiFT's network with TF32 inputs (emulated: as CUDA serves it), with fp16 convolution inputs, weights and
outputs (float32 accumulation; the Snakes, bias adds and residual sums in float32), and wholly in fp16,
each against float32, at the codec's true shape (random weights), on the CPU: the PCM of one utterance's
mel (a 46-code prompt's voice, 60 codes, the flow in float32)."""

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
with torch.inference_mode():
    mel = dec.mel(codes, voice, streaming=True, finalize=True).float()
    dec.hift.fuse(False)  # the [B, C, T] pass; channels-last does the same arithmetic
    want = dec.vocode(mel)
orig = H.conv
out = {"codes": N, "mel_frames": mel.shape[1]}


def tf32(x):
    """Round float32 to TF32's 10 mantissa bits."""
    return ((x.contiguous().view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


def with_weights(m, w, b=None):
    mm = copy.copy(m)
    mm.weight = torch.nn.Parameter(w, requires_grad=False)
    if b is not None:
        mm.bias = torch.nn.Parameter(b, requires_grad=False)
    return mm


def conv_tf32(hift, m, x, bias):
    return orig(with_weights(m, tf32(m.weight.detach())), tf32(x), bias=bias)


def conv_fp16_io(hift, m, x, bias):
    if any(m is c for c in hift.f0_predictor.modules()):
        return orig(m, x, bias=bias)
    r = lambda v: v.detach().half().float()  # noqa: E731
    y = orig(with_weights(m, r(m.weight), None if m.bias is None else r(m.bias)), r(x), bias=bias)
    return y if m is hift.conv_post else r(y)  # exp, sin and the iSTFT in float32


def conv_half(hift, m, x, bias):
    y = orig(m, x.to(m.weight.dtype), bias=bias)
    return y.float() if m is hift.conv_post else y


def to_half(hift):
    for n, m in hift.named_children():
        if n not in ("f0_predictor", "m_source"):
            m.to(torch.float16)


def run(name, conv, prep=None):
    b = copy.deepcopy(dec)
    if prep:
        prep(b.hift)
    H.conv = lambda m, x, *, bias=True: conv(b.hift, m, x, bias)
    try:
        t0 = time.time()
        with torch.inference_mode():
            got = b.vocode(mel)
    finally:
        H.conv = orig
    err = got.float() - want
    snr = (10 * torch.log10(want.pow(2).sum() / err.pow(2).sum())).item()
    out[name] = {"pcm_snr_db": snr, "max_abs_err": err.abs().max().item(), "s": time.time() - t0}
    print(name, json.dumps(out[name]), flush=True)


run("tf32 inputs", conv_tf32)
run("fp16 convolution I/O", conv_fp16_io)
run("fp16 network", conv_half, to_half)
print(json.dumps(out))
