"""The Snakemake workflow end to end on the embedded default, in a scratch directory: what runs,
what reruns after each kind of change, the resources each rule asks for, and the report."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"download", "convert", "calibrate", "build", "verify", "benchmark"}
EVERYTHING = STAGES | {"pages", "all"}


@dataclass
class Workflow:
    repo: Path  # whose Snakefile (and workflow/ code) runs
    workdir: Path

    def run(self, *args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "snakemake", "-s", str(self.repo / "Snakefile"), "-d", str(self.workdir), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=1200)

    def planned(self, *args: str) -> set[str]:
        """The rules `snakemake -n` would run."""
        r = self.run("-n", *args)
        assert r.returncode == 0, r.stderr[-2000:]
        return set(re.findall(r"^(?:local)?rule (\w+):", r.stdout, flags=re.M))

    def resources(self, *args: str) -> dict[str, dict[str, str]]:
        """Each planned rule's threads and resources, as `snakemake -n` prints them (with cores
        enough that no rule's threads are capped to this machine's)."""
        r = self.run("-n", "-c64", *args)
        assert r.returncode == 0, r.stderr[-2000:]
        out = {}
        for block in re.split(r"^(?=(?:local)?rule )", r.stdout, flags=re.M)[1:]:
            rule = re.match(r"(?:local)?rule (\w+):", block).group(1)
            res = re.search(r"^    resources: (.*)$", block, flags=re.M).group(1)
            threads = re.search(r"^    threads: (\d+)$", block, flags=re.M)
            out[rule] = dict(kv.split("=", 1) for kv in res.split(", ")) | {"threads": threads.group(1) if threads else "1"}
        return out


def copy_repo(dest: Path) -> Path:
    """The workflow's files without caches and results: code in it may be edited by a test."""
    junk = shutil.ignore_patterns(".git", ".venv", ".snakemake", "results", "logs", "__pycache__", "*_cache", ".whl", ".gpu")
    shutil.copytree(ROOT, dest, ignore=junk)
    return dest


def test_dry_run_lists_every_stage(tmp_path):
    assert Workflow(ROOT, tmp_path).planned() == EVERYTHING


def test_bad_source_fails_before_any_job(tmp_path):
    r = Workflow(ROOT, tmp_path).run("-n", "--config", "model={source: ftp://x}")
    assert r.returncode != 0
    assert "unknown source 'ftp://x'" in r.stdout + r.stderr


@pytest.mark.parametrize(
    ("setting", "line"),
    [
        ("benchmark={vocoder: {overlap: maybe}}", "config: benchmark.vocoder.overlap: 'maybe' is not of type 'boolean'"),
        ("benchmark={runs: 0}", "config: benchmark.runs: 0 is less than the minimum of 1"),
        (  # the later chunks it holds go once due within the slack: without one they could wait past due
            "benchmark={load: {first_audio_first: true}}",
            "config: benchmark.load.detokenize_slack_s: 0 is less than or equal to the minimum of 0",
        ),
        (  # a stream paced slower than it plays would run out of audio
            "benchmark={load: {pace: 0.5}}",
            "config: benchmark.load.pace: 0.5: 0 (off) or at least 1: a stream made slower than it plays runs out",
        ),
    ],
)
def test_a_value_the_schema_refuses_is_one_line_naming_the_key(tmp_path, setting, line):
    r = Workflow(ROOT, tmp_path).run("-n", "--config", setting)
    assert r.returncode != 0
    assert line in (r.stdout + r.stderr).splitlines()


# --- resources -----------------------------------------------------------------------------


def test_on_the_cpu_no_rule_asks_for_a_gpu(tmp_path):
    res = Workflow(ROOT, tmp_path).resources()
    assert {rule: r["gpu"] for rule, r in res.items() if rule != "all"} == dict.fromkeys(STAGES | {"pages"}, "0")
    assert res["build"]["mem_mb"] == "4000" and res["build"]["runtime"] == "30" and res["build"]["threads"] == "2"


def test_threads_memory_and_runtime_come_from_config_per_rule(tmp_path):
    res = Workflow(ROOT, tmp_path).resources("--config", "resources={benchmark: {threads: 8, mem_mb: 9000, runtime: 90}}")
    assert (res["benchmark"]["threads"], res["benchmark"]["mem_mb"], res["benchmark"]["runtime"]) == ("8", "9000", "90")
    assert (res["verify"]["threads"], res["verify"]["mem_mb"], res["verify"]["runtime"]) == ("2", "4000", "30")


def test_a_rule_on_cuda_asks_for_one_gpu_and_the_site_settings(tmp_path):
    site = "resources={default: {slurm_partition: gpu, slurm_account: lab, gpu_model: h100}, verify: {mem_mb: 64000}}"
    res = Workflow(ROOT, tmp_path).resources("--config", "engine={device: cuda, dtype: bfloat16}", site)
    on_cuda = {"build", "verify", "benchmark"}
    assert {rule for rule, r in res.items() if r.get("gpu") == "1"} == on_cuda
    for rule in STAGES:
        assert res[rule]["slurm_partition"] == "gpu" and res[rule]["slurm_account"] == "lab"
        assert res[rule].get("gpu_model") == ("h100" if rule in on_cuda else None), rule
    assert res["verify"]["mem_mb"] == "64000" and res["build"]["mem_mb"] == "4000"


def test_fp8_calibration_on_cuda_asks_for_a_gpu_and_bf16_passthrough_does_not(tmp_path):
    cuda = "calibration={device: cuda, dtype: bfloat16}"
    assert Workflow(ROOT, tmp_path).resources("--config", "engine={precision: fp8}", cuda)["calibrate"]["gpu"] == "1"
    assert Workflow(ROOT, tmp_path).resources("--config", cuda)["calibrate"]["gpu"] == "0"


def test_a_rule_on_cuda_told_zero_gpus_is_refused(tmp_path):
    r = Workflow(ROOT, tmp_path).run("-n", "--config", "engine={device: cuda}", "resources={build: {gpu: 0}}")
    assert r.returncode != 0
    assert "resources.build.gpu is 0 but rule build runs on cuda" in r.stdout + r.stderr


def test_unknown_rule_in_resources_is_refused(tmp_path):
    r = Workflow(ROOT, tmp_path).run("-n", "--config", "resources={biuld: {mem_mb: 100}}")
    assert r.returncode != 0
    assert "biuld" in r.stdout + r.stderr


# --- the whole chain, then what reruns -----------------------------------------------------


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Workflow:
    """The whole chain, run from a scratch copy of the repository (tests edit its code)."""
    wf = Workflow(copy_repo(tmp_path_factory.mktemp("repo") / "mossbuild"), tmp_path_factory.mktemp("chain"))
    r = wf.run("-c2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return wf


def test_whole_chain_passes_verify_and_benchmarks(chain):
    variant = chain.workdir / "results" / "tiny" / "torch-bf16"
    assert json.loads((variant / "verify.json").read_text())["passed"] is True
    bench = json.loads((variant / "benchmark" / "benchmark.json").read_text())
    assert bench["summary"]["ttfa_ms_p50"] > 0 and bench["summary"]["rtf"] > 0
    assert (variant / "benchmark" / "benchmark.md").read_text().startswith("# Streaming benchmark")


def test_benchmark_json_keeps_its_schema_and_plots(chain, tmp_path):
    from workflow import report
    from workflow.benchmark import SCHEMA, write_outputs
    from workflow.errors import InputError

    out = chain.workdir / "results" / "tiny" / "torch-bf16" / "benchmark"
    bench = json.loads((out / "benchmark.json").read_text())
    report.check_schema(bench, SCHEMA)
    assert set(bench["streams"]["engine"]) == {"1", "4"} and set(bench["streams"]["eager_baseline"]) == {"1"}
    assert bench["floors"]["decode_audio_mode_ms"] < bench["floors"]["decode_text_mode_ms"]
    # the detokenizer is MOSS-Speech's codec decoder (tiny, random weights), the stand-in nowhere
    assert bench["speech"]["kind"] == "codec" and "vocoder" not in bench and "STAND-IN" not in bench["mel_stage"]
    assert "STAND-IN" not in (out / "benchmark.md").read_text()
    assert bench["summary"]["ttfa_ms_p50_codec"] == bench["summary"]["ttfa_ms_p50"]
    # overlap is asked for by default but has no effect on the CPU, and the file says so
    assert bench["settings"]["vocoder"]["overlap"] is True
    assert {r["overlap"] for per_n in bench["streams"].values() for r in per_n.values()} == {False}
    assert "It runs in line with decoding" in (out / "benchmark.md").read_text()
    load = bench["load"]  # the serving benchmark of the tiny default: two closed-loop levels
    assert [(lv["kind"], lv["value"]) for lv in load["levels"]] == [("closed", 2), ("closed", 8)]
    assert all(lv["served"] == lv["requests"] > 0 for lv in load["levels"])
    # at most as many streams open as the tiny codec's 4 flow slots (load.slots: 8); each one's wait to admission
    assert all(lv["max_streams"] == 4 and lv["queued_ms"]["n"] == lv["served"] for lv in load["levels"])
    # the engine's few-row steps (its 8 slots), not the baseline's
    rows = {k for k in bench["microbench"]["engine"] if k.endswith("_rows_ms")}
    assert rows == {f"decode_audio_mode_{n}_rows_ms" for n in (2, 4, 8)}
    assert not any(k.endswith("_rows_ms") for k in bench["microbench"]["eager_baseline"])
    assert "decode step alone at 1 / 2 / 4 / 8 streams" in (out / "benchmark.md").read_text()
    assert bench["summary"]["streams_at_slo"] == load["streams_at_slo"] and bench["summary"]["ttfa_slo_ms"] == 200
    assert "## Under load: streams per GPU at TTFA p99 <= 200 ms" in (out / "benchmark.md").read_text()
    # each part's wall time, in the order it ran
    parts = bench["sections_s"]
    assert list(parts) == ["eager_baseline", "engine", "codec", "load"] and all(s > 0 for s in parts.values())
    assert "Wall time of this run's parts: eager_baseline " in (out / "benchmark.md").read_text()
    # serving's held chunks (load.detokenize_hold: 3) timed as one call, in the schema (checked above)
    assert ("ours, slots", "later, 3 held") in {(r["variant"], r["call"]) for r in bench["codec"]["calls"]}
    for png in ("timeline.png", "latency_cdf.png", "concurrency.png", "load.png", "load_timeline.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    rtf = bench["summary"].pop("rtf")
    with pytest.raises(InputError, match=r"summary.*'rtf' is a required property"):
        report.check_schema(bench, SCHEMA)
    # a refused run keeps its figures beside the output, which is not made; a later pass removes them
    again, failed = tmp_path / "benchmark", tmp_path / "benchmark.failed.json"
    with pytest.raises(InputError, match=r"benchmark.failed.json: breaks .* 'rtf' is a required property .* in this file"):
        write_outputs(bench, again)
    assert json.loads(failed.read_text()) == bench and not again.exists()
    write_outputs(bench | {"summary": bench["summary"] | {"rtf": rtf}}, again)
    assert not failed.exists() and json.loads((again / "benchmark.json").read_text())["summary"]["rtf"] == rtf


def test_up_to_date_workflow_does_nothing_in_under_3_s(chain, capsys):
    assert chain.planned() == set()
    times = []
    for _ in range(3):  # the best of three: this machine's cores are shared
        start = time.monotonic()
        r = chain.run("-c", "all")
        times.append(time.monotonic() - start)
        assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr
    with capsys.disabled():
        print(f"\n'Nothing to be done' in {', '.join(f'{t:.2f}' for t in times)} s")
    assert min(times) < 3.0


@pytest.mark.parametrize(
    ("module", "reruns"),
    [
        ("convert.py", {"convert", "calibrate", "build", "verify", "benchmark"}),
        ("names.py", STAGES),  # the name table: download validates shapes with it
        ("engines/torch_engine.py", {"build", "verify", "benchmark"}),  # calibrate loads no engine
        ("verify.py", {"verify", "benchmark"}),
        ("vocoder.py", {"benchmark"}),
        ("pages.py", set()),
    ],
)
def test_editing_code_reruns_what_uses_it_and_what_follows(chain, module, reruns):
    path = chain.repo / "workflow" / module
    text, st = path.read_bytes(), path.stat()
    try:
        path.write_bytes(text + b"# edited\n")
        assert chain.planned() == reruns | {"pages", "all"}
    finally:
        path.write_bytes(text)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert chain.planned() == set()


def test_a_new_import_makes_its_module_an_input_at_once(chain):
    """Each module's imports are kept between starts (.snakemake/mossbuild/imports.json): a module
    edited to import another has that one among its rule's inputs on the next start, not a stale list."""
    path, vocoder = chain.repo / "workflow" / "pages.py", str(chain.repo / "workflow" / "vocoder.py")
    text, st = path.read_bytes(), path.stat()

    def pages_inputs() -> str:
        r = chain.run("-n", "-R", "pages")
        block = next(b for b in re.split(r"^(?=(?:local)?rule )", r.stdout, flags=re.M) if re.match(r"(?:local)?rule pages:", b))
        return re.search(r"^    input: (.*)$", block, flags=re.M).group(1)

    assert (chain.workdir / ".snakemake" / "mossbuild" / "imports.json").exists() and vocoder not in pages_inputs()
    try:
        path.write_bytes(text + b"import workflow.vocoder  # edited\n")
        assert vocoder in pages_inputs()
    finally:
        path.write_bytes(text)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert vocoder not in pages_inputs() and chain.planned() == set()


def test_a_new_synthetic_checkpoint_reruns_everything(chain):
    assert chain.planned("--config", "model={seed: 1}") == EVERYTHING


def test_a_voice_file_is_an_input_of_the_benchmark(chain, tmp_path):
    """benchmark.codec.voice: the benchmark and what follows it rerun, the file among its inputs, so
    that a new file at the same path reruns it too."""
    from codec_alone import voice_of  # torch: imported only where a test needs it

    from workflow.codec import voice

    path = tmp_path / "voice.safetensors"
    voice.save(path, voice_of(11))
    args = ("--config", f"benchmark={{codec: {{voice: '{path}'}}}}")
    assert chain.planned(*args) == {"benchmark", "pages", "all"}
    r = chain.run("-n", *args)
    block = next(b for b in re.split(r"^(?=(?:local)?rule )", r.stdout, flags=re.M) if b.startswith("rule benchmark:"))
    assert str(path) in re.search(r"^    input: (.*)$", block, flags=re.M).group(1)


def test_changed_resources_rerun_nothing(chain):
    assert chain.planned("--config", "resources={default: {mem_mb: 9000, runtime: 60}, verify: {gpu: 1}}") == set()


def test_report_holds_the_verify_and_benchmark_tables_and_the_plots(chain, tmp_path):
    bench = chain.workdir / "results" / "tiny" / "torch-bf16" / "benchmark"
    plot = bench / "tokens.png"  # any further PNG written into the benchmark's directory
    fig = Figure()
    fig.add_subplot().plot([1, 2, 3])
    fig.savefig(plot)
    try:
        r = chain.run("--report", str(tmp_path / "report.html"))
    finally:
        plot.unlink()
    assert r.returncode == 0, r.stderr[-2000:]
    added = set(re.findall(r"Adding (\S+) \(", r.stdout + r.stderr))
    plots = {"timeline.png", "latency_cdf.png", "concurrency.png", "load.png", "load_timeline.png"}  # the benchmark's own
    assert added == {"verify.html", "benchmark.html", "tokens.png"} | plots
    html = (tmp_path / "report.html").read_text()
    assert "verify.html" in html and "benchmark.html" in html and "tokens.png" in html


# the FP8 chain's benchmark runs the stand-in detokenizer: the default chain runs the codec decoder
FP8 = [
    "--config",
    "engine={precision: fp8}",
    "calibration={num_samples: 64}",
    "benchmark={runs: 1, concurrency: [1], speech: stand-in}",
]


@pytest.fixture(scope="module")
def fp8_chain(chain) -> Workflow:
    r = chain.run("-c2", *FP8)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return chain


def test_fp8_chain_reuses_the_download_and_passes_verify(fp8_chain):
    report = json.loads((fp8_chain.workdir / "results" / "tiny" / "torch-fp8" / "verify.json").read_text())
    assert report["passed"] and report["precision"] == "fp8"
    assert report["held_out"]["disjoint"]
    assert fp8_chain.planned(*FP8) == set()


def test_the_stand_in_detokenizer_is_said_to_be_one(fp8_chain):
    """`benchmark.speech: stand-in` (the FP8 chain): the code->mel table and BigVGAN, labelled as such
    in benchmark.json and .md, its load served too; and no codec decoder figure claimed."""
    out = fp8_chain.workdir / "results" / "tiny" / "torch-fp8" / "benchmark"
    bench = json.loads((out / "benchmark.json").read_text())
    assert bench["speech"] == {"kind": "stand-in", "first_codes": 1} and bench["mel_stage"].startswith("STAND-IN")
    assert bench["vocoder"]["weights"] == "random" and "ttfa_ms_p50_codec" not in bench["summary"]
    assert "Mel stage: STAND-IN" in (out / "benchmark.md").read_text()
    assert all(lv["served"] == lv["requests"] > 0 for lv in bench["load"]["levels"])


def test_calibration_change_reruns_calibrate_and_what_follows(fp8_chain):
    changed = [*FP8[:2], "calibration={num_samples: 65}", *FP8[3:]]
    assert fp8_chain.planned(*changed) == {"calibrate", "build", "verify", "benchmark", "pages", "all"}
    # bf16 passes the checkpoint through: calibration settings do not touch it
    assert fp8_chain.planned("--config", "calibration={num_samples: 65}") == set()


# --- a local checkpoint replaced in place --------------------------------------------------


def test_a_new_checkpoint_in_a_local_directory_reruns_download_and_what_follows(tmp_path):
    def write_checkpoint(out: Path, seed: int) -> None:
        cmd = [sys.executable, "-m", "workflow.download", "--source", "synthetic:tiny", "--seed", str(seed), "--out", str(out)]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)

    source = tmp_path / "moss"
    write_checkpoint(source, seed=0)
    wf = Workflow(ROOT, tmp_path / "work")
    args = ["results/local-moss/ckpt-bf16", "--config", f"model={{source: 'local:{source}'}}"]
    r = wf.run("-c2", *args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert wf.planned(*args) == set()

    write_checkpoint(tmp_path / "new", seed=1)  # new weights, copied over the old files
    for f in (tmp_path / "new").glob("*.safetensors"):
        shutil.copy(f, source / f.name)
    assert wf.planned(*args) == {"download", "convert"}
