# Session 37's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model, and variants /
# bench_rows from gpu_session_more.sh; spec_detail from gpu_session_s31.sh).
#
#   bash scripts/gpu_session.sh s37          # ~9 min: given sums (LUCEBOX_GIVEN_SUMS): their GPU tests (bits against
#                                            #   the products computing their own sums and the batch-1 product);
#                                            #   tiled_probe.py at 12, 16, 24 rows on the 27B's shapes without and with;
#                                            #   the 27B's verify passes (1, 8, 16, 23 nodes) off / on / off; forced
#                                            #   DDTree 8.3 at budget 22 on / off.                        carry: .whl
#   bash scripts/gpu_session.sh s37-ncu      # ~5 min: the given-sums tests; Nsight on the 27B's Q4_K gate | up and
#                                            #   down at 1 and 24 rows, given sums off and on.            carry: .whl

s37() {
  ( synth 27b > "$RES/synth_27b.log" 2>&1; python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$WORK/draft-27b.gguf" \
    "$(model 27b)" > "$RES/synth_draft.log" 2>&1 ) &
  local writer=$! m d pass
  step given-tests 200 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_given_sums_gpu.py ${S37_TESTS:-}
  for pass in off on; do
    step "probe-$pass" 90 env LUCEBOX_GIVEN_SUMS=$([ $pass = on ] && echo 1 || echo 0) python3 scripts/tiled_probe.py \
      --basic --batches 12,16,24 --shapes 27b --json "$RES/probe_$pass.json"
  done
  wait "$writer"; tail -qn1 "$RES"/synth_*.log
  m=$(model 27b) d=$WORK/draft-27b.gguf
  for pass in off on off2; do
    step "verify-$pass" 100 sh -c "LUCEBOX_GIVEN_SUMS=$([ $pass = on ] && echo 1 || echo 0) python3 \
      scripts/verify_profile.py $m --nodes 1,8,16,23 --reps 10 --depth 512 --json $RES/verify_$pass.json \
      | grep 'nodes,'"
  done
  for pass in on off; do
    step "b22-$pass" 100 bash -c "LUCEBOX_GIVEN_SUMS=$([ $pass = on ] && echo 1 || echo 0) python3 -m \
      lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget 22 --force-accept 8.3 --json \
      | spec_detail b22-$pass"
  done
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s37_ncu() {  # ~6 min: the given-sums GPU tests; the probe at 12-24 rows off and on; Nsight Compute on the 27B's gate | up and down (Q4_K) products at batch
  #            1 and 24 rows (tiled_probe.py --ncu --basic: each kernel once), without and with given sums.  carry: .whl
  step given-tests 120 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_given_sums_gpu.py
  local pass
  for pass in 0 1; do
    step "probe-$pass" 60 env LUCEBOX_GIVEN_SUMS=$pass python3 scripts/tiled_probe.py --basic --batches 12,16,24 \
      --shapes 27b --json "$RES/probe_$pass.json"
  done
  command -v ncu >/dev/null || { echo "ncu not on the PATH"; return 1; }
  for pass in 0 1; do
    step "ncu-given-$pass" 150 sh -c "LUCEBOX_GIVEN_SUMS=$pass ncu --clock-control none --kernel-name regex:matvec \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
      --section Occupancy --section LaunchStats --section InstructionStats --section ComputeWorkloadAnalysis \
      python3 scripts/tiled_probe.py --ncu --basic --batches ${S37_NCU_BATCHES:-1,24} --shapes '27b gate,27b down q4_k' \
      > $RES/ncu_given_$pass.txt 2>&1; grep -E '  matvec_|Duration|DRAM Throughput|Compute \(SM\) Th|Issue Slots Busy|No Eligible|Achieved Occupancy|Registers Per|L1/TEX Hit|L2 Hit|Executed Instructions  |SM Busy|Executed Ipc A|Stall Long|Stall Short|Stall MIO|Stall Math|Stall Tex|Stall Wait|Stall LG' \
      $RES/ncu_given_$pass.txt | head -160"
  done
  cp "$RES"/ncu_given_*.txt "$OUT/" 2>/dev/null
  return 0
}
