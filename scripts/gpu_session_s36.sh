# Session 36's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model, and variants /
# bench_rows from gpu_session_more.sh).
#
#   bash scripts/gpu_session.sh s36          # ~6 min: the bulk-copy tiled products (LUCEBOX_BULK_COPIES=1): the GPU
#                                            #   tests of the tiled layout and the model paths that read it (S36_TESTS:
#                                            #   more); tiled_probe.py on the 27B's and 0.8B's shapes at batch 1 and 16;
#                                            #   27B and 0.8B tg128 without and with bulk copies (depth 4, 3, 6); the 27B
#                                            #   pp512 both ways; S36_PROFILE=1: the 27B step's kernels.  carry: .whl
#                                            #   (Call 1 ran it with bulk copies the default.)
#   bash scripts/gpu_session.sh s36-verify   # ~6 min: the bulk kernel's tests; row-major variants at 2-24 rows on
#                                            #   the 27B's shapes; verify passes with the table and with the probe's
#                                            #   fastest in each class (probe_tuned_table.py).          carry: .whl
#   bash scripts/gpu_session.sh s36-spec     # ~5 min: test_static_verify; matvec_probe.py invariance (row-major); the
#                                            #   27B forced chain with the table and with session 35's 16-row entries.
#   bash scripts/gpu_session.sh s36-lookup   # ~4 min: the one-kernel lookup of rows held tiled: the GPU tests of the
#                                            #   tiled layout, embeddings, recorded steps; tiled_probe.py at 16 and 24
#                                            #   rows on the 27B's shapes; 0.8B tg128 default / row-major twice over; 27B
#                                            #   tg128.                                               carry: .whl

s36() {
  ( synth 27b > "$RES/synth_27b.log" 2>&1; synth 0.8b > "$RES/synth_08b.log" 2>&1 ) &
  local writer=$! m
  step bulk-tests 300 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_tiled_gpu.py tests/test_tiled_weights.py ${S36_TESTS:-}
  step tiled-probe 200 python3 scripts/tiled_probe.py --batches 1,16 --shapes "${S36_SHAPES:-27b,0.8b}" \
    --json "$RES/tiled_probe.json"
  wait "$writer"; tail -qn1 "$RES"/synth_*.log
  m=$(model 27b)
  variants 27b "$m" "-p 0 -n 128 -r 3" default bulk:LUCEBOX_BULK_COPIES=1 \
    d3:LUCEBOX_BULK_COPIES=1,LUCEBOX_BULK_DEPTH=3 d6:LUCEBOX_BULK_COPIES=1,LUCEBOX_BULK_DEPTH=6 ${S36_MORE:-}
  variants 08b "$(model 0.8b)" "-p 0 -n 128 -r 3" default bulk:LUCEBOX_BULK_COPIES=1 rowmajor:LUCEBOX_TILED_WEIGHTS=0
  variants 27b-pp "$m" "-p 512 -n 0 -r 3" default bulk:LUCEBOX_BULK_COPIES=1
  [ -n "${S36_PROFILE:-}" ] && step profile-27b 120 python3 scripts/bench_vs_llamacpp.py profile "$m" --out "$RES"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s36_lookup() {
  ( synth 27b > "$RES/synth_27b.log" 2>&1; synth 0.8b > "$RES/synth_08b.log" 2>&1 ) &
  local writer=$!
  step lookup-tests 300 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_tiled_gpu.py tests/test_tiled_weights.py tests/test_cuda_embedding.py tests/test_decode_graph.py \
    ${S36_TESTS:-}
  step tiled-probe 150 python3 scripts/tiled_probe.py --batches 16,24 --shapes 27b --json "$RES/tiled_probe.json"
  wait "$writer"; tail -qn1 "$RES"/synth_*.log
  variants 08b "$(model 0.8b)" "-p 0 -n 128 -r 3" default rowmajor:LUCEBOX_TILED_WEIGHTS=0 default2 \
    rowmajor2:LUCEBOX_TILED_WEIGHTS=0
  variants 27b "$(model 27b)" "-p 0 -n 128 -r 3" default ${S36_MORE:-}
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s36_verify() {  # (call 3, before the retune was built in) the bulk tests; verify passes of 1, 8, 16, 23 nodes
  #               (verify_profile.py) with the table, with probe_tuned_table.py's choices, with the table again
  ( synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local writer=$! m
  step bulk-tests 200 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_tiled_gpu.py -k bulk
  wait "$writer"; tail -qn1 "$RES"/synth_*.log
  m=$(model 27b)
  step verify-probe 150 python3 scripts/tiled_probe.py --basic --batches 2,4,8,12,16,24 --shapes 27b \
    --json "$RES/verify_probe.json"
  local args="$m --nodes 1,8,16,23 --reps 10 --depth 512"
  step verify-table 150 sh -c "python3 scripts/verify_profile.py $args --json $RES/verify_table.json | grep 'nodes,'"
  step verify-tuned 150 sh -c "python3 scripts/probe_tuned_table.py $RES/verify_probe.json $RES/tuned_table.json && \
    LUCEBOX_MATVEC_TUNED=$RES/tuned_table.json python3 scripts/verify_profile.py $args \
    --json $RES/verify_tuned.json | grep 'nodes,'"
  step verify-table2 150 sh -c "python3 scripts/verify_profile.py $args --json $RES/verify_table2.json | grep 'nodes,'"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s36_spec() {  # ~5 min: the retuned table's checks and speculative rows: test_static_verify.py; matvec_probe.py
  #             invariance with every weight row-major (each batch's default against batch 1's, bit for bit); the
  #             27B forced 8.3 chain (16-node verify passes) with the table and with session 35's 16-row entries
  #             (LUCEBOX_MATVEC_TUNED), twice over.                                                  carry: .whl
  ( synth 27b > "$RES/synth_27b.log" 2>&1; python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$WORK/draft-27b.gguf" \
    "$(model 27b)" > "$RES/synth_draft.log" 2>&1 ) &
  local writer=$! m d old=$RES/table_s35.json
  python3 -c "import json, sys
shapes = ((5120, 17408), (10240, 5120), (12288, 5120), (34816, 5120))
rows = [['q4_k', 16, o, i, 'pipe_w4_d4_m2_k1'] for o, i in shapes] + [['q4_k', 2, 12288, 5120, 'mma_pp']]
json.dump({'tuned_table': rows}, open(sys.argv[1], 'w'))" "$old"
  step verify-tests 200 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_static_verify.py ${S36_TESTS:-}
  step invariance 150 sh -c "LUCEBOX_TILED_WEIGHTS=0 python3 scripts/matvec_probe.py invariance \
    --json $RES/invariance.json | grep -E ' default |invariance|False|e-'"
  wait "$writer"; tail -qn1 "$RES"/synth_*.log
  m=$(model 27b) d=$WORK/draft-27b.gguf
  local pass
  for pass in ${S36_PASSES:-table s35 table2 s352}; do
    step "chain-$pass" 90 bash -c "$( [ "${pass%2}" = s35 ] && echo "LUCEBOX_MATVEC_TUNED=$old") python3 -m \
      lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --spec-type chain --force-accept 8.3 --json \
      > $RES/chain_$pass.json; python3 -c \"import json,sys
for r in json.load(open(sys.argv[1])): print('chain-$pass', r['test'], round(r['tokens_per_s'], 1))\" $RES/chain_$pass.json"
  done
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}
