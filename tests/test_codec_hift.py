"""HiFT (workflow/codec/hift.py) and the decoder's log-mel (workflow/codec/mel.py): shapes, names, behaviour."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from workflow.codec.config import CodecConfig, HiftConfig, MelConfig
from workflow.codec.hift import HiFT, Snake, fold_weight_norm, hift_state_dict, istft
from workflow.codec.mel import LogMel, hz_to_mel, log_mel, mel_filterbank, mel_to_hz

TINY = CodecConfig.tiny().hift


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_hift(seed: int = 0) -> HiFT:
    torch.manual_seed(seed)
    return HiFT(TINY).eval()


def conv_params(cin: int, cout: int, k: int) -> int:
    return cin * cout * k + cout


def resblock_params(c: int, k: int, dilations: tuple[int, ...]) -> int:
    return len(dilations) * (2 * conv_params(c, c, k) + 2 * c)  # two convs and two Snake alpha vectors per dilation


def expected_params(cfg: HiftConfig) -> int:
    """HiFTGenerator's constructor arithmetic (CosyVoice generator.py / f0_predictor.py), written out by hand."""
    c, n_fft, rates = cfg.base_channels, cfg.istft_n_fft, cfg.upsample_rates
    n = (cfg.harmonics + 1) + 1  # m_source.l_linear
    n += conv_params(cfg.mel, c, 7)  # conv_pre
    for i, k in enumerate(cfg.upsample_kernels):  # ups: ConvTranspose1d(c/2^i -> c/2^(i+1), k)
        n += conv_params(c >> i, c >> (i + 1), k)
    for i, (k, d) in enumerate(zip(cfg.source_resblock_kernels, cfg.source_resblock_dilations, strict=True)):
        stride = math.prod(rates[i + 1 :])
        n += conv_params(n_fft + 2, c >> (i + 1), 1 if stride == 1 else 2 * stride)  # source_downs
        n += resblock_params(c >> (i + 1), k, d)  # source_resblocks
    for i in range(len(rates)):
        for k, d in zip(cfg.resblock_kernels, cfg.resblock_dilations, strict=True):
            n += resblock_params(c >> (i + 1), k, d)
    n += conv_params(c >> len(rates), n_fft + 2, 7)  # conv_post
    f = cfg.f0_channels  # f0_predictor: 5 x Conv1d(k=3) + Linear(f, 1)
    n += conv_params(cfg.mel, f, 3) + 4 * conv_params(f, f, 3) + f + 1
    return n


def official_keys(cfg: HiftConfig) -> set[str]:
    """The official HiFTGenerator's state_dict keys once weight norm is folded (names read from
    OpenMOSS/MOSS-Speech @6b86ef6 cosyvoice/hifigan/{generator,f0_predictor}.py, transformer/activation.py)."""
    wb = ("weight", "bias")
    keys = {f"{m}.{p}" for m in ("m_source.l_linear", "conv_pre", "conv_post", "f0_predictor.classifier") for p in wb}
    keys |= {f"f0_predictor.condnet.{i}.{p}" for i in (0, 2, 4, 6, 8) for p in wb}
    stages = len(cfg.upsample_rates)
    keys |= {f"{m}.{i}.{p}" for m in ("ups", "source_downs") for i in range(stages) for p in wb}

    def resblock(prefix: str, n_dil: int) -> set[str]:
        out = {f"{prefix}.{c}.{j}.{p}" for c in ("convs1", "convs2") for j in range(n_dil) for p in wb}
        return out | {f"{prefix}.{a}.{j}.alpha" for a in ("activations1", "activations2") for j in range(n_dil)}

    for i, d in enumerate(cfg.source_resblock_dilations):
        keys |= resblock(f"source_resblocks.{i}", len(d))
    for i in range(stages * len(cfg.resblock_kernels)):
        keys |= resblock(f"resblocks.{i}", len(cfg.resblock_dilations[i % len(cfg.resblock_kernels)]))
    return keys


def test_true_shape_parameter_count_and_official_names():
    with torch.device("meta"):
        model = HiFT(HiftConfig())
    n = sum(p.numel() for p in model.parameters())
    assert n == expected_params(HiftConfig()) == 20_806_557
    assert abs(n - 20.8e6) / 20.8e6 < 0.005  # docs/codec.md: HiFT ~20.8 M
    # hift.pt also stores one weight-norm g per output channel (per input channel for the ConvTranspose1d
    # ups): with those, fp32 bytes come to CosyVoice2's hift.pt size, 83.4 MB, within pickling overhead.
    g = sum(m.weight.shape[0] for name, m in model.named_modules() if isinstance(m, nn.Conv1d | nn.ConvTranspose1d))
    g -= sum(m.weight.shape[0] for m in model.source_downs)  # source_downs are not weight-normed
    assert abs((n + g) * 4 - 83.4e6) / 83.4e6 < 0.005

    sd = model.state_dict()
    assert set(sd) == official_keys(HiftConfig())
    shapes = {
        "m_source.l_linear.weight": (1, 9),
        "conv_pre.weight": (512, 80, 7),
        "ups.0.weight": (512, 256, 16),  # ConvTranspose1d: [in, out, k]
        "ups.2.weight": (128, 64, 7),
        "source_downs.0.weight": (256, 18, 30),  # STFT (n_fft+2 = 18 channels) strided by 5*3 = 15
        "source_downs.1.weight": (128, 18, 6),
        "source_downs.2.weight": (64, 18, 1),
        "source_resblocks.0.convs1.0.weight": (256, 256, 7),
        "source_resblocks.2.convs1.2.weight": (64, 64, 11),
        "resblocks.0.activations1.0.alpha": (256,),  # one Snake alpha per channel
        "resblocks.8.convs2.2.weight": (64, 64, 11),
        "conv_post.weight": (18, 64, 7),
        "f0_predictor.condnet.0.weight": (512, 80, 3),
        "f0_predictor.condnet.8.weight": (512, 512, 3),
        "f0_predictor.classifier.weight": (1, 512),
    }
    assert {k: tuple(sd[k].shape) for k in shapes} == shapes


def test_frames_to_samples_limit_and_reproducible():
    model, frames = tiny_hift(), 5
    mel = torch.randn(2, TINY.mel, frames)
    rng = torch.get_rng_state()
    with torch.no_grad():
        pcm, source = model(mel, generator=torch.Generator().manual_seed(7))
        pcm2, source2 = model(mel, generator=torch.Generator().manual_seed(7))
        _, source3 = model(mel, generator=torch.Generator().manual_seed(8))
        pcm_default, _ = model(mel)
        pcm_default2, _ = model(mel)
    assert torch.equal(rng, torch.get_rng_state())  # the global RNG is never drawn from
    assert TINY.hop == 480
    assert pcm.shape == (2, frames * 480) and source.shape == (2, 1, frames * 480)
    assert pcm.abs().max() <= TINY.audio_limit and pcm.abs().max() > 0
    assert torch.equal(pcm, pcm2) and torch.equal(source, source2)
    assert not torch.equal(source, source3)
    assert torch.equal(pcm_default, pcm_default2)


def deterministic_weights(model: HiFT) -> None:
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("alpha"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel() if "ups." not in name else p.shape[0] * p.shape[2] // 2
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
        model.f0_predictor.classifier.bias.fill_(150.0)  # voiced


def test_matches_numbers_from_the_official_generator():
    """Golden numbers from the official HiFTGenerator (MOSS-Speech @6b86ef6, cosyvoice/hifigan, run once outside
    this project with these weights as its weight-norm v and ||v|| as g, the tiny shape's arguments, and
    torch.manual_seed(5) before `inference`): the same seed in a Generator reproduces its source exactly."""
    model = HiFT(TINY).eval()
    deterministic_weights(model)
    mel = torch.randn(1, TINY.mel, 6, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        pcm, source = model(mel, generator=torch.Generator().manual_seed(5))
        f0 = model.f0_predictor(mel)
    want_f0 = [150.0327454, 150.5324097, 150.1598511, 149.8665771, 150.1280823, 150.1737366]
    want_pcm = [0.4370383, 0.0464428, 0.1234973, 0.0690186, 0.4188515, 0.3962714, 0.5041652, 0.4185493]
    want_src = [0.1338976, 0.1968561, 0.1360805, 0.0643330, 0.1418081, 0.1917127, 0.1346705, 0.1415764]
    assert torch.allclose(f0[0], torch.tensor(want_f0), atol=1e-4)
    assert torch.allclose(source[0, 0, 240::360], torch.tensor(want_src), atol=1e-6)
    assert torch.allclose(pcm[0, 240::360], torch.tensor(want_pcm), atol=2e-4)
    assert float(source.abs().sum()) == pytest.approx(390.4125061, rel=1e-5)
    assert float(pcm.abs().sum()) == pytest.approx(514.0559692, rel=1e-4)


def test_output_is_clamped_to_audio_limit():
    model = tiny_hift()
    with torch.no_grad():
        model.conv_post.bias[: TINY.istft_n_fft // 2 + 1] = 4.0  # magnitude e^4 per bin: far beyond 1
        pcm, _ = model(torch.randn(1, TINY.mel, 4))
    assert pcm.abs().max() == pytest.approx(TINY.audio_limit)
    assert torch.isclose(pcm.abs(), torch.tensor(TINY.audio_limit)).float().mean() > 0.1


def test_cache_source_overwrites_the_head():
    model, mel = tiny_hift(), torch.randn(1, TINY.mel, 4)
    cache = torch.full((1, 1, 700), 0.5)
    with torch.no_grad():
        _, plain = model(mel, generator=torch.Generator().manual_seed(3))
        pcm, cached = model(mel, cache, generator=torch.Generator().manual_seed(3))
        pcm_plain, _ = model(mel, generator=torch.Generator().manual_seed(3))
    assert torch.equal(cached[..., :700], cache)
    assert torch.equal(cached[..., 700:], plain[..., 700:])
    assert not torch.allclose(pcm, pcm_plain)  # the source reaches the waveform


def set_f0(model: HiFT, hz: float) -> None:
    with torch.no_grad():
        model.f0_predictor.classifier.weight.zero_()
        model.f0_predictor.classifier.bias.fill_(hz)


def spectrum_peak_hz(x: torch.Tensor, sr: int) -> tuple[float, float]:
    spec = torch.fft.rfft(x * torch.hann_window(x.numel(), periodic=False)).abs()
    k = int(spec[1:].argmax()) + 1
    return k * sr / x.numel(), float(spec[k] * 2 / (x.numel() / 2))  # (Hz, amplitude; Hann's coherent gain 1/2)


@pytest.mark.parametrize("harmonic", [0, 1])
def test_voiced_source_is_a_sine_at_the_harmonic_of_f0(harmonic: int):
    model, frames = tiny_hift(), 20  # 0.4 s: 2.5 Hz bins
    set_f0(model, -200.0)  # the predictor's output is |classifier|: 200 Hz
    with torch.no_grad():
        model.m_source.l_linear.weight.zero_()
        model.m_source.l_linear.weight[0, harmonic] = 1.0  # pass one harmonic through
        model.m_source.l_linear.bias.zero_()
        source = model.source(torch.randn(1, TINY.mel, frames), torch.Generator().manual_seed(0))[0, 0]
    hz, amp = spectrum_peak_hz(source, TINY.sampling_rate)
    assert hz == pytest.approx(200.0 * (harmonic + 1), abs=2.5)
    assert amp == pytest.approx(math.tanh(TINY.nsf_alpha), rel=0.05)  # sine amplitude nsf_alpha, then tanh


def test_unvoiced_source_is_noise_of_alpha_over_three():
    model, frames = tiny_hift(), 20
    set_f0(model, TINY.voiced_threshold - 5)  # below the voiced threshold
    with torch.no_grad():
        model.m_source.l_linear.weight.zero_()
        model.m_source.l_linear.weight[0, 0] = 1.0
        model.m_source.l_linear.bias.zero_()
        source = model.source(torch.randn(1, TINY.mel, frames), torch.Generator().manual_seed(0))[0, 0]
    assert source.mean().abs() < 0.003
    assert float(source.std()) == pytest.approx(TINY.nsf_alpha / 3, rel=0.05)
    set_f0(model, 200.0)
    with torch.no_grad():
        voiced = model.source(torch.randn(1, TINY.mel, frames), torch.Generator().manual_seed(0))[0, 0]
    # The phase is the per-frame cumulative sum, linearly upsampled (align_corners=False): sample j sits at
    # phase 2 pi f0 (j + hop/2 + 1/2) / sr, held constant over the first and last half frame.
    half = TINY.hop // 2
    t = (torch.arange(voiced.numel(), dtype=torch.float64) + half + 0.5) / TINY.sampling_rate
    clean = torch.tanh(TINY.nsf_alpha * torch.sin(2 * math.pi * 200.0 * t)).float()
    residual = (voiced - clean)[half:-half]
    assert float(residual.std()) == pytest.approx(TINY.nsf_sigma, rel=0.1)  # voiced noise std nsf_sigma
    assert float(residual.mean().abs()) < 3e-4


def test_snake_alpha_per_channel():
    snake = Snake(3)
    with torch.no_grad():
        snake.alpha.copy_(torch.tensor([0.5, 1.0, 2.0]))
    x = torch.randn(2, 3, 10)
    a = torch.tensor([0.5, 1.0, 2.0])[None, :, None]
    assert torch.allclose(snake(x), x + torch.sin(a * x) ** 2 / a, atol=1e-6)


def weight_normed(module: nn.Module, form: str) -> nn.Module:
    """torch's weight norm (old `weight_g`/`weight_v` or the parametrization), with g moved off ||v||."""
    if form == "old":
        module = nn.utils.weight_norm(module)
        with torch.no_grad():
            module.weight_g.mul_(torch.rand_like(module.weight_g) + 0.5)
            module(torch.zeros(1, module.in_channels, 8))  # its forward pre-hook recomputes .weight from g, v
    else:
        module = parametrizations.weight_norm(module)
        with torch.no_grad():
            g = module.parametrizations.weight.original0
            g.mul_(torch.rand_like(g) + 0.5)
    return module


@pytest.mark.parametrize("form", ["old", "parametrizations"])
@pytest.mark.parametrize("kind", ["conv", "transposed"])
def test_fold_weight_norm_equals_torch(form: str, kind: str):
    torch.manual_seed(0)
    make = (lambda: nn.Conv1d(4, 6, 3, padding=1)) if kind == "conv" else (lambda: nn.ConvTranspose1d(6, 4, 5, 2, padding=1))
    normed = weight_normed(make(), form)
    state = normed.state_dict()
    assert len(state) == 3  # g, v, bias
    folded = fold_weight_norm(state)
    assert set(folded) == {"weight", "bias"}
    assert torch.allclose(folded["weight"], normed.weight, atol=1e-6)
    # weight norm's dim is 0 for both: Conv1d's output channel, but ConvTranspose1d's *input* channel
    g = next(v for k, v in state.items() if k.endswith(("weight_g", "original0")))
    assert g.shape == (folded["weight"].shape[0], 1, 1)
    assert torch.allclose(folded["weight"].flatten(1).norm(dim=1), g.flatten(), atol=1e-5)
    plain = make()
    plain.load_state_dict(folded, strict=True)
    x = torch.randn(2, plain.in_channels, 9)
    assert torch.allclose(plain(x), normed(x), atol=1e-6)


def test_hift_state_dict_loads_a_weight_normed_checkpoint():
    source = tiny_hift(1)
    normed = copy.deepcopy(source)
    convs = [m for n, m in normed.named_modules() if isinstance(m, nn.Conv1d | nn.ConvTranspose1d) and "source_downs" not in n]
    for i, conv in enumerate(convs):  # both checkpoint forms in one state dict
        weight_normed(conv, "old" if i % 2 else "parametrizations")
    checkpoint = {"generator." + k: v for k, v in normed.state_dict().items()}
    assert any(k.endswith("weight_g") for k in checkpoint) and any(k.endswith("original0") for k in checkpoint)
    model = HiFT(TINY).eval()
    model.load_state_dict(hift_state_dict(checkpoint), strict=True)
    mel = torch.randn(1, TINY.mel, 3)
    with torch.no_grad():
        want, _ = normed(mel, generator=torch.Generator().manual_seed(0))
        got, _ = model(mel, generator=torch.Generator().manual_seed(0))
        unfolded, _ = source(mel, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, unfolded, atol=1e-4)  # g was moved, so the fold is what made them agree


# ---------------------------------------------------------------- mel


def test_slaney_scale_by_hand():
    hz = torch.tensor([0.0, 500.0, 1000.0, 6400.0, 40960.0], dtype=torch.float64)
    # linear at 3/200 mel per Hz up to 1 kHz (= 15 mel), then 27 mels per factor 6.4
    assert torch.allclose(hz_to_mel(hz), torch.tensor([0.0, 7.5, 15.0, 42.0, 69.0], dtype=torch.float64))
    assert torch.allclose(mel_to_hz(hz_to_mel(hz)), hz)


def test_filterbank_peaks_and_equal_area():
    cfg = MelConfig()
    fb = mel_filterbank(cfg.sampling_rate, cfg.n_fft, cfg.mels, cfg.fmin, cfg.fmax).double()
    assert fb.shape == (80, 961) and fb.min() >= 0
    bin_hz = cfg.sampling_rate / cfg.n_fft  # 12.5 Hz
    top = hz_to_mel(torch.tensor(cfg.fmax, dtype=torch.float64))
    corners = mel_to_hz(torch.linspace(0, float(top), cfg.mels + 2, dtype=torch.float64))
    centre_bins = fb.argmax(dim=1).double()
    assert torch.all((centre_bins * bin_hz - corners[1:-1]).abs() <= bin_hz / 2 + 1e-9)
    assert torch.allclose(fb.sum(dim=1) * bin_hz, torch.ones(80, dtype=torch.float64), rtol=0.05)  # slaney: area 1
    assert fb[:, int(cfg.fmax / bin_hz) + 1 :].abs().max() == 0


FILTERBANKS = [(24000, 1920, 80, 0.0, 8000.0), (16000, 512, 40, 55.0, 7600.0)]


@pytest.mark.parametrize(("sr", "n_fft", "mels", "fmin", "fmax"), FILTERBANKS)
def test_filterbank_matches_librosa(sr: int, n_fft: int, mels: int, fmin: float, fmax: float):
    librosa = pytest.importorskip("librosa")
    want = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=mels, fmin=fmin, fmax=fmax)
    got = mel_filterbank(sr, n_fft, mels, fmin, fmax).numpy()
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_log_mel_frames_and_shape():
    mel = LogMel()
    for n, frames in ((480 * 7, 7), (480 * 7 + 100, 7), (480 * 50, 50)):
        out = mel(torch.randn(2, n) * 0.1)
        assert out.shape == (2, 80, frames)
    assert mel(torch.randn(480 * 3) * 0.1).shape == (1, 80, 3)
    silence = log_mel(torch.zeros(1, 480 * 4))
    assert torch.allclose(silence, torch.full_like(silence, math.log(1e-5)))  # sqrt(1e-9) magnitudes fall under the floor


def test_log_mel_matches_a_numpy_reference():
    """Matcha's recipe in float64 numpy: reflect pad, frames of n_fft every hop (no centring), periodic Hann,
    rfft, sqrt(|X|^2 + 1e-9), librosa's filterbank (or ours where librosa is missing), ln(max(., 1e-5))."""
    cfg = MelConfig()
    y = np.random.default_rng(0).uniform(-0.5, 0.5, 480 * 12)
    pad = (cfg.n_fft - cfg.hop) // 2
    padded = np.pad(y, pad, mode="reflect")
    starts = np.arange(0, padded.size - cfg.n_fft + 1, cfg.hop)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(cfg.n_fft) / cfg.n_fft)
    spec = np.fft.rfft(np.stack([padded[s : s + cfg.n_fft] for s in starts]) * window, axis=1).T
    magnitude = np.sqrt(np.abs(spec) ** 2 + 1e-9)
    try:
        import librosa

        fb = librosa.filters.mel(sr=cfg.sampling_rate, n_fft=cfg.n_fft, n_mels=cfg.mels, fmin=cfg.fmin, fmax=cfg.fmax)
    except ImportError:
        fb = mel_filterbank(cfg.sampling_rate, cfg.n_fft, cfg.mels, cfg.fmin, cfg.fmax).numpy()
    want = np.log(np.maximum(fb.astype(np.float64) @ magnitude, 1e-5))
    got = log_mel(torch.tensor(y, dtype=torch.float32)[None])[0].double().numpy()
    np.testing.assert_allclose(got, want, atol=2e-4)


@pytest.mark.parametrize("tone_hz", [440.0, 1000.0, 3000.0])
def test_pure_tone_lands_in_its_mel_band(tone_hz: float):
    cfg = MelConfig()
    t = torch.arange(cfg.sampling_rate // 2) / cfg.sampling_rate
    mel = log_mel(0.5 * torch.sin(2 * math.pi * tone_hz * t)[None])[0].mean(dim=1)
    top = hz_to_mel(torch.tensor(cfg.fmax, dtype=torch.float64))
    centres = mel_to_hz(torch.linspace(0, float(top), cfg.mels + 2, dtype=torch.float64))[1:-1]
    assert int(mel.argmax()) == int((centres - tone_hz).abs().argmin())
    assert mel.max() - mel.median() > 5  # the tone stands well above the rest (in nats)


def test_istft_is_torchs_without_a_host_sync():
    """HiFT's own iSTFT (a CUDA graph can hold it) gives torch.istft's samples: centred, onesided,
    the window's squared overlap divided out, n_fft/2 trimmed at each end."""
    window = torch.hann_window(TINY.istft_n_fft)
    spec = torch.randn(3, TINY.istft_n_fft // 2 + 1, 40, dtype=torch.complex64, generator=torch.Generator().manual_seed(5))
    want = torch.istft(spec, TINY.istft_n_fft, TINY.istft_hop, TINY.istft_n_fft, window)
    got = istft(spec, TINY.istft_hop, window)
    assert got.shape == want.shape == (3, TINY.istft_hop * 39)
    assert torch.allclose(got, want, atol=1e-6)
