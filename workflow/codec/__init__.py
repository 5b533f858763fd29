"""MOSS-Speech's codec decoder (docs/codec.md): codes -> mel (a CosyVoice2-style flow) -> PCM (HiFT)."""
