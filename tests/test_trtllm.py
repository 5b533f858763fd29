"""The TensorRT-LLM backend: its contract with our checkpoints and its input binding, checked
without tensorrt_llm; the real build and runtime in tests marked to run where it is installed."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, write_variant

from workflow import fp8, traffic, trtckpt
from workflow.engines import load_engine, trtllm_engine, trtllm_model
from workflow.engines.trtllm_engine import CacheLayout, IOTensor, check_bindings, step_inputs
from workflow.errors import InputError
from workflow.generate import Ids
from workflow.names import layer_plan, trunk_linears
from workflow.spec import PRESETS

HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
needs_trtllm = pytest.mark.skipif(not HAS_TRTLLM, reason="tensorrt_llm is not installed")
needs_gpu = pytest.mark.skipif(not (HAS_TRTLLM and torch.cuda.is_available()), reason="needs tensorrt_llm and a CUDA device")
without_trtllm = pytest.mark.skipif(HAS_TRTLLM, reason="checks the behaviour without tensorrt_llm")
ACT_AMAX = 8.0  # activation range written into the test FP8 checkpoint (fixed, so both engines read the same)


def quantize_trunk(t, cfg, spec):
    """Our tiny checkpoint with an FP8 trunk, in the FP8 contract of trtckpt (scale = amax / 448)."""
    for module in trunk_linears(spec):
        w = t[f"{module}.weight"].float()
        scale = fp8.scale_of(w.abs().max())
        t[f"{module}.weight"] = fp8.quantize(w, scale)
        t[f"{module}.weights_scaling_factor"] = scale
        t[f"{module}.activation_scaling_factor"] = fp8.scale_of(ACT_AMAX)
    cfg.clear()
    cfg.update(trtckpt.trt_config(spec, fp8=True))


@pytest.fixture(scope="module")
def tiny_fp8_ckpt(tiny_ckpt, tmp_path_factory):
    return write_variant(tiny_ckpt, tmp_path_factory.mktemp("fp8") / "ckpt-fp8", quantize_trunk)


# --- without tensorrt_llm -------------------------------------------------------------------


@without_trtllm
def test_modules_import_without_tensorrt_llm():
    assert trtllm_model.model_classes and trtllm_engine.build and trtllm_engine.load
    assert "tensorrt_llm" not in sys.modules


@without_trtllm
def test_build_fails_at_once_with_one_line_and_leaves_nothing(tiny_ckpt, tmp_path):
    out = tmp_path / "engine"
    options = json.dumps({"backend": "trtllm", "device": "cuda", "dtype": "bfloat16"})
    args = ["--ckpt", str(tiny_ckpt), "--out", str(out), "--options-json", options]
    r = subprocess.run([sys.executable, "-m", "workflow.build", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "pip install tensorrt-llm==" in lines[0] and "--extra-index-url https://pypi.nvidia.com" in lines[0]
    assert f"supported versions: {trtllm_engine.SUPPORTED_TEXT}" in lines[0]
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "a temporary engine directory was left behind"


@without_trtllm
def test_opening_a_trtllm_engine_fails_with_the_install_hint(tmp_path):
    (tmp_path / "engine.json").write_text(json.dumps({"backend": "trtllm", "options": {"device": "cuda", "max_batch": 4}}))
    with pytest.raises(InputError, match=r"pip install tensorrt-llm==.*supported versions"):
        load_engine(tmp_path)


@pytest.mark.parametrize(
    "version, ok",
    [
        ("1.0.0", True),
        ("1.1.0rc2", True),
        ("1.2.1", True),
        ("0.19.0", False),
        ("1.3.0rc1", False),
        ("2.0.0", False),
        ("x", False),
    ],
)
def test_only_versions_that_ship_the_followed_engine_flow_are_accepted(version, ok):
    assert trtllm_engine.version_supported(version) is ok


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_checkpoint_holds_exactly_what_the_definition_loads(precision, tiny_ckpt, tiny_fp8_ckpt):
    ckpt = tiny_ckpt if precision == "bf16" else tiny_fp8_ckpt
    cfg = trtllm_model.check_checkpoint(ckpt)
    _, spec, tensors = trtckpt.load_checkpoint(ckpt)
    got = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    assert got == trtllm_model.declared_parameters(cfg)
    fp8_modules = {n.removesuffix(".weight") for n, (_, dtype) in got.items() if dtype == torch.float8_e4m3fn}
    assert fp8_modules == (set(trunk_linears(spec)) if precision == "fp8" else set())


def _no_excludes(t, cfg, spec):
    cfg["quantization"]["exclude_modules"] = None  # TensorRT-LLM's defaults would then FP8 the branches


def _bf16_trunk_linear(t, cfg, spec):
    name = trunk_linears(spec)[0]
    t[f"{name}.weight"] = fp8.dequantize(t[f"{name}.weight"], t.pop(f"{name}.weights_scaling_factor"), torch.bfloat16)
    del t[f"{name}.activation_scaling_factor"]


def _no_audio_head(t, cfg, spec):
    del t["audio_lm_head.weight"]


@pytest.mark.parametrize(
    "mutate, problem",
    [
        (_no_excludes, r"'transformer\.layers\.3\.attention\.qkv\.weight' has dtype torch\.bfloat16, expected torch\.float8"),
        (_bf16_trunk_linear, r"'transformer\.layers\.0\.attention\.qkv\.weight' has dtype torch\.bfloat16"),
        (_no_audio_head, r"'audio_lm_head\.weight' is missing"),
    ],
)
def test_checkpoint_outside_the_contract_is_refused(mutate, problem, tiny_fp8_ckpt, tmp_path):
    bad = write_variant(tiny_fp8_ckpt, tmp_path / "bad", mutate)
    with pytest.raises(InputError, match=problem):
        trtllm_model.check_checkpoint(bad)


@pytest.mark.parametrize("preset", ["tiny", "full"])
def test_exclude_modules_match_exactly_the_modules_meant(preset):
    spec = PRESETS[preset]
    cfg = trtckpt.trt_config(spec, fp8=True)
    patterns = cfg["quantization"]["exclude_modules"]
    modules = [w.module for w in trtllm_model.weights(cfg)]
    plan = layer_plan(spec)
    branch = tuple(f"transformer.layers.{n}." for n in [*plan["text_block"], *plan["audio_block"]])
    meant = {"transformer.vocab_embedding", "lm_head", "audio_lm_head"} | {m for m in modules if m.startswith(branch)}
    got = {m for m in modules if trtllm_model.excluded(m, patterns)}
    assert got == meant
    assert not got & set(trunk_linears(spec))
    # fuse_gate_mlp decides through QuantConfig._get_quant_cfg: the exact name, or a prefix before '*'
    prefix_rule = {m for m in modules if any(p == m or (p.endswith("*") and m.startswith(p[:-1])) for p in patterns)}
    assert prefix_rule == got
    assert set(trtllm_model.fp8_modules(cfg)) == set(trunk_linears(spec))


def test_config_fields_present_and_right(tiny_ckpt, tiny_hf):
    cfg = json.loads((tiny_ckpt / trtckpt.CONFIG).read_text())
    hf = json.loads((tiny_hf / "config.json").read_text())
    spec = trtllm_model.check_trt_config(cfg)
    assert spec.num_layers == cfg["num_hidden_layers"]
    assert cfg["qwen_type"] == "qwen3" and cfg["qk_layernorm"] is True
    assert cfg["rotary_base"] == hf["rope_theta"] and cfg["position_embedding_type"] == "rope_gpt_neox"
    assert cfg["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert cfg["logits_dtype"] == "float32"


@pytest.mark.parametrize(
    "field, value",
    [
        ("qwen_type", "qwen2"),
        ("qk_layernorm", False),
        ("logits_dtype", "bfloat16"),
        ("rotary_base", 0.0),
        ("mapping", {"world_size": 2, "tp_size": 2, "pp_size": 1}),
        ("audio_layers", [3, 4]),
        ("qwen_type", None),
        ("qk_layernorm", None),
        ("rotary_base", None),
        ("mapping", None),
        ("logits_dtype", None),
    ],
)
def test_config_the_definition_does_not_implement_is_refused(field, value, tiny_ckpt):
    cfg = json.loads((tiny_ckpt / trtckpt.CONFIG).read_text())
    if value is None:
        del cfg[field]
    else:
        cfg[field] = value
    with pytest.raises(InputError, match=f"'{field}'"):
        trtllm_model.check_trt_config(cfg)


@pytest.mark.parametrize("preset", ["tiny", "full"])
def test_kv_cache_layer_indices_are_distinct_per_branch(preset):
    spec = PRESETS[preset]
    cfg = trtckpt.trt_config(spec)
    b = trtllm_model.branches(cfg)
    s, m = spec.num_shared_layers, spec.num_modality_layers
    assert (b["trunk"], b["text"], b["audio"]) == (list(range(s)), list(range(s, s + m)), list(range(s + m, s + 2 * m)))
    every = b["trunk"] + b["text"] + b["audio"]
    assert sorted(every) == list(range(cfg["num_hidden_layers"])), "each layer, hence each KV-cache slot, used once"
    if preset == "full":
        assert (b["text"], b["audio"], cfg["num_hidden_layers"]) == ([32, 33, 34, 35], [36, 37, 38, 39], 40)


# The inputs a TensorRT-LLM 1.x engine declares for our build options (paged KV cache, GPT
# attention plugin, packed input; models/generation_mixin.py, prepare_basic_inputs and
# prepare_attention_inputs): name -> (dtype, in host memory).
ENGINE_INPUTS = {
    "input_ids": (torch.int32, False),
    "position_ids": (torch.int32, False),
    "last_token_ids": (torch.int32, False),
    "context_lengths": (torch.int32, False),
    "host_context_lengths": (torch.int32, True),
    "sequence_length": (torch.int32, False),
    "host_past_key_value_lengths": (torch.int32, True),
    "host_request_types": (torch.int32, True),
    "cache_indirection": (torch.int32, False),
    "kv_cache_block_offsets": (torch.int32, False),
    "host_kv_cache_block_offsets": (torch.int32, True),
    "host_kv_cache_pool_pointers": (torch.int64, True),
    "host_kv_cache_pool_mapping": (torch.int32, True),
    "host_max_attention_window_sizes": (torch.int32, True),
    "host_sink_token_length": (torch.int32, True),
    "host_runtime_perf_knobs": (torch.int64, True),
    "host_context_progress": (torch.int64, True),
}
META = torch.device("meta")  # stands for the GPU: device memory without one
LAYOUT = CacheLayout(num_layers=7, max_batch=4, max_seq_len=1024, tokens_per_block=64)


def engine_io(inputs=ENGINE_INPUTS) -> list[IOTensor]:
    io = [IOTensor(name, True, host, dtype, 1) for name, (dtype, host) in inputs.items()]
    return io + [IOTensor(name, False, False, torch.float32, 2) for name in ("logits", "audio_logits")]


def feeds(past: int, batch: int = 2, t: int = 5) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (batch, 1 if past else t))
    return step_inputs(ids, range(batch), [past] * batch, [t] * batch, LAYOUT, pool_ptr=1 << 32, mapping_rank=2, device=META)


@pytest.mark.parametrize("past", [0, 9])
def test_every_engine_input_is_bound_with_its_dtype_and_place(past):
    check_bindings(engine_io(), feeds(past))


@pytest.mark.parametrize("name", sorted(ENGINE_INPUTS))
def test_enqueue_is_refused_while_any_input_is_unbound(name):
    bound = feeds(0)
    del bound[name]
    with pytest.raises(InputError, match=f"refusing to enqueue: engine input\\(s\\) not bound: {name}$"):
        check_bindings(engine_io(), bound)


def test_an_engine_input_we_do_not_know_is_refused():
    io = engine_io({**ENGINE_INPUTS, "lora_ranks_0": (torch.int32, True), "tasks": (torch.int32, False)})
    with pytest.raises(InputError, match="not bound: lora_ranks_0, tasks"):
        check_bindings(io, feeds(0))


def test_wrong_dtype_or_wrong_memory_is_refused():
    bound = feeds(0)
    with pytest.raises(InputError, match=r"'input_ids' is torch\.int64"):
        check_bindings(engine_io(), {**bound, "input_ids": bound["input_ids"].long()})
    with pytest.raises(InputError, match="'host_request_types' must be in host memory"):
        check_bindings(engine_io(), {**bound, "host_request_types": bound["host_request_types"].to(META)})
    with pytest.raises(InputError, match="'sequence_length' must be in device memory"):
        check_bindings(engine_io(), {**bound, "sequence_length": torch.zeros(2, dtype=torch.int32)})


def test_each_sequence_owns_its_own_kv_blocks():
    offsets = LAYOUT.block_offsets(range(LAYOUT.max_batch))  # [pool, batch, K/V, blocks]
    assert offsets.shape == (1, LAYOUT.max_batch, 2, LAYOUT.blocks_per_seq)
    assert LAYOUT.blocks_per_seq * LAYOUT.tokens_per_block >= LAYOUT.max_seq_len
    k, v = offsets[0, :, 0], offsets[0, :, 1]
    assert torch.equal(v, k + 1)
    stride = 2 * LAYOUT.num_layers  # one block holds every layer's K and V
    assert torch.equal(k % stride, torch.zeros_like(k))
    blocks = (k // stride).flatten()
    assert blocks.unique().numel() == blocks.numel(), "two sequences share a block"
    assert blocks.min() >= 0 and blocks.max() < LAYOUT.pool_shape(2, 32)[0]


def test_step_inputs_follow_generation_session():
    context, step = feeds(0, batch=3, t=5), feeds(9, batch=3, t=5)
    assert context["input_ids"].shape == (15,) and step["input_ids"].shape == (3,)
    host = {k: v for k, v in context.items() if v.device.type == "cpu"}
    assert torch.equal(host["host_request_types"], torch.zeros(3, dtype=torch.int32))
    assert host["host_past_key_value_lengths"].tolist() == [5, 5, 5]
    assert step["host_request_types"].tolist() == [1, 1, 1]
    assert step["host_past_key_value_lengths"].tolist() == [9, 9, 9]  # cached before this step
    assert step["host_context_lengths"].tolist() == [5, 5, 5]  # the prompt length, kept
    assert step["host_kv_cache_pool_mapping"].tolist() == [[0, n] for n in range(LAYOUT.num_layers)]
    cpu = step_inputs(torch.ones(3, 5, dtype=torch.long), range(3), [0] * 3, [5] * 3, LAYOUT, 7, 1, torch.device("cpu"))
    assert cpu["position_ids"].tolist() == [0, 1, 2, 3, 4] * 3
    assert cpu["last_token_ids"].tolist() == [5, 10, 15] and cpu["sequence_length"].tolist() == [5, 5, 5]
    assert cpu["host_kv_cache_pool_mapping"].tolist() == [0] * LAYOUT.num_layers
    later = step_inputs(torch.ones(3, 1, dtype=torch.long), range(3), [9] * 3, [5] * 3, LAYOUT, 7, 2, torch.device("cpu"))
    assert later["position_ids"].tolist() == [9, 9, 9] and later["sequence_length"].tolist() == [10, 10, 10]
    assert later["last_token_ids"].tolist() == [1, 2, 3]


def test_a_ragged_step_gives_each_slot_its_own_length_and_blocks():
    """In-flight batching: slots 3 and 1 step together, 9 and 4 positions cached, prompts of 5 and
    2; each reads and writes its own blocks at its own position."""
    got = step_inputs(torch.ones(2, 1, dtype=torch.long), [3, 1], [9, 4], [5, 2], LAYOUT, 7, 2, torch.device("cpu"))
    assert got["position_ids"].tolist() == [9, 4] and got["sequence_length"].tolist() == [10, 5]
    assert got["host_past_key_value_lengths"].tolist() == [9, 4] and got["host_context_lengths"].tolist() == [5, 2]
    assert torch.equal(got["host_kv_cache_block_offsets"][0], LAYOUT.block_offsets(range(4))[0, [3, 1]])


# --- with tensorrt_llm (and a GPU): skipped here ---------------------------------------------


@needs_trtllm
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_built_model_requires_exactly_the_declaration(precision, tiny_ckpt, tiny_fp8_ckpt):
    cfg = trtllm_model.check_checkpoint(tiny_ckpt if precision == "bf16" else tiny_fp8_ckpt)
    config_cls, model_cls = trtllm_model.model_classes()
    model = model_cls(config_cls(**cfg))
    assert trtllm_model.required_parameters(model) == trtllm_model.declared_parameters(cfg)
    assert [layer.attention.local_layer_idx for layer in model.transformer.layers] == list(range(cfg["num_hidden_layers"]))


def _build(ckpt, out, backend, precision="bf16"):
    from workflow import build

    options = {"backend": backend, "precision": precision, "device": "cuda", "dtype": "bfloat16", "max_seq_len": 256}
    build.main(["--ckpt", str(ckpt), "--out", str(out), "--options-json", json.dumps(options)])
    return load_engine(out)


def _agree(a: torch.Tensor, b: torch.Tensor) -> None:
    cos = torch.nn.functional.cosine_similarity(a.flatten(0, -2), b.flatten(0, -2), dim=-1)
    assert cos.min() > 0.999
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.98


@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_engine_matches_our_torch_engine_on_both_heads(precision, tiny_ckpt, tiny_fp8_ckpt, tmp_path):
    ckpt = tiny_ckpt if precision == "bf16" else tiny_fp8_ckpt
    trt, ref = _build(ckpt, tmp_path / "trt", "trtllm", precision), _build(ckpt, tmp_path / "torch", "torch", precision)
    ids = Ids.of(trt.spec)
    prompts, follow = traffic.batch(3, 60, ids, seed=21), traffic.batch(3, 8, ids, seed=22)
    for got, want in zip(trt.prefill(prompts, all_logits=True), ref.prefill(prompts, all_logits=True), strict=True):
        _agree(got, want)
    for t in range(follow.shape[1]):
        for got, want in zip(trt.decode(follow[:, t]), ref.decode(follow[:, t]), strict=True):
            _agree(got, want)


@needs_gpu
def test_decode_continues_the_prefill_cache_of_every_branch(tiny_ckpt, tmp_path):
    engine = _build(tiny_ckpt, tmp_path / "trt", "trtllm")
    seq = traffic.batch(2, 41, Ids.of(engine.spec), seed=23)
    whole_text, whole_audio = engine.prefill(seq)
    engine.prefill(seq[:, :-1])
    step_text, step_audio = engine.decode(seq[:, -1])
    _agree(step_text, whole_text)
    _agree(step_audio, whole_audio)


@needs_gpu
def test_real_engine_refuses_an_unbound_input(tiny_ckpt, tmp_path, monkeypatch):
    engine = _build(tiny_ckpt, tmp_path / "trt", "trtllm")
    real = trtllm_engine.step_inputs
    monkeypatch.setattr(
        trtllm_engine, "step_inputs", lambda *a: {k: v for k, v in real(*a).items() if k != "host_sink_token_length"}
    )
    with pytest.raises(InputError, match="not bound: host_sink_token_length"):
        engine.prefill(traffic.batch(1, 8, Ids.of(engine.spec), seed=24))
