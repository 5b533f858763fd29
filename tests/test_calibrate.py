"""FP8 calibration of the shared block: scope, scales, the checkpoint, and its numerics."""

import json

import pytest
import torch
from conftest import CALIB, verify_params

from workflow import dataset, fp8, trtckpt, verify
from workflow.calibrate import PARTS, expected_quantizers, quant_config
from workflow.engines import load_engine
from workflow.errors import InputError
from workflow.generate import Ids
from workflow.hfckpt import load_hf_state
from workflow.names import LINEARS, layer_plan
from workflow.reference import MossSpeechReference
from workflow.spec import load_spec
from workflow.traffic import batch


def test_fp8_weights_exactly_on_the_trunk_linears(tiny_fp8):
    cfg, spec, t = trtckpt.load_checkpoint(tiny_fp8 / "checkpoint")  # checks every name, shape, dtype
    fp8_names = {k for k, v in t.items() if v.dtype == torch.float8_e4m3fn}
    trunk = layer_plan(spec)["shared_block"]
    assert fp8_names == {f"transformer.layers.{i}.{lin}.weight" for i in trunk for lin in LINEARS}
    q = cfg["quantization"]
    assert q["quant_algo"] == "FP8" and q["kv_cache_quant_algo"] is None
    assert {"lm_head", "audio_lm_head", "transformer.vocab_embedding"} <= set(q["exclude_modules"])


def test_scales_are_amax_over_448_and_qkv_takes_the_max(tiny_fp8):
    _, spec, t = trtckpt.load_checkpoint(tiny_fp8 / "checkpoint")
    amax = json.loads((tiny_fp8 / "amax.json").read_text())["amax"]
    assert len(amax) == spec.num_shared_layers * 7
    for i in layer_plan(spec)["shared_block"]:
        for lin, parts in PARTS.items():
            name = f"transformer.layers.{i}.{lin}"
            w, a = t[f"{name}.weights_scaling_factor"], t[f"{name}.activation_scaling_factor"]
            assert w.dtype == a.dtype == torch.float32 and w.shape == a.shape == (1,)
            assert float(w) == pytest.approx(max(amax[f"{i}.{p}"]["weight"] for p in parts) / 448, rel=1e-6)
            assert float(a) == pytest.approx(max(amax[f"{i}.{p}"]["input"] for p in parts) / 448, rel=1e-6)
    # q, k and v really have different amaxes, so the merge is a real choice
    assert len({amax[f"0.self_attn.{x}_proj"]["weight"] for x in "qkv"}) == 3


def test_qkv_is_requantized_with_the_merged_scale(tiny_fp8, tiny_ckpt):
    _, _, bf16 = trtckpt.load_checkpoint(tiny_ckpt)
    _, _, q8 = trtckpt.load_checkpoint(tiny_fp8 / "checkpoint")
    name = "transformer.layers.1.attention.qkv"
    w, scale = bf16[f"{name}.weight"].float(), q8[f"{name}.weights_scaling_factor"]
    assert float(scale) * 448 == pytest.approx(float(w.abs().max()), rel=1e-6)  # max over q, k and v
    back = fp8.dequantize(q8[f"{name}.weight"], scale)
    # e4m3 keeps 3 mantissa bits: relative error <= 1/16 for normal values
    normal = w.abs() > scale * 2**-6
    assert ((back - w).abs()[normal] <= w.abs()[normal] / 16 + 1e-12).all()
    assert torch.equal(q8[f"{name}.weight"], fp8.quantize(w, scale))


def test_quant_config_scopes_the_trunk_only(tiny_hf):
    import modelopt.torch.quantization as mtq

    spec = load_spec(tiny_hf)
    rows = batch(2, 16, Ids.of(spec), seed=3)

    def enabled(cfg):
        ref = MossSpeechReference(spec, load_hf_state(tiny_hf), torch.float32, "cpu")
        mtq.quantize(ref, cfg, lambda m: [m(r[None]) for r in rows])
        return {n for n, m in ref.named_modules() if n.endswith("_quantizer") and m.is_enabled}

    assert enabled(quant_config()) == expected_quantizers(spec)
    # modelopt's defaults alone would quantize both branches too: our disables matter
    assert len(enabled(mtq.FP8_DEFAULT_CFG)) > len(expected_quantizers(spec))


@pytest.fixture(scope="module")
def fake_quant_ref(tiny_fp8, tiny_hf):
    """modelopt's fake-quantized reference with the checkpoint's scales (q/k/v merged)."""
    import modelopt.torch.quantization as mtq

    spec = load_spec(tiny_hf)
    _, _, t = trtckpt.load_checkpoint(tiny_fp8 / "checkpoint")
    ref = MossSpeechReference(spec, load_hf_state(tiny_hf), torch.float32, "cpu")
    mtq.quantize(ref, quant_config(), lambda m: m(batch(1, 8, Ids.of(spec), seed=1)))
    for i, layer in enumerate(ref.shared_block):
        for lin, parts in PARTS.items():
            name = f"transformer.layers.{i}.{lin}"
            for part in parts:
                module = layer.get_submodule(part)
                module.weight_quantizer.amax = t[f"{name}.weights_scaling_factor"][0] * 448
                module.input_quantizer.amax = t[f"{name}.activation_scaling_factor"][0] * 448
    return ref


FUSED = {  # our fused trunk linears -> the reference's linears, in row order
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "dense": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "proj": ("mlp.down_proj",),
}


def test_fp8_weights_are_modelopt_fake_quant_weights(fake_quant_ref, tiny_fp8_engine_dir):
    """Every dequantized FP8 weight equals modelopt's fake-quantized weight, except at exact
    rounding ties (W / scale halfway between two FP8 values): the checkpoint divides by the scale
    and rounds half to even, as TensorRT-LLM's export does; modelopt's CPU fake quant multiplies
    by 448 / amax, whose float error breaks a tie either way. There the two are adjacent values."""
    ref, engine = fake_quant_ref, load_engine(tiny_fp8_engine_dir)
    ties = total = 0
    for i, layer in enumerate(engine.trunk):
        for ours, parts in FUSED.items():
            want = torch.cat(
                [
                    ref.shared_block[i].get_submodule(p).weight_quantizer(ref.shared_block[i].get_submodule(p).weight.detach())
                    for p in parts
                ]
            )
            w = torch.cat([ref.shared_block[i].get_submodule(p).weight.detach() for p in parts])
            got, scale = getattr(layer, ours).w_deq, getattr(layer, ours).row_scale()
            tie = fp8.quantize(w * (1 - 1e-6), scale) != fp8.quantize(w * (1 + 1e-6), scale)
            assert torch.allclose(got[~tie], want[~tie], rtol=1e-6, atol=0), (i, ours)
            step = (got - want).abs()[tie]
            assert (step <= got.abs()[tie] / 7).all()  # one e4m3 step (3 mantissa bits)
            ties, total = ties + int(tie.sum()), total + tie.numel()
    assert ties < 0.05 * total


def test_each_fp8_linear_quantizes_its_input_as_modelopt_does(fake_quant_ref, tiny_fp8_engine_dir):
    """Fed the same input, each trunk linear computes modelopt's fake-quantized input times its
    FP8 weight: the activation side of the CPU emulation is exact (fc|gate, q|k|v fused)."""
    ref, engine = fake_quant_ref, load_engine(tiny_fp8_engine_dir)
    seen = {}
    for i, layer in enumerate(ref.shared_block):
        for parts in FUSED.values():
            hook = lambda m, a, o, key=(i, parts[0]): seen.__setitem__(key, a[0])  # noqa: E731
            layer.get_submodule(parts[0]).register_forward_hook(hook)
    ref(batch(2, 40, Ids.of(ref.spec), seed=22))
    for i, layer in enumerate(engine.trunk):
        for ours, parts in FUSED.items():
            x = seen[(i, parts[0])]
            xq = ref.shared_block[i].get_submodule(parts[0]).input_quantizer(x)
            assert not torch.equal(xq, x)
            want = torch.nn.functional.linear(xq, getattr(layer, ours).w_deq)
            got = getattr(layer, ours)(x)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (i, ours)


def test_fp8_engine_is_closer_to_fake_quant_than_to_bf16(fake_quant_ref, tiny_fp8_engine_dir, tiny_hf):
    """Whole-model check. Not bit-exact: FP8 rounding is discontinuous, so 1e-7 float
    differences flip a few roundings and those spread; the gap is still far below FP8's own."""
    spec = load_spec(tiny_hf)
    engine = load_engine(tiny_fp8_engine_dir)
    prompts = batch(2, 48, Ids.of(spec), seed=21)
    et, _ = engine.prefill(prompts, all_logits=True)
    rt, _, _ = fake_quant_ref(prompts)
    pt, _, _ = MossSpeechReference(spec, load_hf_state(tiny_hf), torch.float32, "cpu")(prompts)
    assert (et - rt).abs().mean() < 0.5 * (et - pt).abs().mean()


def test_fp8_engine_passes_verify(tiny_fp8_engine_dir, tiny_fp8, tiny_hf, tmp_path):
    out = tmp_path / "verify.json"
    verify.main(["--engine", str(tiny_fp8_engine_dir), "--ckpt", str(tiny_fp8 / "checkpoint"), "--hf", str(tiny_hf),
                 "--calib-data", str(tiny_fp8 / "dataset"), "--out", str(out), "--params", verify_params()])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["passed"] and report["precision"] == "fp8"
    assert report["held_out"] == {"calibration_rows": CALIB["num_samples"], "disjoint": True}
    for head in ("text", "audio"):
        assert report["teacher_forced"][head]["top1"] >= 0.99
        assert 0 < report["teacher_forced"][head]["kl_mean"] <= 0.01


def test_verify_prompts_are_never_calibration_rows(tiny_fp8, tmp_path):
    p = json.loads(verify_params())
    prompts = batch(p["num_prompts"], p["prompt_len"], Ids.of(load_spec(tiny_fp8.parent / "hf")), p["seed"])
    assert verify.check_held_out(prompts, tiny_fp8 / "dataset")["disjoint"]
    # a calibration set that contains a verify prompt is refused
    import datasets

    rows = {"text_ids": [prompts[0, :, 0].tolist()] * 2, "audio_ids": [prompts[0, :, 1].tolist()] * 2}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "leaky"))
    with pytest.raises(InputError, match="verify prompt 0 is a calibration row"):
        verify.check_held_out(prompts, tmp_path / "leaky")


def test_synthetic_calibration_set_is_deterministic_traffic(tiny_fp8):
    s = dataset.CalibrationSettings(**{k: v for k, v in CALIB.items() if k not in ("device", "dtype")})
    ids = Ids.of(load_spec(tiny_fp8.parent / "hf"))
    a, b = dataset.synthetic_rows(s, ids), dataset.synthetic_rows(s, ids)
    assert a == b and len(a["text_ids"]) == 64
    flat = [t for row in a["text_ids"] for t in row]
    assert ids.sosp in flat and ids.pad in flat  # text segments, start of speech, audio segments
    assert any(ids.eosp in row for row in a["audio_ids"])
