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

// The step metadata's upload, applied on the device from one host-to-device copy of the
// pinned staging (host reference: the host buffers themselves; crates/dsa-kv-cuda/src/
// metadata.rs lays the area out): `nseg` segments at the area's start, each
// {destination address, source offset in the area, 4-byte words}, copied to their
// buffers by grid row y < nseg; the last grid row writes `npairs` page-table cells
// (cell, value) at `pairs_off`: bit 31 of the cell picks the table (0: `a`, 1: `b`), the
// rest is the i32 element index in it (pairs naming one cell twice carry one value).
struct MetaSeg {
    unsigned long long dst;
    unsigned int src;
    unsigned int words;
};

extern "C" __global__ void apply_metadata_upload(const unsigned char* __restrict__ area, int nseg,
                                                 int pairs_off, int npairs, int* __restrict__ a,
                                                 int* __restrict__ b) {
    unsigned stride = gridDim.x * blockDim.x;
    unsigned i0 = blockIdx.x * blockDim.x + threadIdx.x;
    if ((int)blockIdx.y < nseg) {
        const MetaSeg* sg = reinterpret_cast<const MetaSeg*>(area) + blockIdx.y;
        unsigned* d = reinterpret_cast<unsigned*>(sg->dst);
        const unsigned* s = reinterpret_cast<const unsigned*>(area + sg->src);
        for (unsigned i = i0; i < sg->words; i += stride) d[i] = s[i];
        return;
    }
    const int2* p = reinterpret_cast<const int2*>(area + pairs_off);
    for (unsigned i = i0; i < (unsigned)npairs; i += stride) {
        int2 q = p[i];
        unsigned c = (unsigned)q.x;
        int* t = (c >> 31) ? b : a;
        t[c & 0x7fffffffu] = q.y;
    }
}
