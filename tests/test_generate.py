"""The modality-switching loop and the samplers, on a scripted engine."""

import pytest
import torch

from workflow.engines.base import merged_ids
from workflow.generate import Ids, Sampling, advance, audio_mode_after, generate, penalize, sample
from workflow.spec import PRESETS

SPEC = PRESETS["tiny"]
IDS = Ids.of(SPEC)
V, VA = SPEC.vocab_size, SPEC.audio_vocab_size


class Scripted:
    """Emits a scripted (text, audio) argmax per step; records what it was fed. The loop makes
    only an engine's lockstep calls (prefill, decode), so that is all it has."""

    def __init__(self, script: list[tuple[int, int]]):
        self.spec, self.device, self.max_batch, self.max_seq_len = SPEC, torch.device("cpu"), 1, 1 << 20
        self.script, self.fed, self.need_text, self.prefill_need_text = list(script), [], [], None

    def _logits(self):
        text, audio = self.script.pop(0)
        t, a = torch.zeros(1, V), torch.zeros(1, VA)
        t[0, text] = 10.0
        a[0, audio] = 10.0
        return t, a

    def prefill(self, tokens, all_logits=False, need_text=True):
        self.prefill_need_text = need_text
        t, a = self._logits()
        return (t if need_text else None), a

    def decode(self, tokens, need_text=True):
        self.fed.append(tokens[0].tolist())
        self.need_text.append(need_text)
        t, a = self._logits()
        return (t if need_text else None), a


def text_prompt():
    return torch.tensor([[[100, IDS.audio_pad], [101, IDS.audio_pad]]])


def test_text_to_speech_to_text_to_stop():
    script = [(5, 1), (IDS.sosp, 2), (9, 30), (9, 31), (9, IDS.eosp), (6, 4), (IDS.stop[0], 5), (7, 7)]
    eng = Scripted(script)
    out = generate(eng, text_prompt(), 20, IDS)
    assert out.tokens[0].tolist() == [
        [5, IDS.audio_pad],
        [IDS.sosp, IDS.audio_pad],  # start-of-speech: audio mode from the next step
        [IDS.pad, 30],  # text token overwritten by modality_pad
        [IDS.pad, 31],
        [IDS.pad, IDS.eosp],  # end-of-speech: back to text
        [6, IDS.audio_pad],
        [IDS.stop[0], IDS.audio_pad],  # stop id in text mode ends the sequence
    ]
    assert out.audio_mode[0].tolist() == [False, False, True, True, True, False, False]
    assert out.stopped_at == [6]
    assert out.audio_codes(0, IDS) == [30, 31]
    # the text head is skipped exactly where every sequence is in audio mode
    assert eng.prefill_need_text is True
    assert eng.need_text == [True, False, False, False, True, True]


def test_a_prompt_ending_in_start_of_speech_skips_the_text_head_at_prefill():
    prompt = torch.tensor([[[100, IDS.audio_pad], [IDS.sosp, IDS.audio_pad]]])
    eng = Scripted([(5, 30), (6, IDS.eosp), (7, 1)])
    out = generate(eng, prompt, 3, IDS)
    assert eng.prefill_need_text is False and eng.need_text == [False, True]
    assert out.tokens[0].tolist() == [[IDS.pad, 30], [IDS.pad, IDS.eosp], [7, IDS.audio_pad]]
    eng = Scripted([(5, 30)])
    generate(eng, prompt, 1, IDS, skip_text_head=False)
    assert eng.prefill_need_text is True


def test_on_step_gets_host_modes_before_the_steps_one_wait(monkeypatch):
    """on_step must come before the host waits for the step (what it enqueues, e.g. a chunk
    for the vocoder, then runs right behind the sampling) and get the modes as host booleans
    (reading them from the device would be a wait of its own)."""
    log, real = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (log.append("wait") if t.dtype == torch.bool else None, real(t))[1])
    script = [(IDS.sosp, 1), (9, 30), (9, IDS.eosp), (IDS.stop[0], 4)]
    modes = []

    def on_step(step, tokens, audio_mode):
        log.append(f"step {step}")
        modes.append(audio_mode)

    out = generate(Scripted(script), text_prompt(), 10, IDS, on_step=on_step)
    assert log == ["wait", "step 0", "wait", "step 1", "wait", "step 2", "wait", "step 3", "wait"]
    assert modes == [[False], [True], [True], [False]]
    assert all(type(m) is bool for row in modes for m in row)
    assert out.audio_mode[0].tolist() == [m[0] for m in modes]


def test_stop_id_in_audio_mode_does_not_stop():
    eng = Scripted([(IDS.sosp, 0), (IDS.stop[0], 40), (IDS.stop[1], 41), (3, 42)])
    out = generate(eng, text_prompt(), 4, IDS, skip_text_head=False)
    assert out.stopped_at == [None]
    assert out.tokens[0, 1:, 0].tolist() == [IDS.pad, IDS.pad, IDS.pad]


def test_next_input_embeds_audio_exactly_where_text_is_pad():
    tokens = torch.tensor([[5, 77], [IDS.pad, 77], [IDS.sosp, IDS.audio_pad], [IDS.pad, IDS.eosp]])
    assert merged_ids(tokens, SPEC).tolist() == [5, V + 77, IDS.sosp, V + IDS.eosp]


def test_audio_mode_after_each_position():
    tokens = torch.tensor([[5, IDS.audio_pad], [IDS.sosp, IDS.audio_pad], [IDS.pad, 3], [IDS.pad, IDS.eosp], [7, IDS.audio_pad]])
    assert audio_mode_after(tokens, IDS).tolist() == [False, True, True, False, False]


def test_advance_is_vectorised_over_streams():
    text = torch.tensor([IDS.sosp, 8, 8, IDS.stop[1]])
    audio = torch.tensor([1, IDS.eosp, 9, 2])
    mode = torch.tensor([False, True, True, False])
    tokens, nxt, stopped = advance(text, audio, mode, IDS)
    assert tokens.tolist() == [[IDS.sosp, IDS.audio_pad], [IDS.pad, IDS.eosp], [IDS.pad, 9], [IDS.stop[1], IDS.audio_pad]]
    assert nxt.tolist() == [True, False, True, False]
    assert stopped.tolist() == [False, False, False, True]


def test_padding_audio_rows_are_never_sampled():
    eng = Scripted([(IDS.sosp, 0), (0, VA - 1), (0, IDS.eosp + 1)])
    out = generate(eng, text_prompt(), 3, IDS)
    assert all(a <= IDS.eosp for a in out.tokens[0, :, 1].tolist())


def test_min_speech_tokens_holds_back_end_of_speech():
    eng = Scripted([(IDS.sosp, 0)] + [(0, IDS.eosp)] * 6)
    out = generate(eng, text_prompt(), 6, IDS, min_speech_tokens=3)
    audio = out.tokens[0, 1:5, 1].tolist()  # step 0 is start-of-speech
    assert audio == [0, 0, 0, IDS.eosp]


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    assert sample(logits, Sampling(greedy=True)).tolist() == [1]


def test_top_k_and_top_p_restrict_the_support():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[4.0, 3.9, 3.8, 0.0, -1.0]]).repeat(2000, 1)
    k2 = sample(logits, Sampling(temperature=1.0, top_k=2, top_p=1.0), g)
    assert set(k2.tolist()) == {0, 1}
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
    nucleus = sample(p, Sampling(temperature=1.0, top_k=0, top_p=0.75), g)
    assert set(nucleus.tolist()) == {0, 1}  # 0.5 + 0.3 crosses 0.75
    wide = sample(p, Sampling(temperature=1.0, top_k=0, top_p=1.0), g)
    assert set(wide.tolist()) == {0, 1, 2, 3}


def test_sampling_draws_each_token_with_its_probability():
    """The exponential race must be multinomial sampling: frequencies match the softmax (4
    sigma bounds at 40000 draws), a token of probability 0 never wins."""
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    draws = sample(p.log().repeat(40000, 1), Sampling(temperature=1.0, top_k=0, top_p=1.0), g)
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    assert freq[4] == 0
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / draws.numel()).sqrt() + 1e-12).all(), freq


def test_top_k_then_top_p_draw_from_the_renormalised_nucleus_of_a_shuffled_row():
    """Sampling runs on the sorted row: the draws must come back as the row's own ids, with
    the probabilities of the top-k-then-top-p distribution (4 sigma at 40000 draws)."""
    g = torch.Generator().manual_seed(5)
    p = torch.tensor([0.02, 0.3, 0.01, 0.15, 0.4, 0.12])  # top-3: 4, 1, 3; of these top-p 0.7 keeps 4, 1
    draws = sample(p.log().repeat(40000, 1), Sampling(temperature=1.0, top_k=3, top_p=0.7), g)
    kept = torch.tensor([0.0, 0.3, 0.0, 0.0, 0.4, 0.0]) / 0.7
    freq = torch.bincount(draws, minlength=6).double() / draws.numel()
    assert ((freq - kept).abs() <= 4 * (kept * (1 - kept) / draws.numel()).sqrt() + 1e-12).all(), freq


def test_top_k_keeps_every_token_tied_with_the_kth():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[5.0, 1.0, 3.0, 3.0, 0.0]]).repeat(4000, 1)
    draws = sample(logits, Sampling(temperature=1.0, top_k=2, top_p=1.0), g)
    assert set(draws.tolist()) == {0, 2, 3}


def test_temperature_sharpens():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[1.0, 0.0]]).repeat(4000, 1)
    hot = sample(logits, Sampling(temperature=2.0, top_k=0, top_p=1.0), g).float().mean()
    cold = sample(logits, Sampling(temperature=0.25, top_k=0, top_p=1.0), g).float().mean()
    assert cold < 0.05 < hot  # share of the second token


def test_repetition_penalty_shrinks_seen_logits_only():
    logits = torch.tensor([[2.0, -2.0, 2.0]])
    seen = torch.tensor([[True, True, False]])
    assert penalize(logits, seen, 2.0).tolist() == [[1.0, -4.0, 2.0]]


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_generation_is_reproducible(seed):
    def run():
        eng = Scripted([(i % 50, i % 7) for i in range(12)])
        g = torch.Generator().manual_seed(seed)
        return generate(eng, text_prompt(), 10, IDS, Sampling(), g).tokens

    assert torch.equal(run(), run())
