#!/usr/bin/env bash
# A run of record on a two-GPU machine (the device tool's nvidia-h100-x2 or nvidia-h200-x2): bf16 on GPU 0
# and FP8 on GPU 1 side by side, each with half the cores (gpu_pipeline.sh, MOSSBUILD_GPU), in four calls
# of under 10 minutes, run from the repository root with .whl carried (and results/gemv-timing.json, the GEMV's
# timing cache, where an earlier session's archive brought it back: builds on that kind of GPU then skip the tuning):
#
#   MOSSBUILD_COMMIT=<sha> bash benchmarks/gpu_pair.sh 1   # download, convert
#   MOSSBUILD_COMMIT=<sha> bash benchmarks/gpu_pair.sh 2   # bf16 build, verify | FP8 calibrate
#   MOSSBUILD_COMMIT=<sha> bash benchmarks/gpu_pair.sh 3   # bf16 benchmark | FP8 build, verify, the codec's CUDA tests
#   MOSSBUILD_COMMIT=<sha> bash benchmarks/gpu_pair.sh 4   # FP8 benchmark | the GEMV's and flow slots' CUDA tests
#
# A serving A/B session (probe_lanes.py's arms, e.g. PROBE_ARMS=pace) builds engines only, then probes; a
# probe's first arm makes its graphs ahead (185-232 s on an H200), then ~20-40 s a level, so a probe starts
# only with PROBE_MIN_S (default 300) of the call's stage left:
#
#   MOSSBUILD_COMMIT=<sha> bash benchmarks/gpu_pair.sh p1   # download, convert, then bf16 build | FP8 calibrate (~480 s)
#   PROBE_BF16=48,64,80 PROBE_FP8=64,80,96 MOSSBUILD_COMMIT=<sha> bash benchmarks/gpu_pair.sh p2   # bf16 probe | FP8 build, probe if time is left
#   PROBE_BF16=.. PROBE_FP8=.. PROBE_CONFIGS=<yaml ...> bash benchmarks/gpu_pair.sh p3   # again, other arms or settings
#
# On a machine of one GPU (nvidia-h200) the A/B builds and probes one precision, PROBE_ONE (default fp8), with
# every core: p1 download, convert and calibrate (bf16: build), p2 build (bf16: nothing) and its probe, p3 its
# probe; the other precision's PROBE_<P> is ignored. FP8's build takes ~310 s, so its p2 leaves too little
# for a probe and spends the rest on the CUDA tests ($OUT/cuda-tests.log): probe with p3.
#
# On two GPUs, PROBE_PAIR=1 puts one precision, PROBE_ONE, on both: p2 builds it on GPU 1 (bf16: built in p1),
# then p2 and p3 probe it side by side, GPU 0 with PROBE_CONFIGS and GPU 1 with PROBE_CONFIGS_1 (two settings that
# need graphs of their own, e.g. another detokenize_hold), each with its half of the cores, its levels PROBE_<P>,
# its lines in $OUT/probe-gpu<i>-<precision>.log (PROBE_ARMS=base for each setting alone: unset, every arm of
# probe_lanes.py runs in turn, as in "H200 serving bf16 levers"):
#
#   printf 'benchmark:\n  load:\n    detokenize_hold: 16\n' > /tmp/h16.yaml
#   PROBE_ARMS=base PROBE_PAIR=1 PROBE_FP8=88,96,104 PROBE_CONFIGS_1=/tmp/h16.yaml ... bash benchmarks/gpu_pair.sh p3
#
# The codec decoder's A/B needs no engine, so it runs on a fresh machine, one GPU, before anything else
# (probe_codec.py: its codec section per arm, ~1 min an arm at the true shape):
#
#   CODEC_ARMS='{"float32 HiFT": {"hift_dtype": "float32"}}' MOSSBUILD_CONFIGFILE=config/h200.yaml bash benchmarks/gpu_pair.sh c
#
# e.g. pace against none at and past FP8's capacity, in turn in one process (arms after the first reuse its graphs)
# (h200.yaml: 40 streams open, 40 flow slots sharing 720 s of float8 pages; PROBE_CONFIGS for other sizes):
#   MOSSBUILD_STAGE_S=575 PROBE_ARMS="base|pace" PROBE_FP8=80,96 ... bash benchmarks/gpu_pair.sh p3
#
# A precision whose PROBE_<P> is empty is not probed. PROBE_CONFIGS are read after full.yaml and
# MOSSBUILD_CONFIGFILE; the other PROBE_* settings go to probe_lanes.py as they are. Each probe stops at the
# call's MOSSBUILD_STAGE_S; its lines are in $OUT/probe-<precision>.log, its levels in $OUT/probe-<precision>.json.
#
# On H200s, MOSSBUILD_CONFIGFILE=config/h200.yaml before each (its flow slots and pages do not fit an H100's
# 80 GB: gpu_pipeline.sh refuses it there), MOSSBUILD_STAGE_S=585 before call 3 (bf16's benchmark, searched to
# 128 users, took 510 s in H200 run 20, its call 515 s; gpu_pipeline.sh starts no searched level that would end
# within 60 s of the stage, load.search_until_s, so a long search ends with a lower bound, not a cut call) and,
# before call 4, what the session's device time has left (FP8's took 375 s in run 20, its call 380 s; the four
# calls held the machine 1,424 s, leaving ~370 s of a session for one paired probe, p3, on the engines built).
# The CUDA tests run in calls 3 and 4 beside the other precision's benchmark, never in a call of their own: in
# call 1 beside download and convert (~115 s) they held the machine ~140 s longer.
#
# Why two GPUs: the session's device time counts the machine's held time, not its GPUs, and one after the
# other the two precisions hold a machine ~2,500 s, more than a session has; side by side they hold it
# ~1,350-1,770 s (levers.md, "H100 run 19" to "H200 run 18", each call's time). A precision's benchmark
# never runs beside the other's: in call 3 FP8 builds and verifies on its own GPU and cores while bf16 is
# timed. Download and convert (~100 s) are a call of their own: bf16's build (~250 s) and verify (~155 s)
# after them would come near the stage limit. A call cut at MOSSBUILD_STAGE_S is run again as it is (the
# rules it finished are cached). The machine is given back after 30 s idle: make each call as soon as the
# last returns; a call whose earlier calls' outputs are missing stops at once (`needs`). Each side's output
# is in $OUT/gpu<i>-<precision>[-<rule>].log; the archives are gpu_pipeline.sh's.
set -euo pipefail
# the tests written for CUDA (the rest of test_gemv.py runs Triton's CPU interpreter: CI's): the codec's and
# the graphs' priorities and pools after FP8's verify in call 3 (bf16's benchmark takes longer), the GEMV's and
# the flow slots' beside FP8's benchmark in call 4, each cut at its call's stage
FIRST_TESTS=(tests/test_gemv.py::test_bf16_rounds_like_torch tests/test_gemv.py::test_tuning_keeps_a_block_per_row_count_and_passes_over_what_cannot_launch
             tests/test_quant.py tests/test_codec_slots.py tests/test_codec_batch.py)
CODEC_TESTS=(tests/test_codec_kernels.py tests/test_codec_stream.py tests/test_codec_timing.py tests/test_codec_fast.py tests/test_cudagraphs.py tests/test_greenctx.py)
gpus=$(nvidia-smi -L | grep -c '^GPU')
one=${PROBE_ONE:-fp8}  # one GPU: the precision an A/B builds and probes
# side <gpu> <precision> [rule]: gpu_pipeline.sh on GPU i with the i-th half of the cores (one GPU: all of them)
side() { local log pin=(); log=$OUT/gpu$1-$(echo "${@:2}" | tr ' ' -).log
        if [ "$gpus" -gt 1 ]; then pin=(env MOSSBUILD_GPU="$1"); fi
        "${pin[@]}" bash benchmarks/gpu_pipeline.sh "${@:2}" > "$log" 2>&1 || echo "gpu$1 exit $?"; }
both() { side 0 $1 & side 1 $2 & wait; }  # each a precision and a rule, split
cores() { local half=$(( $(nproc) / gpus )); echo "$(( $1 * half ))-$(( $1 * half + half - 1 ))"; }  # GPU i's share of the cores
# tests <gpu> <log> <test ...>: pytest on GPU i with its share of the cores, its output in $OUT/<log>
# (limit=<s> before it: cut after that many seconds, exit 124; none: no limit)
tests() { CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=/tmp/site:. timeout "${limit:-0}" taskset -c "$(cores "$1")" \
              python3 -m pytest -q -p no:cacheprovider "${@:3}" > "$OUT/$2" 2>&1 && rc=0 || rc=$?; echo "tests exit $rc" >> "$OUT/$2"; }
# a call whose earlier calls' outputs are not here met a fresh machine (the one held was given back, e.g. idle
# 30 s between calls: H200 run 14): it stops at once, where redoing them would spend the session's device time
needs() { local f; for f in "$@"; do [ -e "results/full/$f" ] || {
    echo "step $step needs results/full/$f from the calls before it: this machine is fresh; start again at step ${step%%[0-9]*}1" >&2; exit 3; }; done; }
# probe <gpu> <precision> <levels>: probe_lanes.py on that precision's engine until the call's stage ends
deadline=$(( SECONDS + ${MOSSBUILD_STAGE_S:-560} ))
# (PROBE_PAIR: GPU 1's probe with PROBE_CONFIGS_1, and each probe's files named by its GPU too)
probe() { local left=$(( deadline - SECONDS )) out=$OUT/probe-$2 configs=${PROBE_CONFIGS:-}; [ -n "$3" ] || return 0
          if [ -n "${PROBE_PAIR:-}" ]; then out=$OUT/probe-gpu$1-$2; [ "$1" = 0 ] || configs=${PROBE_CONFIGS_1:-}; fi
          [ "$left" -ge "${PROBE_MIN_S:-300}" ] || {
              echo "probe $2: ${left} s of the stage left, under PROBE_MIN_S (${PROBE_MIN_S:-300}), not started" >> "$out.log"; return 0; }
          CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=/tmp/site:. PROBE_LEVELS=$3 timeout "$left" \
              taskset -c "$(cores "$1")" python3 benchmarks/probe_lanes.py \
              "results/full/torch-$2/engine" "$out.json" config/full.yaml ${MOSSBUILD_CONFIGFILE:-} $configs \
              > "$out.log" 2>&1 || echo "probe $2 exit $?" >> "$out.log"; }
pair() { probe 0 "$one" "$(levels "$one")" & probe 1 "$one" "$(levels "$one")" & wait; }  # PROBE_PAIR
levels() { if [ "$1" = bf16 ]; then echo "${PROBE_BF16:-}"; else echo "${PROBE_FP8:-}"; fi; }
# one GPU: what the stage has left after FP8's build and no probe (~250 s) runs the CUDA tests, the first ones
# (the flow slots' and their float8 pages') before the codec's, cut at the stage's end
spare_tests() { local left=$(( deadline - SECONDS )); [ "$left" -ge 60 ] || return 0
                limit=$left tests 0 cuda-tests.log "${FIRST_TESTS[@]}" "${CODEC_TESTS[@]}"; }
step=${1:?step 1, 2, 3 or 4 (a run of record), p1, p2 or p3 (a serving A/B), or c (an A/B of the codec)}
case $one in bf16 | fp8) ;; *) echo "PROBE_ONE must be bf16 or fp8, got $one" >&2; exit 2 ;; esac
case $step in 1 | 2 | 3 | 4) [ "$gpus" -gt 1 ] || { echo "step $step needs two GPUs; this machine has $gpus" >&2; exit 2; } ;; esac
if [ -n "${PROBE_PAIR:-}" ]; then
    [ "$gpus" -gt 1 ] || { echo "PROBE_PAIR needs two GPUs; this machine has $gpus" >&2; exit 2; }
    case $step,$one in
        p2,fp8) needs calib-fp8 ;;
        p2,bf16 | p3,*) needs "torch-$one/engine/engine.json" ;;
        *) echo "PROBE_PAIR is for steps p2 and p3, not $step" >&2; exit 2 ;;
    esac
else
    case $step,$gpus,$one in
        2,*) needs ckpt-bf16 ;;
        3,*) needs torch-bf16/verify.json calib-fp8 ;;
        4,*) needs torch-fp8/verify.json ;;
        p2,1,fp8) needs calib-fp8 ;;
        p2,1,bf16 | p3,1,*) needs "torch-$one/engine/engine.json" ;;
        p2,*) needs torch-bf16/engine/engine.json calib-fp8 ;;
        p3,*) needs torch-bf16/engine/engine.json torch-fp8/engine/engine.json ;;
    esac
fi
[ -d /tmp/site/snakemake ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl
if [ -n "${PROBE_PAIR:-}" ]; then  # p2 or p3 (checked above)
    if [ "$step,$one" = p2,fp8 ]; then side 1 fp8 build; fi
    pair
    exit 0
fi
case $step,$gpus in
    1,*) MOSSBUILD_GPU=0 bash benchmarks/gpu_pipeline.sh bf16 convert ;;
    2,*) both "bf16 verify" "fp8 calibrate" ;;
    3,*) side 0 bf16 & { side 1 fp8 verify; tests 1 cuda-tests.log "${CODEC_TESTS[@]}"; } & wait ;;
    4,*) side 1 fp8 & limit=$(( deadline - SECONDS )) tests 0 first-tests.log "${FIRST_TESTS[@]}" & wait ;;
    p1,1) if [ "$one" = fp8 ]; then side 0 fp8 calibrate; else side 0 bf16 build; fi ;;
    p2,1) if [ "$one" = fp8 ]; then side 0 fp8 build; fi; probe 0 "$one" "$(levels "$one")"; spare_tests ;;
    p3,1) probe 0 "$one" "$(levels "$one")" ;;
    p1,*) MOSSBUILD_GPU=0 bash benchmarks/gpu_pipeline.sh bf16 convert > "$OUT/gpu0-bf16-convert.log" 2>&1; both "bf16 build" "fp8 calibrate" ;;
    p2,*) probe 0 bf16 "$(levels bf16)" & { side 1 fp8 build; probe 1 fp8 "$(levels fp8)"; } & wait ;;
    p3,*) probe 0 bf16 "$(levels bf16)" & probe 1 fp8 "$(levels fp8)" & wait ;;
    c,*) CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:. timeout "$(( deadline - SECONDS ))" python3 benchmarks/probe_codec.py \
             "$OUT/probe-codec.json" config/full.yaml ${MOSSBUILD_CONFIGFILE:-} ${PROBE_CONFIGS:-} > "$OUT/probe-codec.log" 2>&1 \
             || echo "probe codec exit $?" >> "$OUT/probe-codec.log" ;;
    *) echo "unknown step $1 (1, 2, 3, 4, p1, p2, p3 or c)" >&2; exit 2 ;;
esac
