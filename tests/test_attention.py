"""The fused decode attention (run by Triton's interpreter here) against layer_step's torch path."""

import pytest
import torch
import torch.nn.functional as F

from workflow.engines import attention
from workflow.engines.linears import rms_norm, rope

pytestmark = pytest.mark.skipif(not attention.available(), reason="needs triton")

HKV, EPS = 2, 1e-6


def make(b: int, g: int, d: int, seq: int, pos: int, seed: int = 0) -> dict:
    """Inputs at float32 with caches one sequence larger than the batch (that row must stay)."""
    gen = torch.Generator().manual_seed(seed)
    h = g * HKV
    angles = pos * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    return dict(
        qkv=torch.randn(b, 1, (h + 2 * HKV) * d, generator=gen) * 2,
        q_norm=torch.rand(d, generator=gen) + 0.5,
        k_norm=torch.rand(d, generator=gen) + 0.5,
        cos=angles.cos()[None],
        sin=angles.sin()[None],
        k_cache=torch.randn(b + 1, HKV, seq, d, generator=gen),
        v_cache=torch.randn(b + 1, HKV, seq, d, generator=gen),
        pos=torch.tensor([pos]),
    )


def reference(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, kv_len: int) -> torch.Tensor:
    """layer_step's decode path after the qkv projection, on the given caches (written in place)."""
    b, t, d = qkv.shape[0], 1, k_cache.shape[-1]
    kv_size = k_cache.shape[1] * d
    q, k, v = qkv.split([qkv.shape[-1] - 2 * kv_size, kv_size, kv_size], dim=-1)
    q = rope(rms_norm(q.view(b, t, -1, d), q_norm, EPS), cos, sin).transpose(1, 2)
    k = rope(rms_norm(k.view(b, t, -1, d), k_norm, EPS), cos, sin).transpose(1, 2)
    v = v.view(b, t, -1, d).transpose(1, 2)
    k_cache, v_cache = k_cache[:b], v_cache[:b]
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    mask = torch.arange(kv_len)[None, :] <= pos[:, None]
    y = F.scaled_dot_product_attention(q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], attn_mask=mask, enable_gqa=True)
    return y.transpose(1, 2).reshape(b, t, -1)


CASES = [  # b, g, d, kv_len, pos, splits, block_s
    (1, 4, 128, 128, 5, 1, 64),  # pos in the first block
    (3, 2, 32, 256, 255, 1, 64),  # pos the last position
    (3, 4, 32, 128, 0, 1, 32),  # nothing cached yet
    (1, 2, 128, 256, 200, 1, 64),
    (3, 4, 32, 256, 100, 4, 32),  # split-S, pos in the second of four slices
    (1, 2, 128, 256, 255, 2, 64),  # split-S, pos the last position
    (3, 4, 32, 128, 70, 3, 32),  # three slices of 64: the last one lies wholly past kv_len
    (1, 4, 32, 512, 300, 0, 64),  # choose_splits: eight slices of 64
]


@pytest.mark.parametrize(("b", "g", "d", "kv_len", "pos", "splits", "block_s"), CASES)
def test_equals_layer_step_and_writes_only_row_pos(b, g, d, kv_len, pos, splits, block_s):
    seq = kv_len + 64  # rows past kv_len exist and must be neither read nor written
    args = make(b, g, d, seq, pos)
    ref = {k: v.clone() for k, v in args.items()}
    want = reference(**ref, kv_len=kv_len)
    got = attention.launch(**args, kv_len=kv_len, eps=EPS, splits=splits, block_s=block_s)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    for name in ("k_cache", "v_cache"):
        new, old = args[name], ref[name]
        assert torch.allclose(new[:b, :, pos], old[:b, :, pos], atol=1e-6, rtol=1e-6)  # sum order: ulps
        new[:b, :, pos], old[:b, :, pos] = 0, 0
        assert torch.equal(new, old), name  # every other row, and sequence b, untouched


@pytest.mark.parametrize("splits", [1, 2])
def test_each_sequence_reads_its_own_position(splits):
    """Slots at positions 5, 200 and 0 in one launch (each its own angles, length and cache row)
    give what each gives alone, and each writes only its own row at its own position."""
    g, d, kv_len = 2, 32, 256
    alone = [make(1, g, d, kv_len, pos, seed=40 + i) for i, pos in enumerate((5, 200, 0))]
    for a in alone[1:]:  # one layer: the norms are shared
        a["q_norm"], a["k_norm"] = alone[0]["q_norm"], alone[0]["k_norm"]
    batch = {k: torch.cat([a[k] for a in alone]) for k in ("qkv", "cos", "sin", "pos")}
    batch |= {k: torch.cat([a[k][:1] for a in alone]) for k in ("k_cache", "v_cache")}
    batch |= {"q_norm": alone[0]["q_norm"], "k_norm": alone[0]["k_norm"]}
    got = attention.launch(**batch, kv_len=kv_len, eps=EPS, splits=splits)
    for i, a in enumerate(alone):
        want = attention.launch(**a, kv_len=kv_len, eps=EPS, splits=splits)
        assert torch.allclose(got[i], want[0], atol=1e-6, rtol=1e-6), i
        assert torch.equal(batch["k_cache"][i], a["k_cache"][0]) and torch.equal(batch["v_cache"][i], a["v_cache"][0])


@pytest.mark.parametrize("splits", [1, 2])
def test_rows_past_pos_do_not_count(splits):
    """Rows past pos (row pos itself included, before the write) may hold anything: NaN, huge."""
    b, g, d, kv_len, pos = 2, 4, 32, 256, 130
    args = make(b, g, d, kv_len, pos)
    clean = {k: v.clone() for k, v in args.items()}
    want = reference(**clean, kv_len=kv_len)
    for junk in (float("nan"), 1e30):
        dirty = {k: v.clone() for k, v in args.items()}
        dirty["k_cache"][:, :, pos:] = junk
        dirty["v_cache"][:, :, pos:] = -junk
        got = attention.launch(**dirty, kv_len=kv_len, eps=EPS, splits=splits)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (junk, (got - want).abs().max())
        assert torch.allclose(dirty["k_cache"][:b, :, pos], clean["k_cache"][:b, :, pos], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("splits", [1, 2])
def test_quant_gives_dense_its_fp8_input(splits):
    """With dense's activation scale, y comes out as fp8.quantize(y, a) would make it, in one
    kernel (splits 1) or in the combine (splits 2); a small scale makes some values saturate."""
    from workflow import fp8

    b, g, d, kv_len, pos = 2, 4, 32, 256, 130
    args = make(b, g, d, kv_len, pos)
    plain = attention.launch(**{k: v.clone() for k, v in args.items()}, kv_len=kv_len, eps=EPS, splits=splits)
    a = torch.tensor([plain.abs().max().item() / 600])
    got = attention.launch(**args, kv_len=kv_len, eps=EPS, splits=splits, quant=a)
    want = fp8.quantize(plain, a)
    assert got.dtype == torch.float8_e4m3fn and (want.float().abs() == 448).any()
    assert torch.equal(got.float(), want.float())


def test_custom_op_mutates_the_caches_and_has_a_fake():
    """The registered op: the schema's mutations and the fake output agree with the real kernel."""
    b, g, d, kv_len, pos = 1, 2, 32, 128, 9
    args = make(b, g, d, kv_len, pos)
    ref = {k: v.clone() for k, v in args.items()}
    want = reference(**ref, kv_len=kv_len)
    got = torch.ops.mossbuild.decode_attention(*args.values(), kv_len, EPS)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(args["k_cache"], ref["k_cache"], atol=1e-6, rtol=1e-6)
    torch.library.opcheck(
        torch.ops.mossbuild.decode_attention.default,
        (*make(b, g, d, kv_len, pos).values(), kv_len, EPS, 2),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_choose_splits_fills_the_sms_once_and_keeps_short_caches_in_one_kernel():
    cpu = torch.device("cpu")  # counted as 128 SMs
    assert attention.choose_splits(1, 8, 128, cpu) == 1
    assert attention.choose_splits(1, 8, 4096, cpu) == 16
    assert attention.choose_splits(3, 8, 4096, cpu) == 4
    assert attention.choose_splits(1, 2, 512, cpu) == 512 // attention.BLOCK_S
    assert attention.choose_splits(4, 32, 4096, cpu) == 1


def test_rejects_shapes_it_cannot_take():
    args = make(1, 2, 32, 128, 3)
    with pytest.raises(ValueError, match="kv_len"):
        attention.launch(**args, kv_len=256, eps=EPS)
    args["qkv"] = args["qkv"].expand(1, 2, -1)
    with pytest.raises(ValueError, match="t=1"):
        attention.launch(**args, kv_len=128, eps=EPS)
