"""The slot pass's resnet in Triton kernels (workflow/codec/resnets.py) against its torch path
(slots.resnet): output, and the tails it keeps for the next call. On the CPU Triton's interpreter
runs the kernels, in float32 (held to 1e-5); on CUDA in bfloat16 (held to bfloat16's rounding)."""

from __future__ import annotations

import pytest
import torch

from workflow.codec import kernels, resnets, slots
from workflow.codec.estimator import CausalResnetBlock1D
from workflow.codec.kernels import Tile

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton")

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # the interpreter runs only where no GPU is (conftest)


def resnet_call(cin: int, n: int, device: str, dtype: torch.dtype, seed: int = 0) -> tuple:
    """A resnet of cin -> n channels (time embedding 2n) and a call of 6 rows x 13 frames: its input,
    the time embedding's Mish, both convolutions' tails, and each row's valid frames (all, some, one,
    none: a padding row, two)."""
    g = torch.Generator().manual_seed(seed)
    r = CausalResnetBlock1D(cin, n, 2 * n)
    for p in r.parameters():
        fan_in = p[0].numel() if p.dim() > 1 else 1
        p.data = torch.randn(p.shape, generator=g) / fan_in**0.5
    x = torch.randn(6, 13, cin, generator=g)
    temb = torch.randn(6, 2 * n, generator=g)
    tails = (torch.randn(6, 2, cin, generator=g), torch.randn(6, 2, n, generator=g))
    valid = torch.tensor([13, 5, 1, 0, 2, 7])
    return (
        r.to(device, dtype),
        x.to(device, dtype),
        temb.to(device, dtype),
        tuple(t.to(device, dtype) for t in tails),
        valid.to(device),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("cin", "n", "blocking"), [(32, 32, Tile(16, 32, 64, 4, 2)), (48, 32, Tile(16, 8, 16, 4, 2)), (64, 64, None)]
)
def test_resnet_in_kernels_is_the_torch_one(device, cin, n, blocking):
    """Every frame of every row (padding frames too: the torch path computes them alike), and the
    tails: rows with two or more valid frames keep input frames, those with fewer part of their tail.
    Blockings: the whole row in one column block, and four blocks whose statistics combine (Chan);
    rows and reductions that do not fill a block."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    atol = 1e-5 if dtype == torch.float32 else 0.05
    r, x, temb, tails, valid = resnet_call(cin, n, device, dtype)
    with torch.no_grad():
        theirs = slots.resnet(r, x, temb, tails, valid)
        ours = resnets.resnet(r, x, temb, tails, valid, blocking)
    for a, b, what in zip(ours, theirs, ("output", "conv1 tail", "conv2 tail"), strict=True):
        assert a.shape == b.shape and (a.float() - b.float()).abs().max() <= atol, what


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_bug_fails_it(device):
    """The check can fail: the first convolution's tail with its two frames swapped changes the first
    two frames of every row (they read it) and the next two (the second convolution reads the first
    two), and no later frame."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    r, x, temb, tails, valid = resnet_call(32, 32, device, dtype)
    with torch.no_grad():
        theirs, *_ = slots.resnet(r, x, temb, tails, valid)
        ours, *_ = resnets.resnet(r, x, temb, (tails[0].flip(1).contiguous(), tails[1]), valid)
    diff = (ours.float() - theirs.float()).abs()
    assert diff[:, :2].amax(dim=(1, 2)).min() > 0.05 and diff[:, 4:].max() <= (1e-5 if dtype == torch.float32 else 0.05)
