"""Bad input at each stage's entrance: one line `error: <file>: <problem>`, exit status 1, no
traceback, and no artifact left behind (no output, no temporary beside it).

Each case builds its bad input from the session's good artifacts (hard links; a file to change
is unlinked first, so the shared fixtures are never written through) and names the exact line.
The cases in CLI run through `python -m workflow.<stage>`, whose stderr must be that one line;
the rest run in-process through the same entry point (`run_main`).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import CALIB, ROOT, verify_params, write_variant
from safetensors.torch import load_file, save_file

from workflow.artifacts import MANIFEST, read_manifest
from workflow.errors import run_main
from workflow.hfckpt import INDEX

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
LAYER = "model.text_block.layers.0."  # its tensors are in SHARD2
PROGRESS = re.compile(r"\d+%\|")  # a tqdm bar, which stderr may hold before the error


def printed(err: str) -> list[str]:
    """stderr's lines but blank ones and progress bars."""
    return [line for line in err.splitlines() if line.strip() and not PROGRESS.search(line)]


@dataclass(frozen=True)
class Bad:
    stage: str  # workflow.<stage>
    argv: list[str]
    out: Path  # what the stage would have written
    message: str  # the whole line on stderr


# --- building bad inputs -------------------------------------------------------------------


def linked_copy(src: Path, dst: Path, skip: tuple[str, ...] = (MANIFEST,)) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if p.name not in skip:
            os.link(p, dst / p.name)
    return dst


def replace_bytes(path: Path, data: bytes) -> None:
    path.unlink()  # break the hard link before writing
    path.write_bytes(data)


def edit_shard(hf: Path, shard: str, mutate: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    tensors = load_file(hf / shard)
    mutate(tensors)
    (hf / shard).unlink()
    save_file(tensors, hf / shard, metadata={"format": "pt"})
    return hf / shard


def edit_json(path: Path, mutate: Callable[[dict], None]) -> None:
    obj = json.loads(path.read_text())
    mutate(obj)
    replace_bytes(path, json.dumps(obj).encode())


def bad_hf(request, tmp: Path) -> Path:
    return linked_copy(request.getfixturevalue("tiny_hf"), tmp / "bad")


def download(tmp: Path, source: str, file: Path | str, problem: str) -> Bad:
    out = tmp / "result"
    return Bad("download", ["--source", source, "--out", str(out)], out, f"error: {file}: {problem}")


def hf_case(make: Callable[[Path], tuple[Path, str]]) -> Callable[..., Bad]:
    """A download of a local copy of the tiny checkpoint, spoilt by make(dir) -> (file, problem)."""

    def case(request, tmp: Path) -> Bad:
        hf = bad_hf(request, tmp)
        file, problem = make(hf)
        return download(tmp, f"local:{hf}", file, problem)

    return case


def corrupt_header_length(hf: Path) -> tuple[Path, str]:
    f = hf / SHARD2
    replace_bytes(f, (1 << 62).to_bytes(8, "little") + f.read_bytes()[8:])
    return f, f"corrupt safetensors header: it declares a header of {1 << 62} bytes"


def corrupt_header_json(hf: Path) -> tuple[Path, str]:
    f = hf / SHARD2
    data = f.read_bytes()
    replace_bytes(f, data[:8] + b"\xff" * 16 + data[24:])
    return f, "corrupt safetensors header: not a JSON table of tensors"


def truncated_shard(hf: Path) -> tuple[Path, str]:
    f = hf / SHARD2
    data = f.read_bytes()
    replace_bytes(f, data[: len(data) // 2])
    return f, f"truncated: the file has {len(data) // 2} bytes, its header declares {len(data)}"


def index_names_missing_shard(hf: Path) -> tuple[Path, str]:
    (hf / SHARD2).unlink()
    return hf / INDEX, f"names shard '{SHARD2}', which is missing"


def missing_tensor(hf: Path) -> tuple[Path, str]:
    name = LAYER + "mlp.down_proj.weight"
    edit_shard(hf, SHARD2, lambda t: t.pop(name))
    edit_json(hf / INDEX, lambda idx: idx["weight_map"].pop(name))
    return hf / INDEX, f"tensor '{name}' is missing"


def unexpected_tensor(hf: Path) -> tuple[Path, str]:
    edit_shard(hf, SHARD2, lambda t: t.update({"model.extra_head.weight": torch.zeros(4, 128, dtype=torch.bfloat16)}))
    edit_json(hf / INDEX, lambda idx: idx["weight_map"].update({"model.extra_head.weight": SHARD2}))
    return hf / SHARD2, "unexpected tensor 'model.extra_head.weight'"


def set_tensor(name: str, value: Callable[[torch.Tensor], torch.Tensor], problem: str) -> Callable[[Path], tuple[Path, str]]:
    def make(hf: Path) -> tuple[Path, str]:
        return edit_shard(hf, SHARD2, lambda t: t.update({name: value(t[name])})), f"tensor '{name}' {problem}"

    return make


def poison(x: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[3] = x
        return t

    return f


def config_change(mutate: Callable[[dict], object], problem: str) -> Callable[[Path], tuple[Path, str]]:
    def make(hf: Path) -> tuple[Path, str]:
        edit_json(hf / "config.json", mutate)
        return hf / "config.json", problem

    return make


def calibration_set(rows: dict | None, problem: str) -> Callable[..., Bad]:
    """calibrate (fp8) over a local dataset of these rows (None: a directory that is no dataset);
    `problem` may name the directory as {data}."""

    def case(request, tmp: Path) -> Bad:
        import datasets

        data = tmp / "data"
        if rows is None:
            data.mkdir()
        else:
            datasets.Dataset.from_dict(rows).save_to_disk(str(data))
        ckpt, hf, out = request.getfixturevalue("tiny_ckpt"), request.getfixturevalue("tiny_hf"), tmp / "result"
        params = json.dumps({**CALIB, "dataset": f"local:{data}"})
        argv = ["--ckpt", str(ckpt), "--hf", str(hf), "--out", str(out), "--precision", "fp8", "--params", params]
        return Bad("calibrate", argv, out, f"error: {data}: {problem.format(data=data)}")

    return case


def build(options: dict, file: str, problem: str, spoil: Callable[[Path], dict] | None = None) -> Callable[..., Bad]:
    """build with these engine options from the tiny checkpoint, or from a copy spoilt by
    `spoil`, which returns the values that `problem` names; `file` may name {ckpt}."""

    def case(request, tmp: Path) -> Bad:
        ckpt, values = request.getfixturevalue("tiny_ckpt"), {}
        if spoil:
            ckpt = linked_copy(ckpt, tmp / "ckpt", skip=())
            values = spoil(ckpt)
        out = tmp / "result"
        argv = ["--ckpt", str(ckpt), "--out", str(out), "--options-json", json.dumps(options)]
        return Bad("build", argv, out, f"error: {file.format(ckpt=ckpt)}: {problem.format(**values)}")

    return case


def truncate_weights(ckpt: Path) -> dict:
    f = ckpt / "rank0.safetensors"
    data = f.read_bytes()
    replace_bytes(f, data[:-1000])
    return {"size": len(data) - 1000, "declared": len(data)}


def remove_manifest(ckpt: Path) -> dict:
    (ckpt / MANIFEST).unlink()
    return {}


def engine_from_another_checkpoint(request, tmp: Path) -> Bad:
    engine, ckpt = request.getfixturevalue("tiny_engine_dir"), request.getfixturevalue("tiny_ckpt")
    other = write_variant(ckpt, tmp / "other", lambda t, c, s: t["lm_head.weight"][0].add_(1.0))
    got, want = read_manifest(ckpt)["sha256"], read_manifest(other)["sha256"]
    out = tmp / "verify.json"
    argv = ["--engine", str(engine), "--ckpt", str(other), "--hf", str(request.getfixturevalue("tiny_hf"))]
    argv += ["--out", str(out), "--params", verify_params()]
    problem = f"built from checkpoint {got[:12]}, not from {other} ({want[:12]}): rebuild it"
    return Bad("verify", argv, out, f"error: {engine / 'engine.json'}: {problem}")


def reference_of_another_model(request, tmp: Path) -> Bad:
    """verify with a reference checkpoint whose special ids are not the engine's."""
    hf = bad_hf(request, tmp)
    edit_json(hf / "config.json", lambda c: c.update(sosp_token_id=151650))
    engine, ckpt = request.getfixturevalue("tiny_engine_dir"), request.getfixturevalue("tiny_ckpt")
    out = tmp / "verify.json"
    argv = ["--engine", str(engine), "--ckpt", str(ckpt), "--hf", str(hf), "--out", str(out), "--params", verify_params()]
    problem = "sosp_token_id is 151650 but the engine's is 151646: not the engine's model"
    return Bad("verify", argv, out, f"error: {hf / 'config.json'}: {problem}")


ROWS = {"text_ids": [[1] * 40] * 64, "audio_ids": [[512] * 40] * 64}
CASES: dict[str, Callable[..., Bad]] = {
    "corrupt_safetensors_header": hf_case(corrupt_header_length),
    "corrupt_safetensors_header_json": hf_case(corrupt_header_json),
    "truncated_shard": hf_case(truncated_shard),
    "index_names_missing_shard": hf_case(index_names_missing_shard),
    "missing_tensor": hf_case(missing_tensor),
    "unexpected_tensor": hf_case(unexpected_tensor),
    "wrong_shape": hf_case(
        set_tensor(LAYER + "self_attn.q_norm.weight", lambda t: t[:16].clone(), "has shape [16], expected [32]")
    ),
    "wrong_dtype": hf_case(
        set_tensor(LAYER + "self_attn.q_norm.weight", torch.Tensor.double, "has dtype float64, expected bfloat16/float16/float32")
    ),
    "nan_in_weight": hf_case(set_tensor(LAYER + "input_layernorm.weight", poison(float("nan")), "holds NaN or Inf")),
    "inf_in_weight": hf_case(set_tensor("audio_lm_head.weight", poison(float("inf")), "holds NaN or Inf")),
    "config_missing_field": hf_case(config_change(lambda c: c.pop("hidden_size"), "field 'hidden_size' is missing")),
    "config_wrong_type": hf_case(
        config_change(lambda c: c.update(num_attention_heads="4"), "field 'num_attention_heads' must be int, got str")
    ),
    "rope_theta_absent": hf_case(config_change(lambda c: c.pop("rope_theta"), "field 'rope_theta' is missing")),
    "unknown_source_scheme": lambda request, tmp: download(
        tmp,
        "ftp://host/moss",
        "--source",
        "unknown source 'ftp://host/moss': use synthetic:<preset>, local:<dir> or hf:<repo>@<revision>",
    ),
    "hub_source_without_revision": lambda request, tmp: download(
        tmp,
        "hf:OpenMOSS-Team/MOSS-Speech",
        "--source",
        "'hf:OpenMOSS-Team/MOSS-Speech' has no pinned revision: write hf:OpenMOSS-Team/MOSS-Speech@<commit or tag>",
    ),
    "local_source_missing": lambda request, tmp: download(
        tmp, f"local:{tmp / 'nowhere'}", tmp / "nowhere", "local model directory does not exist"
    ),
    "calibration_set_short": calibration_set(
        {k: v[:63] for k, v in ROWS.items()}, "has 63 rows, calibration.num_samples needs 64"
    ),
    "calibration_set_empty": calibration_set({"text_ids": [], "audio_ids": []}, "has 0 rows, calibration.num_samples needs 64"),
    "calibration_text_id_out_of_vocab": calibration_set(
        {**ROWS, "text_ids": [[151680] * 40] * 64}, "row 0: text_ids holds 151680, outside the vocabulary [0, 151680)"
    ),
    "calibration_audio_id_out_of_vocab": calibration_set(
        {**ROWS, "audio_ids": [[512] * 39 + [16512]] * 64}, "row 0: audio_ids holds 16512, outside the vocabulary [0, 16512)"
    ),
    "calibration_row_too_short": calibration_set(
        {"text_ids": [[1] * 8] * 64, "audio_ids": [[512] * 8] * 64}, "row 0: length 8 outside [32, 96]"
    ),
    "calibration_column_missing": calibration_set(
        {"text_ids": ROWS["text_ids"]}, "missing column(s) audio_ids (need text_ids, audio_ids)"
    ),
    "calibration_set_not_a_dataset": calibration_set(
        None,
        "cannot be loaded as a save_to_disk dataset (FileNotFoundError: "
        "Directory {data} is neither a `Dataset` directory nor a `DatasetDict` directory.)",
    ),
    "engine_from_another_checkpoint": engine_from_another_checkpoint,
    "reference_of_another_model": reference_of_another_model,
    "trtllm_on_cpu": build(
        {"backend": "trtllm", "device": "cpu"}, "config: engine.backend", "backend trtllm runs on cuda only, not on device 'cpu'"
    ),
    "triton_kernel_on_cpu": build(
        {"gemv": True}, "config: engine.gemv", "a Triton kernel of the torch backend on cuda, not torch on cpu"
    ),
    "fast_accumulation_off_the_torch_backend": build(
        {"backend": "trtllm", "device": "cuda", "fp8_fast_accum": True},
        "config: engine.fp8_fast_accum",
        "an option of the torch backend, not trtllm",
    ),
    "defer_text_fill_off_the_torch_backend": build(
        {"backend": "trtllm", "device": "cuda", "defer_text_fill": True},
        "config: engine.defer_text_fill",
        "an option of the torch backend, not trtllm",
    ),
    "unknown_backend": build({"backend": "onnx"}, "config: engine.backend", "unknown backend 'onnx' (known: torch, trtllm)"),
    "unknown_precision": build({"precision": "int4"}, "config: engine.precision", "unknown precision 'int4' (known: bf16, fp8)"),
    "unknown_engine_option": build({"gemv_blocks": {}}, "config: engine", "unknown engine option(s) gemv_blocks"),
    "engine_option_of_the_wrong_type": build({"max_batch": "4"}, "config: engine.max_batch", "'4' is not an integer"),
    "precision_does_not_fit_checkpoint": build(
        {"precision": "fp8"}, "{ckpt}/config.json", "quant_algo None does not fit precision fp8"
    ),
    "checkpoint_without_manifest": build(
        {}, "{ckpt}/manifest.json", "file is missing: not a complete artifact", spoil=remove_manifest
    ),
    "truncated_checkpoint_weights": build(
        {},
        "{ckpt}/rank0.safetensors",
        "truncated: the file has {size} bytes, its header declares {declared}",
        spoil=truncate_weights,
    ),
}


# Run through the real command line: stderr must be exactly the one line.
CLI = {
    "corrupt_safetensors_header",
    "truncated_shard",
    "unknown_source_scheme",
    "calibration_set_empty",
    "engine_from_another_checkpoint",
    "trtllm_on_cpu",
    "triton_kernel_on_cpu",
}


def run_stage(bad: Bad, cli: bool, capsys) -> tuple[int, str]:
    if cli:  # not under Triton's interpreter, which lets the kernels run on a CPU
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        argv = [sys.executable, "-m", f"workflow.{bad.stage}", *bad.argv]
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
        return r.returncode, r.stderr
    capsys.readouterr()  # drop what building the bad input printed
    with pytest.raises(SystemExit) as e:
        run_main(importlib.import_module(f"workflow.{bad.stage}").main, bad.argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line_and_leaves_nothing(name, request, tmp_path, capsys):
    bad = CASES[name](request, tmp_path)
    code, err = run_stage(bad, name in CLI, capsys)
    assert code == 1, err
    assert "Traceback" not in err, err
    assert printed(err) == [bad.message]
    if name in CLI:
        assert err == bad.message + "\n"
    stem = bad.out.name.split(".")[0]
    left = [p.name for p in bad.out.parent.iterdir() if p.name.lstrip(".").startswith(stem)]
    assert left == [], f"left behind: {left}"
