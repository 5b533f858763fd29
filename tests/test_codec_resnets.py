"""The slot pass's resnet in two Triton kernels (workflow/codec/resnets.py) against its torch path
(slots.resnet). On the CPU Triton's interpreter runs them, in float32 (held to 1e-5); on CUDA in
bfloat16 (held to a few units of its last place)."""

from __future__ import annotations

import pytest
import torch

from workflow.codec import kernels, resnets, slots
from workflow.codec.estimator import CausalResnetBlock1D

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton")

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # the interpreter runs only where no GPU is (conftest)


def case(cin: int, cout: int, device: str, dtype: torch.dtype, shared_time: bool, seed: int = 0) -> tuple:
    """A resnet and a call's rows: 4 rows of Q = 11 frames, valid 0, 1, 6 and 11 (a row whose tail is all
    kept frames, one whose tail mixes them with the call's, two of the call's alone); each row's tails a
    slice of one wider buffer, as `SlotView.tail` reads them."""
    g = torch.Generator().manual_seed(seed)
    r = CausalResnetBlock1D(cin, cout, 24)
    for p in r.parameters():
        p.data = torch.randn(p.shape, generator=g) * (0.5 / p.shape[1] ** 0.5 if p.dim() > 1 else 0.5)
    r = r.to(device, dtype)
    x = torch.randn(4, 11, cin, generator=g).to(device, dtype)
    time = torch.randn(1 if shared_time else 4, cout, generator=g).to(device, dtype)
    before = torch.randn(4, 2 * cin + 2 * cout + 7, generator=g).to(device, dtype)  # other convolutions' tails beside
    tails = (before[:, 3 : 3 + 2 * cin].view(4, 2, cin), before[:, 3 + 2 * cin : 3 + 2 * cin + 2 * cout].view(4, 2, cout))
    return r, x, time, tails, torch.tensor([0, 1, 6, 11], device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("cin", "cout", "shared_time"), [(40, 32, True), (32, 48, False), (96, 32, False)])
def test_the_resnet_in_two_kernels_is_the_slot_pass_resnet(device, cin, cout, shared_time):
    """Output of every frame and both new tails, for input channels over one and two of its 64-wide steps,
    output channels padded (48 to 64), a time input shared by the rows or each its own."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    r, x, time, tails, valid = case(cin, cout, device, dtype, shared_time)
    with torch.no_grad():
        want = slots.resnet(r, x, time, tails, valid)
        got = resnets.resnet(r, x, time, tails, valid)
    atol = 1e-5 if dtype == torch.float32 else 0.05
    for name, w, o in zip(("out", "tail 1", "tail 2"), want, got, strict=True):
        assert o.shape == w.shape and (o.float() - w.float()).abs().max() <= atol, name


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_bug_fails_it(device):
    """The check can fail: the kept frames read as zeros (a call's first frames as at the sequence's
    start) change the first two frames of every row and the tails of the rows that keep them."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    r, x, time, tails, valid = case(40, 32, device, dtype, True)
    with torch.no_grad():
        want = slots.resnet(r, x, time, tails, valid)
        got = resnets.resnet(r, x, time, tuple(torch.zeros_like(t) for t in tails), valid)
    assert (got[0][:, :2].float() - want[0][:, :2].float()).abs().amax(dim=-1).min() > 0.05
    assert (got[1][:2].float() - want[1][:2].float()).abs().max() > 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_it_refuses_what_it_cannot_hold(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    r, x, time, tails, valid = case(40, 32, device, dtype, True)
    with pytest.raises(ValueError, match="resnet: a program holds its frames whole, 32 channels, not 16"):
        resnets.resnet(r, x, time, tails, valid, kernels.Tile(16, 16, 64, 4, 1))
    with pytest.raises(ValueError, match="resnet: each row's tail must be contiguous"):
        resnets.resnet(r, x, time, (tails[0].transpose(1, 2).contiguous().transpose(1, 2), tails[1]), valid)
