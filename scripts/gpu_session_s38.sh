# Session 38's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model; variants, llama_rows,
# llama_build_bg, llama_wait from gpu_session_more.sh; spec_detail from gpu_session_s31.sh).
#
#   bash scripts/gpu_session.sh s38-table    # ~6-8.5 min: #17's table in one call (both engines, the same files): the
#                                            #   27B's pp512 / pp4096 / tg128, forced DDTree 8.3 at budget 22 and
#                                            #   auto, a drafter that accepts nothing with auto, the 0.8B's pp512 /
#                                            #   tg128, the 27B's tg128 at depth 32768; llama-bench beside each; the
#                                            #   given-sums GPU tests while llama.cpp builds.    carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s38-profile  # ~1.5 min: the profiles #17's results ask for: the 27B's and the 0.8B's
#                                            #   decode step (kernel by kernel), the 27B's verify passes at 1, 16, 23
#                                            #   nodes, Nsight Compute on the 27B's batch-1 products (Q4_K gate | up,
#                                            #   Q4_K down, the Q6_K head), the copy bandwidth.              carry: .whl

# Session 38's call 1 ran these steps from a copy of s31_table with b22-forced at 120 s (now s31_table's too) and
# auto-forced at 90 s (s31_table: 120 s); 353 s on an H100.
s38_table() { TABLE_TESTS=tests/test_given_sums_gpu.py TABLE_TESTS_S=90 s31_table; }

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
