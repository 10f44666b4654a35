// Top-k -> global row ids (host reference: src/ops/topk.rs). One thread per entry.
// global = block_table[r][p / T] * (scale * T) + offset * T + p % T; -1 stays -1; a column
// past the table or a -1 entry gives -1.
extern "C" __global__ void topk_to_global(const int* __restrict__ topk, int k, const int* __restrict__ row_request,
                                          int rows, const int* __restrict__ block_table, int table_rows, int max_blocks, int tpb,
                                          int scale, int layer_offset, int* __restrict__ out) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)rows * k) return;
    int row = (int)(idx / k);
    int p = topk[idx];
    int g = -1;
    if (p >= 0) {
        int col = p / tpb;
        int req = row_request[row];
        if (col < max_blocks && req >= 0 && req < table_rows) {
            int slot = block_table[(long long)req * max_blocks + col];
            if (slot >= 0) g = (int)((i64)slot * scale * tpb + (i64)layer_offset * tpb + p % tpb);
        }
    }
    out[idx] = g;
}

// Dense short-sequence top-k: [0, kv_len) then -1.
extern "C" __global__ void dense_topk(const int* __restrict__ kv_lens, int rows, int k, int* __restrict__ out) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)rows * k) return;
    int j = (int)(idx % k);
    out[idx] = j < kv_lens[idx / k] ? j : -1;
}
