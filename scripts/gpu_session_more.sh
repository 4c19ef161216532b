# Modes of scripts/gpu_session.sh kept apart (that file is near the 800-line limit). Sourced by it: every
# function here named after a mode (dashes as underscores) runs as `bash scripts/gpu_session.sh MODE`, with
# its helpers (step, sparkmodel, llama_build_bg, llama_wait, LB, RES, OUT, SPARK_SKEW).
#
#   bash scripts/gpu_session.sh s21-fusion  # ~9 min: session 21's decode-step kernels (one-launch MoE router,
#                                           #   softplus gate in the attention merge, one key block a split with
#                                           #   the chunked merge, PDL): their GPU tests (PDL changes no bit) and
#                                           #   the family tests on CUDA, then Laguna-XS.2 pp512/tg128 all on the
#                                           #   GPU: the default, PDL on, one key block a split, the two-launch
#                                           #   router (the A/B); step profiles without and with PDL; llama-bench beside (built
#                                           #   meanwhile). ARCHS adds e.g. qwen35moe:35b-a3b.  carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s21-depth   # ~9 min: determinism (decode == verify) on the 0.8B; tg128 of the
#                                           #   0.8B and 27B Q4_K_M with PDL off and on (LUCEBOX_PDL); the path
#                                           #   attention's partition on the 27B (#17's depth row): tg64 at depth
#                                           #   0 / 32768 with one block a split (LUCEBOX_PATH_BLOCKS_PER_SPLIT=1)
#                                           #   against the default four.                          carry: .whl
#   bash scripts/gpu_session.sh s22-moe     # ~8 min: session 22's defaults (PDL in recorded steps, the narrow-head
#                                           #   partition): the fused-decode GPU tests, then Laguna-XS.2 and the
#                                           #   35B-A3B pp512/tg128: default, LUCEBOX_PDL=0, LUCEBOX_PATH_NARROW_SPLITS=0
#                                           #   (session 21's partition); a step profile each; llama-bench beside.
#                                           #                                          carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s22-dense   # ~8 min: determinism on the 0.8B; 0.8B and 27B tg128 default and
#                                           #   LUCEBOX_PDL=0; 27B tg64 at depth 32768, default and NARROW_SPLITS=0;
#                                           #   llama-bench 27B tg128 and tg64 at depth 32768 beside. carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s22-min     # ~3 min: the least that checks session 22's defaults on the GPU: PDL in
#                                           #   recorded steps changes no bit (and the steps were recorded), decode
#                                           #   equals a verified node, the router; Laguna-XS.2 tg128 default / PDL=0.
#                                                                                      carry: .whl
#   bash scripts/gpu_session.sh s22-all     # ~9 min: the most of s22-moe and s22-dense one call holds, in order of
#                                           #   need (a short device budget): the fused-decode GPU tests; Laguna-XS.2
#                                           #   default / LUCEBOX_PDL=0 / NARROW_SPLITS=0 and its profile; the 35B-A3B
#                                           #   default / PDL=0; llama-bench on both; 27B tg128 both engines.
#                                           #                                          carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s23-router  # ~8 min: the one-launch router's top-k back to k passes: its time a launch
#                                           #   per launch shape (scripts/router_probe.py), its GPU tests, Laguna-XS.2
#                                           #   and 35B-A3B pp512/tg128 default / the probe's best / the old shape, a profile,
#                                           #   llama-bench beside; Spark's paged-step GPU tests. carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s23-confirm # ~6 min: the router's measured defaults: fused-decode GPU tests, Laguna and
#                                           #   35B-A3B tg128, 27B tg64 at depth 32K narrow / wide, llama-bench beside.
#   bash scripts/gpu_session.sh s23-profile35  # ~3 min: the 35B-A3B's step profile (no PDL) at the router's new shape.
#                                           #                                                     carry: .whl
#   bash scripts/gpu_session.sh s24-ffn     # ~8 min: session 24's persistent kernels (MLP, MoE block) and MoE SwiGLU-down
#                                           #   kind: GPU tests, their time against the kernels they replace
#                                           #   (scripts/persistent_probe.py), 0.8B and 27B tg128 with the MLP's off / on,
#                                           #   a 0.8B profile with it, llama-bench beside.     carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s25-all     # ~9.5 min: every persistent switch's GPU tests and tg128 A/B in one call
#                                           #   (0.8B, Laguna-XS.2, 27B), the probe, a 0.8B profile. carry: .whl
#   bash scripts/gpu_session.sh s26-dense   # ~9.5 min: the MLP's, Gated DeltaNet's and attention's persistent kernels:
#                                           #   GPU tests, 0.8B tg128 default / each / all, 27B default / all, the probe,
#                                           #   a 0.8B profile with all, llama-bench beside.  carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s26-check   # ~4 min: the persistent attention's GPU tests, the phase tests, 0.8B and 27B
#                                           #   step profiles default / with the three dense persistent kernels. carry: .whl
#   bash scripts/gpu_session.sh s26-swiglu  # ~5 min: LUCEBOX_MOE_SWIGLU_DOWN on Laguna-XS.2: verify == decode with it on
#                                           #   and off, tg128 default / on twice each.            carry: .whl
#   bash scripts/gpu_session.sh s26-profile-moe  # ~3.5 min: Laguna-XS.2 and 35B-A3B step profiles (defaults). carry: .whl
#   bash scripts/gpu_session.sh s26-probe   # ~1.5 min: persistent_probe.py alone (incl. the MLP's 32-row tiles). carry: .whl
#   bash scripts/gpu_session.sh s27-tiled   # ~3 min: tiled_probe.py (the tiled-layout matvec against the row-major
#                                           #   kernels on the 27B / 0.8B shapes), then persistent_probe.py. carry: .whl
#   bash scripts/gpu_session.sh s27-check   # ~8 min: Q6_K weights held tiled: GPU tests (tiled + model paths), verify ==
#                                           #   decode on the 0.8B, 0.8B and 27B tg128 tiled / LUCEBOX_TILED_WEIGHTS=0, a
#                                           #   27B step profile, llama-bench beside.            carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s27-tests   # ~7 min: the tiled kernel's GPU tests, then the model paths' (decode graph,
#                                           #   fused decode, embedding, speculative) with Q6_K weights tiled. carry: .whl
#   bash scripts/gpu_session.sh s28-ab      # ~9 min: the kernels of this tree against older ones (AB_OLD, default ab_old/:
#                                           #   headers copied over the installed package's): tiled GPU tests, the
#                                           #   tiled probe, 27B / 0.8B tg128 with each; the 27B pp4096 tiled
#                                           #   and row-major.                                    carry: .whl (+ ab_old)
#   bash scripts/gpu_session.sh s28-ncu     # ~4 min: Nsight Compute, 27B Q4_K gate|up / down and head, `mma` against the
#                                           #   tiled kernel at batch 1.                          carry: .whl
#   bash scripts/gpu_session.sh s28-min     # ~3 min: tiled GPU tests, tiled probe new (b1, b16) and old (b1). carry: .whl
#   bash scripts/gpu_session.sh s28-all     # ~8 min: s28-ab's kernel and 27B rows, s28-ncu, then s28-ab's other rows.
#                                           #   carry: .whl
#   bash scripts/gpu_session.sh s29-prefill # ~5 min: where the 0.8B's pp512 and the 27B's pp4096 go (prefill_profile.py:
#                                           #   wall against GPU busy, kernels, host ops), 27B tiled and row-major. carry: .whl
#   bash scripts/gpu_session.sh s29-a       # ~8 min: s28-min, then s29-prefill (with ab_old's kernels: main's). carry: .whl
#   bash scripts/gpu_session.sh s29-b       # ~9 min: tiled GPU tests; the tiled probe with this tree's kernels (b1, b16,
#                                           #   every candidate), then --basic at b1 with ab_patch/'s and ab_old/'s files
#                                           #   copied over (bits compare through mma_sha1); then s29-prefill. carry: .whl
#   bash scripts/gpu_session.sh s30-table   # ~8.5 min: Nsight on the 27B's Q4_K products, the prefill profiles, 27B /
#                                           #   0.8B tg128 with llama-bench beside, step profiles. carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s30-host    # ~3 min: prefill_profile.py --python --stacks on the 0.8B's pp512 and the
#                                           #   27B's pp4096: the host's functions, the call sites of device-heavy ops.
#   bash scripts/gpu_session.sh s30-prefill # ~6 min: tiled GPU tests, prefill profiles with call sites, 0.8B pp512 and
#                                           #   27B pp4096 (tiled / row-major), llama-bench beside. carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s30-final   # ~6.5 min: the whole-model check, 27B pp4096/tg128 and forced / unforced
#                                           #   DDTree while llama.cpp builds, then 0.8B pp512/tg128, llama-bench on
#                                           #   both, a 0.8B prefill cProfile.               carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s24-moe     # ~8 min: Laguna-XS.2 and 35B-A3B tg128 default / persistent MoE / SwiGLU-down
#                                           #   / all, a Laguna profile with all, llama-bench beside. carry: .whl .llamacpp

# tok/s of `lucebox bench` rows (its --json) for the A/B table.
bench_rows() { python3 -c "import json,sys
for row in json.load(open(sys.argv[1])):
    print(sys.argv[2], row['test'], round(row['tokens_per_s'], 1), '+-', round(row.get('tokens_per_s_stddev', 0), 1))" \
  "$@" || cat "$1"; }

s21_fusion() {
  LLAMA_NICE=19 llama_build_bg
  step gpu-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_fused_decode_gpu.py tests/test_laguna_cuda.py tests/test_qwen35moe_cuda.py
  local pair arch size m variant
  for pair in laguna:xs2 ${ARCHS:-}; do
    arch=${pair%%:*} size=${pair#*:} m=$(sparkmodel "$arch" "$size" "$SPARK_SKEW")
    step "synth-$arch" 120 sh -c "[ -s $m ] || python3 -m lucebox_core.cli synth --arch $arch --size $size \
      --type q4_k_m --router-skew $SPARK_SKEW -o $m"
    # The default; PDL on (off by default until measured); one key block a split (4 by default); the router in
    # two launches (session 20's); PDL with one block a split.
    for variant in default pdl:LUCEBOX_PDL=1 split1:LUCEBOX_PATH_BLOCKS_PER_SPLIT=1 router2:LUCEBOX_FUSED_ROUTER=0 \
        pdl-split1:LUCEBOX_PDL=1,LUCEBOX_PATH_BLOCKS_PER_SPLIT=1; do
      local name=${variant%%:*} envs=""
      [ "$variant" != "$name" ] && envs=${variant#*:} && envs=${envs//,/ }
      step "tg-$arch-$name" 60 sh -c "env $envs python3 -m lucebox_core.cli bench -m $m -p 512 -n 128 -r 3 --json \
        > $RES/tg_${arch}_$name.json" && bench_rows "$RES/tg_${arch}_$name.json" "$arch-$name"
    done
    step "profile-$arch" 90 python3 scripts/bench_vs_llamacpp.py profile "$m" --out "$RES"
    mkdir -p "$RES/pdl" && step "profile-$arch-pdl" 90 env LUCEBOX_PDL=1 python3 scripts/bench_vs_llamacpp.py \
      profile "$m" --out "$RES/pdl"
  done
  for pair in laguna:xs2 ${ARCHS:-}; do
    arch=${pair%%:*} m=$(sparkmodel "$arch" "${pair#*:}" "$SPARK_SKEW")
    llama_wait && step "llama-$arch" 60 sh -c "$LB -m $m -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o json \
      > $RES/llama_tg_$arch.json; python3 -c 'import json,sys
for r in json.load(open(sys.argv[1])): print(\"llama\", r[\"n_prompt\"], r[\"n_gen\"], round(r[\"avg_ts\"], 1))' \
      $RES/llama_tg_$arch.json"
  done
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s21_depth() {
  step determinism-08b 150 bash -c "synth 0.8b && python3 scripts/verify_determinism.py $(model 0.8b) \
    --json $RES/determinism_08b.json"
  step synth-27b 200 synth 27b
  local variant depth
  for switch in 0 1; do  # PDL on the dense models: the 0.8B (launch-bound) and the 27B, tg128
    for size in 0.8b 27b; do
      step "tg-$size-pdl$switch" 60 bash -c "synth $size && LUCEBOX_PDL=$switch python3 -m lucebox_core.cli bench \
        -m $(model $size) -p 0 -n 128 -r 3 --json > $RES/tg_${size}_pdl$switch.json" \
        && bench_rows "$RES/tg_${size}_pdl$switch.json" "$size-pdl$switch"
    done
  done
  for variant in 1 4; do
    for depth in 0 32768; do
      step "tg-27b-split$variant-d$depth" 90 sh -c "LUCEBOX_PATH_BLOCKS_PER_SPLIT=$variant python3 -m \
        lucebox_core.cli bench -m $(model 27b) -p 0 -n 64 -d $depth -r 2 --json > $RES/tg27_split${variant}_d$depth.json" \
        && bench_rows "$RES/tg27_split${variant}_d$depth.json" "27b-split$variant-d$depth"
    done
  done
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

variants() {  # tag model bench-args variant...: `lucebox bench` per variant (name or name:ENV=V,ENV=V), tok/s rows
  local tag=$1 m=$2 args=$3 variant name envs; shift 3
  for variant in "$@"; do
    name=${variant%%:*} envs=""
    [ "$variant" != "$name" ] && envs=${variant#*:} && envs=${envs//,/ }
    step "bench-$tag-$name" 90 sh -c "env $envs python3 -m lucebox_core.cli bench -m $m $args --json \
      > $RES/bench_${tag}_$name.json" && bench_rows "$RES/bench_${tag}_$name.json" "$tag-$name"
  done
}
llama_rows() {  # tag llama-bench-args...: llama-bench's rows as "llama TAG n_prompt n_gen depth tok/s"
  local tag=$1; shift
  step "llama-$tag" 90 sh -c "$LB $* -ngl 99 -fa 1 -o json > $RES/llama_$tag.json; python3 -c 'import json,sys
for r in json.load(open(sys.argv[1])): print(\"llama\", sys.argv[2], r[\"n_prompt\"], r[\"n_gen\"], r.get(\"n_depth\", 0),
    round(r[\"avg_ts\"], 1))' $RES/llama_$tag.json $tag"
}

moe_files() {  # laguna-file 35b-file: the skewed Laguna-XS.2 and 35B-A3B files, written where missing (host-bound:
  #             modes start it in the background while GPU tests run), logs in $RES/synth_*.log
  [ -s "$1" ] || python3 -m lucebox_core.cli synth --arch laguna --size xs2 --type q4_k_m \
    --router-skew "$SPARK_SKEW" -o "$1" > "$RES/synth_laguna.log" 2>&1
  [ -s "$2" ] || python3 -m lucebox_core.cli synth --arch qwen35moe --size 35b-a3b --type q4_k_m \
    --router-skew "$SPARK_SKEW" -o "$2" > "$RES/synth_35b.log" 2>&1
}

s22_moe() {
  LLAMA_NICE=19 llama_build_bg
  local big; big=$(sparkmodel qwen35moe 35b-a3b "$SPARK_SKEW")
  # The 35B's file is written meanwhile (its synth is host-bound; the tests mostly wait on the GPU).
  ( [ -s "$big" ] || python3 -m lucebox_core.cli synth --arch qwen35moe --size 35b-a3b --type q4_k_m \
      --router-skew "$SPARK_SKEW" -o "$big" > "$RES/synth_35b.log" 2>&1 ) &
  local writer=$!
  step gpu-tests 170 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_fused_decode_gpu.py
  local pair arch m
  for pair in laguna:xs2 qwen35moe:35b-a3b; do
    arch=${pair%%:*} m=$(sparkmodel "$arch" "${pair#*:}" "$SPARK_SKEW")
    if [ "$arch" = qwen35moe ]; then echo "[$SECONDS s] waiting for the 35B's file"; wait "$writer"; tail -1 "$RES/synth_35b.log"
    else step "synth-$arch" 120 sh -c "[ -s $m ] || python3 -m lucebox_core.cli synth --arch $arch --size ${pair#*:} \
      --type q4_k_m --router-skew $SPARK_SKEW -o $m"; fi
    variants "$arch" "$m" "-p 512 -n 128 -r 3" default nopdl:LUCEBOX_PDL=0 wide:LUCEBOX_PATH_NARROW_SPLITS=0
    # Without PDL: its overlapping kernels make every kernel's own time read long.
    mkdir -p "$RES/$arch" && step "profile-$arch" 90 env LUCEBOX_PDL=0 python3 scripts/bench_vs_llamacpp.py profile "$m" \
      --out "$RES/$arch"
  done
  for pair in laguna:xs2 qwen35moe:35b-a3b; do
    llama_wait && llama_rows "${pair%%:*}" -m "$(sparkmodel "${pair%%:*}" "${pair#*:}" "$SPARK_SKEW")" -p 512 -n 128 -r 3
  done
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s22_dense() {
  LLAMA_NICE=19 llama_build_bg
  ( synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local writer=$!
  step attention-check 90 python3 -m lucebox_cuda.triton_attention  # the path kernel's new partition vs the oracle
  step determinism-08b 150 bash -c "synth 0.8b && python3 scripts/verify_determinism.py $(model 0.8b) \
    --json $RES/determinism_08b.json"
  variants 08b "$(model 0.8b)" "-p 0 -n 128 -r 3" default nopdl:LUCEBOX_PDL=0
  echo "[$SECONDS s] waiting for the 27B's file"; wait "$writer"; tail -1 "$RES/synth_27b.log"
  variants 27b "$(model 27b)" "-p 0 -n 128 -r 3" default nopdl:LUCEBOX_PDL=0
  variants 27b-d32k "$(model 27b)" "-p 0 -n 64 -d 32768 -r 2" default wide:LUCEBOX_PATH_NARROW_SPLITS=0
  llama_wait && llama_rows 27b -m "$(model 27b)" -p 0 -n 128 -r 3 && llama_rows 27b-d32k -m "$(model 27b)" -p 0 -n 64 -d 32768 -r 2
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s22_all() {
  LLAMA_NICE=19 llama_build_bg
  local laguna big; laguna=$(sparkmodel laguna xs2 "$SPARK_SKEW") big=$(sparkmodel qwen35moe 35b-a3b "$SPARK_SKEW")
  # The three files written meanwhile (host-bound; the tests mostly wait on the GPU).
  moe_files "$laguna" "$big" &
  local moe_writer=$!
  ( synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local dense_writer=$!
  step gpu-tests 120 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_fused_decode_gpu.py
  echo "[$SECONDS s] waiting for the MoE files"; wait "$moe_writer"; tail -qn1 "$RES"/synth_*.log
  variants laguna "$laguna" "-p 512 -n 128 -r 3" default nopdl:LUCEBOX_PDL=0 wide:LUCEBOX_PATH_NARROW_SPLITS=0
  mkdir -p "$RES/laguna" && step profile-laguna 60 env LUCEBOX_PDL=0 python3 scripts/bench_vs_llamacpp.py profile \
    "$laguna" --out "$RES/laguna"
  variants qwen35moe "$big" "-p 512 -n 128 -r 3" default nopdl:LUCEBOX_PDL=0
  llama_wait && llama_rows laguna -m "$laguna" -p 512 -n 128 -r 3 && llama_rows qwen35moe -m "$big" -p 512 -n 128 -r 3
  echo "[$SECONDS s] waiting for the 27B's file"; wait "$dense_writer"; tail -1 "$RES/synth_27b.log"
  variants 27b "$(model 27b)" "-p 0 -n 128 -r 3" default nopdl:LUCEBOX_PDL=0
  llama_rows 27b -m "$(model 27b)" -p 0 -n 128 -r 3
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s22_min() {
  local laguna; laguna=$(sparkmodel laguna xs2 "$SPARK_SKEW")
  ( [ -s "$laguna" ] || python3 -m lucebox_core.cli synth --arch laguna --size xs2 --type q4_k_m \
      --router-skew "$SPARK_SKEW" -o "$laguna" > "$RES/synth_laguna.log" 2>&1 ) &
  local writer=$!
  step gpu-tests 100 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_fused_decode_gpu.py -k "programmatic or past_one_merge or routes_as"
  wait "$writer"; tail -1 "$RES/synth_laguna.log"
  variants laguna "$laguna" "-p 512 -n 128 -r 3" default nopdl:LUCEBOX_PDL=0
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

best_variant() {  # tag: the variant name with the highest tg128 among bench_TAG_*.json
  python3 -c "import glob,json,sys
rates = {}
for path in glob.glob(sys.argv[1] + '/bench_' + sys.argv[2] + '_*.json'):
    rates.update({path.rsplit('_', 1)[1][:-5]: r['tokens_per_s'] for r in json.load(open(path)) if r['test'] == 'tg128'})
print(max(rates, key=rates.get) if rates else 'default')" "$RES" "$1"
}

s23_router() {
  LLAMA_NICE=19 llama_build_bg
  local laguna big best
  laguna=$(sparkmodel laguna xs2 "$SPARK_SKEW") big=$(sparkmodel qwen35moe 35b-a3b "$SPARK_SKEW")
  moe_files "$laguna" "$big" &
  local moe_writer=$!
  step router-probe 100 sh -c "python3 scripts/router_probe.py --warps 1 2 4 --json $RES/router_probe.json | tee $RES/router_probe.txt"
  local probed; probed=$(sed -n 's/^best: //p' "$RES/router_probe.txt"); probed=${probed:-LUCEBOX_ROUTER_WARPS=4}
  step gpu-tests 90 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=3 \
    tests/test_fused_decode_gpu.py -k "routes_as or one_launch"
  echo "[$SECONDS s] waiting for the MoE files"; wait "$moe_writer"; tail -qn1 "$RES"/synth_*.log
  # Since 2c465a5 the default is 1 warp, 2 rows; "old" is the shape before it.
  variants laguna "$laguna" "-p 512 -n 128 -r 3" default "probed:$probed" \
    old:LUCEBOX_ROUTER_WARPS=4,LUCEBOX_ROUTER_EXPERTS_PER_PROGRAM=4 w2:LUCEBOX_ROUTER_WARPS=2
  best=$(best_variant laguna); echo "best laguna variant: $best (probed: $probed)"
  local envs=""; case $best in probed) envs=${probed//,/ } ;; w*) envs=LUCEBOX_ROUTER_WARPS=${best#w} ;;
    old) envs="LUCEBOX_ROUTER_WARPS=4 LUCEBOX_ROUTER_EXPERTS_PER_PROGRAM=4" ;; esac
  mkdir -p "$RES/laguna" && step profile-laguna 60 env LUCEBOX_PDL=0 $envs \
    python3 scripts/bench_vs_llamacpp.py profile "$laguna" --out "$RES/laguna"
  variants qwen35moe "$big" "-p 512 -n 128 -r 3" default "probed:$probed" \
    old:LUCEBOX_ROUTER_WARPS=4,LUCEBOX_ROUTER_EXPERTS_PER_PROGRAM=4
  llama_wait && llama_rows laguna -m "$laguna" -p 512 -n 128 -r 3 && llama_rows qwen35moe -m "$big" -p 512 -n 128 -r 3
  step spark-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_spark_graphed.py -k gpu
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s23_confirm() {  # ~6 min: session 23's router defaults (1 warp, 2 rows a program) on the GPU: the fused-decode GPU
  #               tests, Laguna-XS.2 and 35B-A3B pp512/tg128, the 27B tg64 at depth 32768 default and with
  #               NARROW_SPLITS=0, llama-bench beside each (built meanwhile). carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  local laguna big
  laguna=$(sparkmodel laguna xs2 "$SPARK_SKEW") big=$(sparkmodel qwen35moe 35b-a3b "$SPARK_SKEW")
  moe_files "$laguna" "$big" &
  local moe_writer=$!
  ( synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local dense_writer=$!
  step gpu-tests 110 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=3 \
    tests/test_fused_decode_gpu.py
  wait "$moe_writer"; tail -qn1 "$RES"/synth_*.log
  variants laguna "$laguna" "-p 512 -n 128 -r 3" default
  variants qwen35moe "$big" "-p 512 -n 128 -r 3" default
  wait "$dense_writer"; tail -1 "$RES/synth_27b.log"
  variants 27b-d32k "$(model 27b)" "-p 0 -n 64 -d 32768 -r 2" default wide:LUCEBOX_PATH_NARROW_SPLITS=0
  llama_wait && llama_rows laguna -m "$laguna" -p 512 -n 128 -r 3 && llama_rows qwen35moe -m "$big" -p 512 -n 128 -r 3 \
    && llama_rows 27b-d32k -m "$(model 27b)" -p 0 -n 64 -d 32768 -r 2
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s23_profile35() {  # ~3 min: the 35B-A3B's decode step profile without PDL (its kernels one by one) at the router's
  #                 session-23 launch shape.                                                      carry: .whl
  local big; big=$(sparkmodel qwen35moe 35b-a3b "$SPARK_SKEW")
  step synth-35b 100 sh -c "[ -s $big ] || python3 -m lucebox_core.cli synth --arch qwen35moe --size 35b-a3b \
    --type q4_k_m --router-skew $SPARK_SKEW -o $big"
  mkdir -p "$RES/qwen35moe" && step profile-qwen35moe 60 env LUCEBOX_PDL=0 python3 scripts/bench_vs_llamacpp.py \
    profile "$big" --out "$RES/qwen35moe"
  cp "$RES"/qwen35moe/*.json "$OUT/" 2>/dev/null
  return 0
}

s24_ffn() {  # ~9 min: session 24's persistent kernels (off by default) and session 25's Gated DeltaNet one: their GPU
  #           tests (the MLP's, the MoE block's, the MoE SwiGLU-down kind's, the mixer's), 0.8B tg128 with
  #           LUCEBOX_PERSISTENT_FFN / _GDN off / on, 27B likewise, their time against the kernels they replace
  #           (scripts/persistent_probe.py), a 0.8B profile with both, llama-bench beside.   carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  ( synth 0.8b > "$RES/synth_08b.log" 2>&1; synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local dense_writer=$! both=LUCEBOX_PERSISTENT_GDN=1,LUCEBOX_PERSISTENT_FFN=1
  step gpu-tests 200 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_ffn_persistent_gpu.py tests/test_moe_persistent_gpu.py tests/test_moe_matvec_cuda.py
  step gdn-tests 120 env TRITON_INTERPRET=0 python3 -m pytest -q -x -p no:cacheprovider --durations=5 \
    tests/test_gdn_persistent_gpu.py
  wait "$dense_writer"; tail -qn1 "$RES"/synth_*.log
  variants 08b "$(model 0.8b)" "-p 512 -n 128 -r 3" default persistent:LUCEBOX_PERSISTENT_FFN=1 \
    gdn:LUCEBOX_PERSISTENT_GDN=1 "both:$both"
  variants 27b "$(model 27b)" "-p 0 -n 128 -r 3" default persistent:LUCEBOX_PERSISTENT_FFN=1 "both:$both"
  step persistent-probe 120 sh -c "python3 scripts/persistent_probe.py --json $RES/persistent_probe.json \
    | tee $RES/persistent_probe.txt"
  mkdir -p "$RES/p08b" && step profile-08b-persistent 60 env LUCEBOX_PDL=0 ${both//,/ } \
    python3 scripts/bench_vs_llamacpp.py profile "$(model 0.8b)" --out "$RES/p08b"
  llama_wait && llama_rows 08b -m "$(model 0.8b)" -p 512 -n 128 -r 3 && llama_rows 27b -m "$(model 27b)" -p 0 -n 128 -r 3
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s25_all() {  # ~9.5 min: every persistent switch's GPU tests and its tg128 A/B in one call (for a session with one call):
  #           the four kernels' GPU tests, the 0.8B (default / FFN / GDN / both), Laguna-XS.2 (default / MoE /
  #           SwiGLU-down / all) and the 27B (default / both); the probe and a 0.8B profile if time is left. No
  #           llama.cpp rows (session 23's same-day figures stand beside).                   carry: .whl
  local laguna both=LUCEBOX_PERSISTENT_GDN=1,LUCEBOX_PERSISTENT_FFN=1
  local all=LUCEBOX_PERSISTENT_MOE=1,LUCEBOX_MOE_SWIGLU_DOWN=1,LUCEBOX_PERSISTENT_FFN=1
  laguna=$(sparkmodel laguna xs2 "$SPARK_SKEW")
  ( synth 0.8b > "$RES/synth_08b.log" 2>&1; [ -s "$laguna" ] || python3 -m lucebox_core.cli synth --arch laguna \
    --size xs2 --type q4_k_m --router-skew "$SPARK_SKEW" -o "$laguna" > "$RES/synth_laguna.log" 2>&1 ) &
  local writer=$!
  ( synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local big_writer=$!
  step gpu-tests 170 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_gdn_persistent_gpu.py tests/test_ffn_persistent_gpu.py tests/test_moe_persistent_gpu.py \
    tests/test_moe_matvec_cuda.py
  wait "$writer"
  variants 08b "$(model 0.8b)" "-p 512 -n 128 -r 3" default ffn:LUCEBOX_PERSISTENT_FFN=1 \
    gdn:LUCEBOX_PERSISTENT_GDN=1 "both:$both"
  variants laguna "$laguna" "-p 512 -n 128 -r 3" default moe:LUCEBOX_PERSISTENT_MOE=1 \
    swiglu:LUCEBOX_MOE_SWIGLU_DOWN=1 "all:$all"
  wait "$big_writer"; tail -qn1 "$RES"/synth_*.log
  variants 27b "$(model 27b)" "-p 0 -n 128 -r 3" default "both:$both"
  step persistent-probe 100 sh -c "python3 scripts/persistent_probe.py --json $RES/persistent_probe.json \
    | tee $RES/persistent_probe.txt"
  mkdir -p "$RES/p08b" && step profile-08b-both 50 env LUCEBOX_PDL=0 ${both//,/ } \
    python3 scripts/bench_vs_llamacpp.py profile "$(model 0.8b)" --out "$RES/p08b"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s26_dense() {  # ~9.5 min: the dense decode step's persistent kernels (MLP, Gated DeltaNet, attention): their GPU tests,
  #             0.8B tg128 default / each / all three, 27B default / all three, the probe, a 0.8B profile with all
  #             three, llama-bench beside (built meanwhile, niced).                          carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  ( synth 0.8b > "$RES/synth_08b.log" 2>&1; synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local dense_writer=$! all=LUCEBOX_PERSISTENT_FFN=1,LUCEBOX_PERSISTENT_GDN=1,LUCEBOX_PERSISTENT_ATTENTION=1
  step attention-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_attention_persistent_gpu.py
  step dense-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_gdn_persistent_gpu.py tests/test_ffn_persistent_gpu.py
  wait "$dense_writer"; tail -qn1 "$RES"/synth_*.log
  variants 08b "$(model 0.8b)" "-p 512 -n 128 -r 3" default ffn:LUCEBOX_PERSISTENT_FFN=1 gdn:LUCEBOX_PERSISTENT_GDN=1 \
    attn:LUCEBOX_PERSISTENT_ATTENTION=1 "all:$all"
  variants 27b "$(model 27b)" "-p 0 -n 128 -r 3" default "all:$all"
  llama_wait && llama_rows 08b -m "$(model 0.8b)" -p 512 -n 128 -r 3 && llama_rows 27b -m "$(model 27b)" -p 0 -n 128 -r 3
  step persistent-probe 80 sh -c "python3 scripts/persistent_probe.py --json $RES/persistent_probe.json \
    | tee $RES/persistent_probe.txt"
  mkdir -p "$RES/p08b" && step profile-08b-all 50 env LUCEBOX_PDL=0 ${all//,/ } \
    python3 scripts/bench_vs_llamacpp.py profile "$(model 0.8b)" --out "$RES/p08b"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s26_check() {  # ~4 min: the persistent attention's GPU tests (short tracebacks), the persistent kernels' phase tests,
  #             decode step profiles of the 0.8B and the 27B, default and with the three dense persistent kernels. carry: .whl
  ( synth 0.8b > "$RES/synth_08b.log" 2>&1; synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local dense_writer=$! all=LUCEBOX_PERSISTENT_FFN=1,LUCEBOX_PERSISTENT_GDN=1,LUCEBOX_PERSISTENT_ATTENTION=1
  step attention-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_attention_persistent_gpu.py tests/test_gdn_persistent_gpu.py::test_the_persistent_mixers_phases_are_the_unfused_ops \
    tests/test_ffn_persistent_gpu.py::test_the_persistent_blocks_first_phase_is_the_unfused_products_and_swiglu
  wait "$dense_writer"; tail -qn1 "$RES"/synth_*.log
  local size
  for size in 0.8b 27b; do
    mkdir -p "$RES/$size-default" "$RES/$size-all"
    step "profile-$size-default" 60 env LUCEBOX_PDL=0 python3 scripts/bench_vs_llamacpp.py profile "$(model $size)" \
      --out "$RES/$size-default"
    step "profile-$size-all" 60 env LUCEBOX_PDL=0 ${all//,/ } python3 scripts/bench_vs_llamacpp.py profile \
      "$(model $size)" --out "$RES/$size-all"
  done
  return 0
}

s26_swiglu() {  # ~5 min: whether LUCEBOX_MOE_SWIGLU_DOWN can be Laguna's default: verify == decode to the bit with it on
  #              and off (verify_determinism.py), tg128 default / on twice each, interleaved.        carry: .whl
  local laguna switch round
  laguna=$(sparkmodel laguna xs2 "$SPARK_SKEW")
  [ -s "$laguna" ] || python3 -m lucebox_core.cli synth --arch laguna --size xs2 --type q4_k_m \
    --router-skew "$SPARK_SKEW" -o "$laguna" > "$RES/synth_laguna.log" 2>&1
  for switch in 1 0; do
    step "determinism-swiglu$switch" 100 sh -c "LUCEBOX_MOE_SWIGLU_DOWN=$switch python3 scripts/verify_determinism.py \
      $laguna --prefix 300 --json $RES/determinism_swiglu$switch.json | tail -4"
  done
  for round in 1 2; do
    variants "laguna-r$round" "$laguna" "-p 0 -n 128 -r 5" default swiglu:LUCEBOX_MOE_SWIGLU_DOWN=1
  done
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s26_profile_moe() {  # ~3.5 min: Laguna-XS.2's and the 35B-A3B's decode step profiles (defaults, no PDL).  carry: .whl
  local laguna big arch
  laguna=$(sparkmodel laguna xs2 "$SPARK_SKEW") big=$(sparkmodel qwen35moe 35b-a3b "$SPARK_SKEW")
  moe_files "$laguna" "$big"; tail -qn1 "$RES"/synth_*.log 2>/dev/null
  for arch in laguna qwen35moe; do
    mkdir -p "$RES/$arch" && step "profile-$arch" 60 env LUCEBOX_PDL=0 python3 scripts/bench_vs_llamacpp.py \
      profile "$([ $arch = laguna ] && echo "$laguna" || echo "$big")" --out "$RES/$arch"
  done
  return 0
}

s26_probe() {  # ~1.5 min: scripts/persistent_probe.py alone (each persistent kernel against the kernels it replaces,
  #             the MLP's 16- and 32-row tiles at 1-4 blocks an SM), its rows on stdout.          carry: .whl
  step persistent-probe 120 sh -c "python3 scripts/persistent_probe.py --json $RES/persistent_probe.json \
    | tee $RES/persistent_probe.txt"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s27_tiled() {  # ~3 min: scripts/tiled_probe.py (the tiled layout's kernel against the row-major ones, bits and GB/s),
  #              then persistent_probe.py (the MLP's 32-row tiles).                                 carry: .whl
  step tiled-probe 390 sh -c "python3 scripts/tiled_probe.py --json $RES/tiled_probe.json | tee $RES/tiled_probe.txt"
  [ -n "${NO_PERSISTENT:-}" ] || step persistent-probe 120 sh -c "python3 scripts/persistent_probe.py \
    --json $RES/persistent_probe.json > $RES/persistent_probe.txt; grep -o '\"shape[^}]*' $RES/persistent_probe.txt \
    | cut -c1-300"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s27_check() {  # ~8 min: session 27's tiled Q6_K weights: the GPU tests of the tiled kernel and of the model paths that
  #              read them (decode graph, fused decode, embedding, speculative), verify == decode on the 0.8B, tg128
  #              of the 0.8B and the 27B tiled (default) and row-major, a 27B step profile, llama-bench beside. carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  ( synth 0.8b > "$RES/synth_08b.log" 2>&1; synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local dense_writer=$!
  step tiled-tests 240 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf --durations=5 \
    tests/test_tiled_gpu.py tests/test_decode_graph.py tests/test_fused_decode_gpu.py tests/test_cuda_embedding.py \
    tests/test_speculative.py
  wait "$dense_writer"; tail -qn1 "$RES"/synth_*.log
  step determinism-08b 120 python3 scripts/verify_determinism.py "$(model 0.8b)" --json "$RES/determinism_08b.json"
  variants 08b "$(model 0.8b)" "-p 512 -n 128 -r 3" default rowmajor:LUCEBOX_TILED_WEIGHTS=0
  variants 27b "$(model 27b)" "-p 0 -n 128 -r 3" default rowmajor:LUCEBOX_TILED_WEIGHTS=0
  llama_wait && llama_rows 08b -m "$(model 0.8b)" -p 512 -n 128 -r 3 && llama_rows 27b -m "$(model 27b)" -p 0 -n 128 -r 3
  mkdir -p "$RES/p27b" && step profile-27b 60 env LUCEBOX_PDL=0 python3 scripts/bench_vs_llamacpp.py profile \
    "$(model 27b)" --out "$RES/p27b"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s27_tests() {  # ~7 min: the GPU tests of session 27's tiled weights, then of the model paths that read them. carry: .whl
  step tiled-tests 200 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf --durations=5 \
    tests/test_tiled_gpu.py
  step model-tests "${MODEL_TESTS_S:-300}" env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    --durations=8 ${MODEL_TESTS:-tests/test_cuda_embedding.py tests/test_decode_graph.py tests/test_fused_decode_gpu.py \
    tests/test_speculative.py}
  return 0
}

s28_ab() {  # ~9 min: this tree's kernels (new) against the files in ${AB_OLD:-ab_old} (old) copied over the installed
  #          package's kernels: the tiled GPU tests (new), the tiled probe and tg128 of the 27B and the 0.8B with each,
  #          the 27B pp4096 tiled and row-major (new).                                        carry: .whl
  local kernels=/tmp/site/lucebox_cuda/kernels old=${AB_OLD:-ab_old} f
  ( synth 0.8b > "$RES/synth_08b.log" 2>&1; synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local dense_writer=$!
  step gpu-tests "${TESTS_S:-150}" env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    --durations=5 ${AB_TESTS:-tests/test_tiled_gpu.py}
  mkdir -p /tmp/newk && cp "$kernels"/*.cu* /tmp/newk/
  local side
  for side in new old; do  # the kernels alone first (no model file needed), then the models
    [ "$side" = old ] && for f in "$old"/*; do cp "$f" "$kernels/"; done
    step "tiled-probe-$side" 150 sh -c "python3 scripts/tiled_probe.py --json $RES/tiled_probe_$side.json \
      --batches $([ $side = new ] && echo 1,16,32 || echo 1,16) > $RES/tiled_probe_$side.txt; \
      tail -n 40 $RES/tiled_probe_$side.txt"
  done
  wait "$dense_writer"; tail -qn1 "$RES"/synth_*.log
  variants "27b-old" "$(model 27b)" "-p 0 -n 128 -r 3" default  # the old kernels are in place from the probe
  variants "08b-old" "$(model 0.8b)" "-p 512 -n 128 -r 3" default
  cp /tmp/newk/* "$kernels/"
  variants "27b-new" "$(model 27b)" "-p 0 -n 128 -r 3" default
  [ -n "${AB_REST_LATER:-}" ] || s28_ab_rest
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s28_ab_rest() {  # the 0.8B's tg128 with the new kernels, the 27B's pp4096 tiled and row-major
  variants "08b-new" "$(model 0.8b)" "-p 512 -n 128 -r 3" default
  variants 27b-pp "$(model 27b)" "-p 4096 -n 0 -r 2" default rowmajor:LUCEBOX_TILED_WEIGHTS=0
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s28_ncu() {  # ~4 min: Nsight Compute on the 27B's Q4_K products at batch 1 (gate|up, down) and the head: the row-major
  #           `mma` kernel against the tiled one (tiled_probe.py --ncu: each kernel once). carry: .whl
  command -v ncu >/dev/null || { echo "ncu not on the PATH"; return 1; }
  step ncu-tiled "${NCU_TIMEOUT:-300}" sh -c "ncu --clock-control none --kernel-name regex:matvec \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --section Occupancy --section LaunchStats --section InstructionStats \
    python3 scripts/tiled_probe.py --ncu --batches 1 --shapes '${NCU_SHAPES:-27b gate,27b down q4_k,27b head}' \
    > $RES/ncu_tiled.txt 2>&1; grep -E 'matvec_|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Issue Slots Busy|No Eligible|Achieved Occupancy|Registers Per|L2 Hit|L1/TEX Hit|Executed Ipc A|Executed Instructions  |Stall|Mem Busy|Max Bandwidth' \
    $RES/ncu_tiled.txt | head -150"
  cp "$RES/ncu_tiled.txt" "$OUT/" 2>/dev/null  # every shape's sections (the log shows the first 150 lines)
  return 0
}

s28_min() {  # ~3 min: the tiled GPU tests, then the tiled probe with this tree's kernels (batches 1 and 16) and with the
  #            older ones in ${AB_OLD:-ab_old} (batch 1).                                       carry: .whl
  local kernels=/tmp/site/lucebox_cuda/kernels f
  step gpu-tests 130 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_tiled_gpu.py
  step tiled-probe-new 80 sh -c "python3 scripts/tiled_probe.py --json $RES/tiled_probe_new.json --batches 1,16 \
    > $RES/tiled_probe_new.txt; cat $RES/tiled_probe_new.txt"
  for f in "${AB_OLD:-ab_old}"/*; do cp "$f" "$kernels/"; done
  step tiled-probe-old 60 sh -c "python3 scripts/tiled_probe.py --json $RES/tiled_probe_old.json --batches 1 \
    > $RES/tiled_probe_old.txt; cat $RES/tiled_probe_old.txt"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s28_all() { AB_REST_LATER=1 s28_ab; s28_ncu; s28_ab_rest; }  # ~8 min: both, one machine start (ncu before the rest)

s29_prefill() {  # ~5 min: prefill profiles (scripts/prefill_profile.py): the 0.8B's pp512 (the issue's "per-chunk
  #               overheads"), the 27B's pp4096 with Q6_K held tiled (the default) and row-major. carry: .whl
  ( synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local big_writer=$!
  step synth-08b 60 synth 0.8b
  step prefill-08b 90 python3 scripts/prefill_profile.py "$(model 0.8b)" --tokens 512 --json "$RES/prefill_08b.json"
  wait "$big_writer"; tail -n1 "$RES/synth_27b.log"
  step prefill-27b 120 python3 scripts/prefill_profile.py "$(model 27b)" --tokens 4096 --reps 2 \
    --json "$RES/prefill_27b_tiled.json"
  step prefill-27b-rowmajor 120 env LUCEBOX_TILED_WEIGHTS=0 python3 scripts/prefill_profile.py "$(model 27b)" \
    --tokens 4096 --reps 2 --top 8 --json "$RES/prefill_27b_rowmajor.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s29_min() {  # ~5 min: the branch's kernels against references (cuda_check's kernel cases: float64), the tiled tests,
  #            the probe at batch 1 (this tree, then ab_old/'s files with --basic).                  carry: .whl ab_old
  local kernels=/tmp/site/lucebox_cuda/kernels f
  step kernel-check 120 python3 scripts/cuda_check.py --out "$RES" --workdir "$WORK" --commit "$COMMIT" --skip-model \
    --skip-timing --skip-triton
  cp "$RES/cuda_check.json" "$OUT/" 2>/dev/null
  step gpu-tests 110 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_tiled_gpu.py
  step tiled-probe-new 60 sh -c "python3 scripts/tiled_probe.py --json $RES/tiled_probe_new.json --batches 1 \
    > $RES/tiled_probe_new.txt; cat $RES/tiled_probe_new.txt"
  for f in ab_old/*; do cp "$f" "$kernels/"; done
  step tiled-probe-ab_old 40 sh -c "python3 scripts/tiled_probe.py --basic --json $RES/tiled_probe_ab_old.json \
    --batches 1 > $RES/tiled_probe_ab_old.txt; cat $RES/tiled_probe_ab_old.txt"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s29_b() {  # ~9 min: three kernel trees through the probe (this one, then ${AB_SETS:-ab_patch ab_old}), then prefill
  local kernels=/tmp/site/lucebox_cuda/kernels set f
  step gpu-tests 130 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_tiled_gpu.py
  step tiled-probe-new 110 sh -c "python3 scripts/tiled_probe.py --json $RES/tiled_probe_new.json --batches 1,16 \
    > $RES/tiled_probe_new.txt; cat $RES/tiled_probe_new.txt"
  for set in ${AB_SETS:-ab_patch ab_old}; do
    for f in "$set"/*; do cp "$f" "$kernels/"; done
    step "tiled-probe-$set" 60 sh -c "python3 scripts/tiled_probe.py --basic --json $RES/tiled_probe_$set.json \
      --batches 1 > $RES/tiled_probe_$set.txt; cat $RES/tiled_probe_$set.txt"
  done
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  s29_prefill
}

s29_a() { s28_min; s29_prefill; }  # ~8 min: one machine start for both

s30_table() {  # ~8.5 min: #17's table with mma_pp in the catalogue: Nsight on the 27B's Q4_K products while llama.cpp
  #             builds, the prefill profiles, 27B / 0.8B tg128 and pp, llama-bench beside, 27B and 0.8B step
  #             profiles.                                                              carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  ( synth 0.8b > "$RES/synth_08b.log" 2>&1; synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local dense_writer=$!
  NCU_TIMEOUT=200 s28_ncu
  wait "$dense_writer"; tail -qn1 "$RES"/synth_*.log
  s29_prefill
  variants 27b "$(model 27b)" "-p 0 -n 128 -r 3" default
  variants 08b "$(model 0.8b)" "-p 512 -n 128 -r 3" default
  llama_wait && llama_rows 08b -m "$(model 0.8b)" -p 512 -n 128 -r 3 && llama_rows 27b -m "$(model 27b)" -p 0 -n 128 -r 3
  local size
  for size in 27b 0.8b; do
    mkdir -p "$RES/p$size" && step "profile-$size" 60 env LUCEBOX_PDL=0 python3 scripts/bench_vs_llamacpp.py profile \
      "$(model $size)" --out "$RES/p$size"
  done
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s30_host() {  # ~3 min: where the host time of a prefill goes: the 0.8B's pp512 and the 27B's pp4096 with cProfile and
  #            the call sites of the torch ops with device time (prefill_profile.py --python --stacks). carry: .whl
  ( synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local big_writer=$!
  step synth-08b 60 synth 0.8b
  step prefill-08b 90 python3 scripts/prefill_profile.py "$(model 0.8b)" --tokens 512 --python --stacks --top 40 \
    --json "$RES/prefill_08b_host.json"
  wait "$big_writer"; tail -n1 "$RES/synth_27b.log"
  step prefill-27b 150 python3 scripts/prefill_profile.py "$(model 27b)" --tokens 4096 --reps 1 --python --stacks \
    --top 40 --json "$RES/prefill_27b_host.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s30_prefill() {  # ~6 min: session 30's prefill changes (cuBLAS writes each tile's product in place, one untile kernel
  #               for tiled rows): the tiled GPU tests, prefill profiles with call sites, 0.8B pp512 and 27B
  #               pp4096 tiled / row-major, llama-bench beside.                         carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  ( synth 0.8b > "$RES/synth_08b.log" 2>&1; synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local dense_writer=$!
  step gpu-tests 130 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_tiled_gpu.py
  wait "$dense_writer"; tail -qn1 "$RES"/synth_*.log
  step prefill-08b 90 python3 scripts/prefill_profile.py "$(model 0.8b)" --tokens 512 --stacks --top 30 \
    --json "$RES/prefill_08b.json"
  step prefill-27b 120 python3 scripts/prefill_profile.py "$(model 27b)" --tokens 4096 --reps 2 --stacks --top 30 \
    --json "$RES/prefill_27b.json"
  variants 08b "$(model 0.8b)" "-p 512 -n 0 -r 5" default
  variants 27b "$(model 27b)" "-p 4096 -n 0 -r 3" default rowmajor:LUCEBOX_TILED_WEIGHTS=0
  llama_wait && llama_rows 08b -m "$(model 0.8b)" -p 512 -n 0 -r 5 && llama_rows 27b -m "$(model 27b)" -p 4096 -n 0 -r 3
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s30_final() {  # ~6.5 min: the whole-model check and the 27B's rows (GPU-bound) while llama.cpp builds at low priority,
  #             then the host-bound 0.8B's rows with nothing beside them (a build beside the 0.8B prefill halves it),
  #             llama-bench on both, a 0.8B prefill cProfile.                            carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  step synth-08b 60 synth 0.8b
  step synth-27b 90 synth 27b
  # The whole-model check (tiny F32 and 0.8B Q4_K_M prefill and greedy steps, CUDA backend against torch f32).
  step model-check 100 python3 scripts/cuda_check.py --out "$RES" --workdir "$WORK" --commit "$COMMIT" \
    --skip-timing --skip-correctness --skip-triton
  local m d; m=$(model 27b); d=$WORK/draft-27b.gguf
  variants 27b "$m" "-p 4096 -n 128 -r 3" default
  # The speculative rows: forced 8.3 with `--tree-budget auto` and 22, a drafter that accepts nothing with auto.
  step synth-draft 60 python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$d" "$m"
  step auto-forced 120 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget auto \
    --force-accept 8.3 --json | spec_rows auto-forced"
  step b22-forced 60 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget 22 \
    --force-accept 8.3 --json | spec_rows b22-forced"
  step auto-unforced 60 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 128 -r 2 --tree-budget auto \
    --json | spec_rows auto-unforced"
  llama_wait
  variants 08b "$(model 0.8b)" "-p 512 -n 128 -r 5" default
  llama_rows 08b -m "$(model 0.8b)" -p 512 -n 128 -r 5 && llama_rows 27b -m "$m" -p 4096 -n 128 -r 3
  step prefill-08b 60 python3 scripts/prefill_profile.py "$(model 0.8b)" --tokens 512 --python --top 30 \
    --json "$RES/prefill_08b.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s24_moe() {  # ~8 min: the MoE decode step with session 24's kernels: Laguna-XS.2 and 35B-A3B tg128 default,
  #           LUCEBOX_PERSISTENT_MOE=1, LUCEBOX_MOE_SWIGLU_DOWN=1, both (with the MLP's for Laguna's dense layer),
  #           a Laguna step profile with the best, llama-bench beside.                  carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  local laguna big best
  laguna=$(sparkmodel laguna xs2 "$SPARK_SKEW") big=$(sparkmodel qwen35moe 35b-a3b "$SPARK_SKEW")
  moe_files "$laguna" "$big"; tail -qn1 "$RES"/synth_*.log 2>/dev/null
  local all=LUCEBOX_PERSISTENT_MOE=1,LUCEBOX_MOE_SWIGLU_DOWN=1,LUCEBOX_PERSISTENT_FFN=1
  variants laguna "$laguna" "-p 512 -n 128 -r 3" default moe:LUCEBOX_PERSISTENT_MOE=1 \
    swiglu:LUCEBOX_MOE_SWIGLU_DOWN=1 "all:$all"
  best=$(best_variant laguna); echo "best laguna variant: $best"
  variants qwen35moe "$big" "-p 512 -n 128 -r 3" default moe:LUCEBOX_PERSISTENT_MOE=1 \
    swiglu:LUCEBOX_MOE_SWIGLU_DOWN=1 "all:$all"
  mkdir -p "$RES/laguna" && step profile-laguna-all 60 env LUCEBOX_PDL=0 ${all//,/ } \
    python3 scripts/bench_vs_llamacpp.py profile "$laguna" --out "$RES/laguna"
  llama_wait && llama_rows laguna -m "$laguna" -p 512 -n 128 -r 3 && llama_rows qwen35moe -m "$big" -p 512 -n 128 -r 3
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}
