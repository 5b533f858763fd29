#!/usr/bin/env bash
# The whole pipeline on the `full` preset on a lent GPU machine, in calls of under 10 minutes
# (the device tool's limit), each run from the repository root with .whl carried:
#
#   MOSSBUILD_COMMIT=<sha> bash benchmarks/gpu_pipeline.sh bf16 verify     # download .. verify
#   MOSSBUILD_COMMIT=<sha> bash benchmarks/gpu_pipeline.sh bf16            # benchmark (load included)
#   MOSSBUILD_COMMIT=<sha> bash benchmarks/gpu_pipeline.sh fp8 calibrate   # reuses download and convert
#   MOSSBUILD_COMMIT=<sha> bash benchmarks/gpu_pipeline.sh fp8 verify      # build (tunes the GEMV at 1, 2 and 4 rows), verify
#   MOSSBUILD_COMMIT=<sha> bash benchmarks/gpu_pipeline.sh fp8             # benchmark
#
# The second argument, a rule, stops there (Snakemake's --until). The fp8 run's benchmark leaves out
# the eager baseline: it is the same transformers model as in the bf16 run, which measures it.
# .whl holds the wheels listed in benchmarks/gpu-wheels.txt: `bash benchmarks/wheels.sh` makes it (once a checkout).
# The machine must stay warm between calls (results/ lives on it): the device tool gives it back after
# 30 s idle, so make each call as soon as the last returns (through a slower agent, one session lost
# the machine between calls; on a fresh one the bf16 benchmark call redid download .. verify and ran
# out of its stage). A call cut at its 560 s limit
# ("snakemake exit 124") is run again as it is: the rules it finished are cached, so the second
# call runs what is left (H100 run 8 in docs/levers.md).
# bf16 and FP8 together no longer fit one machine's 30-minute hold (H100 run 18: ~2,100 s with the load):
# run bf16 verify and bf16 on one machine, then fp8 calibrate, fp8 verify and fp8 on a fresh one (its
# calibrate call redoes download and convert; FP8 calibration alone took 305-340 s there).
# At 7d0b029 on an H100 the bf16 calls took 359 s (verify) and 438 s (levels to 32). Tuning the GEMV
# at 1 and 4 rows took 149 s of bf16's build (359 blocks) and 77 s of FP8's (655) in H100 run 19;
# tuning at 2 rows too adds ~155 and ~200 blocks (~+64 s bf16, ~+24 s FP8).
# MOSSBUILD_CONFIGFILE=<yaml> is read after config/full.yaml, its keys merged over it (a GPU's own
# settings, e.g. more flow slots where memory allows: benchmark.codec.slots and benchmark.load.slots).
# benchmark.json's `sections_s` says where a benchmark call's time went (eager baseline, engine, codec, load).
# MOSSBUILD_STAGE_S sets that limit (default 560): lower it where less of the machine's hold is left
# (the device tool gives a machine back after 30 minutes held; H100 run 9 in docs/levers.md).
# Each call tars the small artifacts (verify.json, benchmark.*, plots, engine.json, amax.json,
# rule TSVs, log tails, the GEMV's timing cache) of all of results/ into $OUT/results-<precision>-<rule>.tgz;
# benchmarks/collect.py then writes summary.json. full.yaml's engine.timing_cache, results/gemv-timing.json, keeps
# the GEMV's tuned blocks by GPU: put the archive's copy in results/ and carry it (the device tool's `carry`, beside
# .whl), and the next session's builds on that kind of GPU skip the tuning (~200 s of bf16's build on an H200).
set -euo pipefail
precision=$1
until=${2:-}
[ -d /tmp/site/snakemake ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
: "${MOSSBUILD_COMMIT:?set MOSSBUILD_COMMIT: the GPU copy has no .git}"
export MOSSBUILD_COMMIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# config/h200.yaml's flow slots and pages do not fit an 80 GB card (16 whole slots ran out on an H100): refused there
if [[ "${MOSSBUILD_CONFIGFILE:-}" == *h200* ]] \
    && [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 120000 ]; then
    echo "$MOSSBUILD_CONFIGFILE needs an H200's 141 GB: this GPU has less (run without it, or on H200s)" >&2; exit 2
fi
# MOSSBUILD_GPU=<i> (benchmarks/gpu_pair.sh): GPU i alone, the i-th half of the cores, and no Snakemake lock, so
# that the other precision runs beside it on a two-GPU machine (their rules' outputs are apart)
pin=() lock=()
if [ -n "${MOSSBUILD_GPU:-}" ]; then
    export CUDA_VISIBLE_DEVICES=$MOSSBUILD_GPU
    half=$(( $(nproc) / 2 ))
    pin=(taskset -c "$(( MOSSBUILD_GPU * half ))-$(( MOSSBUILD_GPU * half + half - 1 ))") lock=(--nolock)
fi
# a call the device tool killed leaves Snakemake's lock behind: the next call lifts it first
configs=(config/full.yaml ${MOSSBUILD_CONFIGFILE:-})
run() { [ -n "${lock[*]}" ] || python3 -m snakemake --configfile "${configs[@]}" "$@" --unlock > /dev/null 2>&1 || true
        timeout "${MOSSBUILD_STAGE_S:-560}" "${pin[@]}" python3 -m snakemake -c8 --configfile "${configs[@]}" "${lock[@]}" "$@" \
            || echo "snakemake exit $?"; }
# the load's search starts no level that would end past the stage less 60 s (start-up, pricing, the report): a
# benchmark near the limit ends with the levels it ran, its answer marked a lower bound, not cut with nothing
until_s=$(( ${MOSSBUILD_STAGE_S:-560} - 60 ))
case $precision in
    bf16) args=(--config benchmark="{load: {search_until_s: $until_s}}") ;;
    fp8) args=(--config engine='{precision: fp8}' benchmark="{baseline: false, load: {search_until_s: $until_s}}") ;;
    *) echo "unknown precision $precision (bf16 or fp8)" >&2; exit 2 ;;
esac
run "${args[@]}" ${until:+--until "$until"}
cd results  # the small artifacts, in one archive: the device tool returns a few files only
stage_dir=$(mktemp -d)
find . \( -name '*.tsv' -o -name 'verify*.json' -o -name 'benchmark*.json' -o -name 'benchmark.md' -o -name '*.png' \
    -o -name engine.json -o -name amax.json -o -name quant_summary.txt -o -name gemv-timing.json \) -not -path '*/checkpoint/*' \
    -not -path '*/dataset/*' -exec cp --parents {} "$stage_dir/" \;
for log in $(find . -name '*.log'); do mkdir -p "$stage_dir/$(dirname "$log")"; tail -c 20000 "$log" > "$stage_dir/$log.tail"; done
tar -czf "$OUT/results-$precision${until:+-$until}.tgz" -C "$stage_dir" .
