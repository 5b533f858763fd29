"""The independent reference: MOSS-Speech's two paths as `transformers.Qwen3ForCausalLM`.

The text path is exactly a Qwen3 decoder of shared + text layers with text_norm and
text_lm_head; the audio path likewise with the audio block (FACTS.md section 1). Both are
built from the Hugging Face checkpoint (never from our TensorRT-LLM conversion) and share the
trunk's layer modules. Nothing here imports our engine code: it is the judge, not the judged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from workflow.generate import Ids
from workflow.spec import ModelSpec


def qwen3_config(spec: ModelSpec, vocab_size: int) -> Qwen3Config:
    """A Qwen3 config for one path: shared + one branch's layers."""
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_shared_layers + spec.num_modality_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        attention_bias=False,
        tie_word_embeddings=False,
        use_cache=True,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def _path_state(hf: Mapping[str, torch.Tensor], spec: ModelSpec, branch: str) -> dict:
    """HF MOSS-Speech tensors renamed to one Qwen3ForCausalLM path ('text' or 'audio')."""
    s = spec.num_shared_layers
    out = {
        "model.embed_tokens.weight": hf["model.embed_tokens.weight" if branch == "text" else "model.audio_embed.weight"],
        "model.norm.weight": hf[f"model.{branch}_norm.weight"],
        "lm_head.weight": hf[f"{branch}_lm_head.weight"],
    }
    prefixes = [(f"model.shared_block.layers.{k}.", k) for k in range(s)]
    prefixes += [(f"model.{branch}_block.layers.{k}.", s + k) for k in range(spec.num_modality_layers)]
    for prefix, k in prefixes:
        for name, t in hf.items():
            if name.startswith(prefix):
                out[f"model.layers.{k}.{name[len(prefix) :]}"] = t
    return out


class MossSpeechReference(nn.Module):
    """Trunk + text branch and trunk + audio branch, each a Qwen3ForCausalLM.

    Module names: the trunk's layers are `shared_block.{i}` (registered first, so that is the
    name module walks report), the branches are under `text_path` and `audio_path`.
    """

    def __init__(self, spec: ModelSpec, hf: Mapping[str, torch.Tensor], dtype: torch.dtype, device: str | torch.device):
        super().__init__()
        self.spec = spec
        paths = {}
        for branch, vocab in (("text", spec.vocab_size), ("audio", spec.audio_vocab_size)):
            cfg = qwen3_config(spec, vocab)
            with torch.device("meta"):
                model = Qwen3ForCausalLM(cfg)
            state = {k: v.to(device=device, dtype=dtype) for k, v in _path_state(hf, spec, branch).items()}
            if branch == "audio":  # share the trunk modules, load only the audio-only tensors
                for k in range(spec.num_shared_layers):
                    model.model.layers[k] = paths["text"].model.layers[k]
                state = {k: v for k, v in state.items() if not _is_trunk(k, spec)}
            missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
            if branch == "text":
                assert not missing and not unexpected, (missing, unexpected)
            else:
                assert not unexpected and all(_is_trunk(k, spec) for k in missing), missing
            # The rotary table is a non-persistent buffer: build it on the real device.
            model.model.rotary_emb = type(model.model.rotary_emb)(cfg, device=device)
            paths[branch] = model.eval()
        self.shared_block = nn.ModuleList(paths["text"].model.layers[: spec.num_shared_layers])
        self.text_path = paths["text"]
        self.audio_path = paths["audio"]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Per-position input embedding: text embedding, or the audio one where text is pad."""
        text, audio = tokens[..., 0], tokens[..., 1]
        is_audio = (text == self.spec.modality_pad_token_id).unsqueeze(-1)
        return torch.where(
            is_audio,
            self.audio_path.model.embed_tokens(audio),
            self.text_path.model.embed_tokens(text),
        )

    @torch.no_grad()
    def forward(
        self, tokens: torch.Tensor, caches: tuple[DynamicCache, DynamicCache] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[DynamicCache, DynamicCache]]:
        """tokens [B, T, 2] (text id, audio id) -> text logits [B, T, V], audio logits [B, T, Va],
        and the two paths' caches, to pass back for the next tokens."""
        emb = self.embed(tokens.to(self.text_path.device))
        caches = caches or (DynamicCache(), DynamicCache())
        text = self.text_path(inputs_embeds=emb, past_key_values=caches[0], use_cache=True)
        audio = self.audio_path(inputs_embeds=emb, past_key_values=caches[1], use_cache=True)
        return text.logits.float(), audio.logits.float(), caches


def _is_trunk(name: str, spec: ModelSpec) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and int(parts[2]) < spec.num_shared_layers


@torch.no_grad()
def greedy_reference(
    model: MossSpeechReference,
    prompt: torch.Tensor,
    steps: int,
    ids: Ids,
    repetition_penalty: float,
    force_switch_at: frozenset[int] = frozenset(),
) -> tuple[list[tuple[int, int, bool]], list[float]]:
    """MOSS-Speech's greedy generation for one prompt [T, 2], written from the official loop's
    description (FACTS.md 1) and sharing nothing but the table of ids with workflow.generate,
    whose loop it judges: per step (text id, audio id, sampled in audio mode), up to and
    including a stop id, and per step the lead of the greedy choice over the runner-up (inf
    where the switch was forced).

    Each step reads one head: the text head in text mode (start-of-speech switches to audio),
    the audio head over the codes and end-of-speech in audio mode (end-of-speech switches back);
    the other channel carries its pad. Both heads take the repetition penalty (CTRL) over the
    ids their channel has carried so far, prompt included. At a step of force_switch_at the
    switch token replaces the greedy one."""
    history = [(int(t), int(a)) for t, a in prompt.tolist()]
    text_logits, audio_logits, caches = model(prompt[None])
    last_text, last_audio = history[-1]
    audio_mode = last_text == ids.sosp or (last_text == ids.pad and last_audio != ids.eosp)
    out: list[tuple[int, int, bool]] = []
    margins: list[float] = []
    for step in range(steps):
        channel = 1 if audio_mode else 0
        logits = (audio_logits if audio_mode else text_logits)[0, -1]
        if audio_mode:
            logits = logits[: ids.eosp + 1]  # the padding rows of the audio head are never sampled
        seen = torch.zeros(len(logits), dtype=torch.bool, device=logits.device)
        seen[[i for i in {row[channel] for row in history} if i < len(logits)]] = True
        penalized = torch.where(logits < 0, logits * repetition_penalty, logits / repetition_penalty)
        logits = torch.where(seen, penalized, logits)
        best = logits.topk(2).values
        token, margin = int(logits.argmax()), float(best[0] - best[1])  # argmax: the first of equal maxima
        if step in force_switch_at:
            token, margin = (ids.eosp if audio_mode else ids.sosp), float("inf")
        row = (ids.pad, token) if audio_mode else (token, ids.audio_pad)
        out.append((*row, audio_mode))
        margins.append(margin)
        history.append(row)
        if not audio_mode and token in ids.stop:
            break
        audio_mode = token != ids.eosp if audio_mode else token == ids.sosp
        text_logits, audio_logits, caches = model(torch.tensor([[row]]), caches)
    return out, margins


class ReferenceEngine:
    """The reference behind the engine interface (prefill/decode), for the generation loop."""

    def __init__(self, model: MossSpeechReference, device: str | torch.device):
        self.model, self.spec, self.device = model, model.spec, torch.device(device)
        self.max_batch, self.max_seq_len = 1 << 16, model.spec.max_position_embeddings
        self.caches: tuple[DynamicCache, DynamicCache] | None = None

    def prefill(
        self, tokens: torch.Tensor, all_logits: bool = False, need_text: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """need_text is ignored (here and in decode): the reference always computes both paths."""
        text, audio, self.caches = self.model(tokens.to(self.device))
        return (text, audio) if all_logits else (text[:, -1], audio[:, -1])

    def decode(self, tokens: torch.Tensor, need_text: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        text, audio, self.caches = self.model(tokens[:, None].to(self.device), self.caches)
        return text[:, -1], audio[:, -1]
