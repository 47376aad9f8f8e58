#!/usr/bin/env bash
# Everything this project measures on the GPU machine, in one call (device time is scarce):
# GPU tests, the rollout benchmark, full RL steps, and the default experiment on the GPU.
#   bash bench/gpu_suite.sh [sections...]   (default: tests rlstep default rollout; also: kernels moe timeline attnwarps gaps
#   host trigger lora ktests trace rtests etests graphs wgmma ncu tiled tiledwide layout layoutprof
#   rlstep_layout tiledbench probe hotspot)
# Logs and JSON go to $OUT (default ./gpu_out). Wheels for packages missing there travel in .whl/, the commit in
# .commit (see below).
set -u
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OUT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { echo "install failed"; tail "$OUT/install.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# The device gets a copy of the working tree whose .git may be stale: the commit comes from `.commit`, written on
# this side before the run (`git rev-parse --short HEAD > .commit`, carried like .whl), else from git.
{ cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null; } | tee "$OUT/commit.txt"
# int4-tiled against row-major: the dispatch A/B at 1 and 16 rows, then the decode command in both layouts
tiled_timings() {
  timeout 150 python3 bench/mma_sweep.py --sections tiled --budget 120 >"$OUT/tiled_sweep.log" 2>&1
  for lay in tiled row-major; do timeout 110 python3 bench/kernels.py --sections dense --m 1 16 --int4-layout $lay \
    --budget 80 >"$OUT/dense_$lay.log" 2>&1; done
}
# decode of an 8-layer Qwen3-8B with int4 stored tiled (auto), then row-major; the arguments go to bench/rollout.py
layout_decode() {
  for lay in auto row-major; do echo "== int4_layout $lay"; timeout 110 python3 bench/rollout.py --presets qwen3-8b \
    --override num_hidden_layers=8 --new-tokens 64 --prompt-len 512 --no-hf --int4-layout $lay "$@"; done
}
sections=${*:-tests rlstep default rollout}
for s in $sections; do
  start=$(date +%s)
  case $s in
    ktests)  timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_gemv_lora.py tests/kernels/test_gemv_mma.py \
               tests/kernels/test_gemv.py -p no:cacheprovider >"$OUT/ktests.log" 2>&1 ;;
    rtests)  timeout 200 python3 -m pytest -q -m gpu tests/rollout tests/kernels/test_gemv_lora.py -p no:cacheprovider \
               >"$OUT/rtests.log" 2>&1 ;;
    etests)  timeout 200 python3 -m pytest -q -m gpu tests/rollout tests/integration tests/kernels/test_sample.py \
               tests/kernels/test_gemv_lora.py -p no:cacheprovider >"$OUT/etests.log" 2>&1 ;;
    graphs)  for v in "--decode-steps 8 --one-graph-per-step" "--decode-steps 8" "--decode-steps 16"; do echo "== $v"
               timeout 100 python3 bench/rollout.py --presets qwen3-8b --override num_hidden_layers=8 --new-tokens 64 \
               --prompt-len 512 --batches 1 4 16 --no-hf $v; done >"$OUT/graphs.log" 2>&1 ;;
    tests)   timeout 280 python3 -m pytest -q -m gpu tests -n 4 -p no:cacheprovider >"$OUT/tests.log" 2>&1 ;;  # (serially: over 300 s)
    # (no --profile here: steps after a torch.profiler session ran ~8 % slower at batch 1; the trace section profiles)
    rollout) timeout 330 python3 bench/rollout.py --override num_hidden_layers=8 --new-tokens 64 --prompt-len 512 \
               --batches 1 16 64 256 --hf-max-batch 64 >"$OUT/rollout.log" 2>&1 ;;
    rlstep)  for det in "" --deterministic; do timeout 100 python3 bench/rl_step.py --shape qwen3-1.7b --prompts 8 \
               --gens 8 --new-tokens 256 --steps 4 $det; done >"$OUT/rl_step.log" 2>&1 ;;
    default) timeout 130 python3 -m orbit_lightning.cli model.device=cuda trainer.max_steps=200 trainer.eval_every=50 \
               trainer.output_dir="$OUT/default_run" >"$OUT/default.log" 2>&1 ;;
    kernels) timeout 200 python3 bench/kernels.py --sections dense,moe --budget 170 >"$OUT/kernels.log" 2>&1 ;;
    # the warpgroup-MMA int4 GEMM at M = 16-64 against bf16 and the tile kernel (bench/RESULTS.md, twelfth session)
    wgmma)   timeout 90 python3 bench/wgmma_sweep.py >"$OUT/wgmma.log" 2>&1 ;;
    # the model's MoE path per projection and as a whole MLP, then full RL steps of a MoE (the expert-chunk A/B)
    moe)     timeout 200 python3 bench/moe_paths.py --projections gate down gate_up --tokens 8192 16384 32768 --chunks 4 0 \
               --mlp >"$OUT/moe.log" 2>&1
             for c in 4 0; do timeout 170 python3 bench/rl_step.py --shape qwen3-30b-a3b --layers 4 --prompts 8 --gens 8 \
               --new-tokens 256 --steps 3 --expert-chunk $c; done >"$OUT/rl_step_moe.log" 2>&1 ;;
    timeline) timeout 120 python3 bench/gemv_timeline.py >"$OUT/timeline.log" 2>&1 ;;
    # Nsight Compute's counters of the decode kernels at 1, 8, 9 and 16 rows (bench/RESULTS.md, twenty-fifth session)
    ncu)     timeout 400 python3 bench/ncu_decode.py >"$OUT/ncu.log" 2>&1 ;;
    gaps)    for steps in 8 16; do timeout 100 python3 bench/rollout.py --presets qwen3-8b --override num_hidden_layers=8 \
               --new-tokens 64 --prompt-len 512 --batches 1 4 16 --no-hf --decode-steps $steps --profile 8; done \
               >"$OUT/gaps.log" 2>&1 ;;
    trigger) for t in 0 1; do echo "ORBIT_PDL_TRIGGER=$t"; ORBIT_PDL_TRIGGER=$t timeout 100 python3 bench/rollout.py \
               --presets qwen3-8b --override num_hidden_layers=8 --new-tokens 64 --prompt-len 512 --batches 1 4 16 \
               --no-hf --profile 8; done >"$OUT/trigger.log" 2>&1 ;;
    trace)   timeout 100 python3 bench/rollout.py --presets qwen3-8b --override num_hidden_layers=8 --new-tokens 64 \
               --prompt-len 512 --batches 1 16 --no-hf --profile 8 --trace /tmp/traces >"$OUT/trace.log" 2>&1
             for f in /tmp/traces/*.json; do echo "== $f"; python3 bench/trace_gaps.py "$f"; done >>"$OUT/trace.log" 2>&1 ;;
    lora)    timeout 100 python3 bench/gemv_sweep.py --sections lora >"$OUT/lora.log" 2>&1 ;;
    # int4-tiled (quant/formats/tiled.py) against row-major int4: its GPU cases, the dispatch A/B at 1 and 16 rows,
    # then the decode command in both layouts (~500 s: one call). tiledwide: 64-4096 rows and the MoE section.
    tiled)   timeout 120 python3 -m pytest -q -m gpu -k "tiled or TILED" tests/kernels tests/quant -n 4 -p no:cacheprovider \
               >"$OUT/tiled_tests.log" 2>&1
             tiled_timings ;;
    tiledbench) tiled_timings ;;  # the same timings without the tests (~370 s), for a short device budget
    # the mma GEMV on int4-tiled with its decode, then also its mmas, left out: what its loads alone allow (~150 s)
    probe)   for m in 1 16; do timeout 90 python3 bench/gemv_probe.py --m $m ship nodecode loadonly; done \
               >"$OUT/probe.log" 2>&1 ;;
    # is 16 rows held by every program reading the same activation lines of L2 at once? (xcopies, xstagger), and do
    # more weight bytes in flight a warp speed its loads at all? (--wide-tiles 2 with loadonly) (~150 s, 230 at most)
    hotspot) { echo "== one K tile a step (shipped)"; timeout 150 python3 bench/gemv_probe.py --m 16 ship xcopies \
               xstagger loadonly; echo "== --wide-tiles 2"; timeout 80 python3 bench/gemv_probe.py --m 16 --wide-tiles 2 \
               ship loadonly; } >"$OUT/hotspot.log" 2>&1 ;;
    tiledwide) for lay in tiled row-major; do timeout 140 python3 bench/kernels.py --sections dense,moe \
               --m 64 256 4096 --int4-layout $lay --budget 110 >"$OUT/wide_$lay.log" 2>&1; done ;;
    # model.int4_layout's end-to-end effect: decode of an 8-layer Qwen3-8B, int4 stored tiled (auto) and row-major
    layout)  layout_decode --batches 1 16 64 >"$OUT/layout.log" 2>&1 ;;
    # the same, profiled: where the step's time goes in each layout at 1 and 16 rows (the batch-16 tie, forty-first session)
    layoutprof) layout_decode --batches 1 16 --profile 8 >"$OUT/layoutprof.log" 2>&1 ;;
    # model.int4_layout's effect on a whole RL step (rollout, old log-probs, reference, train), int4 tiled / row-major
    rlstep_layout) for lay in auto row-major; do echo "== int4_layout $lay"; timeout 110 python3 bench/rl_step.py \
               --shape qwen3-1.7b --prompts 4 --gens 8 --new-tokens 256 --steps 3 --int4-layout $lay; done \
               >"$OUT/rl_step_layout.log" 2>&1 ;;
    host)    timeout 120 python3 bench/engine_host.py --batches 1 64 256 >"$OUT/host.log" 2>&1 ;;
    attnwarps) for w in 4 8; do timeout 100 python3 bench/rollout.py --presets qwen3-8b --override num_hidden_layers=8 \
               --new-tokens 64 --prompt-len 512 --batches 1 16 --no-hf --attn-warps $w --profile 8; done \
               >"$OUT/attnwarps.log" 2>&1 ;;
  esac
  echo "== $s: exit $? in $(( $(date +%s) - start ))s"
done
echo "== summaries"
grep -E "passed|failed|FAILED|Error" "$OUT/ktests.log" "$OUT/rtests.log" "$OUT/etests.log" 2>/dev/null | tail -8
grep -E "^== |^qwen" "$OUT/graphs.log" 2>/dev/null
grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" 2>/dev/null | tail -12
grep -E "^\[profile\] batch|^qwen|roof|HF|dlogprob" "$OUT/rollout.log" 2>/dev/null | tail -24
grep -A9 -E "^(deterministic )?qwen3" "$OUT/rl_step.log" 2>/dev/null | tail -20
grep -A9 -E "^== int4|^qwen3" "$OUT/rl_step_layout.log" 2>/dev/null | tail -30
grep -A6 "== summary" "$OUT/kernels.log" 2>/dev/null
grep -E "^[a-z_]+ \[E=|chunked|expert MLP" "$OUT/moe.log" 2>/dev/null
grep -A6 "^qwen3-30b" "$OUT/rl_step_moe.log" 2>/dev/null
grep -E "^case|lora|^qkv|^o |^gate|^down" "$OUT/timeline.log" 2>/dev/null
grep -E "^qwen|_attn_kernel|_merge_kernel" "$OUT/attnwarps.log" 2>/dev/null
grep -E "^qwen|per step: GPU busy|^\[profile\] batch" "$OUT/gaps.log" 2>/dev/null
grep -E "^== int4|^qwen|per step: GPU busy|^\[profile\] " "$OUT/layoutprof.log" 2>/dev/null | head -80
grep -E "^batch" "$OUT/host.log" 2>/dev/null
grep -E "^ORBIT|^qwen|per step: GPU busy|^\[profile\] batch" "$OUT/trigger.log" 2>/dev/null
grep -vE "^\s*$" "$OUT/lora.log" 2>/dev/null | tail -12
grep -E "passed|failed|FAILED|Error" "$OUT/tiled_tests.log" 2>/dev/null | tail -4
grep -hE "^== one|^== --wide|GEOMEAN|bitwise|FAILED" "$OUT/probe.log" "$OUT/hotspot.log" 2>/dev/null
grep -E "geomean" "$OUT/tiled_sweep.log" "$OUT"/dense_*.log "$OUT"/wide_*.log 2>/dev/null
sed -n '/^== \/tmp/,$p' "$OUT/trace.log" 2>/dev/null | head -60
grep -E '"eval/(accuracy|pass@)' "$OUT/default.log" 2>/dev/null | head -12
