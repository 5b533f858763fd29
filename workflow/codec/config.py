"""The codec decoder's shape and settings, one dataclass per part, gathered in `CodecConfig`.

Defaults are the true shape (docs/codec.md, "Confirmed": the codec's flow/config.yaml as
transcribed by a third-party port, agreeing with the official GitHub code); `tiny()` is the
embedded default's. What docs/codec.md lists as unconfirmed is a field here, not a constant."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class EncoderConfig:
    """Token embedding -> UpsampleConformerEncoder -> encoder_proj (mu, the mel-rate condition)."""

    vocab_size: int = 20480  # unconfirmed: read it from input_embedding.weight's rows when loading
    size: int = 512  # embedding, conformer and upsampler width
    heads: int = 8
    linear_units: int = 2048
    blocks: int = 6  # before the upsampler
    up_blocks: int = 4  # after it
    stride: int = 4  # token_mel_ratio: 12.5 Hz codes -> 50 Hz mel frames
    lookahead: int = 3  # pre_lookahead_len: tokens the PreLookaheadLayer reads ahead
    mel: int = 80  # encoder_proj's output
    spk_dim: int = 192  # x-vector (CAM++), L2-normalised, then Linear(192, mel)


@dataclass(frozen=True)
class EstimatorConfig:
    """CausalConditionalDecoder: the causal 1-D U-Net that predicts the flow's velocity."""

    in_channels: int = 320  # x, mu, spk, cond: 80 each
    out_channels: int = 80
    channels: int = 256
    head_dim: int = 64
    heads: int = 8
    blocks: int = 4  # transformer blocks per level
    mid_blocks: int = 12  # the time embedding is 4 x channels wide (1024)


@dataclass(frozen=True)
class SolverConfig:
    """Conditional flow matching at inference: Euler on a cosine schedule, classifier-free guidance."""

    steps: int = 10
    cfg_rate: float = 0.7
    noise_frames: int = 15000  # the fixed noise buffer (seed 0): at most 300 s of prompt + output
    noise_seed: int = 0


@dataclass(frozen=True)
class HiftConfig:
    """HiFT: NSF source + transposed-conv upsampling + iSTFT head, mel -> 24 kHz PCM."""

    mel: int = 80
    base_channels: int = 512
    harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernels: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop: int = 4
    resblock_kernels: tuple[int, ...] = (3, 7, 11)
    resblock_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernels: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_channels: int = 512  # ConvRNNF0Predictor's width

    @property
    def hop(self) -> int:
        """PCM samples per mel frame: the upsampling rates times the iSTFT hop (8 x 5 x 3 x 4 = 480)."""
        n = self.istft_hop
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True)
class MelConfig:
    """The decoder's log-mel (Matcha-TTS's mel_spectrogram): the voice prompt's features."""

    sampling_rate: int = 24000
    n_fft: int = 1920
    hop: int = 480
    win: int = 1920
    mels: int = 80
    fmin: float = 0.0
    fmax: float = 8000.0


@dataclass(frozen=True)
class CodecConfig:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)
    hift: HiftConfig = field(default_factory=HiftConfig)
    mel: MelConfig = field(default_factory=MelConfig)
    chunk: int = 5  # streaming chunk in codes (flow-chunk-5.pt; 25: flow-chunk-25.pt); 0: offline

    def past_frames(self, prompt_codes: int) -> int:
        """The frames a flow past covers for a prompt of that many codes: its whole chunks that the
        lookahead does not reach (180 of a 50-code prompt's 200)."""
        if self.chunk <= 0:
            raise ValueError("a flow past needs a chunk-trained config (cfg.chunk > 0)")
        chunk_frames = self.chunk * self.encoder.stride
        return max(0, (prompt_codes - self.encoder.lookahead) * self.encoder.stride // chunk_frames * chunk_frames)

    @classmethod
    def tiny(cls) -> CodecConfig:
        """The embedded default's shape: every part present, narrow and shallow, seconds on a CPU."""
        return cls(
            encoder=EncoderConfig(vocab_size=16385, size=32, heads=2, linear_units=64, blocks=1, up_blocks=1),
            estimator=EstimatorConfig(channels=32, head_dim=8, heads=2, blocks=1, mid_blocks=1),
            solver=SolverConfig(steps=2, noise_frames=2000),
            hift=replace(HiftConfig(), base_channels=16, harmonics=2, f0_channels=16),
        )
