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

s36_verify() {  # the bulk kernel's GPU tests (its refill after the math); verify passes of 1, 8, 16, 23 nodes
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
  step verify-table 150 sh -c "python3 scripts/verify_profile.py $args --json $RES/verify_table1.json | grep 'nodes,'"
  step verify-tuned 150 sh -c "python3 scripts/probe_tuned_table.py $RES/verify_probe.json $RES/verify_table.json && \
    LUCEBOX_MATVEC_TUNED=$RES/verify_table.json python3 scripts/verify_profile.py $args \
    --json $RES/verify_tuned.json | grep 'nodes,'"
  step verify-table2 150 sh -c "python3 scripts/verify_profile.py $args --json $RES/verify_table2.json | grep 'nodes,'"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}
