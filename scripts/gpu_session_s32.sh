# Session 32's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model, spec_detail).
#
#   bash scripts/gpu_session.sh s32-verify   # ~9 min: where a verify pass's time goes on the 27B (1, 16, 23 nodes,
#                                            #   chain and tree: kernels by kind, scripts/verify_profile.py); the
#                                            #   recorded prefill's replays against eager pieces on the 0.8B (also at
#                                            #   depth 4096); the 27B drafter that accepts nothing with auto, its JSON
#                                            #   kept whole.                                       carry: .whl

synth_draft_bg() {  # target draft: the 27B's full-size DFlash drafter written in the background ($! is its job)
  ( python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[2], size='full', type='q4_k_m', seed=1, target=sys.argv[1])" "$1" "$2" \
    > "$RES/synth_draft.log" 2>&1 ) &
}

s32_verify() {
  step synth-27b 90 synth 27b
  local m d writer; m=$(model 27b); d=$WORK/draft-27b.gguf
  synth_draft_bg "$m" "$d"; writer=$!
  step verify-profile 150 python3 scripts/verify_profile.py "$m" --nodes 1,8,16,23,32 --depth 512 --reps 20 \
    --json "$RES/verify_profile_27b.json"
  wait "$writer"; tail -n1 "$RES/synth_draft.log"
  step auto-unforced 150 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 128 -r 3 --tree-budget auto \
    --json > $RES/auto_unforced.json; spec_detail auto-unforced < $RES/auto_unforced.json"
  step synth-08b 60 synth 0.8b
  step check-08b 150 python3 scripts/recorded_prefill_check.py "$(model 0.8b)" --ctx 8192 \
    --pieces 512,300,1024,1024,1024,1024,40,300 --timed 512,64 --json "$RES/recorded_check_08b.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s32_diag() {  # ~7 min: the verify profile on the 27B; one speculative step's parts at a forced 8.3
  #            (spec_step_profile.py: draft, tree, verify, walk, commit, the rest); which part of a recorded prefill
  #            piece changes its bits against an eager piece at depth (the 0.8B: a 1024-token piece from 0, and
  #            from 812 recorded and with the padded step run eagerly).                           carry: .whl
  step synth-27b 90 synth 27b
  local m d writer; m=$(model 27b); d=$WORK/draft-27b.gguf
  synth_draft_bg "$m" "$d"; writer=$!
  step verify-profile 150 python3 scripts/verify_profile.py "$m" --nodes 1,8,16,23,32 --depth 512 --reps 20 \
    --json "$RES/verify_profile_27b.json"
  wait "$writer"; tail -n1 "$RES/synth_draft.log"
  step spec-step-profile 170 python3 scripts/spec_step_profile.py "$m" "$d" --force-accept 8.3 -n 256 \
    --json "$RES/spec_step_27b.json"
  step synth-08b 60 synth 0.8b
  local p; p=$(model 0.8b)
  step check-1024 60 python3 scripts/recorded_prefill_check.py "$p" --pieces 1024 --timed 16 --reps 1 \
    --json "$RES/check_1024.json"
  step check-812-1024 60 python3 scripts/recorded_prefill_check.py "$p" --pieces 812,1024,40 --timed 16 --reps 1 \
    --json "$RES/check_812_1024.json"
  step check-812-1024-eager-step 60 python3 scripts/recorded_prefill_check.py "$p" --pieces 812,1024,40 --timed 16 \
    --reps 1 --eager-step --json "$RES/check_812_1024_eager_step.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s32_commit() {  # ~8 min: the recorded commit: its GPU test; the verify profile with PDL off (each kernel's own
  #              time); one speculative step's parts at a forced 8.3 with the recorded commit and with
  #              LUCEBOX_RECORDED_COMMIT=0; the 27B's speculative rows (budget 22 and auto forced, auto with a
  #              drafter that accepts nothing).                                                    carry: .whl
  step gpu-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_static_verify.py
  step synth-27b 90 synth 27b
  local m d writer; m=$(model 27b); d=$WORK/draft-27b.gguf
  synth_draft_bg "$m" "$d"; writer=$!
  step verify-profile-nopdl 120 env LUCEBOX_PDL=0 python3 scripts/verify_profile.py "$m" --nodes 1,16,23 \
    --depth 512 --reps 20 --json "$RES/verify_profile_27b_nopdl.json"
  wait "$writer"; tail -n1 "$RES/synth_draft.log"
  step spec-step-recorded 150 python3 scripts/spec_step_profile.py "$m" "$d" --force-accept 8.3 -n 256 \
    --json "$RES/spec_step_27b_recorded.json"
  step spec-step-eager 90 env LUCEBOX_RECORDED_COMMIT=0 python3 scripts/spec_step_profile.py "$m" "$d" \
    --force-accept 8.3 -n 256 --json "$RES/spec_step_27b_eager.json"
  step b22-forced 90 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget 22 \
    --force-accept 8.3 --json | spec_detail b22-forced"
  step auto-forced 90 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget auto \
    --force-accept 8.3 --json | spec_detail auto-forced"
  step auto-unforced 90 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 128 -r 3 --tree-budget auto \
    --json > $RES/auto_unforced.json; spec_detail auto-unforced < $RES/auto_unforced.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s32_check() {  # ~3 min: the recorded commit's GPU test (bit-equal to eager commits) with the module's CPU tests on a
  #             GPU machine, the recorded prefill's and the decode graph's GPU tests; the verify profile with PDL off
  #             and the weights' bytes (the products' GB/s).                                         carry: .whl
  step gpu-tests 200 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_static_verify.py tests/test_recorded_prefill.py tests/test_decode_graph.py
  step synth-27b 90 synth 27b
  step verify-profile-nopdl 120 env LUCEBOX_PDL=0 python3 scripts/verify_profile.py "$(model 27b)" --nodes 1,23 \
    --depth 512 --reps 20 --json "$RES/verify_profile_27b_nopdl.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}
