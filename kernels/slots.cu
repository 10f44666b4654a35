// Slot-mapping recomputation from updated cached lengths, on the device (host reference:
// StepMetadata::recompute_slot_mappings). One thread per new token. The device clamps the
// block column to the table instead of failing.
extern "C" __global__ void recompute_slot_mappings(const int* __restrict__ indexer_table, int max_blocks,
                                                   const int* __restrict__ num_cached,
                                                   const int* __restrict__ req_idx,
                                                   const int* __restrict__ token_start, int n, int tpb,
                                                   int page_scale, long long page_bytes, int data_bytes,
                                                   int scale_bytes, int has_indexer, i64* __restrict__ vmap,
                                                   i64* __restrict__ smap, i64* __restrict__ mla) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    int r = req_idx[t];
    int g = num_cached[r] + (t - token_start[r]);
    int col = min(g / tpb, max_blocks - 1);
    int page = indexer_table[(long long)r * max_blocks + col];
    int pos = g % tpb;
    if (has_indexer) {
        vmap[t] = (i64)page * page_bytes + (i64)pos * data_bytes;
        smap[t] = (i64)page * page_bytes + (i64)tpb * data_bytes + (i64)pos * scale_bytes;
    } else {
        vmap[t] = -1;
        smap[t] = -1;
    }
    mla[t] = (i64)(page / (page_scale > 0 ? page_scale : 1)) * tpb + pos;
}

// Page-table cells changed since the last upload (host reference: the change log of the
// step metadata, dsa_kv_core::metadata::mirror): pair i = (cell, value); bit 31 of the
// cell picks the table (0: `a`, 1: `b`), the rest is the i32 element index in it. Pairs
// naming one cell twice carry the same value (the host's value at upload time).
extern "C" __global__ void apply_table_cells(int* __restrict__ a, int* __restrict__ b,
                                             const int2* __restrict__ pairs, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int2 p = pairs[i];
    unsigned c = (unsigned)p.x;
    int* t = (c >> 31) ? b : a;
    t[c & 0x7fffffffu] = p.y;
}
