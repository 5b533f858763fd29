"""Our PyTorch engine: reads the TensorRT-LLM checkpoint, KV caches in max_batch slots, two heads.

gpt-fast in spirit: plain modules, static cache buffers, masks derived on the device from the
positions, no host syncs in a step. The caches hold `max_batch` slots (`slots.Slots`): admit
prefills new streams into free rows, a step of k slots swaps their rows into 0..k-1 where they
are not there already and advances those rows together, each at its own position (its rope
angles, its keys written at (row, position), its own attention mask), and a release refills the
freed row with the last one. Rows k.. that a step's bucket pads with are stepped too, at their
own next position, and their results dropped: what they write there (cache entries, the held
trunk output) lies past their length, where no one reads before a step of theirs writes it.
Layers 0..S-1 are the trunk, then the text branch, then the audio branch; each layer owns its K
and V caches, a tensor each, so neither branches nor K and V can alias. On CUDA every step is
replayed from a CUDA graph (one per row bucket, text-head need and attention bucket); decode
attends to the first `kv_len` cached positions, a multiple of KV_BUCKET just past the longest
sequence stepped, rather than to the whole cache. A layer is a pure function of its tensors
(`layer.layer_step`), so that with `compile` one torch.compile'd version of it, with the
elementwise work between the matmuls fused, serves every layer. With `gemv` and
`decode_attention`, decode goes through our Triton kernels (workflow.engines.gemv, .attention):
the matmuls with their norms and residual adds, and the whole attention, each one kernel;
linears.py holds the linear layers and `project`, which picks the path.

With `defer_text_fill`, an audio-mode step runs no text branch at all (its only use there is
to fill that branch's KV cache: the text logits are never read, FACTS.md 1); it keeps the
trunk's output, and the next step that needs text first runs the text branch over every
position owed, at once, like a prefill continuing the cache: one read of the branch's weights
(1.5 GB in bf16) per spoken reply instead of one per audio step; each row keeps its own count of
positions filled. Every logit the loop reads is the same function; only when the text cache is
filled changes.

`confine` puts the decode steps' graphs (and the text catch-ups') on a green context of fewer SMs,
the admissions' staying on all: serving's detokenizer keeps the rest while decode runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workflow import trtckpt
from workflow.cudagraphs import CAPTURE_PRIORITY, Graphs
from workflow.engines import ahead, blocks
from workflow.engines.base import Engine, any_text, merged_ids, to_device
from workflow.engines.layer import At, Layer, LayerConfig, layer_step
from workflow.engines.linears import Linear, layer_linears, project
from workflow.engines.options import EngineOptions
from workflow.engines.slots import Slots, step_bucket
from workflow.engines.tuning import tune
from workflow.names import layer_plan
from workflow.spec import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_BUCKET = 128  # decode attends to the cache in steps of this many positions
COMPILES = 64  # layer_step's compiled versions kept (torch's default, 8, is fewer than its shapes)
CATCH_UP_ROWS = 16  # the deferred text branch's catch-up runs at least this many rows (a graph per power of two)
NORMS = ("input_layernorm", "post_layernorm", "attention.q_layernorm", "attention.k_layernorm")


class TorchEngine(Engine, nn.Module):
    """The whole dual-head model over a TensorRT-LLM checkpoint's tensors."""

    def __init__(
        self,
        spec: ModelSpec,
        tensors: dict[str, torch.Tensor],
        options: EngineOptions,
        tuning: dict[blocks.Use, blocks.Tuned] | None = None,
        known: dict[blocks.Use, blocks.Tuned] | None = None,
    ):
        """tuning: the GEMV's blocks from engine.json; None with `gemv` on CUDA: tuned here (build), but for those
        `known` has (build's timing cache, `engine.timing_cache`)."""
        nn.Module.__init__(self)
        self.spec, self.options = spec, options
        self.device = torch.device(options.device)
        self.dtype = DTYPES[options.dtype]
        dev, dt = options.device, self.dtype

        def t(name: str) -> torch.Tensor:
            return tensors[name].to(device=dev, dtype=dt)

        step = layer_step
        if options.compile:  # static shapes: a recompile per (batch, length, bucket) beats slower dynamic kernels
            step = torch._dynamo.config.patch(cache_size_limit=COMPILES)(torch.compile(step, dynamic=False, fullgraph=True))
        cfg = LayerConfig(spec.rms_norm_eps, spec.head_dim, options.gemv, options.decode_attention, options.gemv)
        self.embedding = t("transformer.vocab_embedding.weight")
        self.layers = nn.ModuleList(
            Layer(
                layer_linears(tensors, f"transformer.layers.{n}.", dt, dev, options.fp8_fast_accum),
                tuple(t(f"transformer.layers.{n}.{k}.weight") for k in NORMS),
                step,
                cfg,
            )
            for n in range(spec.num_layers)
        )
        plan = layer_plan(spec)
        self.trunk = [self.layers[i] for i in plan["shared_block"]]
        self.text_block = [self.layers[i] for i in plan["text_block"]]
        self.audio_block = [self.layers[i] for i in plan["audio_block"]]
        self.ln_f, self.audio_ln_f = t("transformer.ln_f.weight"), t("transformer.audio_ln_f.weight")
        self.lm_head = Linear(t("lm_head.weight"))
        self.audio_lm_head = Linear(t("audio_lm_head.weight"))
        self.max_batch, self.max_seq_len = options.max_batch, options.max_seq_len
        self.tuning = dict(tuning or {})
        if options.gemv and self.device.type == "cuda":
            uses = self.gemv_uses()
            if not self.tuning:  # first load (build): choose each use's block on this GPU
                self.tuning = tune([(lin.weight, fuse) for lin, fuse in uses], known=known)
            for lin, fuse in uses:
                lin.blocks = blocks.blocks_for(self.tuning, lin.weight, fuse)
        inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, device=dev).float() / spec.head_dim)
        angles = torch.outer(torch.arange(options.max_seq_len, device=dev).float(), inv_freq)
        self.cos, self.sin = angles.cos(), angles.sin()
        self.positions = torch.arange(options.max_seq_len, device=dev)  # persistent: graphs read it
        self.row_ids = torch.arange(options.max_batch, device=dev)[:, None]
        for layer in self.layers:  # a tensor each: one compiled step mutating two views of one base would alias
            shape = (options.max_batch, spec.num_key_value_heads, options.max_seq_len, spec.head_dim)
            layer.k_cache, layer.v_cache = torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev)
        self.slots = Slots(options.max_batch, options.max_seq_len)
        self.pos = torch.zeros(options.max_batch, 1, dtype=torch.long, device=dev)  # each row's next position
        self.admit_rows = torch.zeros(options.max_batch, 1, dtype=torch.long, device=dev)  # the admit graphs' input
        self.use_graphs = options.cuda_graphs and self.device.type == "cuda"
        self.graphs = Graphs(self.device) if self.use_graphs else None
        self.static_tokens: dict[tuple[int, ...], tuple] = {}  # shape -> graph input, pinned host buffer, copy event
        self.defer_text_fill = options.defer_text_fill
        self.held: torch.Tensor | None = None  # [max_batch, max_seq_len, hidden], made by the first step that defers
        self.catch_up_pos = torch.zeros(options.max_batch, options.max_seq_len, dtype=torch.long, device=dev)

    def gemv_uses(self) -> list[tuple[Linear, blocks.Fuse]]:
        """Each linear the GEMV reads in decode, with the Fuse of its call."""
        heads = [(head, blocks.Fuse.NORM) for head in (self.lm_head, self.audio_lm_head)]
        return [use for layer in self.layers for use in layer.gemv_uses()] + heads

    def tuning_json(self) -> dict:
        return {"gemv": blocks.tuning_json(self.tuning)} if self.tuning else {}

    def at(self, pos: torch.Tensor, rows: torch.Tensor, kv_len: int | None) -> At:
        """A step's At: positions pos [B or 1, T] in cache rows [B, 1]; kv_len None: a prefill."""
        mask = None if kv_len is None else attention_mask(pos, kv_len)
        return At(self.cos[pos], self.sin[pos], pos, rows, mask)

    def forward_tokens(
        self, tokens: torch.Tensor, at: At, need_text: bool, all_logits: bool, hold: bool = False, step: Callable | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """tokens [B, T, 2] (text id, audio id) where `at` puts them -> both heads' logits.
        hold: no text branch, the trunk output kept in `held` for `_catch_up_text`. step: as `Layer.forward`'s."""
        x = F.embedding(merged_ids(tokens, self.spec), self.embedding)
        for layer in self.trunk:
            x = layer(x, at, step)
        if hold:
            self.held[at.rows, at.pos] = x
        text = x if hold else self._text_branch(x, at, step)
        audio = x
        for layer in self.audio_block:
            audio = layer(audio, at, step)
        if not all_logits:
            text, audio = text[:, -1], audio[:, -1]
        eps, fused = self.spec.rms_norm_eps, self.options.gemv
        text_logits = project(text, self.lm_head.args(), fused, self.ln_f, eps).float() if need_text else None
        audio_logits = project(audio, self.audio_lm_head.args(), fused, self.audio_ln_f, eps).float()
        return text_logits, audio_logits

    def _text_branch(self, x: torch.Tensor, at: At, step: Callable | None = None) -> torch.Tensor:
        for layer in self.text_block:
            x = layer(x, at, step)
        return x

    def _catch_up_text(self, b: int) -> None:
        """The text branch over every position audio-mode steps left it, in rows 0..b-1, at once:
        one read of its weights for them all. Each row runs R positions from its first owed one
        (R a power of two, >= CATCH_UP_ROWS and the most any row owes); positions past a row's
        length (clamped to the cache) write entries no one reads before a step writes them. On
        CUDA a graph per (rows, R, attention bucket) replays it (eager, its ~250 small ops cost
        the host milliseconds), with the eager `layer_step`: a compile per shape costs seconds."""
        slots, m = self.slots, min(b, self.slots.n)
        owed = max(n - f for n, f in zip(slots.length[:m], slots.filled[:m], strict=True))
        if owed == 0:
            return
        r = max(CATCH_UP_ROWS, 1 << (owed - 1).bit_length())
        kv_len = kv_bucket(min(max(slots.filled[:m]) + r, self.max_seq_len), self.max_seq_len)
        first = to_device(self.device, slots.filled[:m] + [0] * (b - m))
        pos = (first[:, None] + self.positions[None, :r]).clamp_(max=self.max_seq_len - 1)
        self.catch_up_pos[:b, :r].copy_(pos)
        self._fill_text(b, r, kv_len)

    def _fill_text(self, b: int, r: int, kv_len: int) -> None:
        """The catch-up itself, at the positions `catch_up_pos` holds."""

        def fill() -> torch.Tensor:
            pos, rows = self.catch_up_pos[:b, :r], self.row_ids[:b]
            return self._text_branch(self.held[rows, pos], self.at(pos, rows, kv_len), layer_step)

        if self.use_graphs:
            self.graphs.run(("catch-up", b, r, kv_len), fill)
        else:
            fill()

    @torch.no_grad()
    def admit(
        self, slots: Sequence[int], tokens: torch.Tensor, need_text: bool = True, all_logits: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        b, t, _ = tokens.shape
        if b != len(slots):
            raise ValueError(f"admit: {b} prompts for {len(slots)} slots")
        rows = self.slots.admit(slots, t)
        self.pos[rows.start : rows.stop].fill_(t)
        self.admit_rows[:b, 0].copy_(self.row_ids[rows.start : rows.stop, 0])
        return self._run(tokens, ("admit", need_text, all_logits), self._prefill(b, t, need_text, all_logits))

    @torch.no_grad()
    def step(
        self, slots: Sequence[int], tokens: torch.Tensor, need_text: bool | Sequence[bool] = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        if not slots:
            raise ValueError("step: no active slot")
        self.slots.rows(slots)  # refuses what it cannot step before any row moves
        if swaps := self.slots.front(slots):
            self._swap(swaps)
        rows = [self.slots.row_of[s] for s in slots]  # 0..k-1 now, in the caller's order
        text_head = any_text(need_text)
        n = len(rows)
        b = step_bucket(n, self.max_batch)
        kv_len = kv_bucket(max(self.slots.length[:n]) + 1, self.max_seq_len)
        hold = self.defer_text_fill and not text_head
        if not hold:
            self._catch_up_text(b)
        elif self.held is None:  # outside any graph: those that hold read this one buffer
            self.held = self.embedding.new_zeros(self.max_batch, self.max_seq_len, self.spec.hidden_size)
        index = None if rows == list(range(n)) else to_device(tokens.device, rows)  # each slot's row
        by_row = tokens
        if index is not None or b != n:  # the tokens in row order, padding rows after them
            by_row = tokens.new_zeros(b, 2)
            by_row[slice(0, n) if index is None else index] = tokens

        text, audio = self._run(by_row[:, None], ("step", text_head, kv_len, hold), self._decode(b, kv_len, text_head, hold))
        self.pos[:n] += 1
        self.slots.stepped(range(n), () if hold else range(min(b, self.slots.n)))
        if index is not None or b != n:  # back in the slots' order, padding rows dropped
            keep = slice(0, n) if index is None else index.to(self.device)
            text, audio = (None if text is None else text[keep]), audio[keep]
        return text, audio

    def _swap(self, swaps: list[tuple[int, int]]) -> None:
        """Exchange the rows of each pair (disjoint pairs: one gather and scatter a tensor for all of
        them) in the caches, positions and held trunk outputs."""
        dst, src = to_device(self.device, [[a for a, _ in swaps] + [b for _, b in swaps],
                                           [b for _, b in swaps] + [a for a, _ in swaps]]).unbind(0)  # fmt: skip
        for t in [*self.caches(), self.pos, *([] if self.held is None else [self.held])]:
            t[dst] = t[src]

    def confine(self, sms: int, setting: str = "decode_sms") -> int:
        """Decode steps and text catch-ups on `sms` SMs from now on, 0: all (`Graphs.confine`); the SMs they
        have. Without graphs (off CUDA, or `cuda_graphs` off) nothing changes."""
        return self.graphs.confine(sms, decode_work, CAPTURE_PRIORITY, setting) if self.graphs else 0

    def capture(self, rows: int, shortest: int, admissions: Sequence[tuple[int, int]] = ()) -> int:
        """Serving's graphs made ahead (`ahead.capture`); the number captured."""
        return ahead.capture(self, rows, shortest, admissions)

    def _prefill(self, b: int, t: int, need_text: bool, all_logits: bool, step: Callable | None = None) -> Callable:
        """A prefill of t tokens into the rows `admit_rows` holds, as a function of the tokens on the device."""

        def run(static: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
            at = self.at(self.positions[None, :t], self.admit_rows[:b], None)
            return self.forward_tokens(static, at, need_text, all_logits, step=step)

        return run

    def _decode(self, b: int, kv_len: int, text_head: bool, hold: bool, step: Callable | None = None) -> Callable:
        """A decode step of rows 0..b-1 at their positions, as a function of the tokens on the device."""

        def run(static: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
            pos = self.pos[:b].clamp(max=self.max_seq_len - 1)  # a padding row may be a full one
            at = self.at(pos, self.row_ids[:b], kv_len)
            return self.forward_tokens(static, at, text_head, False, hold, step)

        return run

    def release(self, slots: Sequence[int]) -> None:
        for src, dst in self.slots.release(slots):
            for cache in self.caches():
                cache[dst].copy_(cache[src])
            self.pos[dst] = self.pos[src]
            if self.held is not None:
                self.held[dst].copy_(self.held[src])
        self.pos[self.slots.n :].zero_()  # free rows step at position 0 in a padded bucket

    def active(self) -> list[int]:
        return self.slots.active()

    def caches(self) -> list[torch.Tensor]:
        """Every layer's K and V cache, [max_batch, kv heads, max_seq_len, head_dim] each."""
        return [c for layer in self.layers for c in (layer.k_cache, layer.v_cache)]

    def _run(self, tokens: torch.Tensor, key: tuple, fn: Callable[[torch.Tensor], tuple]) -> tuple:
        """fn(tokens on the device), replayed on CUDA from a graph per (tokens' shape, key). Host
        tokens reach the graph's input through a pinned buffer, copied asynchronously, and the
        embedding rows are chosen inside the graph: a step costs the host one copy and one launch."""
        if not self.use_graphs:
            return fn(tokens.to(self.device))
        shape = tuple(tokens.shape)
        if shape not in self.static_tokens:
            pinned = torch.empty(shape, dtype=torch.long, pin_memory=True)
            self.static_tokens[shape] = (torch.empty(shape, dtype=torch.long, device=self.device), pinned, torch.cuda.Event())
        static, pinned, copied = self.static_tokens[shape]
        if tokens.device.type == "cpu":
            copied.synchronize()  # the previous copy out of the pinned buffer has finished
            pinned.copy_(tokens)
            static.copy_(pinned, non_blocking=True)
            copied.record()
        else:
            static.copy_(tokens)
        text, audio = self.graphs.run((shape, *key), lambda: fn(static))
        return (None if text is None else text.clone()), audio.clone()


def decode_work(key: Hashable) -> bool:
    """Whether a graph's key (`_run`'s, `_fill_text`'s) is a decode step's or a text catch-up's, not an admission's."""
    return isinstance(key, tuple) and (key[0] == "catch-up" or key[1] == "step")


def attention_mask(pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, 1, T, kv_len]: which of its row's first kv_len cached positions each token at pos
    [B, T] attends to (itself and those before it), made on the device so that a graph replays it."""
    return (torch.arange(kv_len, device=pos.device) <= pos[..., None])[:, None]


def kv_bucket(length: int, max_seq_len: int) -> int:
    """How many cached positions decode attends to for a sequence of `length`: the next
    multiple of KV_BUCKET (one graph per bucket), at most the cache."""
    return min(max_seq_len, -(-length // KV_BUCKET) * KV_BUCKET)


def load(engine_dir: str | Path, meta: dict, options: EngineOptions, known: dict | None = None) -> TorchEngine:
    """Open an engine directory written by build (its checkpoint files are hard links), with
    the tuning build stored (none yet: tuned now, but for the blocks `known` has)."""
    _, spec, tensors = trtckpt.load_checkpoint(engine_dir, device="cuda" if options.on_cuda else "cpu")
    return TorchEngine(spec, tensors, options, blocks.read_tuning(meta.get("tuning", {}).get("gemv", {})), known)
