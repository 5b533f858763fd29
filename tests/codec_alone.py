"""The judge of the batched codec tests (test_codec_batch, test_codec_slots): a stream's PCM from its own
`CodecStream`, alone, re-running every frame each call, which tests/test_codec_stream.py holds to the
one-call decode. Batched streams differ from it in the rounding of batched arithmetic only."""

from __future__ import annotations

from collections.abc import Callable

import torch

from workflow.codec.batch import CodecBatch
from workflow.codec.config import CodecConfig
from workflow.codec.decoder import CodecDecoder, VoicePrompt
from workflow.codec.hift import DEFAULT_SEED
from workflow.codec.stream import CodecStream
from workflow.detokenize import Piece

TINY = CodecConfig.tiny()
SPC = TINY.encoder.stride * TINY.hift.hop  # 1920 samples a code
ATOL_PCM = 1e-5  # observed <= 7e-7 on peaks of ~0.87


def voice_of(codes: int) -> VoicePrompt:
    """A voice prompt of `codes` random codes (below 1000), its log-mel (4 frames a code) and x-vector, seed 1."""
    g = torch.Generator().manual_seed(1)
    return VoicePrompt(
        torch.randint(0, 1000, (codes,), generator=g), torch.randn(80, 4 * codes, generator=g), torch.randn(192, generator=g)
    )


def alone(decoder: CodecDecoder, voice: VoicePrompt, key: int, codes: torch.Tensor, chunk: int) -> torch.Tensor:
    """Stream `key`'s PCM (its source noise seeded by its key, as `CodecBatch` seeds it), pushed `chunk` codes at a time."""
    s = CodecStream(decoder, voice, DEFAULT_SEED + key, flow_cache=False)
    return torch.cat([s.push(codes[i : i + chunk]) for i in range(0, len(codes), chunk)] + [s.finish()])


def in_steps(
    batch: CodecBatch, codes: dict[int, torch.Tensor], joins: dict[int, int], chunk: int = 5,
    after: Callable[[set[int]], None] = lambda ended: None,
) -> dict[int, torch.Tensor]:  # fmt: skip
    """Streams through `batch` as a server sends them: stream k joins at step joins[k] and sends a piece
    of `chunk` codes a step, two at steps 3 and 5 (chunks that waited); stream 4, if its codes are whole
    chunks, ends with an empty piece. `after(ended)` runs after each step. Each stream's PCM, whole."""
    got: dict[int, list[torch.Tensor]] = {k: [] for k in codes}
    done, ended, step = dict.fromkeys(codes, 0), set(), 0
    while len(ended) < len(codes):
        pieces = []
        for k, c in codes.items():
            for _ in range(2 if step in (3, 5) else 1):
                if step < joins[k] or k in ended:
                    continue
                take = c[done[k] : done[k] + chunk]
                last = done[k] + len(take) >= len(c) and (len(take) < chunk or (k == 4 and len(take) == 0))
                if len(take) or last:
                    pieces.append(Piece(k, take, done[k], last))
                    done[k] += len(take)
                if last:
                    ended.add(k)
        for p, x in zip(pieces, batch.vocodes(batch.flows(pieces)), strict=True):
            got[p.stream].append(x)
        after(ended)
        step += 1
    return {k: torch.cat(x) for k, x in got.items()}
