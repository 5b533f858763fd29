"""benchmarks/collect.py over the committed runs of record, and the docs that quote them: the
figures README.md quotes come out of collect.py, and every run, commit and patch the docs name
can be opened."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
COLLECT = ROOT / "benchmarks" / "collect.py"
RUNS = ["2026-11-27-h100-full19", "2026-11-29-h200-full20"]  # README's runs of record
BASE = "5dada02"  # holds every results directory and patch the ledger names


def collect(tmp_path: Path, run: Path, *variants: str) -> dict:
    args = [arg for v in variants for arg in (f"--{v}", str(run / f"torch-{v}"))]
    out = tmp_path / "summary.json"
    tsv = run / "benchmarks" / "calibrate-fp8.tsv"
    cmd = [sys.executable, str(COLLECT), *args, "--calibrate-tsv", str(tsv), "--date", "d", "--command", "c", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("run", RUNS)
def test_both_variants_give_the_committed_summary(tmp_path, run):
    """Each run of record's summary.json, recomputed from its two variants' files: the same in
    everything but the date and the command, which collect.py is given."""
    got = collect(tmp_path, RESULTS / run, "bf16", "fp8")
    want = json.loads((RESULTS / run / "summary.json").read_text())
    for key in ("date", "command"):
        got.pop(key), want.pop(key)
    assert got == want


def test_one_variant_marks_what_it_cannot_judge(tmp_path):
    """FP8 alone (the H200 run of record's FP8 variant): its own figures and goals; bf16's and the ratios
    between the two are not measured, neither met nor missed."""
    got = collect(tmp_path, RESULTS / RUNS[1], "fp8")
    assert set(got["decode_step_ms"]) == {"fp8"} and "fp8_decode_speedup" not in got
    goals = {g["figure"]: g for g in got["goals"]}
    assert goals["decode_vs_floor.fp8"]["met"] is False and goals["ttfa_ms_p50.fp8"]["met"] is True
    for figure in ("decode_vs_floor.bf16", "fp8_decode_speedup", "fp8_prefill_speedup", "ttfa_ms_p50.bf16"):
        assert goals[figure]["measured"] is None and goals[figure]["met"] is None


def test_the_speed_up_spreads_the_text_catch_up_where_it_was_measured(tmp_path):
    """The FP8 speed-up is judged on steps with the text branch's catch-up spread over the
    reply, not on the bare audio steps; a run whose benchmark measured no catch-up (its
    benchmark.json without the spread figures) is judged on its steps."""
    run = RESULTS / RUNS[0]
    got = collect(tmp_path, run, "bf16", "fp8")
    spread, bare = got["decode_step_amortized_ms"], got["decode_step_ms"]
    assert all(spread[p] > bare[p] for p in ("bf16", "fp8"))
    assert got["fp8_decode_speedup"] == spread["bf16"] / spread["fp8"] != bare["bf16"] / bare["fp8"]

    old = tmp_path / "no-catch-up"
    for p in ("bf16", "fp8"):
        variant = old / f"torch-{p}"
        (variant / "benchmark").mkdir(parents=True)
        shutil.copy(run / f"torch-{p}" / "verify.json", variant)
        bench = json.loads((run / f"torch-{p}" / "benchmark" / "benchmark.json").read_text())
        for key in ("decode_step_amortized_ms", "text_catch_up_ms"):
            del bench["summary"][key]
        (variant / "benchmark" / "benchmark.json").write_text(json.dumps(bench))
    shutil.copytree(run / "benchmarks", old / "benchmarks")
    got = collect(tmp_path, old, "bf16", "fp8")
    assert "decode_step_amortized_ms" not in got
    assert got["fp8_decode_speedup"] == got["decode_step_ms"]["bf16"] / got["decode_step_ms"]["fp8"]


def docs() -> dict[str, str]:
    """README.md and every docs/*.md, by path."""
    return {"README.md": (ROOT / "README.md").read_text()} | {
        f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))
    }


def test_readme_is_for_users():
    """README.md: at most 15,000 characters, the two commands and the layout in its first half,
    every docs/*.md linked from it, and what has never been run said plainly."""
    text = docs()["README.md"]
    assert len(text.encode()) <= 15_000
    for heading in ("## Two commands", "## Layout"):
        assert text.index(f"\n{heading}\n") < len(text) / 2, f"{heading} is not in README's first half"
    assert "make run" in text and "make test" in text
    assert "never run" in text and "TensorRT-LLM" in text
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages
    for page in pages:
        assert re.search(rf"\]\(docs/{re.escape(page.name)}(#[\w-]*)?\)", text), f"README.md does not link docs/{page.name}"


def test_readme_quotes_the_runs_of_record():
    """README names each run kept under benchmarks/results/ (and keeps no other), and its table
    quotes each one's summary.json."""
    text = docs()["README.md"]
    assert sorted(p.name for p in RESULTS.iterdir() if p.is_dir()) == sorted(RUNS)
    for run in RUNS:
        assert f"benchmarks/results/{run}/" in text
        s = json.loads((RESULTS / run / "summary.json").read_text())
        for p in ("bf16", "fp8"):
            assert f"{s['decode_step_ms'][p]:.2f} ms ({s['decode_vs_floor'][p]:.3f} x)" in text
            assert f"{s['prefill512_ms'][p]:.2f} ms" in text
            assert f"{s['ttfa_ms_p50'][p]:.1f} ms" in text and f"{s['rtf'][p]:.3f}" in text
        assert f"{s['fp8_decode_speedup']:.3f} x" in text and f"{s['fp8_prefill_speedup']:.3f} x bf16" in text
        assert f"{100 * s['prefill_matmul_efficiency']['bf16']:.1f} %" in text


def test_every_result_path_the_docs_name_is_in_the_tree():
    """A path under benchmarks/results/ that README.md or a docs page names must exist, or a claim
    would rest on nothing a reader can open (a path in git history is written <commit>:path)."""
    named = {}
    for name, text in docs().items():
        for path in re.findall(r"(?<![\w:/.-])benchmarks/results/[\w./-]*", text):
            named.setdefault(path.rstrip("/."), name)
    assert {f"benchmarks/results/{run}" for run in RUNS} <= set(named)
    for path, name in named.items():
        assert (ROOT / path).exists(), f"{name} names {path}, which is not in the tree"


def git(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True, text=True, check=True).stdout


def missing(objects: list[str]) -> list[str]:
    """Those of `objects` (git revision expressions) that do not name an object."""
    out = git("cat-file", "--batch-check", stdin="".join(f"{o}\n" for o in objects)).splitlines()
    return [o for o, line in zip(objects, out, strict=True) if line.endswith(" missing")]


def ledger_rows(text: str) -> list[dict[str, str]]:
    """Every row of every table in the ledger, as {column: cell}."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if header is None:
            header = cells
        elif not set(line) <= set("|- "):
            rows.append(dict(zip(header, cells, strict=True)))
    return rows


@pytest.fixture(scope="module")
def history():
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout: the ledger's commits cannot be looked up")
    if git("rev-parse", "--is-shallow-repository").strip() == "true":
        pytest.skip("a shallow clone holds no history for the ledger's commits")


def test_every_commit_and_result_the_ledger_names_is_in_git(history):
    """Each ledger row names the commit that added its results directory: the commit exists, the
    directory is there at that commit, and so is every patch the row names. Every other commit
    the ledger, performance.md or README.md names exists too."""
    text = docs()["docs/levers.md"]
    rows = ledger_rows(text)
    assert len(rows) > 60
    objects = []
    for row in rows:
        sha, results = row["commit"], row["results"]
        assert re.fullmatch(r"[0-9a-f]{7,40}", sha), f"not a commit: {sha!r}"
        (where,) = re.findall(r"`([\w-]+)/`", results) or [None]
        assert where, f"the row names no results directory: {results!r}"
        objects += [f"{sha}^{{commit}}", f"{sha}:benchmarks/results/{where}"]
        objects += [f"{sha}:benchmarks/results/{where}/{patch}" for patch in re.findall(r"`([\w-]+\.patch)`", row["verdict"])]
    for name in ("docs/levers.md", "docs/performance.md", "README.md"):
        for sha in re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", docs()[name]):
            objects.append(f"{sha}^{{commit}}")
    assert not missing(objects)


def test_the_ledger_has_a_row_for_every_removed_result(history):
    """Every results directory and every patch the base commit held, but the tree no longer
    does, is a row of the ledger (a patch: in the verdict of a row of its directory); a row for
    a directory added since names the commit that holds it, and the tree holds it no more."""
    rows = ledger_rows(docs()["docs/levers.md"])
    where = [re.findall(r"`([\w-]+)/`", row["results"])[0] for row in rows]
    dirs = set(where)
    patches = {(d, p) for d, row in zip(where, rows, strict=True) for p in re.findall(r"`([\w-]+\.patch)`", row["verdict"])}
    held = git("ls-tree", "-r", "--name-only", BASE, "benchmarks/results/").splitlines()
    removed = {path.split("/")[2] for path in held if path.count("/") > 2} - set(RUNS)
    assert removed and removed <= dirs
    for d, row in zip(where, rows, strict=True):
        if d not in removed:
            assert git("ls-tree", "--name-only", row["commit"], f"benchmarks/results/{d}/"), f"{row['commit']} holds no {d}"
            assert not (RESULTS / d).exists(), f"{d} is a ledger row but still in the tree"
    for path in held:
        if path.endswith(".patch"):
            assert (path.split("/")[2], path.split("/")[-1]) in patches, f"the ledger names no row for {path}"


def test_first_audio_with_the_codec_decoder_is_collected_and_judged(tmp_path):
    """A run whose detokenizer was the codec decoder (`benchmark.speech: codec`): summary.json gains its
    time to first audio and RTF per variant, judged against issue 32's 60 ms (bf16) and 50 ms (FP8); a
    run with the stand-in (no codec figures in its summary) gains neither figure nor goal. H100 run 19
    missed both; H200 run 19 met both (57.9 and 47.2 ms)."""
    runs = {}
    for name, ms in (("coded", {"bf16": 58.0, "fp8": 51.0}), ("plain", None)):
        run = runs[name] = tmp_path / name
        shutil.copytree(RESULTS / RUNS[1], run)
        for p in ("bf16", "fp8"):
            path = run / f"torch-{p}" / "benchmark" / "benchmark.json"
            b = json.loads(path.read_text())
            if ms is None:
                del b["summary"]["ttfa_ms_p50_codec"], b["summary"]["rtf_codec"], b["summary"]["codec_gpu_share_at_slo"]
            else:
                b["summary"] |= {"ttfa_ms_p50_codec": ms[p], "rtf_codec": 0.5}
            path.write_text(json.dumps(b))
    got = collect(tmp_path, runs["coded"], "bf16", "fp8")
    assert got["ttfa_ms_p50_codec"] == {"bf16": 58.0, "fp8": 51.0} and got["rtf_codec"] == {"bf16": 0.5, "fp8": 0.5}
    goals = {g["figure"]: g["met"] for g in got["goals"]}
    assert goals["ttfa_ms_p50_codec.bf16"] is True and goals["ttfa_ms_p50_codec.fp8"] is False
    plain = collect(tmp_path, runs["plain"], "bf16", "fp8")
    assert "ttfa_ms_p50_codec" not in plain and not any("codec" in g["figure"] for g in plain["goals"])
    h200 = {g["figure"]: g["met"] for g in collect(tmp_path, RESULTS / RUNS[1], "bf16", "fp8")["goals"]}
    assert h200["ttfa_ms_p50_codec.bf16"] is True and h200["ttfa_ms_p50_codec.fp8"] is True
    codec = {g["figure"]: g["met"] for g in collect(tmp_path, RESULTS / RUNS[0], "bf16", "fp8")["goals"]}
    assert codec["ttfa_ms_p50_codec.bf16"] is False and codec["ttfa_ms_p50_codec.fp8"] is False


def test_streams_at_the_slo_come_from_runs_with_the_load_benchmark(tmp_path):
    """A run whose benchmark.json holds the load benchmark's answer: summary.json gains
    streams_at_slo per variant and the SLO, judged against the H200 goal (the H200 run of record, its
    answers changed to 128 and 96); a run without it gains nothing."""
    run = tmp_path / "run"
    shutil.copytree(RESULTS / RUNS[1], run)
    for p, n in (("bf16", 128), ("fp8", 96)):
        path = run / f"torch-{p}" / "benchmark" / "benchmark.json"
        if not path.exists():
            path = run / f"torch-{p}" / "benchmark.json"
        b = json.loads(path.read_text())
        b["summary"] |= {"streams_at_slo": n, "ttfa_slo_ms": 200.0}
        path.write_text(json.dumps(b))
    got = collect(tmp_path, run, "bf16", "fp8")
    assert got["streams_at_slo"] == {"bf16": 128, "fp8": 96} and got["ttfa_slo_ms"] == 200.0
    goals = {g["figure"]: g["met"] for g in got["goals"]}
    assert goals["streams_at_slo.bf16"] is True and goals["streams_at_slo.fp8"] is False
    for p in ("bf16", "fp8"):  # the same run without the load benchmark
        path = run / f"torch-{p}" / "benchmark" / "benchmark.json"
        b = json.loads(path.read_text())
        del b["summary"]["streams_at_slo"], b["summary"]["ttfa_slo_ms"]
        path.write_text(json.dumps(b))
    assert "streams_at_slo" not in collect(tmp_path, run, "bf16", "fp8")


def test_the_codecs_share_of_the_gpu_is_judged_against_a_third_where_priced(tmp_path):
    """summary.json gains the codec decoder's work priced alone at the level of streams at the SLO
    (`codec_gpu_share_at_slo`), judged against issue 32's third; a run that did not price it (the CPU:
    null) is "not measured", and a run from before the pricing has neither figure nor goal."""
    run = tmp_path / "run"
    shutil.copytree(RESULTS / RUNS[1], run)
    for p, share in (("bf16", 0.30), ("fp8", None)):
        path = run / f"torch-{p}" / "benchmark" / "benchmark.json"
        b = json.loads(path.read_text())
        b["summary"]["codec_gpu_share_at_slo"] = share
        path.write_text(json.dumps(b))
    got = collect(tmp_path, run, "bf16", "fp8")
    goals = {g["figure"]: g for g in got["goals"]}
    assert got["codec_gpu_share_at_slo"] == {"bf16": 0.30, "fp8": None}
    assert goals["codec_gpu_share_at_slo.bf16"]["met"] is True and goals["codec_gpu_share_at_slo.fp8"]["met"] is None
    assert goals["codec_gpu_share_at_slo.bf16"]["limit"] == pytest.approx(1 / 3)
    before = collect(tmp_path, RESULTS / RUNS[0], "bf16", "fp8")  # H100 run 19: not priced
    assert "codec_gpu_share_at_slo" not in before and not any("share" in g["figure"] for g in before["goals"])
