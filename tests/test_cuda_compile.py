"""Every CUDA kernel source compiles with NVRTC for each architecture it claims (no GPU needed)."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="lucebox-cuda's dependencies (cuda-bindings) are not installed")

from lucebox_cuda import catalogue, nvrtc  # noqa: E402

# Portable kernels claim every architecture from Ampere consumer cards to Blackwell consumer cards.
ARCHITECTURES = ("sm_86", "sm_89", "sm_90", "sm_120")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCEBOX_HOME", str(tmp_path))


def test_every_source_has_a_compile_check():
    assert set(catalogue.compile_check_programs()) == set(nvrtc.kernel_files())


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("source", sorted(catalogue.compile_check_programs()))
def test_source_compiles(source, arch):
    program = catalogue.compile_check_programs()[source]
    cubin = nvrtc.compile_program(program, arch, use_cache=False)
    assert cubin[:4] == b"\x7fELF"  # machine code for the exact architecture, not PTX
    # Every instantiated kernel is in the image under its extern "C" name.
    for line in program.instantiations:
        if line.startswith("#"):  # the megakernel's case lists and its loop's header, not kernels
            continue
        macro, args = line.split("(", 1)
        parts = [part.strip() for part in args.rstrip(")").split(",")]
        if macro in ("LUCEBOX_MATVEC_PIPE", "LUCEBOX_MATVEC_PIPE_S"):
            fmt, act, batch, warps, depth, groups = parts
            kind = "_s" if macro.endswith("_S") else ""
            assert f"matvec_pipe{kind}_w{warps}_d{depth}_m{groups}_{fmt}_{act}_{batch}".encode() in cubin
            continue
        if macro in ("LUCEBOX_MATVEC_TILED", "LUCEBOX_MATVEC_TILED_S"):
            fmt, act, batch, warps, row_tiles, ahead, order = parts
            kind = "_s" if macro.endswith("_S") else ""
            name = f"matvec_tiled{kind}_w{warps}_r{row_tiles}_a{ahead}_o{order}_{fmt}_{act}_{batch}"
            assert name.encode() in cubin
            continue
        if macro == "LUCEBOX_MATVEC_TILED_BOUNDED":
            fmt, act, batch, warps, row_tiles, ahead, order, blocks = parts
            name = f"matvec_tiled_w{warps}_r{row_tiles}_a{ahead}_o{order}_b{blocks}_{fmt}_{act}_{batch}"
            assert name.encode() in cubin
            continue
        if macro == "LUCEBOX_MATVEC_MMA_BOUNDED":  # the name's prefix is the first argument
            prefix, _, _, _, fmt, act, batch = parts
            assert f"{prefix}_{fmt}_{act}_{batch}".encode() in cubin
            continue
        if macro == "LUCEBOX_MATVEC_MMA_PP_BOUNDED":
            prefix, _, fmt, act, batch = parts
            assert f"{prefix}_{fmt}_{act}_{batch}".encode() in cubin
            continue
        if macro == "LUCEBOX_MATVEC_BULK":
            fmt, act, batch, depth = parts
            assert f"matvec_bulk_d{depth}_{fmt}_{act}_{batch}".encode() in cubin
            continue
        if macro == "LUCEBOX_MATVEC_TILED_UNITS":
            fmt, act, batch, warps, ahead, order = parts
            assert f"matvec_tiled_units_w{warps}_a{ahead}_o{order}_{fmt}_{act}_{batch}".encode() in cubin
            continue
        if macro == "LUCEBOX_QWEN35_MEGAKERNEL":  # the name first (a digest of the case lists)
            assert parts[0].encode() in cubin
            continue
        if macro == "LUCEBOX_UNTILE_ROWS":  # no arguments: one kernel
            assert b"untile_rows" in cubin
            continue
        if macro == "LUCEBOX_MOE_PERSISTENT":  # both router kinds from one line
            for suffix in ("sn", "xg"):
                assert f"moe_persistent_{'_'.join(parts)}_{suffix}".encode() in cubin
            continue
        if macro == "LUCEBOX_ATTENTION_PERSISTENT":  # the group size last, after a "g"
            *types, group = parts
            assert f"attention_persistent_{'_'.join(types)}_g{group}".encode() in cubin
            continue
        if macro.startswith("LUCEBOX_MOE_MATVEC_MMA"):
            fmt, act, warps = parts
            kind = macro.removeprefix("LUCEBOX_MOE_MATVEC_MMA").lower()
            assert f"moe_matvec_mma{warps}{kind}_{fmt}_{act}".encode() in cubin
            continue
        name = {"LUCEBOX_MATVEC": "matvec", "LUCEBOX_MATVEC_MMA": "matvec_mma", "LUCEBOX_MATVEC_MMA8": "matvec_mma8",
                "LUCEBOX_MATVEC_MMA_R2": "matvec_mma_r2", "LUCEBOX_MATVEC_MMA_PP": "matvec_mma_pp",
                "LUCEBOX_MATVEC_MMA_S": "matvec_mma_s", "LUCEBOX_MATVEC_MMA_R2_S": "matvec_mma_r2_s",
                "LUCEBOX_MATVEC_SUMS": "matvec_sums",
                "LUCEBOX_DEQUANT": "dequant", "LUCEBOX_DEQUANT_ROWS": "dequant_rows",
                "LUCEBOX_RMS_NORM": "rms_norm", "LUCEBOX_MOE_MATVEC": "moe_matvec",
                "LUCEBOX_MOE_MATVEC_PAGED": "moe_matvec_paged", "LUCEBOX_MOE_MATVEC_PAIR": "moe_matvec_pair",
                "LUCEBOX_MOE_MATVEC_PAIR_PAGED": "moe_matvec_pair_paged", "LUCEBOX_FFN_PERSISTENT": "ffn_persistent",
                "LUCEBOX_FFN_PERSISTENT_R2": "ffn_persistent_r2",
                "LUCEBOX_GDN_PERSISTENT": "gdn_persistent"}[macro]
        assert f"{name}_{'_'.join(parts)}".encode() in cubin


def test_catalogue_names_match_the_macros():
    program, name = catalogue.matvec("q6_k", "f16", 5)
    assert name == "matvec_q6_k_f16_5"
    assert name.encode() in nvrtc.compile_program(program, "sm_90", use_cache=False)


@pytest.mark.parametrize("kind", ["", "paged", "pair", "pair_paged"])
def test_expert_product_kernels_are_named_as_compiled(kind, monkeypatch):
    """The catalogue's expert-product launches name a kernel their program defines: tensor cores for the K-quants
    (as many warps as a row has GGUF blocks, up to 4), CUDA cores for the other formats and for HIP."""
    monkeypatch.delenv("LUCEBOX_MOE_MATVEC", raising=False)
    down = catalogue.moe_matvec_kernel("q4_k", "bf16", 512, kind)
    gate = catalogue.moe_matvec_kernel("q6_k", "f32", 2048, kind)
    other = catalogue.moe_matvec_kernel("q8_0", "bf16", 2048, kind)
    hip = catalogue.moe_matvec_kernel("q4_k", "bf16", 2048, kind, tensor_cores=False)
    assert (down.threads, down.rows_per_block) == (64, 16) and down.name.startswith("moe_matvec_mma2")
    assert (gate.threads, gate.rows_per_block) == (128, 16) and gate.name.startswith("moe_matvec_mma4")
    assert other.program.file == hip.program.file == "moe_matvec.cu" and other.threads == 128
    for launch in (down, gate, other, hip):
        assert launch.name.encode() in nvrtc.compile_program(launch.program, "sm_90")
    monkeypatch.setenv("LUCEBOX_MOE_MATVEC", "mma8")
    assert catalogue.moe_matvec_kernel("q4_k", "bf16", 512, kind).threads == 256
    assert catalogue.moe_matvec_kernel("q8_0", "bf16", 512, kind).name.startswith("moe_matvec_")  # no mma: simt
    monkeypatch.setenv("LUCEBOX_MOE_MATVEC", "mma3")
    with pytest.raises(ValueError, match="LUCEBOX_MOE_MATVEC"):
        catalogue.moe_matvec_kernel("q4_k", "bf16", 512, kind)


@pytest.mark.parametrize("kind", ["swiglu", "paged_swiglu"])
def test_the_swiglu_down_kernels_exist_only_where_the_kernel_holds_the_row(kind, monkeypatch):
    """The down product computing silu(gate) * up itself: tensor-core variants with 16-bit activations and rows
    its shared memory holds; elsewhere the catalogue refuses by name and the caller keeps the SwiGLU kernel."""
    monkeypatch.delenv("LUCEBOX_MOE_MATVEC", raising=False)
    launch = catalogue.moe_matvec_kernel("q4_k", "bf16", 512, kind)
    assert launch.name == f"moe_matvec_mma2_{kind}_q4_k_bf16"
    assert launch.name.encode() in nvrtc.compile_program(launch.program, "sm_90")
    assert catalogue.moe_swiglu_kernel("q6_k", "f16", 2048)
    for fmt, act, cols, cores in (("q4_k", "f32", 512, True), ("q8_0", "bf16", 512, True),
                                  ("q4_k", "bf16", 2 * catalogue.MOE_SWIGLU_MAX_COLS, True), ("q4_k", "bf16", 512, False)):
        assert not catalogue.moe_swiglu_kernel(fmt, act, cols, tensor_cores=cores)
        with pytest.raises(ValueError, match=f"no {kind} expert kernel"):
            catalogue.moe_matvec_kernel(fmt, act, cols, kind, tensor_cores=cores)


def test_compile_error_carries_the_log():
    broken = nvrtc.KernelProgram("matvec.cu", ["LUCEBOX_MATVEC(q3_k, bf16, 1)"])  # no such format
    with pytest.raises(nvrtc.CudaCompileError, match=r"matvec\.cu for sm_90:\n.*W_q3_k"):
        nvrtc.compile_program(broken, "sm_90", use_cache=False)


def test_disk_cache_is_keyed_by_source_and_arch(tmp_path):
    program, _ = catalogue.rms_norm("bf16", "f32")
    first = nvrtc.compile_program(program, "sm_89")
    cached = sorted((tmp_path / "cuda-cache").glob("*.cubin"))
    assert len(cached) == 1 and cached[0].read_bytes() == first
    # A second call is served from the file: prove it by planting different bytes there.
    cached[0].write_bytes(b"planted")
    assert nvrtc.compile_program(program, "sm_89") == b"planted"
    # Another architecture or another instantiation is another entry.
    nvrtc.compile_program(program, "sm_90")
    other, _ = catalogue.rms_norm("f16", "f32")
    nvrtc.compile_program(other, "sm_89")
    assert len(list((tmp_path / "cuda-cache").glob("*.cubin"))) == 3
    keys = {nvrtc.cache_key(program, "sm_89"), nvrtc.cache_key(program, "sm_90"), nvrtc.cache_key(other, "sm_89")}
    assert len(keys) == 3


@pytest.mark.parametrize(("rows", "tile"), [(1, 1), (8, 8), (9, 12), (13, 16), (33, 48), (64, 64)])
def test_batch_tile(rows, tile):
    assert catalogue.batch_tile(rows) == tile


def test_batch_tile_rejects_more_than_the_maximum():
    with pytest.raises(ValueError, match="maximum of 64"):
        catalogue.batch_tile(65)


@pytest.mark.parametrize(
    ("fmt", "act", "rows", "shape", "variant", "name", "grid", "block", "slices"),
    [
        # The H200 sweep's table (catalogue.MATVEC_TUNED): the fastest of the shape's arithmetic class at the
        # measured batch nearest in ratio (12 rows -> the 16 entry, 33 rows -> the 64 entry) ...
        ("q4_k", "bf16", 1, (17408, 5120), "mma", "matvec_mma_q4_k_bf16_1", 1088, 128, 1),
        ("q4_k", "bf16", 12, (17408, 5120), "pipe_w4_d4_m2_k1", "matvec_pipe_w4_d4_m2_q4_k_bf16_12", 544, 128, 1),
        ("q4_k", "bf16", 23, (17408, 5120), "mma_r2", "matvec_mma_r2_q4_k_bf16_24", 544, 128, 1),
        ("q4_k", "bf16", 33, (17408, 5120), "mma_r2", "matvec_mma_r2_q4_k_bf16_48", 544, 128, 1),
        # ... far from any timed batch, the rule for unmeasured shapes where it lies in the shape's class ...
        ("q4_k", "bf16", 1, (248320, 5120), "pipe_w4_d4_m2_k1", "matvec_pipe_w4_d4_m2_q4_k_bf16_1", 7760, 128, 1),
        ("q4_k", "bf16", 33, (248320, 5120), "mma_r2", "matvec_mma_r2_q4_k_bf16_48", 7760, 128, 1),
        ("q6_k", "bf16", 1, (248320, 5120), "pipe_w4_d3_m1_k1", "matvec_pipe_w4_d3_m1_q6_k_bf16_1", 15520, 128, 1),
        # ... tiny shapes on the fastest tensor-core class (a CUDA-core winner would slow every verify) ...
        ("q4_k", "bf16", 1, (1024, 5120), "pipe_w8_d3_m1_k4", "matvec_pipe_w8_d3_m1_q4_k_bf16_1", 64, 256, 4),
        ("q4_k", "bf16", 23, (1024, 5120), "pipe_w8_d3_m1_k4", "matvec_pipe_w8_d3_m1_q4_k_bf16_24", 64, 256, 4),
        # ... the 27B's gate | up at batch 1 on the two-register-set kernel (session 29's probe) ...
        ("q4_k", "bf16", 1, (34816, 5120), "mma_pp", "matvec_mma_pp_q4_k_bf16_1", 2176, 128, 1),
        # ... and for unmeasured shapes the rule: 4 warps, one slice, the variant by batch range ...
        ("q4_k", "bf16", 8, (34816, 5120), "mma_r2", "matvec_mma_r2_q4_k_bf16_8", 1088, 128, 1),
        ("q4_k", "bf16", 12, (34816, 5120), "pipe_w4_d4_m2_k1", "matvec_pipe_w4_d4_m2_q4_k_bf16_12", 1088, 128, 1),
        ("q6_k", "f16", 13, (17000, 5120), "pipe_w4_d4_m1_k1", "matvec_pipe_w4_d4_m1_q6_k_f16_16", 1063, 128, 1),
        ("q6_k", "bf16", 23, (17000, 5120), "mma", "matvec_mma_q6_k_bf16_24", 1063, 128, 1),
        # ... or, for few long rows, 8 warps and 4 K-slices (few short rows: the 4-warp rule).
        ("q4_k", "bf16", 1, (96, 5120), "pipe_w8_d3_m1_k4", "matvec_pipe_w8_d3_m1_q4_k_bf16_1", 6, 256, 4),
        ("q4_k", "bf16", 1, (1024, 1024), "mma", "matvec_mma_q4_k_bf16_1", 64, 128, 1),
        # fp32 activations have tensor-core kernels only up to 8 rows: CUDA cores at every batch.
        ("q5_k", "f32", 1, (17408, 5120), "simt", "matvec_q5_k_f32_1", 4352, 128, 1),
        ("q5_k", "f32", 9, (17408, 5120), "simt", "matvec_q5_k_f32_12", 4352, 128, 1),
        ("q8_0", "bf16", 1, (17408, 5120), "simt", "matvec_q8_0_bf16_1", 4352, 128, 1),  # no tensor-core Q8_0
    ],
)
def test_matvec_kernel_choice(fmt, act, rows, shape, variant, name, grid, block, slices):
    kernel = catalogue.matvec_kernel(fmt, act, rows, shape[0], in_features=shape[1])
    assert (kernel.variant, kernel.name, kernel.grid, kernel.block, kernel.slices) == (
        variant, name, grid, block, slices)


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q8_0"])
@pytest.mark.parametrize("act", ["bf16", "f16", "f32"])
def test_matvec_default_stays_in_one_arithmetic_class(fmt, act):
    """One arithmetic class per shape whatever the batch: a verify pass then computes each token's product
    as the one-token decode step does (the GPU probe shows the variants of a class agree bit for bit, and
    each is bit-identical across batches)."""
    for out_features, in_features in [(17408, 5120), (5120, 17408), (248320, 5120), (1024, 5120), (48, 5120),
                                      (6144, 5120), (34816, 5120), (100, 256)]:
        for asked in (None, "pipe"):  # the default, and its streamed form (LUCEBOX_MATVEC_VARIANT=pipe)
            chosen = {catalogue.arithmetic_class(kernel.variant)
                      for rows in (1, 2, 5, 8, 9, 12, 16, 23, 33, 64)
                      for kernel in [catalogue.matvec_kernel(fmt, act, rows, out_features, asked,
                                                             in_features=in_features, max_shared_bytes=200 * 1024)]}
            assert len(chosen) == 1, (asked, out_features, in_features, chosen)


def test_arithmetic_classes():
    assert catalogue.arithmetic_class("mma") == catalogue.arithmetic_class("mma_r2") == \
        catalogue.arithmetic_class("mma_pp") == catalogue.arithmetic_class("pipe_w4_d3_m2_k1") == ("mma", 4, 1)
    assert catalogue.arithmetic_class("mma8") == catalogue.arithmetic_class("pipe_w8_d4_m1_k1") == ("mma", 8, 1)
    assert catalogue.arithmetic_class("pipe_w4_d4_m1_k2") != catalogue.arithmetic_class("mma")
    assert catalogue.arithmetic_class("simt") == ("simt",)
    with pytest.raises(ValueError, match="unknown matvec variant"):
        catalogue.arithmetic_class("fast")


def test_tuned_entries_of_a_shape_share_a_class():
    classes: dict[tuple, set] = {}
    for (fmt, _, out, inn), variant in catalogue.MATVEC_TUNED.items():
        classes.setdefault((fmt, out, inn), set()).add(catalogue.arithmetic_class(variant))
    assert classes and all(len(found) == 1 for found in classes.values()), classes


def test_named_variants_and_shared_memory():
    kernel = catalogue.matvec_kernel("q4_k", "bf16", 1, 17408, "mma8")
    assert (kernel.name, kernel.grid, kernel.block, kernel.streamed) == ("matvec_mma8_q4_k_bf16_1", 1088, 256, False)
    # Two row tiles of 16 per block of 4 warps: half the blocks.
    kernel = catalogue.matvec_kernel("q6_k", "bf16", 23, 17408, "mma_r2")
    assert (kernel.name, kernel.grid, kernel.block) == ("matvec_mma_r2_q6_k_bf16_24", 544, 128)
    kernel = catalogue.matvec_kernel("q6_k", "bf16", 3, 100, "pipe_w8_d3_m2_k2", max_shared_bytes=1 << 20)
    # 8 warps x 3 stages x 32 rows x 224 bytes (Q6_K over-fetched to 14 chunks a row); rows 100 -> 4 blocks.
    assert (kernel.name, kernel.grid, kernel.block, kernel.slices, kernel.shared_bytes) == (
        "matvec_pipe_w8_d3_m2_q6_k_bf16_3", 4, 256, 2, 8 * 3 * 32 * 224)
    # The partial sums reuse the ring; at batch 64 they are the larger part with one stage.
    pipe = catalogue.PipeVariant(8, 2, 1)
    assert pipe.shared_bytes("q4_k", "bf16", 64) == max(8 * 2 * 16 * 144, 8 * 16 * 65 * 4)
    # A named variant over the device's limit is refused; the default steps its depth down to fit.
    with pytest.raises(ValueError, match="shared memory"):
        catalogue.matvec_kernel("q6_k", "bf16", 1, 64, "pipe_w8_d6_m1_k1", max_shared_bytes=99 * 1024)
    small = catalogue.matvec_kernel("q6_k", "bf16", 1, 4096, "pipe", max_shared_bytes=40 * 1024)
    assert small.variant.startswith("pipe_w4_d2_") and small.shared_bytes <= 40 * 1024
    assert catalogue.matvec_kernel("q6_k", "bf16", 1, 4096, "pipe", max_shared_bytes=16 * 1024).variant == "mma"


def test_pipe_variant_names_round_trip():
    for warps, depth, groups in catalogue.PIPE_SWEEP_CONFIGS:
        for slices in (1, 2, 4):
            variant = catalogue.PipeVariant(warps, depth, groups, slices)
            assert catalogue.PipeVariant.parse(variant.name) == variant
    assert catalogue.PipeVariant.parse("mma") is None
    with pytest.raises(ValueError, match="two row groups"):
        catalogue.matvec_kernel("q4_k", "bf16", 33, 64, "pipe_w4_d4_m2_k1")


def test_tuned_table_overrides_the_rule(monkeypatch):
    monkeypatch.setitem(catalogue.MATVEC_TUNED, ("q4_k", 1, 17408, 5120), "pipe_w8_d3_m1_k1")
    assert catalogue.matvec_kernel("q4_k", "bf16", 1, 17408, in_features=5120).variant == "pipe_w8_d3_m1_k1"
    # ... "pipe" still asks for the streamed kernel, and unmeasured shapes keep the rule.
    assert catalogue.matvec_kernel("q4_k", "bf16", 1, 17408, "pipe", in_features=5120).variant.startswith("pipe_")
    assert catalogue.matvec_kernel("q4_k", "bf16", 1, 10000, in_features=5120).variant == "mma"


def test_matvec_kernel_refuses_a_missing_variant():
    with pytest.raises(ValueError, match="no tensor-core matvec for q8_0"):
        catalogue.matvec_kernel("q8_0", "bf16", 1, 64, variant="mma")
    with pytest.raises(ValueError, match="no tensor-core matvec for q8_0"):
        catalogue.matvec_kernel("q8_0", "bf16", 1, 64, variant="pipe_w4_d4_m1_k1")
    assert catalogue.matvec_kernel("q4_k", "bf16", 1, 64, variant="simt").name == "matvec_q4_k_bf16_1"



def test_a_sweep_table_named_by_the_environment_is_laid_over_the_built_in_one(tmp_path):
    """LUCEBOX_MATVEC_TUNED: a sweep's matvec_sweep.json adds (and overrides) entries; a file that is not one
    leaves the built-in table, with a warning naming the variable."""
    import json
    import subprocess
    import sys

    sweep = tmp_path / "matvec_sweep.json"
    sweep.write_text(json.dumps({"tuned_table": [["q4_k", 1, 7168, 3072, "pipe_w8_d3_m1_k4"],
                                                 ["q4_k", 1, 5120, 6144, "pipe_w4_d3_m1_k1"]]}))
    probe = ("import warnings; warnings.simplefilter('always')\n"
             "from lucebox_cuda import catalogue as c\n"
             "print(c.MATVEC_TUNED.get(('q4_k', 1, 7168, 3072)), c.MATVEC_TUNED[('q4_k', 1, 5120, 6144)])")
    run = lambda path: subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                      env={**__import__("os").environ, "LUCEBOX_MATVEC_TUNED": str(path)})
    assert run(sweep).stdout.split() == ["pipe_w8_d3_m1_k4", "pipe_w4_d3_m1_k1"]
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = run(broken)
    assert result.stdout.split() == ["None", "mma"]  # the built-in entry of the 27B's shape
    assert "LUCEBOX_MATVEC_TUNED" in result.stderr and "not a matvec sweep result" in result.stderr


def test_below_the_tile_and_for_fp32_the_products_compute_their_own_sums():
    """Given sums (tests/test_given_sums_gpu.py keeps their bits) from GIVEN_SUMS_MIN_TILE rows, where the variant
    has the form: the sums kernel's grid and scratch for the row length, the product's name with "_s"."""
    for rows, act in ((8, "bf16"), (1, "bf16"), (8, "f32")):
        assert catalogue.matvec_kernel("q4_k", act, rows, 1000, "mma_r2", in_features=2560, given=True).sums is None
    assert catalogue.matvec_kernel("q4_k", "bf16", 16, 1000, "mma8", in_features=2560, given=True).sums is None
    assert catalogue.matvec_kernel("q4_k", "bf16", 16, 1000, "mma", in_features=2560).sums is None
    launch = catalogue.matvec_kernel("q6_k", "bf16", 23, 1000, "mma_r2", in_features=2560, given=True)
    assert launch.name == "matvec_mma_r2_s_q6_k_bf16_24" and launch.sums.name == "matvec_sums_q6_k_bf16_24"
    assert (launch.sums.grid(2560), launch.sums.floats(2560)) == (40, 10 * 16 * 3 * 8)  # 160 (block, group) warps
    program, name, _, sums = catalogue.matvec_tiled("q6_k", "bf16", 12, given=True)
    assert name == "matvec_tiled_s_w4_r2_a1_o0_q6_k_bf16_12" and sums.name == "matvec_sums_q6_k_bf16_12"
    assert name.encode() in nvrtc.compile_program(program, "sm_90")
    assert catalogue.matvec_tiled("q6_k", "bf16", 8, given=True)[3] is None
    piped = catalogue.matvec_kernel("q4_k", "bf16", 12, 1000, "pipe_w4_d4_m2_k2", in_features=2560, given=True)
    assert piped.name.startswith("matvec_pipe_s_w4_d4_m2_") and piped.slices == 2 and piped.shared_bytes > 0
    for launch in (launch, piped):
        cubin = nvrtc.compile_program(launch.program, "sm_90")
        assert launch.name.encode() in cubin
        assert launch.sums.name.encode() in nvrtc.compile_program(launch.sums.program, "sm_90")
