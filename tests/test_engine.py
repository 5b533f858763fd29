"""Our PyTorch engine against the independent transformers reference, and its KV caches."""

import pytest
import torch

from workflow import traffic
from workflow.engines import load_engine
from workflow.generate import Ids, generate
from workflow.hfckpt import load_hf_state
from workflow.reference import MossSpeechReference, ReferenceEngine
from workflow.spec import load_spec

TOL = 1e-4  # float32 end to end; logits are O(10)


@pytest.fixture(scope="module")
def ref(tiny_hf):
    return MossSpeechReference(load_spec(tiny_hf), load_hf_state(tiny_hf), torch.float32, "cpu")


@pytest.fixture
def engine(tiny_engine_dir):
    return load_engine(tiny_engine_dir)


def test_prefill_logits_match_reference(engine, ref):
    ids = Ids.of(engine.spec)
    prompts = traffic.batch(3, 100, ids, seed=11)  # text, speech and switches in one sequence
    et, ea = engine.prefill(prompts, all_logits=True)
    rt, ra, _ = ref(prompts)
    assert et.shape == rt.shape == (3, 100, engine.spec.vocab_size)
    assert ea.shape == ra.shape == (3, 100, engine.spec.audio_vocab_size)
    assert (et - rt).abs().max() < TOL
    assert (ea - ra).abs().max() < TOL


def assert_decode_matches_reference(engine, ref, batch: int, prompt_len: int, steps: int, seed: int) -> None:
    """Prefill both with the same traffic, then feed both the same tokens one step at a time."""
    ids = Ids.of(engine.spec)
    prompts = traffic.batch(batch, prompt_len, ids, seed=seed)
    follow = traffic.batch(batch, steps, ids, seed=seed + 1)
    engine.prefill(prompts)
    _, _, caches = ref(prompts)
    for t in range(steps):
        et, ea = engine.decode(follow[:, t])
        rt, ra, caches = ref(follow[:, t : t + 1], caches)
        assert (et - rt[:, -1]).abs().max() < TOL
        assert (ea - ra[:, -1]).abs().max() < TOL


def test_decode_steps_match_reference(engine, ref):
    assert_decode_matches_reference(engine, ref, batch=2, prompt_len=30, steps=12, seed=12)


def test_decode_across_an_attention_bucket_matches_reference(engine, ref):
    """Decode attends to the cache in buckets of KV_BUCKET positions: crossing one changes
    nothing but the work done."""
    from workflow.engines.torch_engine import KV_BUCKET

    assert_decode_matches_reference(engine, ref, batch=1, prompt_len=KV_BUCKET - 3, steps=6, seed=19)


def test_greedy_generation_matches_reference_across_modality_switches(engine, ref):
    ids = Ids.of(engine.spec)
    prompts = traffic.batch(4, 24, ids, seed=14)
    got = generate(engine, prompts, 64, ids)
    want = generate(ReferenceEngine(ref, "cpu"), prompts, 64, ids)
    assert got.tokens.shape == want.tokens.shape == (4, 64, 2)
    assert torch.equal(got.tokens, want.tokens)
    modes = want.audio_mode.int()
    assert (modes[:, 1:] != modes[:, :-1]).any(dim=1).all(), "every sequence must switch modality"
    assert modes.any() and not modes.all()


def test_branches_never_touch_each_others_kv_cache(engine):
    """Each layer owns distinct cache storage; scribbling over one branch's cache changes
    only that branch's head, and the trunk's changes both."""
    plan = {"trunk": engine.trunk, "text": engine.text_block, "audio": engine.audio_block}
    ptrs = [p for layer in engine.layers for p in (layer.k_cache.data_ptr(), layer.v_cache.data_ptr())]
    assert len(set(ptrs)) == len(ptrs)
    ids = Ids.of(engine.spec)
    prompt = traffic.batch(1, 40, ids, seed=15)
    step = prompt[:, -1]

    def decode_after(scribble: str | None):
        engine.prefill(prompt[:, :-1])
        if scribble:
            for layer in plan[scribble]:
                layer.k_cache.normal_()
                layer.v_cache.normal_()
        return engine.decode(step)

    base_t, base_a = decode_after(None)
    for name, text_changes, audio_changes in (("text", True, False), ("audio", False, True), ("trunk", True, True)):
        t, a = decode_after(name)
        assert (not torch.equal(t, base_t)) == text_changes, name
        assert (not torch.equal(a, base_a)) == audio_changes, name


def test_decode_writes_each_branch_cache_at_the_step_position(engine):
    ids = Ids.of(engine.spec)
    prompt = traffic.batch(2, 20, ids, seed=16)
    engine.prefill(prompt)
    for layer in engine.layers:
        layer.k_cache[:, :, 20].fill_(float("nan"))
    engine.decode(prompt[:, -1], need_text=False)  # audio mode: no text head, text cache still filled
    for layer in engine.layers:
        assert torch.isfinite(layer.k_cache[:2, :, 20]).all()


def test_skipping_the_text_head_changes_nothing_else(engine):
    """At prefill and decode: the text branch's cache is filled all the same, greedy output
    is unchanged."""
    ids = Ids.of(engine.spec)
    prompt = traffic.speech_prompt(2, 12, ids, seed=19)
    _, want_audio = engine.prefill(prompt)
    want_next, _ = engine.decode(prompt[:, -1])
    skipped, audio = engine.prefill(prompt, need_text=False)
    assert skipped is None and torch.equal(audio, want_audio)
    assert torch.equal(engine.decode(prompt[:, -1])[0], want_next)
    prompt = traffic.speech_prompt(2, 32, ids, seed=17)  # ends in start-of-speech: audio mode
    with_head = generate(engine, prompt, 40, ids, skip_text_head=False)
    without = generate(engine, prompt, 40, ids, skip_text_head=True)
    assert torch.equal(with_head.tokens, without.tokens)
    assert with_head.audio_mode.any()


def test_deferred_text_fill_matches_reference_across_mode_switches(engine, ref):
    """With the text branch of audio-mode steps left to the next text-mode step, every head
    the loop reads still matches the reference: text logits after runs of audio steps need the
    text cache of every position, filled by the catch-up (its padding rows included)."""
    engine.defer_text_fill = True
    ids = Ids.of(engine.spec)
    prompts = traffic.batch(2, 30, ids, seed=21)
    follow = traffic.batch(2, 10, ids, seed=22)
    engine.prefill(prompts)
    _, _, caches = ref(prompts)
    for t, need_text in enumerate((False, False, True, False, True, True, False, False, False, True)):
        et, ea = engine.decode(follow[:, t], need_text=need_text)
        rt, ra, caches = ref(follow[:, t : t + 1], caches)
        assert (ea - ra[:, -1]).abs().max() < TOL, t
        assert (et is not None) == need_text
        if need_text:
            assert (et - rt[:, -1]).abs().max() < TOL, t
    prompt = traffic.speech_prompt(2, 32, ids, seed=17)  # ends in start-of-speech: audio mode first
    got = generate(engine, prompt, 40, ids)
    want = generate(ReferenceEngine(ref, "cpu"), prompt, 40, ids)
    assert torch.equal(got.tokens, want.tokens)
    assert got.audio_mode.any() and not got.audio_mode.all()


@pytest.mark.parametrize("room", [None, 6], ids=["padded", "no_room_to_pad"])
def test_deferred_text_fill_skips_the_text_branch_then_catches_up(tiny_engine_dir, room):
    """Audio-mode steps leave the text cache untouched (the branch is not run: its weights
    are not read), and the first text-mode step fills every owed position with what in-step
    filling writes; the other caches are never affected. room: positions left in the cache
    after the prompt (6: too few to pad the catch-up's rows, which then run as they are)."""
    first = load_engine(tiny_engine_dir)
    ids = Ids.of(first.spec)
    n = 20 if room is None else first.max_seq_len - room
    prompts, follow = traffic.batch(2, n, ids, seed=23), traffic.batch(2, 6, ids, seed=24)
    engines = {}
    for defer in (False, True):
        e = engines[defer] = first if not defer else load_engine(tiny_engine_dir)
        e.defer_text_fill = defer
        e.prefill(prompts)
        for layer in e.layers:
            layer.k_cache[:, :, n : n + 6].fill_(7.0)  # a marker (masked until written: NaN would leak through)
        for t in range(5):
            e.decode(follow[:, t], need_text=False)
    text = [e.text_block for e in engines.values()]
    assert all((layer.k_cache[:2, :, n : n + 5] != 7.0).all() for layer in text[0])
    assert all((layer.k_cache[:2, :, n : n + 5] == 7.0).all() for layer in text[1])
    got = [e.decode(follow[:, 5], need_text=True) for e in engines.values()]
    assert (got[0][0] - got[1][0]).abs().max() < TOL and (got[0][1] - got[1][1]).abs().max() < TOL
    for a, b in zip(engines[False].layers, engines[True].layers, strict=True):
        for want, have in ((a.k_cache, b.k_cache), (a.v_cache, b.v_cache)):
            assert (want[:2, :, : n + 6] - have[:2, :, : n + 6]).abs().max() < TOL
    assert engines[True].slots.filled == [n + 6] * 2


def test_batch_rows_are_independent(engine):
    ids = Ids.of(engine.spec)
    prompts = traffic.batch(3, 25, ids, seed=18)
    t3, a3 = engine.prefill(prompts)
    t1, a1 = engine.prefill(prompts[1:2])
    assert (t3[1] - t1[0]).abs().max() < TOL and (a3[1] - a1[0]).abs().max() < TOL


def test_limits_are_enforced(engine):
    ids = Ids.of(engine.spec)
    with pytest.raises(ValueError, match="exceeds the engine's limits"):
        engine.prefill(traffic.batch(engine.max_batch + 1, 4, ids, seed=1))
    engine.prefill(traffic.batch(2, 4, ids, seed=1))
    with pytest.raises(ValueError, match="decode of batch 3"):
        engine.decode(torch.zeros(3, 2, dtype=torch.long))
