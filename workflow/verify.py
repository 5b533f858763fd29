"""verify: does the engine compute MOSS-Speech? Judged by the independent reference.

Two checks on held-out prompts (synthetic traffic from verify's own seed, never calibration
rows):
- teacher-forced: per-position logits of both heads, engine vs reference: max |diff| and
  cosine over every position; KL(reference || engine) and top-1 agreement where generation
  reads the head (the text head in text mode, the audio head in audio mode; audio logits over
  the real codes only, as generation masks the padding rows);
- greedy: the modality-switching loop run on both for N steps; tokens must match.
Thresholds per precision come from config. verify.json is written only when every threshold
holds; otherwise the metrics go to verify.failed.json and the rule fails, so no benchmark
ever runs on an engine that computes the wrong function.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from workflow import artifacts, dataset, traffic
from workflow.download import load_hf_state
from workflow.engines import check_built_from, load_engine
from workflow.engines.base import Engine
from workflow.errors import InputError, run_main
from workflow.generate import Ids, audio_mode_after, generate
from workflow.reference import MossSpeechReference, ReferenceEngine
from workflow.spec import load_spec

# A threshold named *_min fails below its value, *_max above it; null means not checked.
METRICS = {
    "max_abs_diff_max": ("teacher_forced", "max_abs_diff"),
    "cosine_min": ("teacher_forced", "cosine_min"),
    "top1_min": ("teacher_forced", "top1"),
    "kl_mean_max": ("teacher_forced", "kl_mean"),
}


def head_metrics(ref: torch.Tensor, eng: torch.Tensor, used: torch.Tensor) -> dict:
    """ref/eng [N, V] float logits at the same positions; used [N] marks positions read."""
    diff = (ref - eng).abs().amax(-1)
    cos = torch.nn.functional.cosine_similarity(ref, eng, dim=-1)
    lp, lq = ref[used].log_softmax(-1), eng[used].log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (ref[used].argmax(-1) == eng[used].argmax(-1)).float()
    return {
        "positions": int(ref.shape[0]),
        "positions_used": int(used.sum()),
        "max_abs_diff": float(diff.max()),
        "cosine_min": float(cos.min()),
        "cosine_mean": float(cos.mean()),
        "kl_mean": float(kl.mean()) if kl.numel() else 0.0,
        "kl_max": float(kl.max()) if kl.numel() else 0.0,
        "top1": float(top1.mean()) if top1.numel() else 1.0,
    }


def teacher_forced(engine: Engine, ref: MossSpeechReference, prompts: torch.Tensor, ids: Ids) -> dict:
    """Both heads' metrics over every position of every prompt."""
    n_codes = ids.eosp + 1
    acc: dict[str, list[torch.Tensor]] = {k: [] for k in ("rt", "et", "ra", "ea", "mode")}
    for chunk in prompts.split(engine.max_batch):
        et, ea = engine.prefill(chunk, all_logits=True)
        rt, ra, _ = ref(chunk.to(ref.text_path.device))
        for k, v in (("rt", rt), ("et", et), ("ra", ra[..., :n_codes]), ("ea", ea[..., :n_codes])):
            acc[k].append(v.float().cpu().flatten(0, 1))
        acc["mode"].append(audio_mode_after(chunk, ids).flatten().cpu())
    cat = {k: torch.cat(v) for k, v in acc.items()}
    return {
        "text": head_metrics(cat["rt"], cat["et"], ~cat["mode"]),
        "audio": head_metrics(cat["ra"], cat["ea"], cat["mode"]),
    }


def greedy(engine: Engine, ref: ReferenceEngine, prompts: torch.Tensor, steps: int, ids: Ids) -> dict:
    """Greedy generation on both; per prompt: the first step where tokens differ (or None)."""
    first_diff: list[int | None] = []
    switches = 0
    for chunk in prompts.split(engine.max_batch):
        got = generate(engine, chunk, steps, ids)
        want = generate(ref, chunk, steps, ids)
        n = min(got.tokens.shape[1], want.tokens.shape[1])
        for b in range(chunk.shape[0]):
            same = (got.tokens[b, :n].cpu() == want.tokens[b, :n].cpu()).all(-1)
            lengths_differ = got.tokens.shape[1] != want.tokens.shape[1]
            bad = torch.nonzero(~same).flatten()
            first_diff.append(int(bad[0]) if len(bad) else (n if lengths_differ else None))
            mode = want.audio_mode[b].int()
            switches += int((mode[1:] != mode[:-1]).sum())
    matched = sum(d is None for d in first_diff)
    return {
        "steps": steps,
        "sequences": len(first_diff),
        "matched": matched,
        "match_fraction": matched / len(first_diff),
        "first_divergence": first_diff,
        "modality_switches": switches,
    }


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
    """Every threshold missed, as 'what: got vs limit'."""
    out = []
    for key, (section, metric) in METRICS.items():
        limit = thresholds.get(key)
        if limit is None:
            continue
        for head, m in report[section].items():
            got = m[metric]
            if (key.endswith("_min") and not got >= limit) or (key.endswith("_max") and not got <= limit):
                out.append(f"{head} {metric} {got:.6g} vs {key} {limit}")
    g = report["greedy"]
    if thresholds.get("greedy_match_min") is not None and g["match_fraction"] < thresholds["greedy_match_min"]:
        out.append(f"greedy match_fraction {g['match_fraction']:.3g} vs greedy_match_min {thresholds['greedy_match_min']}")
    if thresholds.get("min_switches") is not None and g["modality_switches"] < thresholds["min_switches"]:
        out.append(f"greedy saw {g['modality_switches']} modality switches vs min_switches {thresholds['min_switches']}")
    return out


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
    precision = meta["precision"]
    engine = load_engine(args.engine)
    spec = load_spec(args.hf)
    ids = Ids.of(spec)
    ref_dtype = getattr(torch, p["reference_dtype"])
    ref = MossSpeechReference(spec, load_hf_state(args.hf), ref_dtype, engine.device)
    prompts = traffic.batch(p["num_prompts"], p["prompt_len"], ids, p["seed"])
    report = {
        "engine": str(args.engine),
        "backend": meta["backend"],
        "precision": precision,
        "checkpoint_sha256": meta["checkpoint"]["sha256"],
        "reference": f"transformers.Qwen3ForCausalLM, text and audio paths, {p['reference_dtype']}",
        "device": str(engine.device),
        "prompts": {"count": p["num_prompts"], "length": p["prompt_len"], "seed": p["seed"]},
        "held_out": check_held_out(prompts, args.calib_data) if args.calib_data and args.calib_data.exists() else None,
        "teacher_forced": teacher_forced(engine, ref, prompts, ids),
        "greedy": greedy(engine, ReferenceEngine(ref, engine.device), prompts, p["greedy_steps"], ids),
        "thresholds": p["thresholds"][precision],
    }
    failed = failures(report, report["thresholds"])
    report["failures"] = failed
    report["passed"] = not failed
    print(json.dumps({k: report[k] for k in ("teacher_forced", "greedy")}, indent=2))
    if failed:
        artifacts.write_json(args.out.with_suffix(".failed.json"), report)
        raise SystemExit("verify FAILED: " + "; ".join(failed))
    artifacts.write_json(args.out, report)
    print(f"verify passed: {args.out}")


if __name__ == "__main__":
    run_main(main)
