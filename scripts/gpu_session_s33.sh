# Session 33's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model, spec_detail, and
# synth_draft_bg from gpu_session_s32.sh).
#
#   bash scripts/gpu_session.sh s33-replay   # ~9 min: LUCEBOX_GDN_REPLAY (a verify pass keeps its recurrent steps'
#                                            #   inputs, the commit replays the path): its GPU tests (bit-equal to
#                                            #   kept node states, with recorded commits), then on the 27B the verify
#                                            #   profile (PDL off, 1 and 23 nodes) and one speculative step's parts
#                                            #   at a forced 8.3, each with the switch off and on (and on with
#                                            #   LUCEBOX_RECORDED_DRAFT_SYNC=1, the drafter's sync recorded); the
#                                            #   forced budget-22 and auto rows and auto with a drafter that accepts
#                                            #   nothing, replay on.
#                                            #   carry: .whl

# One speculative step's parts on target $1 with drafter $2 at a forced 8.3: the replay off and on (the recorded
# sync off, as these modes were written before it became the default), then both on.
spec_step_replays() {
  local switch
  for switch in 0 1; do
    step "spec-step-replay$switch" 150 env LUCEBOX_GDN_REPLAY=$switch LUCEBOX_RECORDED_DRAFT_SYNC=0 python3 \
      scripts/spec_step_profile.py "$1" "$2" --force-accept 8.3 -n 256 --json "$RES/spec_step_replay$switch.json"
  done
  step spec-step-replay-sync 120 env LUCEBOX_GDN_REPLAY=1 LUCEBOX_RECORDED_DRAFT_SYNC=1 python3 \
    scripts/spec_step_profile.py "$1" "$2" --force-accept 8.3 -n 256 --json "$RES/spec_step_replay_sync.json"
}

s33_replay() {
  step gpu-tests 200 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_gdn_replay.py tests/test_static_verify.py \
    tests/test_speculative.py::test_recorded_context_sync_projects_as_the_eager_one
  step synth-27b 90 synth 27b
  local m d writer switch; m=$(model 27b); d=$WORK/draft-27b.gguf
  synth_draft_bg "$m" "$d"; writer=$!
  for switch in 0 1; do
    step "verify-profile-replay$switch" 100 env LUCEBOX_PDL=0 LUCEBOX_GDN_REPLAY=$switch python3 \
      scripts/verify_profile.py "$m" --nodes 1,23 --depth 512 --reps 20 --json "$RES/verify_profile_replay$switch.json"
  done
  wait "$writer"; tail -n1 "$RES/synth_draft.log"
  spec_step_replays "$m" "$d"
  step b22-forced-replay 90 bash -c "LUCEBOX_GDN_REPLAY=1 python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 \
    -r 2 --tree-budget 22 --force-accept 8.3 --json | spec_detail b22-forced-replay"
  step auto-forced-replay 90 bash -c "LUCEBOX_GDN_REPLAY=1 python3 -m lucebox_core.cli bench -m $m -md $d -p 0 \
    -n 256 -r 2 --tree-budget auto --force-accept 8.3 --json | spec_detail auto-forced-replay"
  step auto-unforced-replay 90 bash -c "LUCEBOX_GDN_REPLAY=1 python3 -m lucebox_core.cli bench -m $m -md $d -p 0 \
    -n 128 -r 3 --tree-budget auto --json > $RES/auto_unforced_replay.json; \
    spec_detail auto-unforced-replay < $RES/auto_unforced_replay.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}
