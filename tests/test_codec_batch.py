"""Many streams through the codec decoder at once (workflow/codec/batch.py), and serving with it.
CPU, float32, the tiny shape.

The judge is `CodecStream` (stream.py) run alone, which tests/test_codec_stream.py holds to the one-call
decode. Batched, each stream's rows are padded (after its end, and with rows of other streams), so the
arithmetic differs in rounding only: the PCM is held to 1e-5 (observed <= 7e-7 on peaks of ~0.87)."""

from __future__ import annotations

import time

import pytest
import torch
from codec_alone import ATOL_PCM, SPC, TINY, alone, in_steps, voice_of
from torch.utils._python_dispatch import TorchDispatchMode

from workflow.codec.batch import CodecBatch
from workflow.codec.decoder import CodecDecoder, VoicePrompt
from workflow.codec.lanes import CodecLanes
from workflow.cudagraphs import CONFINED
from workflow.detokenize import Piece
from workflow.engines import load_engine
from workflow.generate import Ids, Sampling
from workflow.serve import load
from workflow.serve.alone import graph_sets

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def decoder(codec_decoder) -> CodecDecoder:
    return codec_decoder


@pytest.fixture(scope="module")
def voice() -> VoicePrompt:
    return voice_of(7)


def test_streams_batched_at_different_points_give_what_each_gives_alone(decoder, voice):
    """Four streams join at different steps and end at different lengths, one of them right after a whole
    chunk (its last piece empty), in two batches each stream's chunks two at a time (chunks that waited),
    the batch padded to one more row and its frames to a multiple of 16: each stream's PCM is its own
    alone, whole (codes x 1920 samples), and no state is left once every stream has ended."""
    g = torch.Generator().manual_seed(2)
    lengths, joins, chunk = {1: 23, 2: 31, 3: 12, 4: 15}, {1: 0, 2: 6, 3: 2, 4: 1}, 5
    codes = {k: torch.randint(0, 1000, (n,), generator=g) for k, n in lengths.items()}
    batch = CodecBatch(decoder, voice, bucket=lambda n: n + 1, pad_frames=16)
    got = in_steps(batch, codes, joins, chunk)
    assert not batch.streams
    for k, n in lengths.items():
        mine, own = got[k], alone(decoder, voice, k, codes[k], chunk)
        assert mine.shape == own.shape == (n * SPC,)
        assert (mine - own).abs().max() <= ATOL_PCM, k


def test_hift_runs_the_calls_of_one_shape_together(decoder, voice, monkeypatch):
    """Three streams in step: each HiFT pass is over all three (their NSF sources, each continued from its
    own stream's, and network together: at their start, then continuing), and each stream's PCM is still
    its own alone."""
    g = torch.Generator().manual_seed(5)
    codes = {k: torch.randint(0, 1000, (17,), generator=g) for k in (1, 2, 3)}
    passes = hift_passes(monkeypatch)
    got = in_steps(CodecBatch(decoder, voice), codes, dict.fromkeys(codes, 0), 5)
    assert passes and all(n == 3 for n, _ in passes) and {fresh for _, fresh in passes} == {True, False}
    for k in codes:
        assert (got[k] - alone(decoder, voice, k, codes[k], 5)).abs().max() <= ATOL_PCM, k


def hift_passes(monkeypatch) -> list[tuple[int, bool]]:
    """Each HiFT pass from here on (its rows, and whether at the streams' start), as `hift_from_f0` runs it."""
    passes: list[tuple[int, bool]] = []
    real = CodecDecoder.hift_from_f0

    def counted(self, mel, f0, seeds, first, before=None, *, context=0):
        passes.append((mel.shape[0], before is None))
        return real(self, mel, f0, seeds, first, before, context=context)

    monkeypatch.setattr(CodecDecoder, "hift_from_f0", counted)
    return passes


@pytest.mark.parametrize("slots", [0, 2, 4])
def test_a_streams_waiting_calls_vocode_in_one_pass(decoder, voice, monkeypatch, slots):
    """Chunks that waited: two streams send 21 codes at once (flow calls due at 6, 11, 16 and 21 codes), then
    their last 5. HiFT runs each batch's calls in one pass per shape, not a round per call: the first
    call's (at the streams' start), the second's (after the short first hop its F0 context is its own)
    and the last two's together, their source phase carried from call to call; then the chunk, and the
    last call apart (its own shape). With slots a pass has at most as many rows as there are slots (serving's
    graphs are made for so many). Each stream's PCM is its own alone, chunk by chunk."""
    g = torch.Generator().manual_seed(5)
    codes = {k: torch.randint(0, 1000, (26,), generator=g) for k in (1, 2)}
    batch = CodecBatch(decoder, voice, slots=slots, max_codes=40)
    passes = hift_passes(monkeypatch)
    pcm: dict[int, list[torch.Tensor]] = {k: [] for k in codes}
    for done, n, last in ((0, 21, False), (21, 5, True)):
        pieces = [Piece(k, c[done : done + n], done, last) for k, c in codes.items()]
        for p, x in zip(pieces, batch.vocodes(batch.flows(pieces)), strict=True):
            pcm[p.stream].append(x)
    later = [(4, False)] if slots != 2 else [(2, False)] * 2  # at most `slot_count` rows a pass
    assert passes == [(2, True), (2, False), *later, (2, False), (2, False)]  # before: 4 rounds, then 2
    for k, c in codes.items():
        assert (torch.cat(pcm[k]) - alone(decoder, voice, k, c, 5)).abs().max() <= ATOL_PCM, k


class Launches(TorchDispatchMode):
    """Counts the ops that compute (not views) dispatched outside `CodecBatch._graphed` (CUDA graphs there)."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.n, self.inside, real = 0, 0, CodecBatch._graphed

        def graphed(batch, *args):
            self.inside += 1
            try:
                return real(batch, *args)
            finally:
                self.inside -= 1

        monkeypatch.setattr(CodecBatch, "_graphed", graphed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        alias = func._schema.returns[0].alias_info if func._schema.returns else None
        self.n += not self.inside and not (alias is not None and not alias.is_write)
        return func(*args, **(kwargs or {}))


def test_a_held_batchs_vocoding_launches_as_much_for_four_streams_as_for_one(decoder, voice, monkeypatch):
    """Outside HiFT's passes (CUDA graphs there), vocoding a batch of held chunks launches nearly what it
    launches for one stream's: each stream's frames joined in one copy, the source's cycles carried from call to
    call and the cross-fades made rank by rank (the k-th calls of every stream together), the PCM joined
    in one copy. Call by call it was ~120 ops a stream's 8 held chunks, which on CUDA queue behind the
    batch's solve. Each stream's PCM is still its own alone."""
    g = torch.Generator().manual_seed(9)
    codes = {k: torch.randint(0, 1000, (37,), generator=g) for k in (1, 2, 3, 4)}
    count = Launches(monkeypatch)
    launched, pcm = {}, {}
    for streams in (1, 4):  # 4 slots: HiFT's passes take 4 rows each, so 4 streams' 24 calls are more passes
        batch = CodecBatch(decoder, voice, slots=4, max_codes=40, later_frames=120)
        pieces = [Piece(k, codes[k][:7], 0) for k in range(1, streams + 1)]  # the first chunks, then six held each
        got = batch.vocodes(batch.flows(pieces))
        state = batch.streams[1].state()  # what `CodecLanes` marks as used on a lane the stream moves to
        assert len(state) == 4 and all(t.numel() for t in state)  # its mel tail, source cycles, held PCM, fade
        pieces = [Piece(k, codes[k][7 + 5 * j : 12 + 5 * j], 7 + 5 * j, j == 5) for k in range(1, streams + 1) for j in range(6)]
        work = batch.flows(pieces)
        with count:
            held = batch.vocodes(work)
        launched[streams], count.n = count.n, 0
        pcm = {k: torch.cat([got[k - 1], *held[6 * (k - 1) : 6 * k]]) for k in range(1, streams + 1)}
    assert launched[4] - launched[1] <= 3 * 8, launched  # a stream's frames joined, its rows' inputs; not ~13 a call
    for k, c in codes.items():
        assert (pcm[k] - alone(decoder, voice, k, c, 5)).abs().max() <= ATOL_PCM, k


class GraphCalls:
    """Stands in for the codec's CUDA graphs on the CPU: records each key and its rows, runs fn (the padded
    rows, the keys and the outputs' cloning are what graphs add)."""

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.asked: list[tuple] = []  # keys `made` was asked about

    def call(self, key, fn, *args):
        self.keys.append(key)
        return fn(*args)

    def made(self, key) -> bool:
        self.asked.append(key)
        return key in self.keys


def test_padded_passes_give_what_each_stream_gives_alone(decoder, voice, monkeypatch):
    """The graphed path's bookkeeping on the CPU (its graphs stood in for): two streams send 21 codes at
    once, then the rest, in 3 slots; every HiFT pass but a last call's has at most 3 rows, padded to
    its bucket (here n + 1) with copies of its last, keyed by its shape and the lane, F0 and the rest
    apart; each stream's PCM is its own alone."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("Lane", (), {"priority": -1})())
    g = torch.Generator().manual_seed(5)
    codes = {k: torch.randint(0, 1000, (26,), generator=g) for k in (1, 2)}
    batch = CodecBatch(decoder, voice, bucket=lambda n: n + 1, slots=3, max_codes=40)
    batch.graphs = graphs = GraphCalls()  # type: ignore[assignment]
    pcm: dict[int, list[torch.Tensor]] = {k: [] for k in codes}
    for done, n, last in ((0, 21, False), (21, 5, True)):
        pieces = [Piece(k, c[done : done + n], done, last) for k, c in codes.items()]
        for p, x in zip(pieces, batch.vocodes(batch.flows(pieces)), strict=True):
            pcm[p.stream].append(x)
    hift = [(k[0], k[-2][0]) for k in graphs.keys if k[0] in ("f0", "hift")]
    passes = [("f0", 3), ("f0", 3), ("f0", 4), ("f0", 2)]  # first, second, and the later four rows as 3 + 1
    assert hift == [*passes, *(("hift", n) for _, n in passes), ("f0", 3), ("hift", 3)]  # then the chunk (the last: eager)
    assert all(k[-1] == -1 for k in graphs.keys)  # the lane's
    for k, c in codes.items():
        assert (torch.cat(pcm[k]) - alone(decoder, voice, k, c, 5)).abs().max() <= ATOL_PCM, k


def test_a_last_call_replays_what_warm_made_for_its_shape_and_runs_eager_where_it_made_none(decoder, voice, monkeypatch):
    """A stream's last call has as many frames as it has codes left after its last whole chunk (0 .. 4
    here): `CodecLanes.warm` makes its HiFT passes at each (graphs stood in for on the CPU, every pass
    padded to 8 rows), so the last calls of streams of 16 .. 20 codes replay them, while a reply that ends
    after its first chunk (its last call's F0 context its own) runs eager: no HiFT pass is captured while
    serving. Each stream's PCM is its own alone."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("Lane", (), {"priority": -1})())
    batch = CodecBatch(decoder, voice, bucket=lambda n: 8, slots=8, max_codes=20)
    batch.graphs = graphs = GraphCalls()  # type: ignore[assignment]
    lanes = CodecLanes(batch, torch.device("cpu"), time.perf_counter)
    assert lanes.warm(6, 5, 20) == 5 * 4 and not batch.streams and not batch.make_last  # 5 sets of 8 streams, 4 pieces
    made = set(graphs.keys)
    g = torch.Generator().manual_seed(9)
    codes = {k: torch.randint(0, 1000, (n,), generator=g) for k, n in enumerate((16, 17, 18, 19, 20, 8), 1)}
    pcm: dict[int, list[torch.Tensor]] = {k: [] for k in codes}
    for done, n in ((0, 6), (6, 5), (11, 5), (16, 5)):
        pieces = [Piece(k, c[done : done + n], done, done + n >= len(c)) for k, c in codes.items() if done < len(c)]
        for p, x in zip(pieces, batch.vocodes(batch.flows(pieces)), strict=True):
            pcm[p.stream].append(x)
    assert {k for k in graphs.keys if k[0] in ("f0", "hift")} <= made  # no HiFT pass captured while serving
    last = graphs.asked  # each last call's F0 and network passes: the short reply's, then the five others'
    assert len(last) == 2 * 6 and not any(k in made for k in last[:2]) and all(k in made for k in last[2:])
    assert len({k[1] for k in last[2:]}) == 5  # five lengths of last call, each made ahead
    for k, c in codes.items():
        assert (torch.cat(pcm[k]) - alone(decoder, voice, k, c, 5)).abs().max() <= ATOL_PCM, k


@pytest.mark.parametrize("pad_frames", [16, 40])
def test_warm_makes_every_flow_shape_that_streams_to_the_longest_reply_meet(decoder, voice, monkeypatch, pad_frames):
    """`benchmark.codec.pad_frames` sets how many flow shapes there are: a call's frames padded to a multiple
    of it. `CodecLanes.warm` makes the flow at every multiple a reply of up to `max_codes` codes reaches, at
    each of `frames_a_call` (graphs stood in for on the CPU), so streams of 8 to 30 codes, in slots, joining at
    different steps, meet no flow shape it did not make. Each stream's PCM is its own alone."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("Lane", (), {"priority": -1})())
    batch = CodecBatch(decoder, voice, bucket=lambda n: 1 << (n - 1).bit_length(), pad_frames=pad_frames, slots=4, max_codes=30)
    batch.graphs = graphs = GraphCalls()  # type: ignore[assignment]
    CodecLanes(batch, torch.device("cpu"), time.perf_counter).warm(4, 5, 30)
    made = {k for k in graphs.keys if k[0] == "slots"}
    q, ends = pad_frames // 4, sorted({k[1][1] for k in made})  # the padded lengths made, in codes
    assert ends == list(range(ends[0], ends[-1] + q, q)) and ends[0] % q == 0 and ends[-1] >= len(batch.prompt) + 30
    assert len(made) == len(ends) * len(batch.frames_a_call) * 3  # each multiple, each solve, rows 1, 2 and 4
    graphs.keys.clear()
    g = torch.Generator().manual_seed(8)
    lengths, joins = {1: 30, 2: 8, 3: 23, 4: 17}, {1: 0, 2: 1, 3: 2, 4: 4}
    codes = {k: torch.randint(0, 1000, (n,), generator=g) for k, n in lengths.items()}
    got = in_steps(batch, codes, joins)
    met = {k for k in graphs.keys if k[0] == "slots"}
    assert met and met <= made, met - made
    for k in lengths:
        assert (got[k] - alone(decoder, voice, k, codes[k], 5)).abs().max() <= ATOL_PCM, k


def test_streams_ending_at_once_take_one_flow_pass_and_hift_passes_of_the_rows_warm_made(decoder, voice, monkeypatch):
    """Five streams end in one batch where `CodecLanes.warm` made last calls' HiFT passes for up to two rows:
    their last flow calls are one pass, the graph warm made for any call of that frame bucket (their context
    -1s), HiFT's last passes go two rows at a time, each replaying a graph warm made (graphs stood in for on
    the CPU), none captured while serving; each stream's PCM is its own alone."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("Lane", (), {"priority": -1})())
    batch = CodecBatch(decoder, voice, bucket=lambda n: 2 if n <= 2 else 6, pad_frames=16, slots=6, max_codes=20)
    batch.graphs = graphs = GraphCalls()  # type: ignore[assignment]
    lanes = CodecLanes(batch, torch.device("cpu"), time.perf_counter)
    lanes.warm(5, 5, 20, few=2)
    assert batch.last_rows == 2 and batch.pass_rows == 6
    assert lanes.codes_a_call == 15  # a slot's largest solve, 60 frames: a later batch's most codes of a stream
    made = set(graphs.keys)
    g = torch.Generator().manual_seed(4)
    codes = {k: torch.randint(0, 1000, (18,), generator=g) for k in range(1, 6)}
    pcm: dict[int, list[torch.Tensor]] = {k: [] for k in codes}
    for done, n in ((0, 6), (6, 5), (11, 5), (16, 2)):
        start = len(graphs.keys)
        pieces = [Piece(k, c[done : done + n], done, done + n == len(c)) for k, c in codes.items()]
        for p, x in zip(pieces, batch.vocodes(batch.flows(pieces)), strict=True):
            pcm[p.stream].append(x)
    ends = graphs.keys[start:]  # the last batch's: its flow pass, then HiFT's F0 and network passes
    assert set(graphs.keys) <= made  # nothing captured while serving
    assert [k[0] for k in ends] == ["slots"] + ["f0"] * 3 + ["hift"] * 3  # HiFT's 5 rows as 2 + 2 + 1, each replayed
    assert ends[0][1][0] == 6 and all(k[-2][0] == 2 for k in ends[1:])  # the flow's 5 rows padded to 6, HiFT's to 2
    for k, c in codes.items():
        assert (torch.cat(pcm[k]) - alone(decoder, voice, k, c, 5)).abs().max() <= ATOL_PCM, k


def test_a_last_piece_goes_with_its_streams_held_chunks_and_the_others_calls_in_one_flow_pass(decoder, voice, monkeypatch):
    """Two slotted streams send their first chunk, then two held chunks each, stream 1's last piece with them:
    that batch is one flow pass of two rows (stream 1's chunks and its end one call, its context -1s), not a
    second pass for the end, and each stream's PCM is its own alone."""
    batch = CodecBatch(decoder, voice, slots=2, max_codes=40, later_frames=80)
    g = torch.Generator().manual_seed(8)
    codes = {1: torch.randint(0, 1000, (18,), generator=g), 2: torch.randint(0, 1000, (26,), generator=g)}
    passes: list[list[bool]] = []
    real = CodecBatch.mel

    def counted(self, calls, keys=None, solve=0):
        passes.append([c.finalize for c in calls])
        return real(self, calls, keys, solve)

    monkeypatch.setattr(CodecBatch, "mel", counted)
    fc, pcm = batch.first_codes, {k: [] for k in codes}
    steps = [[(k, 0, fc, False) for k in codes], [(1, fc, 18 - fc, True), (2, fc, 10, False)], [(2, fc + 10, 26 - fc - 10, True)]]
    for step in steps:
        passes.clear()
        pieces = [Piece(k, codes[k][a : a + n], a, last) for k, a, n, last in step]
        for p, x in zip(pieces, batch.vocodes(batch.flows(pieces)), strict=True):
            pcm[p.stream].append(x)
        if step is steps[1]:
            assert passes == [[True, False]]  # one pass: stream 1's held chunks and its end, stream 2's chunks
    for k, c in codes.items():
        assert (torch.cat(pcm[k]) - alone(decoder, voice, k, c, 5)).abs().max() <= ATOL_PCM, k


def test_first_codes_follow_the_prompt_and_the_lookahead(decoder, voice):
    """The first PCM needs the first hop and the lookahead: for a 7-code prompt the 3 codes that end its last
    chunk (their 12 frames outnumber the 8 held back for the cross-fade), then 3: 6 codes, PCM of 4 frames."""
    batch = CodecBatch(decoder, voice)
    assert batch.first_codes == 3 + TINY.encoder.lookahead
    early = batch.vocodes(batch.flows([Piece(8, torch.arange(batch.first_codes), 0)]))
    assert early[0].numel() == 4 * TINY.hift.hop  # not the last: the first PCM, less the held tail
    batch.end(8)
    out = batch.vocodes(batch.flows([Piece(9, torch.arange(batch.first_codes - 1), 0)]))
    assert out[0].numel() == 0  # one code short: nothing yet
    out = batch.vocodes(batch.flows([Piece(9, torch.tensor([5]), batch.first_codes - 1, True)]))
    assert out[0].numel() == batch.first_codes * SPC and not batch.streams


def test_a_piece_that_does_not_follow_its_streams_codes_is_refused(decoder, voice):
    """A piece says how many of its stream's codes came before it: one after a lost chunk, or one that
    overtook another, would decode wrong audio; it is refused, naming the stream, and the codes the
    stream has stay as they were."""
    batch = CodecBatch(decoder, voice)
    batch.vocodes(batch.flows([Piece(3, torch.arange(4), 0), Piece(3, torch.arange(4), 4)]))
    for done in (12, 4):  # a chunk lost (8..12), a chunk sent again
        with pytest.raises(ValueError, match=f"codec stream 3: a piece after {done} codes, where it has 8"):
            batch.flows([Piece(3, torch.arange(4), done)])
    assert batch.streams[3].codes == [0, 1, 2, 3, 0, 1, 2, 3]
    batch.vocodes(batch.flows([Piece(3, torch.arange(4), 8)]))  # the next one goes on


@pytest.mark.parametrize("slots", [0, 1])
def test_serving_with_the_codec_decoder_times_each_stream_from_its_first_pcm(tiny_engine_dir, decoder, voice, slots):
    """The load benchmark with the codec decoder as serving's detokenizer (the CPU: in line): every
    request served, its PCM whole (codes x 1920 samples), its first chunk as many codes as the first
    PCM needs (6 here), so its time to first audio the first chunk's, and no decoder state left
    behind; `warm` leaves none either. With one flow slot for two users, serving opens one stream at
    a time (`CodecLanes.max_streams`), so that none re-runs every frame."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    detok = CodecLanes(CodecBatch(decoder, voice, slots=slots, max_codes=20), torch.device("cpu"), time.perf_counter)
    assert detok.sample_rate == 24000 and detok.first_codes == 6 and not detok.lanes
    assert detok.warm(2, 5, 20) == 2 * 4 and not detok.batch.streams  # four pieces for each of buckets 1 and 2
    assert set(detok.warm_s) == {1, 2} and all(t["pieces"] > 0 <= t["flow"] for t in detok.warm_s.values())  # its time
    assert detok.batch.pass_rows == 2  # a HiFT pass of held calls takes no more rows than warm made graphs for
    cfg = load.LoadConfig(closed=(2,), duration_s=1.0, reply_seconds=(1.0, 1.6), prompt_len=24, slots=4)
    levels, served = [], []

    def run_level(*args, **kw):
        result, done = real(*args, **kw)
        levels.append(result)
        served.extend(done)
        return result, done

    real, load.run_level = load.run_level, run_level
    try:
        out = load.run(engine, detok, time.perf_counter, cfg, ids, 5, Sampling())
    finally:
        load.run_level = real
    assert out["levels"][0]["served"] == out["levels"][0]["requests"] > 0 and not detok.batch.streams
    made = out["prepared"]  # the load's warm: its time by batch size (CodecBatch's buckets: every size up to load.slots)
    assert list(made["detokenizer_seconds"]) == ["1", "2", "3", "4"] and made["detokenizer_batches"] == 4 * 4
    assert sum(t["flow"] + t["pieces"] for t in made["detokenizer_seconds"].values()) <= made["seconds"] - made["engine_seconds"]
    assert out["levels"][0]["max_streams"] == (slots or cfg.slots)
    lanes, wall = out["levels"][0]["detokenizer_calls"], out["levels"][0]["wall_s"]  # by lane: a second, a call's
    assert set(lanes) == {"detokenize", "detokenize first"} and all(1 <= c["streams"] <= c["chunks"] for c in lanes.values())
    sent = sum(round(c["per_s"] * wall) * c["chunks"] for c in lanes.values())  # every chunk served, in some call
    assert sent == pytest.approx(sum(len(r.chunk_samples) for r in served))
    assert not detok.batch.slot_of and (not slots or len(detok.batch.slots.free) == slots)
    for req in served:
        assert req.error is None and sum(req.chunk_samples) == len(req.codes) * SPC
        assert req.chunk_codes[0] == 6 and all(n == 5 for n in req.chunk_codes[1:-1])  # the first: the first PCM's codes
        assert all(n > 0 for n in req.chunk_samples)  # so every chunk makes PCM (the last: the rest, the held tail)
        assert req.ttfa_s == pytest.approx(req.chunk_ready[0] - req.t_arrival)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("slots, later_sms", [(0, 0), (4, 0), (4, 32)])
def test_on_cuda_the_lanes_and_their_graphs_give_what_each_stream_gives_alone(decoder, voice, monkeypatch, slots, later_sms):
    """Serving's lanes on CUDA: the flow and HiFT's network replayed from a graph per shape and lane
    (all made ahead by `warm`), a stream's pieces on the urgent lane until it has a chunk's audio (here its
    first three: the first PCM, after 6 codes, is 80 ms) and the rest on the other, the
    host never waiting: each stream's PCM (its `sink`) is what it gives alone, in its own call order;
    with flow slots too (each call solving new frames only, its slot written inside the graph; warm
    makes the later lane's solves at both of `frames_a_call`). Then every graph they replayed is priced
    alone, replayed by itself as the load does once its levels end (serve/alone.py), and the same streams
    served again still give what they give alone: those replays wrote only what ended streams held.
    With `later_sms` the later lane's graphs, and only those, are captured on a green context of so many SMs
    (`confine_later`). TF32 off: the tolerance is float32's."""
    import copy

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    dev = torch.device("cuda")
    dec = copy.deepcopy(decoder).to(dev)
    dec.noise.buffer = dec.noise.buffer.to(dev)
    got: dict[int, list[torch.Tensor]] = {}
    lanes = CodecLanes(
        CodecBatch(
            dec, voice, bucket=lambda n: 1 << (n - 1).bit_length(), pad_frames=40, graphs=True, slots=slots, max_codes=30,
            later_frames=100,
        ),
        dev, time.perf_counter,
        sink=lambda key, pcm: got.setdefault(key, []).append(pcm),
    )  # fmt: skip
    assert lanes.confine_later(later_sms) >= later_sms
    assert lanes.warm(4, 5, 30) > 0 and not lanes.batch.streams and lanes.lanes
    if later_sms:  # each graph in the confined pool exactly where its key is the later lane's
        pool, later = lanes.batch.graphs.capture[CONFINED][1], lanes.priorities["later"]
        assert all((g.pool() == pool) == (k[-1] == later) for k, (g, _, _) in lanes.batch.graphs.graphs.items())
    graphs = len(lanes.batch.graphs.graphs)
    g = torch.Generator().manual_seed(3)
    lengths, chunk = {1: 26, 2: 17, 3: 30}, 5
    codes = {k: torch.randint(0, 1000, (n,), generator=g) for k, n in lengths.items()}

    def serve() -> tuple[list, dict]:
        got.clear()
        readies, made = [], dict.fromkeys(lengths, 0)
        for done in range(0, 30, chunk):
            pieces = [Piece(k, codes[k][done : done + chunk], done, done + chunk >= n) for k, n in lengths.items() if done < n]
            urgent_of = {p.stream: made[p.stream] < chunk * SPC for p in pieces}  # as the scheduler: until a chunk's audio
            for urgent in (True, False):
                part = [p for p in pieces if urgent_of[p.stream] == urgent]
                if part:
                    ready, samples = lanes(part, urgent)
                    readies.append(ready)
                    made.update({p.stream: made[p.stream] + n for p, n in zip(part, samples, strict=True)})
        return readies, urgent_of

    def each_its_own() -> None:
        for k, n in lengths.items():
            own = alone(dec, voice, k, codes[k].to(dev), chunk)
            mine = torch.cat(got[k])
            assert mine.shape == own.shape == (n * SPC,) and (mine - own).abs().max() <= ATOL_PCM, k

    readies, urgent_of = serve()
    assert lanes.first_codes == 6 and not any(urgent_of.values())  # the last pieces went to the other lane
    assert all(r(True) > 0 for r in readies) and not lanes.batch.streams and not lanes.batch.slot_of
    each_its_own()
    assert len(lanes.batch.graphs.graphs) == graphs == lanes.batch.graphs.captured  # warm made every shape met
    assert graph_sets(None, lanes) == {"detokenizer": lanes.batch.graphs}  # what the load counts mid-level
    served = lanes.batch.graphs.replays  # every graph the streams replayed, priced alone as the load does (serve/alone.py)
    assert set(lanes.batch.graphs.alone_ms(served)) == set(served) and len(served) > 2
    readies, _ = serve()  # those replays wrote only what the ended streams held: the same streams again give what they gave
    assert all(r(True) > 0 for r in readies) and not lanes.batch.streams
    each_its_own()
