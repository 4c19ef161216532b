# Session 38's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model; variants, llama_rows,
# llama_build_bg, llama_wait from gpu_session_more.sh; spec_detail from gpu_session_s31.sh).
#
#   bash scripts/gpu_session.sh s38-table    # ~8.5 min: #17's table in one call (both engines, the same files): the
#                                            #   27B's pp512 / pp4096 / tg128, forced DDTree 8.3 at budget 22 and
#                                            #   auto, a drafter that accepts nothing with auto, the 0.8B's pp512 /
#                                            #   tg128, the 27B's tg128 at depth 32768; llama-bench beside each; the
#                                            #   given-sums GPU tests while llama.cpp builds.    carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s38-profile  # ~7 min: the profiles #17's results ask for: the 27B's and the 0.8B's
#                                            #   decode step (kernel by kernel), the 27B's verify passes at 1, 16, 23
#                                            #   nodes, Nsight Compute on the 27B's batch-1 products (Q4_K gate | up,
#                                            #   Q4_K down, the Q6_K head), the copy bandwidth.              carry: .whl

s38_table() {
  LLAMA_NICE=19 llama_build_bg
  step synth-08b 60 synth 0.8b
  step synth-27b 90 synth 27b
  local m d; m=$(model 27b); d=$WORK/draft-27b.gguf
  ( python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$d" "$m" \
    > "$RES/synth_draft.log" 2>&1 ) &
  local writer=$!
  step given-tests 90 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_given_sums_gpu.py
  variants 27b "$m" "-p 512,4096 -n 128 -r 3" default
  wait "$writer"; tail -n1 "$RES/synth_draft.log"
  # The first speculative run compiles the tree kernels: it gets the longest limit.
  step b22-forced 120 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget 22 \
    --force-accept 8.3 --json | spec_detail b22-forced"
  step auto-unforced 70 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 128 -r 2 --tree-budget auto \
    --json | spec_detail auto-unforced"
  step auto-forced 90 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget auto \
    --force-accept 8.3 --json | spec_detail auto-forced"
  llama_wait
  variants 08b "$(model 0.8b)" "-p 512 -n 128 -r 5" default
  llama_rows 08b -m "$(model 0.8b)" -p 512 -n 128 -r 5 && llama_rows 27b -m "$m" -p 512,4096 -n 128 -r 3
  variants 27b-d32k "$m" "-p 0 -n 128 -d 32768 -r 2" default
  llama_rows 27b-d32k -m "$m" -p 0 -n 128 -d 32768 -r 2
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s38_profile() {
  step synth-27b 90 synth 27b
  step synth-08b 60 synth 0.8b
  step copy 60 python3 -c "import sys; sys.path.insert(0, 'scripts'); import bench_vs_llamacpp as b
print('copy GB/s', round(b.copy_bandwidth_gb_s(), 1))"
  # PDL off for the step profiles: with it on, each kernel's time includes its wait for the one ahead.
  step profile-27b 100 env LUCEBOX_PDL=0 python3 scripts/bench_vs_llamacpp.py profile "$(model 27b)" --out "$RES"
  step profile-08b 60 env LUCEBOX_PDL=0 python3 scripts/bench_vs_llamacpp.py profile "$(model 0.8b)" --out "$RES"
  step verify-27b 100 sh -c "python3 scripts/verify_profile.py $(model 27b) --nodes 1,16,23 --reps 10 --depth 512 \
    --json $RES/verify_27b.json | grep 'nodes,'"
  command -v ncu >/dev/null || { echo "ncu not on the PATH"; cp "$RES"/*.json "$OUT/" 2>/dev/null; return 1; }
  step ncu-batch1 150 sh -c "ncu --clock-control none --kernel-name regex:matvec \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --section Occupancy --section LaunchStats --section InstructionStats \
    python3 scripts/tiled_probe.py --ncu --basic --batches 1 --shapes '27b gate,27b down q4_k,27b head' \
    > $RES/ncu_batch1.txt 2>&1; grep -E '  matvec_|Duration|DRAM Throughput|Compute \(SM\) Th|Issue Slots Busy|No Eligible|Achieved Occupancy|Registers Per|L2 Hit|Executed Instructions  |Stall Long|Stall Short|Stall MIO|Stall Wait|Stall LG' \
    $RES/ncu_batch1.txt | head -120"
  cp "$RES"/*.json "$RES"/ncu_batch1.txt "$OUT/" 2>/dev/null
  return 0
}
