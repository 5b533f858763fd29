"""TensorRT-LLM backend: build the engine (trtllm_model's definition) and drive it behind `Engine`.

Never run on this project's machines (no GPU, and the wheels come only from NVIDIA's index):
everything here imports without tensorrt_llm and fails at once with one line when it is needed.

The runtime binds the engine by hand rather than through ModelRunner/GenerationSession, which
reject a second output. Every engine input is filled here and `check_bindings` refuses to
enqueue while any input is unbound or has the wrong dtype or place (host/device). The values
follow what GenerationSession feeds the same inputs (runtime/generation.py, 1.x:
_get_context_shape_buffer, _get_next_step_shape_buffer), with a static KV-cache layout:
sequence b of a batch owns blocks [b * blocks_per_seq, (b + 1) * blocks_per_seq) of one pool
[num_blocks, num_layers, 2, kv_heads, tokens_per_block, head_size], and block k's K/V offset is
k * num_layers * 2 + (0 | 1) (runtime/kv_cache_manager.py, BlocksManager.get_k_or_v_block_offset;
the attention plugin adds the layer's slot, host_kv_cache_pool_mapping = [pool, layer]).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workflow.engines import trtllm_model
from workflow.engines.base import Engine, any_text, merged_ids
from workflow.engines.options import EngineOptions
from workflow.engines.slots import Slots
from workflow.errors import InputError
from workflow.spec import ModelSpec

SUPPORTED = (1, 0), (1, 2)  # major.minor range whose engine flow this follows
SUPPORTED_TEXT = "1.0 to 1.2.x"
INSTALL_HINT = (
    "tensorrt_llm is not installed: on a CUDA 13 machine with Python 3.12 run "
    "'pip install tensorrt-llm==1.2.1 --extra-index-url https://pypi.nvidia.com' "
    f"(or use envs/trtllm.yaml); supported versions: {SUPPORTED_TEXT}"
)
ENGINE_FILE = "rank0.engine"
WHERE = "engine.backend: trtllm"


def version_supported(version: str) -> bool:
    """Whether a tensorrt_llm version string lies in the supported range (1.2.1, 1.1.0rc3, ...)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return bool(m) and SUPPORTED[0] <= (int(m[1]), int(m[2])) <= SUPPORTED[1]


def require_tensorrt_llm(where: str = WHERE):
    """Import tensorrt_llm (which registers its TensorRT plugins) or raise the one-line hint."""
    try:
        import tensorrt_llm
    except ImportError:
        raise InputError(where, INSTALL_HINT) from None
    if not version_supported(tensorrt_llm.__version__):
        raise InputError(where, f"tensorrt_llm {tensorrt_llm.__version__} is not supported; {INSTALL_HINT.split(': ', 1)[1]}")
    return tensorrt_llm


@dataclass(frozen=True)
class BuildSettings:
    """What build() asks of TensorRT-LLM; stored in engine.json for the runtime."""

    max_batch: int
    max_seq_len: int
    tokens_per_block: int = 64
    gemm_plugin: str = "auto"  # the model dtype; "fp8" selects the FP8 GEMM plugin for FP8 linears
    gather_context_logits: bool = True  # every prompt position's logits: verify's teacher forcing needs them

    def plugins(self) -> dict:
        """PluginConfig fields (plugin/plugin.py): paged KV cache, context FMHA, packed input, GEMM plugin."""
        return {
            "gpt_attention_plugin": "auto",
            "gemm_plugin": self.gemm_plugin,
            "paged_kv_cache": True,
            "context_fmha": True,
            "remove_input_padding": True,
            "tokens_per_block": self.tokens_per_block,
        }


def build(ckpt_dir: Path, out: Path, meta: dict) -> None:
    """Build the engine into `out` (build.py's temporary directory, which then gets engine.json).

    tensorrt_llm.build(model, BuildConfig) and Engine.save(dir) as in builder.py (1.x); FP8
    checkpoints build strongly typed (build() also forces it for quant_algo FP8)."""
    tllm = require_tensorrt_llm()
    from tensorrt_llm import builder

    opts: EngineOptions = meta["options"]
    settings = BuildSettings(max_batch=opts.max_batch, max_seq_len=opts.max_seq_len)
    model = trtllm_model.load_model(ckpt_dir)
    config = builder.BuildConfig(
        max_batch_size=settings.max_batch,
        max_input_len=settings.max_seq_len,
        max_seq_len=settings.max_seq_len,
        max_num_tokens=settings.max_batch * settings.max_seq_len,
        gather_context_logits=settings.gather_context_logits,
        strongly_typed=True,
        output_timing_cache=str(out / "timing.cache"),  # the default is a file in the working directory
    )
    for name, value in settings.plugins().items():
        setattr(config.plugin_config, name, value)
    builder.build(model, config).save(str(out))
    meta["trtllm"] = {"version": tllm.__version__, "kv_dtype": model.config.kv_dtype, **asdict(settings)}


@dataclass(frozen=True)
class IOTensor:
    """One engine IO tensor as TensorRT reports it."""

    name: str
    is_input: bool
    on_host: bool
    dtype: torch.dtype
    rank: int


def check_bindings(io: list[IOTensor], bound: dict[str, torch.Tensor], where: str = WHERE) -> None:
    """Refuse (InputError) unless every engine input is bound, with the engine's dtype and place."""
    missing = [t.name for t in io if t.is_input and t.name not in bound]
    if missing:
        raise InputError(where, f"refusing to enqueue: engine input(s) not bound: {', '.join(missing)}")
    for t in io:
        x = bound.get(t.name)
        if x is not None and x.dtype != t.dtype:
            raise InputError(where, f"refusing to enqueue: '{t.name}' is {x.dtype}, the engine wants {t.dtype}")
        if x is not None and (x.device.type == "cpu") != t.on_host:
            raise InputError(where, f"refusing to enqueue: '{t.name}' must be in {'host' if t.on_host else 'device'} memory")


@dataclass(frozen=True)
class CacheLayout:
    """The static paged KV cache: one pool, a fixed run of blocks per batch slot."""

    num_layers: int
    max_batch: int
    max_seq_len: int
    tokens_per_block: int

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.max_seq_len / self.tokens_per_block)

    def pool_shape(self, kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (self.max_batch * self.blocks_per_seq, self.num_layers, 2, kv_heads, self.tokens_per_block, head_size)

    def block_offsets(self, slots: Sequence[int]) -> torch.Tensor:
        """[1 pool, len(slots), K/V, blocks_per_seq] int32 offsets into the pool: each slot's own
        run of blocks, whichever sequences step together."""
        first = torch.tensor(list(slots), dtype=torch.int32)[:, None] * self.blocks_per_seq
        blocks = (first + torch.arange(self.blocks_per_seq, dtype=torch.int32)).view(len(slots), 1, -1)
        return (blocks * self.num_layers * 2 + torch.arange(2, dtype=torch.int32).view(1, 2, 1))[None]


def step_inputs(
    ids: torch.Tensor,
    slots: Sequence[int],
    past: Sequence[int],
    prompt_len: Sequence[int],
    layout: CacheLayout,
    pool_ptr: int,
    mapping_rank: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Every engine input for one step: `ids` [B, T] embedding rows of the sequences in these
    slots, after past[b] cached positions each (in-flight batching: each its own length).

    All past 0 is the context phase (T = each prompt's length); otherwise a generation step (T = 1)."""
    b, t = ids.shape
    host = {"dtype": torch.int32}
    dev = {"dtype": torch.int32, "device": device}
    context = not any(past)
    past_t = torch.tensor(list(past), **host)
    knobs = torch.full((16,), -1, dtype=torch.int64)
    knobs[0] = 1  # multi-block mode, as GenerationSession sets it
    mapping = torch.stack([torch.zeros(layout.num_layers, **host), torch.arange(layout.num_layers, **host)], 1)
    offsets = layout.block_offsets(slots)
    prompts = torch.tensor(list(prompt_len), **host)
    return {
        "input_ids": ids.reshape(-1).to(**dev),
        "position_ids": (past_t[:, None] + torch.arange(t, **host)).reshape(-1).to(device),
        "last_token_ids": (torch.arange(1, b + 1, **host) * t).to(device),  # 1-based, packed
        "context_lengths": prompts.to(device),
        "host_context_lengths": prompts,
        "sequence_length": (past_t + t).to(device),
        "host_past_key_value_lengths": torch.full((b,), t, **host) if context else past_t,
        "host_request_types": torch.full((b,), 0 if context else 1, **host),
        "cache_indirection": torch.zeros((b, 1, layout.max_seq_len), **dev),
        "kv_cache_block_offsets": offsets.to(device),
        "host_kv_cache_block_offsets": offsets,
        "host_kv_cache_pool_pointers": torch.tensor([[pool_ptr, 0]], dtype=torch.int64),
        "host_kv_cache_pool_mapping": mapping if mapping_rank == 2 else mapping[:, 0].contiguous(),
        "host_max_attention_window_sizes": torch.full((layout.num_layers,), layout.max_seq_len, **host),
        "host_sink_token_length": torch.zeros(1, **host),
        "host_runtime_perf_knobs": knobs,
        "host_context_progress": torch.zeros(1, dtype=torch.int64),
    }


class TrtllmEngine(Engine):
    """A built TensorRT-LLM engine with its KV pool: both heads per step, every input bound."""

    def __init__(self, engine_dir: Path, meta: dict, max_batch: int):
        require_tensorrt_llm()
        import tensorrt as trt
        from tensorrt_llm._utils import str_dtype_to_torch, trt_dtype_to_torch
        from tensorrt_llm.runtime import Session

        t = meta["trtllm"]
        self.spec = ModelSpec(**meta["spec"])
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_batch, self.max_seq_len = max_batch, t["max_seq_len"]
        self.gather_context_logits = t["gather_context_logits"]
        self.session = Session.from_serialized_engine((Path(engine_dir) / ENGINE_FILE).read_bytes())
        engine = self.session.engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.io = [
            IOTensor(
                name=n,
                is_input=engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT,
                on_host=engine.get_tensor_location(n) == trt.TensorLocation.HOST,
                dtype=trt_dtype_to_torch(engine.get_tensor_dtype(n)),
                rank=len(engine.get_tensor_shape(n)),
            )
            for n in names
        ]
        ranks = {io.name: io.rank for io in self.io}
        if ranks.get("kv_cache_block_offsets") != 4 or ranks.get("host_kv_cache_pool_pointers") != 2:
            raise InputError(
                engine_dir, f"the engine's KV-cache inputs are not laid out as TensorRT-LLM {SUPPORTED_TEXT} lays them"
            )
        self.mapping_rank = ranks.get("host_kv_cache_pool_mapping", 2)
        self.layout = CacheLayout(self.spec.num_layers, max_batch, self.max_seq_len, t["tokens_per_block"])
        kv_shape = self.layout.pool_shape(self.spec.num_key_value_heads, self.spec.head_dim)
        self.pool = torch.zeros(kv_shape, dtype=str_dtype_to_torch(t["kv_dtype"]), device=self.device)
        self.slots = Slots(max_batch, self.max_seq_len)  # a slot keeps its own run of pool blocks: no moves
        self.prompt_len: dict[int, int] = {}

    def _run(self, ids: torch.Tensor, slots: Sequence[int], past: Sequence[int]) -> dict[str, torch.Tensor]:
        """One enqueue on the current stream; the outputs as TensorRT shapes them."""
        prompts = [self.prompt_len[s] for s in slots]
        feeds = step_inputs(ids, slots, past, prompts, self.layout, self.pool.data_ptr(), self.mapping_rank, self.device)
        inputs = {t.name: feeds[t.name] for t in self.io if t.is_input and t.name in feeds}
        check_bindings(self.io, inputs)
        ctx = self.session.context
        for name, x in inputs.items():
            ctx.set_input_shape(name, tuple(x.shape))
        outputs = {
            t.name: torch.empty(tuple(ctx.get_tensor_shape(t.name)), dtype=t.dtype, device=self.device)
            for t in self.io
            if not t.is_input
        }
        for name, x in {**inputs, **outputs}.items():
            ctx.set_tensor_address(name, x.data_ptr())
        if not ctx.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise RuntimeError("TensorRT failed to enqueue the MOSS-Speech engine")
        return outputs

    @torch.no_grad()
    def admit(
        self, slots: Sequence[int], tokens: torch.Tensor, need_text: bool = True, all_logits: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A context phase for the new sequences only; the engine always computes both heads (one
        network), so need_text only drops the text logits."""
        b, t, _ = tokens.shape
        if all_logits and not self.gather_context_logits:
            raise ValueError("this engine was built without gather_context_logits: no logits for every position")
        if b != len(slots):
            raise ValueError(f"admit: {b} prompts for {len(slots)} slots")
        self.slots.admit(slots, t)
        self.prompt_len |= dict.fromkeys(slots, t)
        out = self._run(merged_ids(tokens.to(self.device), self.spec), slots, [0] * b)
        text, audio = out["logits"], out["audio_logits"]
        if self.gather_context_logits:  # one row per prompt position, sequences packed
            text, audio = text.view(b, t, -1), audio.view(b, t, -1)
            if not all_logits:
                text, audio = text[:, -1], audio[:, -1]
        return (text.float() if need_text else None), audio.float()

    @torch.no_grad()
    def step(
        self, slots: Sequence[int], tokens: torch.Tensor, need_text: bool | Sequence[bool] = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One generation step for these active slots, each after its own cached length (in-flight
        batching: any of them, their blocks found by slot)."""
        rows = self.slots.rows(slots)
        past = [self.slots.length[r] for r in rows]
        out = self._run(merged_ids(tokens.to(self.device), self.spec)[:, None], slots, past)
        self.slots.stepped(rows, rows)
        return (out["logits"].float() if any_text(need_text) else None), out["audio_logits"].float()

    def release(self, slots: Sequence[int]) -> None:
        self.slots.release(slots)  # the rows' moves need nothing here: blocks belong to slots
        for s in slots:
            del self.prompt_len[s]

    def active(self) -> list[int]:
        return self.slots.active()


def load(engine_dir: str | Path, meta: dict, options: EngineOptions) -> TrtllmEngine:
    """Open an engine directory written by build (a CUDA device; a batch limit up to the built one)."""
    built, max_batch = meta["options"].max_batch, options.max_batch
    if max_batch > built:
        raise InputError(engine_dir, f"max_batch {max_batch} exceeds the {built} the engine was built for")
    require_tensorrt_llm()
    if "trtllm" not in meta:
        raise InputError(Path(engine_dir) / "engine.json", "no 'trtllm' section: not built by this backend's build()")
    return TrtllmEngine(Path(engine_dir), meta, max_batch)
