"""The flow cache in fixed buffers: many streams' pasts in preallocated pools, written in place, so
that one batched call (and one CUDA graph per shape) solves only each stream's new frames.

A stream's `Past` (estimator.py) holds what the ODE's passes made of its earlier frames, but as
tensors that each call copies and grows, one stream at a time. Here, per ODE step:

- keys and values, per attention: one pool [frames, 2, heads, head_dim], flat, so that any frame is
  one index. First two rows of `frames` frames: the voice prompt's (its past, `CodecDecoder.prompt_past`,
  read by every stream: the prompt's frames are stored once) and a scratch row (what padding rows
  write); then pages of PAGE frames, which a slot takes as its stream's frames grow (its frames from
  the end of the prompt's past on) and gives back when it ends: the pools hold the frames streams
  have, not every slot's longest reply, so more streams fit the same memory;
- each causal convolution's last `left` input frames: one pool [rows, width] for all convolutions,
  two rows a slot: a call reads one and writes the other, so that a call run again (a CUDA graph's
  warm-up and capture run it three times) reads what it read the first time.

Every row is two rows with guidance (the conditioned and the unconditioned pass). A call gives each
of its rows the flat index of every key frame (the prompt's past, then its slot's frames) and of its
new frames; a pass writes the new keys and values, then attends over the gathered keys under each
row's chunk mask, shifted by the row's first frame. Frames a call writes past its row's valid end
(its padding) lie after every frame the row has: masked until the next call writes them over.

Memory is what bounds it: at the true shape in bf16, 10 steps x 56 attentions x keys and values of
512 values x 2 rows is ~2.3 MB a frame (docs/codec.md, "The flow cache"). With `fp8` the keys' and
values' pools hold float8 e4m3, half that: each value divided by its (key or value, head)'s scale,
PAGE_MARGIN x the largest the voice prompt's past holds there over e4m3's largest, so that values up
to that margin past the prompt's keep e4m3's 3 mantissa bits and larger ones saturate; every read
multiplies it back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workflow.codec import kernels
from workflow.codec.decoder import CodecDecoder, VoicePrompt
from workflow.codec.estimator import CausalConv1d, CausalResnetBlock1D, TransformerBlock
from workflow.codec.fast import ALIGN, compile_block, conv, windowed
from workflow.codec.solver import solve

PAGE = 40  # frames a page of the pools holds (two chunks of 5 codes at 4 frames a code)
FP8_MAX = 448.0  # e4m3's largest finite value
PAGE_MARGIN = 2.0  # with fp8: keys and values up to this many times the prompt's largest keep their precision


@dataclass(frozen=True)
class SlotIndex:
    """One batched call's rows (R = rows x 2 with guidance, the conditioned rows first), made on the
    host: each row's first frame solved and how many of its Q new frames count, the flat index of its
    K key frames and of its new frames in the key pools, the convolution-tail rows it reads and writes."""

    starts: Tensor  # [R]
    valid: Tensor  # [R]
    keys: Tensor  # [R, K]
    writes: Tensor  # [R, Q]
    tails_in: Tensor  # [R]
    tails_out: Tensor  # [R]

    def tensors(self) -> tuple[Tensor, ...]:
        return self.starts, self.valid, self.keys, self.writes, self.tails_in, self.tails_out


class FlowSlots:
    """`slots` streams' flow pasts of up to `frames` frames each (after the prompt's past) in one voice,
    in `pages` pages of PAGE frames (0: enough for every slot's `frames`); fp8: keys and values in float8."""

    def __init__(
        self, decoder: CodecDecoder, prompt: VoicePrompt, slots: int, frames: int, pages: int = 0, fp8: bool = False
    ) -> None:
        cfg, est = decoder.cfg, decoder.estimator
        if slots < 1 or frames < 1:
            raise ValueError(f"flow slots: need at least one slot of one frame, got {slots} of {frames}")
        self.decoder, self.prompt = decoder, prompt.to(decoder.device)
        past = decoder.prompt_past(self.prompt)
        self.base = past[0].frames  # the prompt's past: every stream's first call starts there
        self.halves = 2 if cfg.solver.cfg_rate != 0 else 1
        self.frames = max(frames, self.base)  # a row's frames (the prompt's row holds its past)
        self.count, self.pages = slots, pages or slots * -(-self.frames // PAGE)
        self.free = list(range(slots))
        self.free_pages = list(range(self.pages))
        self.table: list[list[int]] = [[] for _ in range(slots)]  # each slot's pages, in frame order
        self.freed: dict[tuple[str, int], torch.cuda.Event] = {}  # CUDA: each released slot's and page's last use
        self.parity = [0] * slots
        self.attn = [b.attn1 for b in est.transformer_blocks()]
        self.convs = [m for m in est.modules() if isinstance(m, CausalConv1d)]
        self.width = {c: c.left * c.in_channels for c in self.convs}
        self.offset, w = {}, 0
        for c in self.convs:
            self.offset[c], w = w, w + self.width[c]
        dev, dtype = decoder.device, est.final_proj.weight.dtype
        h, heads, d = self.halves, est.cfg.heads, est.cfg.head_dim
        if fp8 and not all(p.keys for p in past):
            raise ValueError("flow slots: fp8 pages take their scales from the voice prompt's past, and this prompt has none")
        self.fixed = 2 * h * self.frames  # the prompt's rows and the scratch's, then the pages
        size = self.fixed + self.pages * h * PAGE
        kv_dtype = torch.float8_e4m3fn if fp8 else dtype
        self.kv = [{a: torch.zeros(size, 2, heads, d, device=dev, dtype=kv_dtype) for a in self.attn} for _ in past]
        # with fp8: each pool's scale [2, heads, d], a frame's layout (the kernels index it as they index a frame)
        self.scale = [{a: page_scale(*p.keys[a]) for a in self.attn} for p in past] if fp8 else None
        self.tails = [torch.zeros(h * (2 + 2 * slots), w, device=dev, dtype=dtype) for _ in past]
        for step, p in enumerate(past):  # the prompt's rows: its past, once
            for a, (k, v) in p.keys.items():
                rows = self.kv[step][a][: self.fixed].view(2 * h, self.frames, 2, heads, d)
                kv = torch.stack([k, v], 2).transpose(1, 3)
                rows[:h, : self.base] = to_page(kv, self.scale[step][a]) if self.scale else kv
            for c, x in p.convs.items():
                self.tails[step][:h, self.offset[c] : self.offset[c] + self.width[c]] = x.flatten(1)
        self.noise = decoder.noise.buffer.to(dev)  # [1, mels, frames], read per row inside a graph
        self.velocity = SlotPass(decoder)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for step in self.kv for t in step.values()) + sum(
            t.numel() * t.element_size() for t in self.tails
        )

    @staticmethod
    def size(decoder: CodecDecoder, slots: int, frames: int, pages: int = 0, fp8: bool = False) -> int:
        """The bytes `FlowSlots(decoder, <a prompt whose past fits a slot>, slots, frames, pages, fp8)` holds."""
        cfg, est = decoder.cfg, decoder.estimator
        h = 2 if cfg.solver.cfg_rate != 0 else 1
        rows = 2 * h * frames + (pages or slots * -(-frames // PAGE)) * h * PAGE
        kv = len(est.transformer_blocks()) * rows * 2 * est.cfg.heads * est.cfg.head_dim
        tails = h * (2 + 2 * slots) * sum(m.left * m.in_channels for m in est.modules() if isinstance(m, CausalConv1d))
        size = est.final_proj.weight.element_size()
        return cfg.solver.steps * (kv * (1 if fp8 else size) + tails * size)

    def take(self) -> int:
        """A free slot for a new stream (its pages come as its frames grow: `grow`). On CUDA the current
        stream first waits for the slot's last use: its last stream's final call may still run on the
        other lane, and the new stream's first call writes the same rows."""
        if not self.free:
            raise RuntimeError(f"all {self.count} flow slots are taken (benchmark.codec.slots)")
        slot = self.free.pop(0)
        self._after(("slot", slot))
        return slot

    def grow(self, slot: int, frames: int) -> bool:
        """Pages for the slot's first `frames` frames, taken now if it lacks them; False (taking none)
        past a slot's `frames` or the free pages. A page another slot gave back is waited for like a slot."""
        need = -(-frames // PAGE) - len(self.table[slot])
        if frames > self.frames or need > len(self.free_pages):
            return False
        for _ in range(need):
            self.table[slot].append(self.free_pages.pop(0))
            self._after(("page", self.table[slot][-1]))
        return True

    def release(self, slot: int) -> None:
        """Called after the slot's last call is launched, on the lane that launched it: the slot and its
        pages are free."""
        self.parity[slot] = 0
        self.free.append(slot)
        self.free_pages += self.table[slot]
        if self.decoder.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.decoder.device))
            self.freed |= {("slot", slot): done} | {("page", p): done for p in self.table[slot]}
        self.table[slot] = []

    def _after(self, what: tuple[str, int]) -> None:
        if what in self.freed:
            torch.cuda.current_stream(self.decoder.device).wait_event(self.freed.pop(what))

    def index(self, slots: list[int | None], starts: list[int], ends: list[int], new: int, keys: int) -> SlotIndex:
        """The rows of a call: per row its slot (None: padding, the scratch row), its first and end
        frame (absolute, the prompt's first); `new` frames solved a row (Q), `keys` key frames (K).
        A row's first call starts at `base` and reads the prompt's tails; then its slot's, by parity. A
        row's slot takes the pages its new frames need (`grow`)."""
        f, h, n = self.frames, self.halves, len(slots)
        for s, a, b in zip(slots, starts, ends, strict=True):
            if s is not None and (b - a > new or b > keys or not self.grow(s, a - self.base + new)):
                raise ValueError(
                    f"a flow call of frames {a}..{b} does not fit: {new} new frames a call, {keys} keys, slots of {f} "
                    f"frames, {len(self.free_pages)} of {self.pages} pages free"
                )
        half = torch.arange(h)[:, None].expand(h, n)
        hr = half.reshape(-1, 1)  # each row's half
        paged = torch.tensor([s is not None for s in slots]).repeat(h)[:, None]
        have = torch.tensor([f if s is None else len(self.table[s]) * PAGE for s in slots]).repeat(h)[:, None]
        width = max([len(self.table[s]) for s in slots if s is not None] + [1])
        pad = [[0] * width if s is None else self.table[s] + self.table[s][-1:] * (width - len(self.table[s])) for s in slots]
        table = torch.tensor(pad).repeat(h, 1)  # each row's pages, padded with its last

        def at(own: Tensor) -> Tensor:  # [R, X] frames of each row's own (from base) -> flat indices
            own = torch.minimum(own.clamp(min=0), have - 1)
            page = table.gather(1, torch.where(paged, own, 0) // PAGE)
            return torch.where(paged, self.fixed + (page * h + hr) * PAGE + own % PAGE, (h + hr) * f + own)

        start = torch.tensor(starts).repeat(h)
        j = torch.arange(keys)[None]
        key_index = torch.where(j < self.base, hr * f + j.clamp(max=f - 1), at(j - self.base))
        writes = at(start[:, None] - self.base + torch.arange(new))
        tail_row = [(2 + 2 * s + self.parity[s]) if s is not None else 1 for s in slots]  # in units of h rows
        first = [s is not None and a == self.base for s, a in zip(slots, starts, strict=True)]
        t_in = torch.tensor([0 if fi else r for fi, r in zip(first, tail_row, strict=True)])
        t_out = torch.tensor([r if s is None else 2 + 2 * s + 1 - self.parity[s] for s, r in zip(slots, tail_row, strict=True)])
        return SlotIndex(
            start,
            (torch.tensor(ends) - torch.tensor(starts)).repeat(h),
            key_index,
            writes,
            (t_in[None] * h + half).reshape(-1),
            (t_out[None] * h + half).reshape(-1),
        )

    def advance(self, slots: list[int | None]) -> None:
        """After a call (launched): its slots' next call reads the tails it wrote."""
        for s in slots:
            if s is not None:
                self.parity[s] ^= 1

    def flow(self, tokens: Tensor, lengths: Tensor, context: Tensor, *index: Tensor) -> Tensor:
        """The flow over rows of this voice, each solving only its new frames: tokens [n, T] (the prompt's
        codes first, right-padded), lengths [n], context [n, lookahead] (a last call's -1s), `index` a SlotIndex's
        tensors -> mel [n, mels, Q] float32, the frames from each row's start. No host sync: a graph."""
        dec = self.decoder
        return self.solve(dec.flow(tokens, lengths, chunk=dec.cfg.chunk, context=context), *index)

    def solve(self, mu: Tensor, *index: Tensor, step: int | None = None) -> Tensor:
        """The ODE of `flow` from the front end's mu [n, mels, T x stride]; step: that one ODE step alone
        (its pass and update: timing.py times it)."""
        dec, ix = self.decoder, SlotIndex(*index)
        n, q = mu.shape[0], ix.writes.shape[1]
        mels, frames = mu.shape[1], mu.shape[2]
        at = ix.starts[:n, None] + torch.arange(q, device=mu.device)  # [n, Q] absolute frames
        mu = mu.gather(2, at.clamp(max=frames - 1)[:, None].expand(-1, mels, -1))
        pm = self.prompt.mel.to(mu)
        cond = torch.cat([pm, pm.new_zeros(mels, 1)], 1)[:, at.clamp(max=pm.shape[1])].transpose(0, 1)
        x0 = self.noise[0][:, at.clamp(max=self.noise.shape[-1] - 1)].transpose(0, 1).to(mu.dtype)
        mask = (torch.arange(q, device=mu.device) < ix.valid[:n, None])[:, None].to(mu.dtype)
        spks = dec.flow.speaker(self.prompt.xvector.to(mu)[None]).expand(n, -1)
        bias = None if self.velocity.kernels else row_bias(ix, q, dec.estimator.chunk_frames, mu.dtype)
        steps = range(len(self.kv)) if step is None else [step]
        views = [SlotView(self, s, ix, bias) for s in steps]
        solver = dec.cfg.solver if step is None else replace(dec.cfg.solver, steps=1)
        return solve(self.velocity, mu, mask, spks, cond, solver, True, dec.noise, views, x0=x0)


def page_scale(k: Tensor, v: Tensor) -> Tensor:
    """A pool's fp8 scale [2, heads, d] from the prompt's past keys and values [h, heads, frames, d]: per
    (key or value, head), PAGE_MARGIN x their largest magnitude over FP8_MAX, the same for every d."""
    amax = torch.stack([k, v]).float().abs().amax(dim=(1, 3, 4)).clamp(min=1e-6)  # [2, heads]
    return (amax * PAGE_MARGIN / FP8_MAX)[..., None].expand(-1, -1, k.shape[-1]).contiguous()


def to_page(x: Tensor, scale: Tensor) -> Tensor:
    """Keys and values [..., 2, heads, d] as an fp8 pool stores them (saturating past FP8_MAX)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def from_page(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (x.float() * scale).to(dtype)


def tail_at(x: Tensor, valid: Tensor, left: int) -> Tensor:
    """x [R, left + Q, C], a convolution's input with its left context: each row's last `left` valid
    input frames [R, left, C] (row r's valid frames end at valid[r])."""
    at = valid[:, None] + torch.arange(left, device=x.device)
    return x.gather(1, at[..., None].expand(-1, -1, x.shape[2]))


def row_bias(ix: SlotIndex, q: int, chunk: int, dtype: torch.dtype) -> Tensor:
    """SDPA's additive mask [R, 1, Q, K] of a call's rows, made once a call (every ODE step's blocks read
    it): query frame start + i sees key j when j is in its chunk or before, and among the row's valid
    frames."""
    k = ix.keys.shape[1]
    at = ix.starts[:, None] + torch.arange(q, device=ix.starts.device)  # [R, Q]
    keys = torch.arange(k, device=at.device)
    allowed = (keys < ((at // chunk + 1) * chunk)[..., None]) & (keys < (ix.starts + ix.valid)[:, None, None])
    bias = torch.zeros(*allowed.shape[:2], -(-k // ALIGN) * ALIGN, device=at.device, dtype=dtype)[..., :k]
    return bias.masked_fill_(~allowed, float("-inf"))[:, None]


class SlotView:
    """One ODE step's part of a call: the convolution tails (`fast.Tails`), the keys and values, and
    the call's attention mask (None with the kernels, which compute it in place). The tails are read
    once, before the pass, and written once, after it (`flush`)."""

    def __init__(self, slots: FlowSlots, step: int, ix: SlotIndex, bias: Tensor | None) -> None:
        self.slots, self.ix, self.bias = slots, ix, bias
        self.kv = slots.kv[step]
        self.scale = slots.scale[step] if slots.scale else {}  # fp8 pages: each pool's scale
        self.pool = slots.tails[step]
        self.before = self.pool[ix.tails_in]  # [R, width]
        self.kept: dict[nn.Module, Tensor] = {}

    def tail(self, conv: nn.Module, x: Tensor | None = None) -> Tensor:
        """The convolution's left context [R, left, C_in], as read before the pass (x: unused, for `Tails`)."""
        o, w = self.slots.offset[conv], self.slots.width[conv]
        return self.before[:, o : o + w].view(-1, conv.left, conv.in_channels)

    def keep(self, conv: nn.Module, x: Tensor) -> None:
        self.kept[conv] = tail_at(x, self.ix.valid, conv.left)

    def flush(self) -> None:
        """Every convolution's new tails to the rows the call writes, in one copy."""
        new = torch.cat([self.kept[c].flatten(1) for c in self.slots.convs], dim=1)
        self.pool.index_copy_(0, self.ix.tails_out, new.to(self.pool.dtype))


def resnet(
    r: CausalResnetBlock1D, x: Tensor, time: Tensor, tails: tuple[Tensor, Tensor], valid: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """fast.resnet, its two causal convolutions' left context given and their new tails returned: no
    state, so it compiles whole."""
    (c1, _, n1), (c2, _, n2) = r.block1.block, r.block2.block
    x1 = torch.cat([tails[0], x], dim=1)
    h = F.mish(n1(windowed(c1, x1))) + time[:, None]
    h1 = torch.cat([tails[1], h], dim=1)
    out = F.mish(n2(windowed(c2, h1))) + conv(r.res_conv, x)
    return out, tail_at(x1, valid, c1.left), tail_at(h1, valid, c2.left)


def qkv(b: TransformerBlock, h: Tensor) -> Tensor:
    """A transformer block's q, k and v over [R, Q, C] -> [R, Q, 3, heads, d]."""
    a = b.attn1
    return a.qkv(b.norm1(h)).view(*h.shape[:2], 3, a.heads, -1)


def out(b: TransformerBlock, h: Tensor, y: Tensor) -> Tensor:
    """The rest of the block after attention: y [R, Q, heads x d]."""
    h = h + b.attn1.to_out[0](y)
    return h + b.ff(b.norm3(h))


class SlotPass:
    """The estimator's fast pass (fast.py) against a call's slot view: the same U-Net, each row's
    mask shifted by its own first frame. With the decoder's blocks compiled, so are the transformer
    blocks' parts around the attention (the pools are read and written eager, between them); with its
    `kernels`, the transformer blocks are five Triton kernels each (kernels.py)."""

    def __init__(self, decoder: CodecDecoder) -> None:
        self.fast, self.chunk = decoder.fast, decoder.estimator.chunk_frames
        self.kernels = decoder.kernels  # CodecDecoder checked that triton is there
        wrap = compile_block if decoder.compiled else lambda f: f
        self.resnet = wrap(resnet)
        self.qkv, self.out = (qkv, out) if self.kernels else (wrap(qkv), wrap(out))  # the kernels replace them

    def res(self, r: CausalResnetBlock1D, x: Tensor, time: Tensor, view: SlotView) -> Tensor:
        c1, c2 = r.block1.block[0], r.block2.block[0]
        out, view.kept[c1], view.kept[c2] = self.resnet(r, x, time, (view.tail(c1), view.tail(c2)), view.ix.valid)
        return out

    def time_inputs(self, t: Tensor) -> list[Tensor]:
        return self.fast.time_inputs(t)

    def transformer(self, b: TransformerBlock, h: Tensor, bias: Tensor | None, view: SlotView) -> Tensor:
        """A transformer block over [R, Q, C] whose keys are the row's past frames and its own: the new
        keys and values written to the row's pool frames first, then every key frame gathered."""
        scale = view.scale.get(b.attn1)
        if self.kernels:
            ix = view.ix
            return kernels.block(b, h, view.kv[b.attn1], ix.keys, ix.writes, ix.starts, ix.valid, self.chunk, scale)
        x = self.qkv(b, h)
        pool = view.kv[b.attn1]
        pool.index_put_((view.ix.writes,), x[:, :, 1:] if scale is None else to_page(x[:, :, 1:], scale))
        kv = pool[view.ix.keys]  # [R, K, 2, heads, d]
        kv = kv if scale is None else from_page(kv, scale, x.dtype)
        y = F.scaled_dot_product_attention(
            x[:, :, 0].transpose(1, 2), kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), attn_mask=bias
        )
        return self.out(b, h, y.transpose(1, 2).flatten(2))

    def __call__(
        self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, streaming: bool = True,
        past: SlotView | None = None, times: Sequence[Tensor] | None = None,
    ) -> Tensor:  # fmt: skip
        """Called like the estimator (solver.Estimator), `past` the call's view of this ODE step: the
        velocity [R, 80, Q] of each row's new frames; the step's tails written after the pass. times:
        as FastEstimator's."""
        if past is None or not streaming:
            raise ValueError("a slot pass needs its call's slot view and chunk masks")
        est = self.fast.est
        parts = est.inputs(x, mu, spks, cond, streaming, past)  # type: ignore[arg-type]
        h = torch.cat([p.transpose(1, 2) for p in parts], dim=2)
        times = est.resnet_times(t) if times is None else times
        out = self.fast.unet(h, times, past.bias, past, self.res, self.transformer)
        past.flush()
        return out.transpose(1, 2) * mask
