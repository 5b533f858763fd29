"""The modality-switching loop and the samplers, on a scripted engine."""

import pytest
import torch

from workflow.engines.base import Engine, merged_ids
from workflow.generate import Ids, Sampling, advance, audio_mode_after, generate, penalize, sample
from workflow.spec import PRESETS

SPEC = PRESETS["tiny"]
IDS = Ids.of(SPEC)
V, VA = SPEC.vocab_size, SPEC.audio_vocab_size


class Scripted(Engine):
    """Emits a scripted (text, audio) argmax per step; records what it was fed."""

    def __init__(self, script: list[tuple[int, int]]):
        self.spec, self.device, self.max_batch, self.max_seq_len = SPEC, torch.device("cpu"), 1, 1 << 20
        self.script, self.fed, self.need_text = list(script), [], []

    def _logits(self):
        text, audio = self.script.pop(0)
        t, a = torch.zeros(1, V), torch.zeros(1, VA)
        t[0, text] = 10.0
        a[0, audio] = 10.0
        return t, a

    def prefill(self, tokens, all_logits=False):
        return self._logits()

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
    assert eng.need_text == [True, False, False, False, True, True]


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
