"""The shape of a MOSS-Speech model, read from its Hugging Face config.json.

This is the one place shapes come from: synthetic checkpoints, name tables, conversion,
the reference and the engines all take a ModelSpec.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from workflow.errors import InputError, read_json

# Field name -> accepted Python types, as configuration_moss_speech.py writes them.
REQUIRED_FIELDS: dict[str, tuple[type, ...]] = {
    "model_type": (str,),
    "architectures": (list,),
    "vocab_size": (int,),
    "audio_vocab_size": (int,),
    "hidden_size": (int,),
    "intermediate_size": (int,),
    "num_hidden_layers": (int,),
    "num_shared_layers": (int,),
    "num_modality_layers": (int,),
    "num_attention_heads": (int,),
    "num_key_value_heads": (int,),
    "head_dim": (int,),
    "hidden_act": (str,),
    "max_position_embeddings": (int,),
    "rms_norm_eps": (float, int),
    "rope_theta": (float, int),
    "attention_bias": (bool,),
    "tie_word_embeddings": (bool,),
    "sosp_token_id": (int,),
    "eosp_token_id": (int,),
    "modality_pad_token_id": (int,),
}


@dataclass(frozen=True)
class ModelSpec:
    """Sizes and special ids of one MOSS-Speech model (FACTS.md section 1)."""

    vocab_size: int  # text vocabulary
    audio_vocab_size: int  # audio vocabulary: codes, end-of-speech, then padding
    hidden_size: int
    intermediate_size: int
    num_shared_layers: int
    num_modality_layers: int  # per branch: text and audio each have this many
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    sosp_token_id: int  # start-of-speech, on the text channel
    eosp_token_id: int  # end-of-speech, on the audio channel
    modality_pad_token_id: int  # text id that means "embed the audio id instead"

    @property
    def num_layers(self) -> int:
        """Decoder layers held by the checkpoint: trunk + text branch + audio branch."""
        return self.num_shared_layers + 2 * self.num_modality_layers

    @property
    def qkv_size(self) -> int:
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)


def spec_from_config(cfg: dict, source: str = "config.json") -> ModelSpec:
    """Validate a MOSS-Speech config.json dict and return its spec; InputError names the field."""
    for name, types in REQUIRED_FIELDS.items():
        if name not in cfg:
            raise InputError(source, f"field '{name}' is missing")
        value = cfg[name]
        if isinstance(value, bool) and bool not in types:
            raise InputError(source, f"field '{name}' must be {types[0].__name__}, got bool")
        if not isinstance(value, types):
            raise InputError(source, f"field '{name}' must be {types[0].__name__}, got {type(value).__name__}")
    if cfg["model_type"] != "moss_speech":
        raise InputError(source, f"model_type is '{cfg['model_type']}', expected 'moss_speech'")
    if cfg["hidden_act"] != "silu":
        raise InputError(source, f"hidden_act '{cfg['hidden_act']}' is not supported (silu)")
    if cfg["attention_bias"] or cfg["tie_word_embeddings"]:
        raise InputError(source, "attention_bias and tie_word_embeddings must be false")
    if cfg.get("rope_scaling") not in (None, {}):
        raise InputError(source, f"rope_scaling {cfg['rope_scaling']!r} is not supported")
    if cfg["num_shared_layers"] + cfg["num_modality_layers"] != cfg["num_hidden_layers"]:
        raise InputError(source, "num_shared_layers + num_modality_layers must equal num_hidden_layers")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise InputError(source, "num_attention_heads must be a multiple of num_key_value_heads")
    spec = ModelSpec(
        vocab_size=cfg["vocab_size"],
        audio_vocab_size=cfg["audio_vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_shared_layers=cfg["num_shared_layers"],
        num_modality_layers=cfg["num_modality_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(cfg["rope_theta"]),
        max_position_embeddings=cfg["max_position_embeddings"],
        sosp_token_id=cfg["sosp_token_id"],
        eosp_token_id=cfg["eosp_token_id"],
        modality_pad_token_id=cfg["modality_pad_token_id"],
    )
    for name in ("sosp_token_id", "modality_pad_token_id"):
        if not 0 <= getattr(spec, name) < spec.vocab_size:
            raise InputError(source, f"{name} is outside the text vocabulary")
    if not 0 <= spec.eosp_token_id < spec.audio_vocab_size:
        raise InputError(source, "eosp_token_id is outside the audio vocabulary")
    return spec


def load_spec(hf_dir: str | Path) -> ModelSpec:
    """Read and validate <hf_dir>/config.json."""
    path = Path(hf_dir) / "config.json"
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise InputError(path, "top level must be a JSON object")
    return spec_from_config(cfg, str(path))


def hf_config(spec: ModelSpec, dtype: str = "bfloat16") -> dict:
    """The config.json the hub ships for a model of this spec (real field names)."""
    return {
        "architectures": ["MossSpeechForCausalLM"],
        "model_type": "moss_speech",
        "auto_map": {
            "AutoConfig": "configuration_moss_speech.MossSpeechConfig",
            "AutoModelForCausalLM": "modeling_moss_speech.MossSpeechForCausalLM",
        },
        "vocab_size": spec.vocab_size,
        "audio_vocab_size": spec.audio_vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_shared_layers + spec.num_modality_layers,
        "num_shared_layers": spec.num_shared_layers,
        "num_modality_layers": spec.num_modality_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "sosp_token_id": spec.sosp_token_id,
        "eosp_token_id": spec.eosp_token_id,
        "modality_pad_token_id": spec.modality_pad_token_id,
        "torch_dtype": dtype,
    }


FIRST_SPECIAL_TEXT_ID = 151643  # text ids from here on are Qwen's special tokens; synthetic text samples none

_SPECIAL = dict(
    vocab_size=151680,
    audio_vocab_size=16512,
    sosp_token_id=151646,
    eosp_token_id=16384,
    modality_pad_token_id=151667,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
)

PRESETS: dict[str, ModelSpec] = {
    # The exact shape of OpenMOSS-Team/MOSS-Speech (9.1 B parameters).
    "full": ModelSpec(
        hidden_size=4096,
        intermediate_size=12288,
        num_shared_layers=32,
        num_modality_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        **_SPECIAL,
    ),
    # Real vocabularies and special ids, small everything else; two layers per branch so that
    # branch indexing is exercised. Runs the whole chain on a 2-core CPU in minutes.
    "tiny": ModelSpec(
        hidden_size=128,
        intermediate_size=256,
        num_shared_layers=3,
        num_modality_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        **_SPECIAL,
    ),
}
