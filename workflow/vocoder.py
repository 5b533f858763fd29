"""The detokenizer: audio codes -> mel (a labelled stand-in) -> waveform (BigVGAN-v2).

MOSS-Speech's own decoder is a flow-matching model to an 80-bin mel plus a HiFT vocoder
(FACTS.md section 1), which we do not have. Stage 1 here is a stand-in that maps each code to
mel frames through a fixed random table (cheap, so its time is a floor, not an estimate);
stage 2 is BigVGAN-v2 from the `bigvgan` package, with real weights when a directory is
given, otherwise the exact v2 architecture with random weights. Each stage is timed on its
own, so the real decoder's cost can be added without touching the rest.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from workflow.cudagraphs import Graphs
from workflow.errors import InputError
from workflow.tensorfile import load_pickle

SECONDS_PER_TOKEN = 0.08  # 12.5 audio tokens per second

_V2 = dict(
    n_fft=1024, win_size=1024, hop_size=256,
    upsample_rates=[4, 4, 2, 2, 2, 2], upsample_kernel_sizes=[8, 8, 4, 4, 4, 4],
    upsample_initial_channel=1536, resblock="1", resblock_kernel_sizes=[3, 7, 11],
    resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    activation="snakebeta", snake_logscale=True, use_tanh_at_final=False, use_bias_at_final=False,
    fmin=0, fmax=None,
)  # fmt: skip
CONFIGS = {
    "bigvgan_v2_24khz_100band_256x": _V2 | {"num_mels": 100, "sampling_rate": 24000},
    "bigvgan_v2_22khz_80band_256x": _V2 | {"num_mels": 80, "sampling_rate": 22050},
    # The v2 architecture with 1/12 of the channels: the embedded CPU default (0.9 M params).
    "reduced_24khz_100band_256x": _V2 | {"num_mels": 100, "sampling_rate": 24000, "upsample_initial_channel": 128},
}


@dataclass(frozen=True)
class VocoderInfo:
    name: str
    weights: str  # "random" or the weights directory
    sampling_rate: int
    hop: int
    num_mels: int
    parameters: int
    fused_kernel: bool


class MelStandIn:
    """STAND-IN for MOSS-Speech's flow-matching decoder: code -> mel frames via a fixed table.

    Produces exactly enough frames for the codes so far (hop-aligned, 80 ms per code), so a
    stream's waveform can be trimmed to codes x 80 ms.
    """

    def __init__(self, num_codes: int, num_mels: int, frames_per_second: float, device: torch.device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.table = (torch.randn(num_codes, num_mels, generator=g) - 4.0).to(device)  # log-mel-like
        self.frames_per_token = SECONDS_PER_TOKEN * frames_per_second

    def frames(self, tokens: int) -> int:
        """Frames that cover `tokens` codes."""
        return int(-(-tokens * self.frames_per_token // 1))

    def __call__(self, codes: torch.Tensor, done: int) -> torch.Tensor:
        """codes [B, K] after `done` earlier codes -> mel [B, num_mels, frames] for these K."""
        k = codes.shape[1]
        n = self.frames(done + k) - self.frames(done)
        which = ((torch.arange(n, device=codes.device) + self.frames(done)) / self.frames_per_token).long() - done
        return self.table[codes[:, which.clamp(0, k - 1)]].transpose(1, 2)


def load_generator_state(path: Path) -> dict[str, torch.Tensor]:
    """The generator's tensors from a BigVGAN .pt (`tensorfile.load_pickle`: no code runs)."""
    state = load_pickle(path)
    if not isinstance(state, dict) or not isinstance(state.get("generator"), dict):
        raise InputError(path, "has no 'generator' state dict")
    return state["generator"]


def load_bigvgan(name: str, weights_dir: str | None, device: torch.device, dtype: torch.dtype, fused_kernel: bool = False):
    """BigVGAN-v2 with its weight norm removed; real weights from weights_dir if given.

    fused_kernel asks for BigVGAN's fused CUDA activation. As shipped it is compiled at first
    use for compute_70/80, which CUDA 13's nvcc rejects: any failure falls back to the plain
    torch activation with a notice on stderr, and VocoderInfo.fused_kernel says which ran.
    """
    import bigvgan  # imports librosa and friends: only when a vocoder is wanted
    from bigvgan.env import AttrDict

    if weights_dir:
        cfg_path = Path(weights_dir) / "config.json"
        try:
            h = json.loads(cfg_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise InputError(cfg_path, f"cannot read vocoder config ({e})") from None
    else:
        if name not in CONFIGS:
            raise InputError("config: benchmark.vocoder.name", f"unknown vocoder '{name}' (known: {', '.join(CONFIGS)})")
        h = dict(CONFIGS[name])
    torch.manual_seed(0)
    fused = fused_kernel and device.type == "cuda"
    if fused_kernel and not fused:
        print("notice: BigVGAN's fused activation needs CUDA; using the torch activation", file=sys.stderr)
    model = _build(bigvgan, AttrDict(h), fused, device)
    if model is None:
        fused, model = False, _build(bigvgan, AttrDict(h), False, device)
    if weights_dir:
        model.load_state_dict(load_generator_state(Path(weights_dir) / "bigvgan_generator.pt"))
    model.remove_weight_norm()
    model = model.eval().to(device=device, dtype=dtype)
    info = VocoderInfo(
        name=name,
        weights=str(weights_dir) if weights_dir else "random",
        sampling_rate=h["sampling_rate"],
        hop=h["hop_size"],
        num_mels=h["num_mels"],
        parameters=sum(p.numel() for p in model.parameters()),
        fused_kernel=fused,
    )
    return model, info


def _build(bigvgan, h, fused: bool, device: torch.device):
    """A BigVGAN; with the fused kernel, one that has run once (it compiles on first use), or None."""
    model = None
    try:
        model = bigvgan.BigVGAN(h, use_cuda_kernel=fused)
        if fused:
            with torch.no_grad():
                model.to(device)(torch.zeros(1, h["num_mels"], 8, device=device))
    except Exception as e:
        if not fused:
            raise
        print(
            f"notice: BigVGAN's fused CUDA activation did not build ({type(e).__name__}: {str(e)[:200]}); "
            "using the torch activation",
            file=sys.stderr,
        )
        return None
    return model


class Graphed:
    """Replays a module from one CUDA graph per input shape (a chunk's mel is 37 or 38 frames) and
    stream priority (each lane of the detokenizer has its own); on the CPU it just calls it."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.module, self.device = module, device
        self.graphs = Graphs(device)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return self.module(x)
        key = (tuple(x.shape), torch.cuda.current_stream(self.device).priority)
        return self.graphs.call(key, self.module, x).clone()
