// The megakernel's layer loop (qwen35_megakernel.cu), included by the launcher's lines after its three case lists
// (MEGA_GDN_CASES, MEGA_ATTENTION_CASES, MEGA_FFN_CASES: the bodies this model's weight formats need), which the
// switches below expand. No include guard: one inclusion a program, after the lists.
template <class X, class Nw, int GROUP>
__device__ __forceinline__ void megakernel_body(
    const u64* __restrict__ table, int layers, const X* embedded, const X* zeros, const Nw* final_norm,
    X* normed_out, X* sums, X* mixer_out, X* mlp_out, X* products, X* mlp_products, X* core, X* act,
    float* partial_max, float* partial_sum, float* partial_acc, const float* inv_freq, const i64* position,
    unsigned int* arrived, int hidden, int inter, int key_heads, int value_heads, int kv_heads, int rot_dim,
    int span, int spans, float scale, float mixer_eps, float attention_eps, float eps, u64* timeline,
    int prefetch_ahead) {
    __shared__ __align__(16) X staged[MEGA_STAGE_VALUES];
    lucebox_wait_prior_grid();  // the embedding is the kernel ahead's (PDL); every body waits again, at no cost
    if (blockIdx.x == 0 && threadIdx.x == 0) {  // the phases' clocks, where asked for (grid_barrier_mark)
        grid_barrier_timeline = timeline;
        if (timeline != nullptr) timeline[0] = 0;
        grid_barrier_mark();
    }
    // The residual stream: the embedding plus nothing before the first layer (the reference's plain norm; adding
    // zero is exact). A layer's mixer writes its sum to mixer_sum, its MLP to layer_sum.
    X* mixer_sum = sums;
    X* layer_sum = sums + hidden;
    const X* x = embedded;
    const X* residual = zeros;
    // `prefetch_ahead` layers' weights ask for L2 before their turn (0: none): the first ones now, then each layer's
    // successor that far ahead as the layer starts.
    for (int layer = 0; layer < min(prefetch_ahead, layers); ++layer)
        mega_prefetch_layer(table + static_cast<i64>(layer) * MEGA_FIELDS);
    for (int layer = 0; layer < layers; ++layer) {
        const u64* f = table + static_cast<i64>(layer) * MEGA_FIELDS;
        if (prefetch_ahead > 0 && layer + prefetch_ahead < layers)
            mega_prefetch_layer(table + static_cast<i64>(layer + prefetch_ahead) * MEGA_FIELDS);
        if (f[MEGA_KIND] == 0) {
            switch (static_cast<int>(f[MEGA_MIXER_VARIANT])) { MEGA_GDN_CASES default: __trap(); }
        } else {
            switch (static_cast<int>(f[MEGA_MIXER_VARIANT])) { MEGA_ATTENTION_CASES default: __trap(); }
        }
        grid_barrier(arrived);  // the mixer's output and sum, for every block's MLP
        switch (static_cast<int>(f[MEGA_FFN_VARIANT])) { MEGA_FFN_CASES default: __trap(); }
        grid_barrier(arrived);  // the MLP's output and the layer's sum, for the next layer
        x = mlp_out;
        residual = layer_sum;
    }
    if (blockIdx.x != 0) return;
    // The final add + norm: block 0 alone (its sum goes to mixer_sum, which nobody reads now).
    add_rms_norm_staged(x, residual, final_norm, eps, hidden, staged, mixer_sum);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) normed_out[i] = staged[i];
    if (threadIdx.x == 0) grid_barrier_mark();
}
