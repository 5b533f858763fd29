"""verify: does the engine compute MOSS-Speech? Judged by the independent reference.

Four checks on held-out prompts (synthetic traffic from verify's own seed, never calibration
rows):
- teacher-forced, prefill: per-position logits of both heads, engine vs reference: max |diff|
  and cosine over every position; KL(reference || engine) and top-1 agreement where
  generation reads the head (the text head in text mode, the audio head in audio mode; audio
  logits over the real codes only, as generation masks the padding rows);
- teacher-forced, decode: the same metrics, but the second half of each prompt is fed one
  decode step at a time, so every logit comes through the KV caches (a prefill only reads
  keys it has just written, so it cannot see a cache shared between branches);
- ragged: the same metrics with the prompts sharing the engine's slots at different lengths,
  joining and leaving at different steps (`workflow.ragged`), each judged against the
  reference over that sequence alone;
- greedy: the modality-switching loop run on both for N steps; tokens must match.
Thresholds per precision come from config. verify.json is written only when every threshold
holds; otherwise the metrics go to verify.failed.json, an earlier verify.json is removed and
the rule fails, so no benchmark ever runs on an engine that computes the wrong function.
`evaluate` is the whole judgement on a loaded engine object; `main` only opens the files.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import torch

from workflow import artifacts, dataset, ragged, traffic, trtckpt
from workflow.engines import check_built_from, load_engine
from workflow.engines.base import Engine
from workflow.errors import InputError, run_main
from workflow.generate import Generation, Ids, Sampling, audio_mode_after, generate
from workflow.hfckpt import load_hf_state, validate
from workflow.reference import MossSpeechReference, greedy_reference
from workflow.spec import ModelSpec

# A threshold named *_min fails below its value, *_max above it; null means not checked. Each
# applies to both teacher-forced sections.
METRICS = {"max_abs_diff_max": "max_abs_diff", "cosine_min": "cosine_min", "top1_min": "top1", "kl_mean_max": "kl_mean"}
TEACHER_FORCED = ("teacher_forced", "teacher_forced_decode", "ragged")


def head_metrics(ref: torch.Tensor, eng: torch.Tensor, used: torch.Tensor, tie_margin: float = 0.0) -> dict:
    """ref/eng [N, V] float logits at the same positions; used [N] marks positions read. Top-1
    is judged where the reference decides: its two best logits at least tie_margin apart (0:
    every used position). A flip between near-ties is rounding, not a bug, and a model that is
    unsure of most tokens (a real one on verify's random prompts, or plain random weights) has
    many; KL judges those positions."""
    diff = (ref - eng).abs().amax(-1)
    cos = torch.nn.functional.cosine_similarity(ref, eng, dim=-1)
    lp, lq = ref[used].log_softmax(-1), eng[used].log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    best = ref[used].topk(2, dim=-1).values
    decided = best[:, 0] - best[:, 1] >= tie_margin
    top1 = (ref[used][decided].argmax(-1) == eng[used][decided].argmax(-1)).float()
    return {
        "positions": int(ref.shape[0]),
        "positions_used": int(used.sum()),
        "positions_decided": int(decided.sum()),
        "max_abs_diff": float(diff.max()),
        "cosine_min": float(cos.min()),
        "cosine_mean": float(cos.mean()),
        "kl_mean": float(kl.mean()) if kl.numel() else 0.0,
        "kl_max": float(kl.max()) if kl.numel() else 0.0,
        "top1": float(top1.mean()) if top1.numel() else 1.0,
    }


def batches(prompts: torch.Tensor, max_batch: int) -> list[torch.Tensor]:
    """The first prompt alone, then the rest in batches of up to max_batch: a single sequence
    and a full batch take different engine paths (the fused GEMV takes up to a few rows, cuBLAS
    the rest), and the benchmark times both; verify must have checked both."""
    return [prompts[:1], *prompts[1:].split(max_batch)] if len(prompts) > 1 else [prompts]


def teacher_forced(
    engine: Engine, ref: MossSpeechReference, prompts: torch.Tensor, ids: Ids, tie_margin: float = 0.0
) -> dict[str, dict]:
    """Both heads' metrics, engine against reference, along two engine paths: "prefill" over
    every position of every prompt, and "decode" over the second half of each prompt, fed one
    decode step at a time after a prefill of the first. One reference pass serves both. The
    text head is compared wherever the engine was asked for it (decode skips it at steps where
    every sequence is in audio mode, as the generation loop does)."""
    n_codes = ids.eosp + 1
    acc: dict[str, dict[str, list[torch.Tensor]]] = {
        path: {k: [] for k in ("rt", "et", "ra", "ea", "mode", "asked")} for path in ("prefill", "decode")
    }
    for chunk in batches(prompts, engine.max_batch):
        rt, ra, _ = ref(chunk)
        mode = audio_mode_after(chunk, ids)
        start, end = chunk.shape[1] // 2, chunk.shape[1]
        after = slice(start - 1, end - 1)  # positions whose logits the decode path produces
        dt, da, asked = _decode_logits(engine, chunk, start, mode)  # first: its caches hold no earlier pass over chunk
        et, ea = engine.prefill(chunk, all_logits=True)
        paths = {
            "prefill": (et, ea, rt, ra, mode, torch.ones_like(mode)),
            "decode": (dt, da, rt[:, after], ra[:, after], mode[:, after], asked),
        }
        for path, (et_, ea_, rt_, ra_, mode_, asked_) in paths.items():
            for k, v in (("rt", rt_), ("et", et_), ("ra", ra_[..., :n_codes]), ("ea", ea_[..., :n_codes])):
                acc[path][k].append(v.float().cpu().flatten(0, 1))
            acc[path]["mode"].append(mode_.flatten().cpu())
            acc[path]["asked"].append(asked_.flatten().cpu())
    out = {}
    for path, parts in acc.items():
        cat = {k: torch.cat(v) for k, v in parts.items()}
        asked = cat["asked"]
        out[path] = {
            "text": head_metrics(cat["rt"][asked], cat["et"][asked], ~cat["mode"][asked], tie_margin),
            "audio": head_metrics(cat["ra"], cat["ea"], cat["mode"], tie_margin),
        }
    return out


def _decode_logits(
    engine: Engine, chunk: torch.Tensor, start: int, mode: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits after positions start-1 .. T-2: a prefill of chunk[:, :start], then decode steps,
    each asking for text logits only if some sequence's next token is a text one, as the
    generation loop asks (so an engine that skips the text head, or defers the text branch, in
    audio mode is checked doing so); and [B, steps] marking where text logits were asked for
    (elsewhere they are zeros, standing for audio-mode positions only)."""
    text, audio = engine.prefill(chunk[:, :start])
    texts, audios, asked = [text], [audio], [True]
    for t in range(start, chunk.shape[1] - 1):
        asked.append(not bool(mode[:, t].all()))
        text, audio = engine.decode(chunk[:, t], need_text=asked[-1])
        texts.append(torch.zeros_like(texts[0]) if text is None else text)
        audios.append(audio)
    asked_rows = torch.tensor(asked).expand(chunk.shape[0], -1)
    return torch.stack(texts, 1), torch.stack(audios, 1), asked_rows


def greedy(
    engine: Engine,
    ref: MossSpeechReference,
    prompts: torch.Tensor,
    steps: int,
    ids: Ids,
    force_switch_at: frozenset[int],
    tie_margin: float = 0.0,
) -> dict:
    """Greedy generation: the product's loop (workflow.generate) driving the engine, in batches
    as verify's other checks run, against the reference's own loop (greedy_reference), one
    prompt at a time. Both switch modality at the steps of force_switch_at, whatever they
    sample there, so every checkpoint crosses switches in both directions. Per prompt: the
    first step where tokens, modes or the stop differ (None: none). Switches are counted on
    the reference's run, forced and natural apart. A prompt whose first difference comes at a
    step where the reference's two best logits lie within tie_margin diverged at a tie: it
    counts as matched, and is reported."""
    sampling = Sampling(greedy=True)
    first_diff: list[int | None] = []
    at_tie = 0
    switches = {"forced": 0, "natural": 0, "to_audio": 0, "to_text": 0}
    for chunk in batches(prompts, engine.max_batch):
        got = generate(engine, chunk, steps, ids, sampling, force_switch_at=force_switch_at)
        for b in range(chunk.shape[0]):
            want, margins = greedy_reference(ref, chunk[b], steps, ids, sampling.repetition_penalty, force_switch_at)
            diff = first_difference(got, b, want)
            first_diff.append(diff)
            at_tie += diff is not None and diff < len(want) and margins[diff] < tie_margin
            for k, (text, audio, audio_mode) in enumerate(want):
                if (audio == ids.eosp) if audio_mode else (text == ids.sosp):
                    switches["forced" if k in force_switch_at else "natural"] += 1
                    switches["to_text" if audio_mode else "to_audio"] += 1
    matched = sum(d is None for d in first_diff)
    return {
        "steps": steps,
        "sequences": len(first_diff),
        "matched": matched,
        "diverged_at_tie": at_tie,
        "match_fraction": (matched + at_tie) / len(first_diff),
        "first_divergence": first_diff,
        "force_switch_at": sorted(force_switch_at),
        "modality_switches": switches["forced"] + switches["natural"],
        "forced_switches": switches["forced"],
        "natural_switches": switches["natural"],
        "switches_to_audio": switches["to_audio"],
        "switches_to_text": switches["to_text"],
    }


def first_difference(got: Generation, b: int, want: list[tuple[int, int, bool]]) -> int | None:
    """The first step where sequence b of the loop's run and the reference's (text, audio,
    mode) steps differ, one stopping before the other included; None if they are the same."""
    n = got.tokens.shape[1] if got.stopped_at[b] is None else got.stopped_at[b] + 1
    mine = [(t, a, m) for (t, a), m in zip(got.tokens[b, :n].tolist(), got.audio_mode[b, :n].tolist(), strict=True)]
    for k, (x, y) in enumerate(zip(mine, want, strict=False)):
        if x != y:
            return k
    return None if len(mine) == len(want) else min(len(mine), len(want))


def check_held_out(prompts: torch.Tensor, calib_dir: Path) -> dict:
    """No verify prompt may be (the start of) a calibration row: held-out means never calibrated on."""
    import datasets

    t = prompts.shape[1]
    rows = dataset.as_tensors(datasets.load_from_disk(str(calib_dir)))
    seen = {tuple(r[:t].flatten().tolist()) for r in rows if r.shape[0] >= t}
    for i, p in enumerate(prompts):
        if tuple(p.flatten().tolist()) in seen:
            raise InputError(calib_dir, f"verify prompt {i} is a calibration row: the held-out set is not disjoint")
    return {"calibration_rows": len(rows), "disjoint": True}


def failures(report: dict, thresholds: dict) -> list[str]:
    """Every config field that differs, then every threshold missed, as
    '<section>.<head>.<metric> got vs limit'."""
    out = list(report["config"]["differences"])
    for key, metric in METRICS.items():
        limit = thresholds.get(key)
        for section in TEACHER_FORCED if limit is not None else ():
            for head in ("text", "audio"):
                got = report[section][head][metric]  # written so that NaN fails either way
                if (key.endswith("_min") and not got >= limit) or (key.endswith("_max") and not got <= limit):
                    out.append(f"{section}.{head}.{metric} {got:.6g} vs {key} {limit}")
    g = report["greedy"]
    if thresholds.get("greedy_match_min") is not None and not g["match_fraction"] >= thresholds["greedy_match_min"]:
        out.append(f"greedy.match_fraction {g['match_fraction']:.3g} vs greedy_match_min {thresholds['greedy_match_min']}")
    if thresholds.get("min_switches") is not None and g["modality_switches"] < thresholds["min_switches"]:
        out.append(f"greedy.modality_switches {g['modality_switches']} vs min_switches {thresholds['min_switches']}")
    return out


def config_check(engine_spec: ModelSpec, hf_spec: ModelSpec, ckpt_config: dict | None = None) -> dict:
    """Every model field the engine reads, against what the HF config.json makes of it: the
    fields of the engine's own spec and, where given, every field of the checkpoint config.json
    it was built from (layer lists, rope scaling, FP8 exclusions...). The logits cannot be
    trusted to show a wrong field: on the tiny model a norm epsilon 10 times too large moves
    them less than the thresholds, on real weights it does not."""
    fp8 = ckpt_config is not None and trtckpt.quant_algo(ckpt_config) == "FP8"
    want = trtckpt.trt_config(hf_spec, fp8)
    hf_names = {trt: field for field, trt in trtckpt.TRT_NAMES.items()}
    spec_fields = {f.name for f in fields(ModelSpec)}

    def origin(key: str) -> str:
        name = hf_names.get(key, key)
        return f"the HF config's {name}" if name in spec_fields else "derived from the HF config"

    differences: dict[str, str] = {}  # one line a field, the checkpoint's value first
    sources = ([] if ckpt_config is None else [ckpt_config]) + [trtckpt.trt_config(engine_spec, fp8)]
    for found in sources:
        for key in sorted(want.keys() | found.keys()):
            if found.get(key) != want.get(key) and key not in differences:
                differences[key] = f"config.{key} {found.get(key)!r} vs {want.get(key)!r} ({origin(key)})"
    return {"fields_checked": len(want), "differences": list(differences.values())}


def evaluate(
    engine: Engine,
    ref: MossSpeechReference,
    prompts: torch.Tensor,
    greedy_steps: int,
    thresholds: dict,
    force_switch_at: tuple[int, ...] = (),
    ckpt_config: dict | None = None,
) -> dict:
    """The core of verify, on any engine object: metrics, failures and the verdict.

    Takes a loaded engine rather than a directory so that faults which live only in a running
    engine (a KV cache aliased between branches, say) can be injected and must be caught.
    ckpt_config: the config.json of the checkpoint the engine was built from, checked field by
    field (`config_check`)."""
    ids = Ids.of(ref.spec)
    tie_margin = thresholds.get("tie_margin") or 0.0
    forced = teacher_forced(engine, ref, prompts, ids, tie_margin)
    report = {
        "config": config_check(engine.spec, ref.spec, ckpt_config),
        "teacher_forced": forced["prefill"],
        "teacher_forced_decode": forced["decode"],
        "ragged": ragged.compare(engine, ref, prompts, ids, head_metrics, tie_margin),
        "greedy": greedy(engine, ref, prompts, greedy_steps, ids, frozenset(force_switch_at), tie_margin),
        "thresholds": thresholds,
    }
    report["failures"] = failures(report, thresholds)
    report["passed"] = not report["failures"]
    return report


def thresholds_for(p: dict, precision: str) -> dict:
    """The configured thresholds of this precision; none configured is an error, not a pass."""
    t = p.get("thresholds", {}).get(precision)
    if not isinstance(t, dict) or not any(v is not None for v in t.values()):
        raise InputError("config: verify.thresholds", f"no thresholds for precision '{precision}'")
    unknown = sorted(set(t) - {*METRICS, "greedy_match_min", "min_switches", "tie_margin"})
    if unknown:
        raise InputError("config: verify.thresholds", f"unknown threshold(s) {', '.join(unknown)} for precision '{precision}'")
    return t


def write_report(report: dict, out: Path) -> None:
    """verify.json only for a pass; a failure writes verify.failed.json, removes any earlier
    verify.json (fail closed: no stale pass survives) and exits non-zero."""
    failed_path = out.with_suffix(".failed.json")
    if report["passed"]:
        artifacts.write_json(out, report)
        failed_path.unlink(missing_ok=True)
        print(f"verify passed: {out}")
        return
    artifacts.write_json(failed_path, report)
    out.unlink(missing_ok=True)
    failed = report["failures"]
    more = f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
    raise SystemExit(f"verify FAILED: {'; '.join(failed[:3])}{more} (all metrics in {failed_path})")


# What the engine and the reference must share for their outputs to be compared at all. The
# numbers conversion can get wrong (rope base, norm epsilon, weights) are for the metrics to catch.
INTERFACE = ("vocab_size", "audio_vocab_size", "sosp_token_id", "eosp_token_id", "modality_pad_token_id")


def check_same_interface(engine: Engine, spec: ModelSpec, hf_dir: Path) -> None:
    for name in INTERFACE:
        want, got = getattr(spec, name), getattr(engine.spec, name)
        if want != got:
            raise InputError(hf_dir / "config.json", f"{name} is {want} but the engine's is {got}: not the engine's model")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--ckpt", type=Path, required=True, help="the checkpoint the engine must come from")
    ap.add_argument("--hf", type=Path, required=True, help="HF checkpoint for the reference")
    ap.add_argument("--calib-data", type=Path, help="the calibration set, if any: prompts must not be in it")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--params", required=True, help="the verify section of the config, as JSON")
    args = ap.parse_args(argv)
    p = json.loads(args.params)
    meta = check_built_from(args.engine, args.ckpt)
    thresholds = thresholds_for(p, meta["options"].precision)
    spec = validate(args.hf, check_finite=False)
    engine = load_engine(args.engine)
    check_same_interface(engine, spec, args.hf)
    ref = MossSpeechReference(spec, load_hf_state(args.hf), getattr(torch, p["reference_dtype"]), engine.device)
    prompts = traffic.batch(p["num_prompts"], p["prompt_len"], Ids.of(spec), p["seed"])
    report = {
        "engine": str(args.engine),
        "backend": meta["options"].backend,
        "precision": meta["options"].precision,
        "checkpoint_sha256": meta["checkpoint"]["sha256"],
        "reference": f"transformers.Qwen3ForCausalLM, text and audio paths, {p['reference_dtype']}",
        "device": str(engine.device),
        "prompts": {
            "count": p["num_prompts"],
            "length": p["prompt_len"],
            "seed": p["seed"],
            "batches": [len(chunk) for chunk in batches(prompts, engine.max_batch)],  # the engine paths checked
        },
        "held_out": check_held_out(prompts, args.calib_data) if args.calib_data and args.calib_data.exists() else None,
        **evaluate(engine, ref, prompts, p["greedy_steps"], thresholds, p["force_switch_at"], trtckpt.read_config(args.ckpt)[0]),
    }
    print(json.dumps({k: report[k] for k in ("config", *TEACHER_FORCED, "greedy")}, indent=2))
    write_report(report, args.out)


if __name__ == "__main__":
    run_main(main)
