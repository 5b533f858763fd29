"""The flow cache in fixed buffers (workflow/codec/slots.py): many streams' pasts in preallocated pools,
each call solving only its streams' new frames. CPU, float32, the tiny shape.

The judge is `CodecStream` alone re-running every frame each call (no cache at all), which
tests/test_codec_stream.py holds to the one-call decode. With slots the rows of a batch start at
different frames and read their keys through index pools, so the arithmetic differs in rounding
only: the PCM is held to 1e-5, as the batch without slots (tests/test_codec_batch.py)."""

from __future__ import annotations

import pytest
import torch
from codec_alone import ATOL_PCM, SPC, alone, in_steps, voice_of

from workflow.codec.batch import CodecBatch
from workflow.codec.decoder import CodecDecoder, VoicePrompt
from workflow.codec.slots import FlowSlots
from workflow.codec.stream import CodecStream
from workflow.detokenize import Piece

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def decoder(codec_decoder) -> CodecDecoder:
    return codec_decoder


@pytest.fixture(scope="module")
def voice() -> VoicePrompt:
    """12 codes: the prompt's past holds one whole chunk (20 frames), which every stream reads."""
    return voice_of(12)


def test_streams_in_slots_give_what_each_gives_alone(decoder, voice):
    """Five streams join at different steps and end at different lengths (one right after a whole chunk,
    its last piece empty), on three slots: the fifth joins after two have ended and takes a slot they
    freed. Some batches hold two chunks of a stream (chunks that waited), the rows are padded with one
    more and the frames to a multiple of 16. Each stream's PCM is its own alone, whole, and every slot
    is free at the end."""
    g = torch.Generator().manual_seed(2)
    lengths, joins, chunk = {1: 23, 2: 31, 3: 12, 4: 15, 5: 14}, {1: 0, 2: 6, 3: 2, 4: 1, 5: 5}, 5
    codes = {k: torch.randint(0, 1000, (n,), generator=g) for k, n in lengths.items()}
    batch = CodecBatch(decoder, voice, bucket=lambda n: n + 1, pad_frames=16, slots=3, max_codes=40)
    assert batch.slots is None and batch.flow_slots().base == 20  # made at the first call
    reused, scattered = [], []  # after a step: stream 5 in a slot two others freed; a slot's pages not in a row

    def after(ended: set[int]) -> None:
        reused.append(5 in batch.slot_of and len(ended - {5}) >= 2)
        scattered.append(any(t != list(range(t[0], t[0] + len(t))) for t in batch.slots.table if t))

    got = in_steps(batch, codes, joins, chunk, after)
    assert any(reused) and not batch.streams and not batch.slot_of and sorted(batch.slots.free) == [0, 1, 2]
    assert any(scattered) and sorted(batch.slots.free_pages) == list(range(batch.pages))  # every page back
    assert batch.slots.nbytes() == FlowSlots.size(decoder, 3, batch.slot_frames)
    for k, n in lengths.items():
        mine, own = got[k], alone(decoder, voice, k, codes[k], chunk)
        assert mine.shape == own.shape == (n * SPC,)
        assert (mine - own).abs().max() <= ATOL_PCM, k
    batch.release()  # no stream speaks: the slots go, and come back with the next stream
    assert batch.slots is None
    pcm = batch.vocodes(batch.flows([Piece(9, codes[1], 0, True)]))[0]
    assert (pcm - alone(decoder, voice, 9, codes[1], 23)).abs().max() <= ATOL_PCM and batch.slots is not None
    batch.flows([Piece(10, codes[1][:5], 0, False)])
    with pytest.raises(RuntimeError, match="1 streams still speak"):
        batch.release()


def test_unguided_streams_of_other_steps_in_slots_give_what_each_gives_alone(decoder, voice):
    """`benchmark.codec.cfg_rate` 0 and `ode_steps` 3 (settings.CodecTiming.config): the slots keep one half of
    the rows a step (no unconditional one) and a past per step; each stream's PCM is its own alone with that
    solver, whole, and not what the guided decoder gives."""
    from workflow.codec.settings import CodecTiming

    cfg = CodecTiming(cfg_rate=0.0, ode_steps=3).config()
    assert (cfg.solver.steps, cfg.solver.cfg_rate) == (3, 0.0) and cfg.encoder == decoder.cfg.encoder
    unguided = CodecDecoder(cfg).eval()
    unguided.load_state_dict(decoder.state_dict())
    g = torch.Generator().manual_seed(6)
    lengths, joins = {1: 17, 2: 12, 3: 21}, {1: 0, 2: 1, 3: 2}
    codes = {k: torch.randint(0, 1000, (n,), generator=g) for k, n in lengths.items()}
    batch = CodecBatch(unguided, voice, bucket=lambda n: n + 1, pad_frames=16, slots=3, max_codes=40)
    got = in_steps(batch, codes, joins)
    assert batch.slots.halves == 1 and len(batch.slots.kv) == 3
    assert batch.slots.nbytes() == FlowSlots.size(unguided, 3, batch.slot_frames) < FlowSlots.size(decoder, 3, batch.slot_frames)
    for k in lengths:
        own = alone(unguided, voice, k, codes[k], 5)
        assert (got[k] - own).abs().max() <= ATOL_PCM, k
        assert (own - alone(decoder, voice, k, codes[k], 5)).abs().max() > 100 * ATOL_PCM  # another solver, another PCM


def test_streams_past_the_slots_re_run_every_frame_beside_the_slotted_ones(decoder, voice):
    """Three streams on one slot (serving opens no more streams than slots, but a stream that outgrows
    its slot, or a caller of the batch, meets this): the first holds the slot, the others re-run every
    frame, in the same batches; each one's PCM is its own alone, whole."""
    g = torch.Generator().manual_seed(4)
    lengths, joins = {1: 17, 2: 13, 3: 21}, {1: 0, 2: 0, 3: 1}
    codes = {k: torch.randint(0, 1000, (n,), generator=g) for k, n in lengths.items()}
    batch = CodecBatch(decoder, voice, slots=1, max_codes=40)
    mixed = []  # after a step: a slotted stream and an unslotted one speak

    def after(ended: set[int]) -> None:
        mixed.append(bool(batch.slot_of) and any(k not in batch.slot_of for k in batch.streams))

    got = in_steps(batch, codes, joins, 5, after)
    assert any(mixed) and not batch.streams and batch.slots.free == [0]
    for k, n in lengths.items():
        own = alone(decoder, voice, k, codes[k], 5)
        assert got[k].shape == own.shape == (n * SPC,) and (got[k] - own).abs().max() <= ATOL_PCM, k


def test_a_pool_of_fewer_pages_holds_streams_as_they_grow_and_one_that_cannot_grow_re_runs(decoder, voice):
    """Pages for 80 codes' frames (8 pages of 40) on three slots of up to 40 codes (7 pages each): the
    streams take pages as their frames grow, so three fit where their longest replies would not; when
    the pages run out a stream that cannot grow gives its slot back and re-runs every frame. Each
    stream's PCM is its own alone, whole. `holds` says which replies fit at once, by their most pages."""
    g = torch.Generator().manual_seed(6)
    lengths, joins = {1: 23, 2: 31, 3: 12}, {1: 0, 2: 1, 3: 2}
    codes = {k: torch.randint(0, 1000, (n,), generator=g) for k, n in lengths.items()}
    batch = CodecBatch(decoder, voice, slots=3, max_codes=40, pool_codes=80)
    assert batch.pages == 8 and batch.slots is None
    assert [-(-batch.frames_for(n) // 40) for n in (12, 23, 31, 40)] == [4, 6, 6, 7]
    assert batch.holds([12, 12]) and not batch.holds([23, 12]) and not batch.holds([1, 1, 1, 1])  # 8 pages; 3 slots
    assert batch.holds([80]) == batch.holds([40])  # a reply past max_codes gives its slot back: 7 pages at most
    slotted, starved = [], []

    def after(ended: set[int]) -> None:
        slotted.append(len(batch.slot_of))
        starved.append(any(k not in batch.slot_of for k in batch.streams) and bool(batch.slots.free))

    got = in_steps(batch, codes, joins, 5, after)
    assert max(slotted) == 3 and any(starved) and batch.slots.nbytes() == FlowSlots.size(decoder, 3, batch.slot_frames, 8)
    assert sorted(batch.slots.free_pages) == list(range(8)) and sorted(batch.slots.free) == [0, 1, 2]
    for k, n in lengths.items():
        own = alone(decoder, voice, k, codes[k], 5)
        assert got[k].shape == own.shape == (n * SPC,) and (got[k] - own).abs().max() <= ATOL_PCM, k


def test_a_streams_waiting_chunks_run_as_one_call(decoder, voice, monkeypatch):
    """Chunks that waited: with a slot, a stream's consecutive flow calls go as one while their new
    frames fit a call (under chunk masks the frames of one call over two chunks are those of two
    calls). Two streams, each with its first chunk and the next three at once, take two calls, not
    four, then one for the rest (a chunk and their last call); each stream's PCM is its own alone."""
    batch = CodecBatch(decoder, voice, slots=2, max_codes=40)
    ran, real = [], FlowSlots.flow
    monkeypatch.setattr(FlowSlots, "flow", lambda self, tokens, *a: ran.append(len(tokens)) or real(self, tokens, *a))
    g = torch.Generator().manual_seed(5)
    codes = {k: torch.randint(0, 1000, (26,), generator=g) for k in (1, 2)}
    pcm: dict[int, list[torch.Tensor]] = {k: [] for k in codes}
    calls = []
    for done, n, last in ((0, 21, False), (21, 5, True)):  # 21 codes: calls due at 6, 11, 16 and 21; then 26, last
        pieces = [Piece(k, c[done : done + n], done, last) for k, c in codes.items()]
        for p, x in zip(pieces, batch.vocodes(batch.flows(pieces)), strict=True):
            pcm[p.stream].append(x)
        calls.append(len(ran))
    assert ran == [2] * 3 and calls == [2, 3] and batch.new_frames == 60  # 40 frames + 20 in one call, then the rest in one
    for k, c in codes.items():
        assert (torch.cat(pcm[k]) - alone(decoder, voice, k, c, 5)).abs().max() <= ATOL_PCM, k


def held_then_last(batch: CodecBatch) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Two streams of 26 codes through `batch`: 21 codes at once (chunks that waited), then the last 5;
    each stream's codes and its PCM."""
    g = torch.Generator().manual_seed(5)
    codes = {k: torch.randint(0, 1000, (26,), generator=g) for k in (1, 2)}
    pcm: dict[int, list[torch.Tensor]] = {k: [] for k in codes}
    for done, n, last in ((0, 21, False), (21, 5, True)):
        pieces = [Piece(k, c[done : done + n], done, last) for k, c in codes.items()]
        for p, x in zip(pieces, batch.vocodes(batch.flows(pieces)), strict=True):
            pcm[p.stream].append(x)
    return codes, {k: torch.cat(x) for k, x in pcm.items()}


@pytest.mark.parametrize(
    ("later_frames", "later_shapes", "frames_a_call", "held_shape"),
    [(90, 1, (60, 100), 100), (190, 1, (60, 200), 200), (190, 2, (60, 100, 200), 100)],
)
def test_held_chunks_solve_in_one_round_of_the_least_shape_that_fits(
    decoder, voice, monkeypatch, later_frames, later_shapes, frames_a_call, held_shape
):
    """With `later_frames` a stream's waiting chunks are solved as one call up to that many frames a row,
    not rounds of `new_frames`; a call takes the least of `frames_a_call` that its rows fit, with
    `later_shapes` 2 the held shape's half too. The same two streams as above: 21 codes (100 new frames
    each) in one call of 100 frames a row (200 where that is the least shape past 60), then a chunk and
    the last call in one of 60; each stream's PCM is still its own alone."""
    batch = CodecBatch(decoder, voice, slots=2, max_codes=40, later_frames=later_frames, later_shapes=later_shapes)
    assert batch.frames_a_call == frames_a_call  # whole chunks of 20 frames, above the first call's 60
    assert batch.slot_frames == CodecBatch(decoder, voice, slots=2, max_codes=40).slot_frames + frames_a_call[-1] - 60
    shapes, real = [], FlowSlots.flow
    monkeypatch.setattr(
        FlowSlots, "flow", lambda self, tokens, *a: shapes.append((len(tokens), a[-3].shape[1])) or real(self, tokens, *a)
    )
    codes, pcm = held_then_last(batch)
    assert shapes == [(2, held_shape), (2, 60)]
    for k, c in codes.items():
        assert (pcm[k] - alone(decoder, voice, k, c, 5)).abs().max() <= ATOL_PCM, k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_on_cuda_each_solve_shape_is_a_graph_of_its_own(decoder, voice, monkeypatch):
    """The held chunks' round above on CUDA, the flow replayed from a graph per shape: a graph at each
    of `frames_a_call` (100 frames a row, then 60), each stream's PCM its own alone. TF32 off."""
    import copy

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    dev = torch.device("cuda")
    dec = copy.deepcopy(decoder).to(dev)
    dec.noise.buffer = dec.noise.buffer.to(dev)
    batch = CodecBatch(dec, voice, pad_frames=40, graphs=True, slots=2, max_codes=40, later_frames=100)
    codes, pcm = held_then_last(batch)
    assert sorted({key[2] for key in batch.graphs.graphs if key[0] == "slots"}) == [60, 100]
    for k, c in codes.items():
        assert (pcm[k] - alone(dec, voice, k, c.to(dev), 5)).abs().max() <= ATOL_PCM, k


def test_a_stream_longer_than_its_slot_gives_it_back_and_goes_on(decoder, voice):
    """A reply longer than `max_codes` (the slots' size): when its next call would run past its slot
    the stream gives the slot back, for the next stream, and re-runs every frame from there; its PCM
    is still its own alone, whole."""
    batch = CodecBatch(decoder, voice, slots=1, max_codes=10)
    codes = torch.randint(0, 1000, (31,), generator=torch.Generator().manual_seed(6))
    pcm, held = [], []
    for done in range(0, 31, 5):
        piece = Piece(1, codes[done : done + 5], done, done + 5 >= 31)
        pcm += batch.vocodes(batch.flows([piece]))
        held.append(1 in batch.slot_of)
    assert held[0] and not held[-2] and batch.flow_slots().free == [0]
    mine = torch.cat(pcm)
    assert mine.shape == (31 * SPC,) and (mine - alone(decoder, voice, 1, codes, 5)).abs().max() <= ATOL_PCM


def call_rows(decoder: CodecDecoder, voice: VoicePrompt, codes: list[int], keys: int):
    """One first call of `codes` after the prompt: tokens, lengths and lookahead context of one row."""
    la = decoder.cfg.encoder.lookahead
    row = voice.codes.tolist() + codes
    tokens = torch.zeros(1, keys // decoder.stride, dtype=torch.long)
    tokens[0, : len(row) - la] = torch.tensor(row[:-la])
    return tokens, torch.tensor([len(row) - la]), torch.tensor([row[-la:]]), (len(row) - la) * decoder.stride


def test_a_call_run_again_gives_the_same_frames_and_the_next_call_reads_what_it_wrote(decoder, voice):
    """A CUDA graph runs a call three times before it is replayed (warm-up, capture): run again, a call
    reads the convolution tails it read the first time (a slot has two, by parity), so it gives the same
    frames; the next call, after `advance`, reads the tails the first wrote and gives the frames the
    stream gives alone (its second call's)."""
    slots = FlowSlots(decoder, voice, slots=1, frames=120)
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 1000, (16,), generator=g).tolist()  # the first hop (3 codes end the prompt's chunk) + 3, then 5, 5
    own = CodecStream(decoder, voice, flow_cache=False, keep_mel=True)
    own.flow(codes)
    s = slots.take()
    with torch.inference_mode():
        start = slots.base
        for n in (6, 11, 16):
            tokens, lengths, context, end = call_rows(decoder, voice, codes[:n], 120)
            ix = slots.index([s], [start], [end], 60, 120).tensors()
            once, again = slots.flow(tokens, lengths, context, *ix), slots.flow(tokens, lengths, context, *ix)
            assert torch.equal(once, again)
            slots.advance([s])
            new = once[0, :, max(start, voice.codes.numel() * decoder.stride) - start : end - start]
            assert torch.allclose(new, own.mels.pop(0), atol=1e-5, rtol=0)
            start = end
    assert not own.mels


def test_slots_refuse_what_they_cannot_hold(decoder, voice):
    """A stream past the slots' count, or a call past a slot's frames, is refused with a one-line reason."""
    slots = FlowSlots(decoder, voice, slots=1, frames=30)
    slots.take()
    with pytest.raises(RuntimeError, match="all 1 flow slots are taken"):
        slots.take()
    with pytest.raises(ValueError, match="does not fit"):
        slots.index([0], [60], [80], 20, 80)
    paged = FlowSlots(decoder, voice, slots=2, frames=120, pages=2)  # 80 frames for both
    a, b = paged.take(), paged.take()
    assert paged.grow(a, 41) and paged.table[a] == [0, 1] and not paged.grow(b, 1) and not paged.grow(a, 121)
    with pytest.raises(ValueError, match=r"does not fit: .* 0 of 2 pages free"):
        paged.index([b], [20], [40], 20, 40)
    paged.release(a)
    assert paged.grow(b, 1) and paged.table == [[], [0]] and sorted(paged.free_pages) == [1]
    with pytest.raises(ValueError, match="at least one slot"):
        FlowSlots(decoder, voice, slots=0, frames=30)


def batch_rows(decoder: CodecDecoder, voice: VoicePrompt, calls: list[list[int]]):
    """Non-final flow calls of several streams in one batch (each its codes so far): tokens, lengths,
    lookahead context, and each row's end frame."""
    la, p = decoder.cfg.encoder.lookahead, voice.codes.tolist()
    bodies = [p + c[:-la] for c in calls]
    tokens = torch.zeros(len(calls), max(map(len, bodies)), dtype=torch.long)
    for i, b in enumerate(bodies):
        tokens[i, : len(b)] = torch.tensor(b)
    context = torch.tensor([c[-la:] for c in calls])
    return tokens, torch.tensor([len(b) for b in bodies]), context, [len(b) * decoder.stride for b in bodies]


def two_calls(slots: FlowSlots, device: str) -> list[torch.Tensor]:
    """Two batched calls on these slots, rows at different starts (a stream's second call beside another's
    first): each row's new mel frames."""
    dec, voice, mels = slots.decoder, slots.prompt, []
    g = torch.Generator().manual_seed(4)
    a, b, c = (torch.randint(0, 1000, (16,), generator=g).tolist() for _ in range(3))
    with torch.inference_mode():
        for calls, rows, starts in (([a[:11], b[:11]], [0, 1], [20, 20]), ([a, c[:11]], [0, 2], [80, 20])):
            tokens, lengths, context, ends = batch_rows(dec, voice, calls)
            ix = slots.index(rows, starts, ends, 60, tokens.shape[1] * dec.stride).tensors()
            mel = slots.flow(*(t.to(device) for t in (tokens, lengths, context, *ix)))
            slots.advance(rows)
            mels += [mel[i, :, : e - s] for i, (s, e) in enumerate(zip(starts, ends, strict=True))]
    return mels


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only"))]
)
@pytest.mark.parametrize("variant", ["compiled", "kernels"])
def test_the_compiled_slot_pass_and_its_kernels_give_the_eager_ones_frames(decoder, voice, device, variant, monkeypatch):
    """With the decoder's blocks compiled (dynamic shapes), the slot pass runs its resnets and the
    transformer blocks' parts around attention compiled; with its kernels, the transformer blocks in
    Triton (kernels.py; on the CPU Triton's interpreter). Each gives the eager pass's frames, for a batch whose
    rows start at different frames (a stream's second call beside another's first). TF32 off."""
    import copy

    from workflow.codec import kernels

    if "kernels" in variant and (not kernels.available() or (device == "cpu" and torch.cuda.is_available())):
        pytest.skip("needs triton, and on the CPU its interpreter (on where no GPU is: conftest)")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    eager = copy.deepcopy(decoder).to(device)
    other = CodecDecoder(decoder.cfg, **{variant: True}).eval().to(device)
    other.load_state_dict(eager.state_dict())
    got = [two_calls(FlowSlots(dec, voice, slots=3, frames=120), device) for dec in (eager, other)]
    assert getattr(other, variant.split(",")[0]) and not eager.compiled and not eager.kernels
    for want, mine in zip(*got, strict=True):
        torch.testing.assert_close(mine, want, rtol=0, atol=1e-5)


def test_fp8_pages_round_trip_within_e4m3s_precision_and_saturate_past_the_margin():
    """A pool's scale comes from the prompt's past per (key or value, head): values up to PAGE_MARGIN x
    that head's largest come back within e4m3's half step (2^-4 relative, normal range), larger ones
    saturate at the margin, and a head of small values keeps its precision beside a head of large ones."""
    from workflow.codec.slots import PAGE_MARGIN, from_page, page_scale, to_page

    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 3, 7, 8, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[None, :, None, None]  # heads apart
    v = torch.randn(2, 3, 7, 8, generator=g)
    scale = page_scale(k, v)
    assert scale.shape == (2, 3, 8)
    amax = torch.stack([k, v]).abs().amax(dim=(1, 3, 4))  # [2, heads]
    x = torch.stack([k, v], 2).transpose(1, 3) * 1.5  # [h, frames, 2, heads, d], within the margin
    back = from_page(to_page(x, scale), scale, torch.float32)
    rel = ((back - x).abs() / x.abs().clamp(min=1e-30))[x.abs() > (amax * 2.0**-6 * PAGE_MARGIN / 448)[..., None]]
    assert rel.max() <= 2.0**-4 + 1e-6
    big = torch.full_like(x, 1e4)
    assert torch.allclose(from_page(to_page(big, scale), scale, torch.float32), (amax * PAGE_MARGIN)[..., None].expand_as(x))


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only"))]
)
@pytest.mark.parametrize("variant", ["eager", "kernels"])
def test_fp8_pages_hold_a_quarter_of_float32s_bytes_and_give_frames_near_the_exact_ones(decoder, voice, variant, device):
    """The slots' keys and values in float8 (`fp8`): the same calls as above (rows at different starts),
    eager and through the Triton kernels (on the CPU Triton's interpreter, whose float8 cast does not
    round to nearest), give mel within 1 % RMS of the float32 pools' (observed 0.17 % eager, 0.43 % with
    the interpreter's kernels), where a key read with its value's scale (1.9 %), or a page read
    unscaled (65 %), is far off. The pools hold a quarter of float32's bytes (half of bf16's)."""
    from workflow.codec import kernels

    if variant == "kernels" and (not kernels.available() or (device == "cpu" and torch.cuda.is_available())):
        pytest.skip("needs triton, and on the CPU its interpreter (on where no GPU is: conftest)")
    dec = CodecDecoder(decoder.cfg, kernels=variant == "kernels").eval().to(device)
    dec.load_state_dict(decoder.state_dict())
    got, kv_bytes = [], []
    for fp8 in (False, True):
        slots = FlowSlots(dec, voice, slots=3, frames=120, fp8=fp8)
        got.append(torch.cat([m.flatten() for m in two_calls(slots, device)]))
        kv_bytes.append(sum(t.numel() * t.element_size() for step in slots.kv for t in step.values()))
        assert slots.nbytes() == FlowSlots.size(dec, 3, 120, fp8=fp8)
        assert all(t.dtype == (torch.float8_e4m3fn if fp8 else torch.float32) for step in slots.kv for t in step.values())
    assert kv_bytes[0] == 4 * kv_bytes[1]
    exact, fp8 = got
    err = ((fp8 - exact).norm() / exact.norm()).item()
    assert 0 < err <= 1e-2


def test_streams_in_fp8_slots_stay_near_what_each_gives_alone(decoder, voice):
    """Serving's batches with fp8 pages (`CodecBatch(fp8_pages=True)`): streams joining and leaving on
    fewer slots than streams (one re-runs every frame) give PCM within 0.1 % RMS of each stream alone
    at full precision (observed <= 0.009 %: the tiny decoder's PCM moves far less than its mel)."""
    g = torch.Generator().manual_seed(2)
    lengths, joins, chunk = {1: 23, 2: 31, 3: 12}, {1: 0, 2: 3, 3: 1}, 5
    codes = {k: torch.randint(0, 1000, (n,), generator=g) for k, n in lengths.items()}
    batch = CodecBatch(decoder, voice, slots=2, max_codes=40, fp8_pages=True)
    got = in_steps(batch, codes, joins, chunk, lambda ended: None)
    assert batch.slots.kv[0][batch.slots.attn[0]].dtype == torch.float8_e4m3fn
    for k in lengths:
        own = alone(decoder, voice, k, codes[k], chunk)
        assert ((got[k] - own).norm() / own.norm()).item() <= 1e-3, k
