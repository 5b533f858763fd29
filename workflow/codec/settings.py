"""The codec decoder's settings (`benchmark.codec`) and the decoders they make: the same weights as ours
(its dtype, fast pass, compiled blocks and kernels on CUDA) and the official structure (float32, eager),
and the voice prompt a stream continues. timing.py times them; the benchmark's detokenizer serves ours."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from workflow.codec import checkpoint
from workflow.codec import voice as voice_file
from workflow.codec.config import CodecConfig
from workflow.codec.decoder import CodecDecoder, VoicePrompt
from workflow.errors import InputError

PRESETS = {"tiny": CodecConfig.tiny, "full": CodecConfig}
HIFT_LEAST_DB = 50.0  # float16 HiFT's PCM of the voice prompt at least this close to float32's (60.7 dB at the true shape)
CACHE = Path("results/.hub-cache")  # where hf: weights are fetched, as the download rule does


@dataclass(frozen=True)
class CodecTiming:
    """`benchmark.codec`, checked as it is made: the decoder's shape, dtypes and solver, what the benchmark's
    codec section times, and serving's flow slots, pages and padding."""

    preset: str = "tiny"  # tiny | full (the true shape)
    dtype: str = "float32"  # ours: float32 | bfloat16 (the front end and the flow)
    hift_dtype: str = "float32"  # ours: float32 | float16 (HiFT's convolutions, hift.HiFT.convs_to)
    prompt_codes: int = 10  # the voice prompt's codes (5k + 1 or 5k + 2: a shorter first hop, stream.first_hop)
    later_codes: int = 20  # where the later call falls: codes of the reply past the first hop (a multiple of the chunk)
    batches: tuple[int, ...] = (1, 2)
    repeat: int = 3
    baseline: bool = True  # also time the official structure (float32, eager, batch 1)
    flow_cache: bool = True  # also time ours with the flow cache (the new frames only, each call)
    weights: str | None = None  # None: random; local:<dir> or hf:<repo>@<rev>: the codec's checkpoint (checkpoint.py)
    seed: int = 0
    graphs: bool = True  # CUDA only
    compile: bool = True  # CUDA only: ours with the estimator's blocks through torch.compile (fast.py)
    kernels: bool = True  # CUDA only: the flow slots' transformer blocks as Triton kernels (kernels.py)
    slots: int = 0  # serving: streams whose flow pasts stay in fixed buffers (slots.py), each call solving new frames only
    pool_seconds: float = 0.0  # serving: the audio the slots' pages hold in all (0: every slot its longest reply)
    fp8_pages: bool = False  # the slots' keys and values in float8 e4m3 (slots.py): half the memory a second of audio
    held: int = 1  # > 1, with slots: also a later call solving this many chunks a row at once (serving's detokenize_hold)
    pad_frames: int = 320  # serving on CUDA: a call's frames padded to a multiple, a graph per multiple (warm makes each)
    later_shapes: int = 1  # serving, with slots: a later call's solve shapes, the held call's frames a row and its halves
    ode_steps: int | None = None  # the flow's Euler steps; None: the preset's (full: MOSS-Speech's 10)
    cfg_rate: float | None = None  # classifier-free guidance; None: the preset's (0.7); 0: none, half the flow's rows
    voice: str | None = None  # None: a random voice; a voice file (voice.py), whose codes are prompt_codes (from_dict)

    def __post_init__(self) -> None:
        """The settings checked wherever they come from (`from_dict`, or `dataclasses.replace`)."""
        if self.preset not in PRESETS:
            raise ValueError(f"benchmark.codec.preset: '{self.preset}' is not one of {', '.join(PRESETS)}")
        if self.ode_steps is not None and self.ode_steps < 1:
            raise ValueError(f"benchmark.codec.ode_steps: {self.ode_steps} is under 1")
        if self.cfg_rate is not None and self.cfg_rate < 0:
            raise ValueError(f"benchmark.codec.cfg_rate: {self.cfg_rate} is negative")
        cfg = self.config()
        chunk = cfg.chunk
        if self.hift_dtype not in ("float32", "float16"):
            raise ValueError(f"benchmark.codec.hift_dtype: '{self.hift_dtype}' is not one of float32, float16")
        if self.fp8_pages and not self.slots:
            raise ValueError("benchmark.codec.fp8_pages: it stores the flow slots' pages, and benchmark.codec.slots is 0")
        if self.fp8_pages and not cfg.past_frames(self.prompt_codes):  # FlowSlots' scales: the prompt's past
            raise ValueError(
                f"benchmark.codec.fp8_pages: its scales come from the voice prompt's past, and {self.prompt_codes} codes "
                f"hold no whole chunk past the lookahead ({chunk} + {cfg.encoder.lookahead} codes): raise prompt_codes"
            )
        stride = cfg.encoder.stride
        if self.pad_frames <= 0 or self.pad_frames % stride:
            raise ValueError(
                f"benchmark.codec.pad_frames: {self.pad_frames} is not a positive multiple of {stride} frames (a code's)"
            )
        if self.later_shapes < 1:
            raise ValueError(f"benchmark.codec.later_shapes: {self.later_shapes} is under 1 (the held call's shape alone)")
        if self.later_codes % chunk:
            raise ValueError(f"benchmark.codec.later_codes: {self.later_codes} is not a multiple of the chunk ({chunk} codes)")
        if self.slots and self.held * chunk > self.later_codes:  # the held call's chunks end where the later call does
            raise ValueError(
                f"benchmark.codec.later_codes: {self.later_codes} codes hold fewer than the {self.held} chunks "
                f"({self.held * chunk} codes) that load.detokenize_hold holds: raise it to {self.held * chunk} or more"
            )

    def config(self) -> CodecConfig:
        """The preset's shape, its solver's steps and guidance as set here."""
        cfg = PRESETS[self.preset]()
        steps = cfg.solver.steps if self.ode_steps is None else self.ode_steps
        rate = cfg.solver.cfg_rate if self.cfg_rate is None else self.cfg_rate
        return dataclasses.replace(cfg, solver=dataclasses.replace(cfg.solver, steps=steps, cfg_rate=rate))

    @classmethod
    def from_dict(cls, d: dict) -> CodecTiming:
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"benchmark.codec: unknown key(s) {', '.join(unknown)}")
        if d.get("voice"):  # the voice file's codes are the prompt's
            d = d | {"prompt_codes": voice_file.codes_in(d["voice"])}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def decoders(t: CodecTiming, device: torch.device, cache_dir: Path = CACHE) -> tuple[CodecDecoder, CodecDecoder | None]:
    """Ours (t.dtype, the estimator's fast pass; HiFT's convolutions t.hift_dtype) and the baseline (float32, the estimator's
    official forward), one set of weights: the checkpoint's, checked against the preset's shape, or random."""
    torch.manual_seed(t.seed)
    cfg = t.config()
    base = (checkpoint.load(checkpoint.fetch(t.weights, cache_dir), cfg) if t.weights else CodecDecoder(cfg)).eval().to(device)
    base.noise.buffer = base.noise.buffer.to(device)  # read inside the solve's graph: no host copy there
    base.official = True
    cuda = device.type == "cuda"
    ours = CodecDecoder(base.cfg, compiled=t.compile and cuda, kernels=t.kernels and cuda).eval().to(device)
    ours.load_state_dict(base.state_dict())
    dtype = getattr(torch, t.dtype)
    ours.flow.to(dtype)
    ours.estimator.to(dtype)
    ours.hift.convs_to(getattr(torch, t.hift_dtype))
    ours.noise.buffer = base.noise.buffer
    return ours, (base if t.baseline else None)


def stream_decoder(t: CodecTiming, device: torch.device) -> tuple[CodecDecoder, VoicePrompt]:
    """Ours, as `decoders` makes it, and `voice_of` it."""
    ours, _ = decoders(dataclasses.replace(t, baseline=False), device)
    voice = voice_of(t, ours)
    check_hift(t, ours, voice)
    return ours, voice


def check_hift(t: CodecTiming, dec: CodecDecoder, voice: VoicePrompt) -> None:
    """HiFT's convolutions in float16 (`hift_dtype`) refused in one line where they move its PCM of the voice
    prompt's mel less than HIFT_LEAST_DB from float32's: these weights then need float32."""
    if t.hift_dtype != "float32" and not (snr := dec.hift.snr_to_float32(voice.mel)) >= HIFT_LEAST_DB:
        problem = f"HiFT's PCM of the voice prompt {snr:.1f} dB from float32's, under {HIFT_LEAST_DB:g}: set float32"
        raise InputError(t.weights or "random weights", f"benchmark.codec.hift_dtype {t.hift_dtype} moves {problem}")


def voice_of(t: CodecTiming, dec: CodecDecoder) -> VoicePrompt:
    """The voice file's (`voice`), or a voice of `prompt_codes` random codes, log-mel and x-vector."""
    if t.voice:
        return voice_file.load(t.voice, dec.cfg)
    cfg, g = dec.cfg.encoder, torch.Generator().manual_seed(t.seed)
    codes = torch.randint(0, min(cfg.vocab_size, voice_file.AUDIO_CODES), (t.prompt_codes,), generator=g)
    return VoicePrompt(
        codes, torch.randn(cfg.mel, t.prompt_codes * cfg.stride, generator=g), torch.randn(cfg.spk_dim, generator=g)
    )
