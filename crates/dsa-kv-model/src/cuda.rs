//! The reference model on the GPU: the same forward as [`super::paged::ModelForward`],
//! computed by the kernels of `kernels/model.cu` (NVRTC, exact IEEE, every sum in the
//! host model's order: the warp-shaped `Lanes32` order (`math.rs`) by one
//! warp for the matrix-vector products, norms, indexer and attention scores and softmax
//! denominators, one thread's ascending loop for the rest) on the batch's compute stream, reading and
//! writing the device pools through the device metadata. The KV is written by the
//! crate's own scatter kernels (`mla_scatter`, `quantize_indexer` + `indexer_k_scatter`),
//! as a framework would. The logits come back to the host for sampling (the step waits
//! for them and for the fail flag; with speculation also for the hidden states, and each
//! draft-chain token for its logits); every bit equals the host model's.
//!
//! Decode-only steps can run as one CUDA graph (captured once per bucket of padded token
//! counts 8, 16, 32, …; padding tokens are marked by position −1, and the runtime's slot
//! mappings past the step's tokens are −1; the metadata buffers never move). The MTP draft
//! layer's KV is written (separate draft cache or the target's), and with speculation its
//! draft chains run on the GPU too: each chain token's own KV goes to an overlay page, and
//! the attention reads cached positions through the draft metadata and the chain's
//! positions from the overlay, as the host's `Overlay` store does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaFunction, CudaModule, CudaStream, LaunchConfig};

use super::math::{rope_cos_sin, Mat};
use super::model::output_of;
use super::paged::{check_setup, verdict, ForwardOptions, Mtp, Outputs};
use super::weights::Layer;
use super::{Model, ModelError, INDEX_DIM, LATENT, ROPE};
use dsa_kv_core::config::KvDtype;
use dsa_kv_core::core::scheduler::RequestOutcome;
use dsa_kv_core::ids::TokenId;
use dsa_kv_cuda::kernels::{DevRows, MlaEncoding};
use dsa_kv_cuda::{CudaError, DeviceBuffer, Gpu, KERNEL_SOURCES};
use dsa_kv_device::forward::{
    Batch, Forward, ForwardError, ForwardFactory, ForwardSetup, LayerCache, MetadataView,
    Proposals, Sampled, Sampling,
};

const ROW: usize = LATENT + ROPE;

fn cuda(e: CudaError) -> ForwardError {
    ForwardError::framework(e)
}

fn launch_err(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> ForwardError {
    move |e| ForwardError::Unsupported {
        what: format!("{what}: {e:?}"),
    }
}

/// One layer's weights on the device.
struct DevLayer {
    w_dkv: DeviceBuffer,
    w_kr: DeviceBuffer,
    w_ik: DeviceBuffer,
    /// The per-head matrices stacked (head 0's rows first).
    w_iq: DeviceBuffer,
    w_iw: DeviceBuffer,
    w_qn: DeviceBuffer,
    w_uk: DeviceBuffer,
    w_qr: DeviceBuffer,
    w_uv: DeviceBuffer,
    w_o: DeviceBuffer,
    w_1: DeviceBuffer,
    w_2: DeviceBuffer,
}

impl DevLayer {
    fn new(gpu: &Gpu, l: &Layer) -> Result<DevLayer, CudaError> {
        let up = |m: &Mat| DeviceBuffer::from_slice(gpu, &m.w, "model weights");
        let stack = |v: &[Mat]| {
            let mut w: Vec<f32> = v.iter().flat_map(|m| m.w.iter().copied()).collect();
            if w.is_empty() {
                // No heads: nothing reads it, but a device buffer has a byte.
                w.push(0.0);
            }
            DeviceBuffer::from_slice(gpu, &w, "model weights")
        };
        Ok(DevLayer {
            w_dkv: up(&l.w_dkv)?,
            w_kr: up(&l.w_kr)?,
            w_ik: up(&l.w_ik)?,
            w_iq: stack(&l.w_iq)?,
            w_iw: up(&l.w_iw)?,
            w_qn: stack(&l.w_qn)?,
            w_uk: stack(&l.w_uk)?,
            w_qr: stack(&l.w_qr)?,
            w_uv: stack(&l.w_uv)?,
            w_o: up(&l.w_o)?,
            w_1: up(&l.w_1)?,
            w_2: up(&l.w_2)?,
        })
    }
}

struct Funcs {
    embed: CudaFunction,
    rmsnorm: CudaFunction,
    matvec: CudaFunction,
    matvec_t: CudaFunction,
    add: CudaFunction,
    relu: CudaFunction,
    rope: CudaFunction,
    to_bf16: CudaFunction,
    index_scores: CudaFunction,
    topk: CudaFunction,
    attn_scores: CudaFunction,
    attn_out: CudaFunction,
}

/// Per-step buffers, sized for the largest step.
struct Scratch {
    tok: DeviceBuffer,
    pos: DeviceBuffer,
    row: DeviceBuffer,
    x: DeviceBuffer,
    xn: DeviceBuffer,
    kv: DeviceBuffer,
    kvbf: DeviceBuffer,
    key: DeviceBuffer,
    keybf: DeviceBuffer,
    keyv: DeviceBuffer,
    keys: DeviceBuffer,
    q: DeviceBuffer,
    qbf: DeviceBuffer,
    qv: DeviceBuffer,
    qs: DeviceBuffer,
    iw: DeviceBuffer,
    scores: DeviceBuffer,
    sel: DeviceBuffer,
    nsel: DeviceBuffer,
    qn: DeviceBuffer,
    qlat: DeviceBuffer,
    qpe: DeviceBuffer,
    ebuf: DeviceBuffer,
    /// The attention's selected row addresses, `max_ctx` per token.
    rowp: DeviceBuffer,
    olat: DeviceBuffer,
    hv: DeviceBuffer,
    attn: DeviceBuffer,
    hm: DeviceBuffer,
    mo: DeviceBuffer,
    logits: DeviceBuffer,
    fail: DeviceBuffer,
}

/// A captured decode step; created, launched and dropped on the device actor's thread.
struct Graph(cudarc::driver::CudaGraph);
// SAFETY: the graph is only used on the device actor's thread (the forward lives there).
unsafe impl Send for Graph {}

/// The model on one GPU. See the module docs.
pub struct CudaModelForward {
    model: Arc<Model>,
    device: usize,
    record: Option<Arc<Mutex<Outputs>>>,
    gpu: Arc<Gpu>,
    _module: Arc<CudaModule>,
    f: Funcs,
    layers: Vec<DevLayer>,
    draft: DevLayer,
    embed: DeviceBuffer,
    w_out: DeviceBuffer,
    rope: DeviceBuffer,
    s: Scratch,
    t_max: usize,
    max_ctx: usize,
    mtp: Mtp,
    graphs: bool,
    /// Captured decode steps by bucket (padded token count), with the metadata addresses
    /// they were captured with.
    graph: HashMap<usize, (Graph, Vec<u64>)>,
    graph_steps: Arc<std::sync::atomic::AtomicU64>,
    /// Draft tokens to propose per step (0: none).
    drafts: usize,
    pending: Vec<Pending>,
    ov: OverlayBuffers,
}

/// A request that sampled a token this step: what its draft chain starts from.
struct Pending {
    id: dsa_kv_core::ids::RequestId,
    row: usize,
    last: u32,
    hidden: Vec<f32>,
    next: u32,
}

/// Device buffers of the draft chains: one overlay page per chain (request).
struct OverlayBuffers {
    chains: usize,
    last: DeviceBuffer,
    keys: DeviceBuffer,
    rows: DeviceBuffer,
    slots: DeviceBuffer,
    vmap: DeviceBuffer,
    smap: DeviceBuffer,
}

/// Compiles `kernels` (a file of `kernels/`, after `common.cuh`'s helpers) with the
/// crate's exact-IEEE options and loads it on `gpu`.
pub(crate) fn load_module(gpu: &Gpu, kernels: &str) -> Result<Arc<CudaModule>, CudaError> {
    let ptx = dsa_kv_cuda::compile(format!("{}\n{kernels}\n", KERNEL_SOURCES[0].1))?;
    let ordinal = gpu.ordinal();
    gpu.context()
        .load_module(ptx)
        .map_err(|e| dsa_kv_cuda::driver_error(ordinal, "cuModuleLoadData", e))
}

/// Launch configuration: `threads` threads in blocks of 256.
pub(crate) fn grid(threads: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (threads.div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launch configuration: one warp for each of `warps` outputs, in blocks of 8 warps.
fn warps(warps: usize) -> LaunchConfig {
    grid(warps * 32)
}

fn blocks(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Where `write_kv` puts a batch's KV: an MLA row view with its token-slot mapping and,
/// for a layer with an indexer, the indexer cache (base, bytes from base) and its value
/// and scale byte-offset mappings (device i64 arrays; −1: skip).
#[derive(Clone, Copy)]
struct KvDst {
    rows: DevRows,
    enc: MlaEncoding,
    mla_slots: u64,
    indexer: Option<(u64, u64, u64, u64)>,
}

impl KvDst {
    /// The batch's cache layer through the step's slot mappings.
    fn of(cache: &LayerCache, m: &MetadataView) -> Result<KvDst, ForwardError> {
        let mla = cache.mla.ok_or_else(|| {
            ForwardError::framework(ModelError::Access("a layer without an MLA cache".into()))
        })?;
        Ok(KvDst {
            rows: DevRows::of(&mla.rows),
            enc: match mla.encoding {
                KvDtype::Fp8DsMla => MlaEncoding::Fp8DsMla { ue8m0: true },
                _ => MlaEncoding::Bf16,
            },
            mla_slots: m.mla_slot_mapping.addr,
            indexer: cache.indexer.map(|ix| {
                (
                    ix.base,
                    ix.pool.addr + ix.pool.bytes - ix.base,
                    m.slot_mapping_value.addr,
                    m.slot_mapping_scale.addr,
                )
            }),
        })
    }
}

/// A draft chain's overlay: per chain token, the last cached position (`ov_last`, device
/// i32) and the overlay pages holding the chain's own rows and keys.
#[derive(Clone, Copy)]
struct Overlay {
    last: u64,
    keys: u64,
    rows: u64,
}

/// A row-major matrix operand and where its output goes.
struct MatOp<'a> {
    w: &'a DeviceBuffer,
    rows: usize,
    cols: usize,
    out: &'a DeviceBuffer,
    /// Output row stride and offset (floats).
    os: usize,
    oo: usize,
    x: &'a DeviceBuffer,
    xs: usize,
    xo: usize,
    /// `groups` matrices of `rows × cols` stacked in `w` (heads), group `g` reading `x`
    /// from `xo + g × xg` and writing its outputs after group `g − 1`'s.
    groups: usize,
    xg: usize,
}

impl CudaModelForward {
    /// A factory giving every CUDA device the model, sampling and proposing as
    /// [`ModelForward::factory`](super::paged::ModelForward::factory) does with `opts`
    /// (the draft chains on the GPU: their own KV in overlay pages, the cached draft KV
    /// through the draft metadata; no trace); `graphs`: run decode-only steps as a CUDA
    /// graph. `graph_steps` counts graph launches.
    pub fn factory(
        model: Arc<Model>,
        opts: ForwardOptions,
        graphs: bool,
        graph_steps: Arc<std::sync::atomic::AtomicU64>,
    ) -> ForwardFactory {
        let (drafts, record) = (opts.drafts, opts.record.clone());
        Arc::new(move |setup: &ForwardSetup<'_>| {
            if opts.tracer.is_some() {
                return Err(ForwardError::Unsupported {
                    what: "the GPU forward traces nothing: trace on the host backend".into(),
                });
            }
            if model.checkpoint().is_some() {
                return Err(ForwardError::Unsupported {
                    what: "the GPU forward runs the built-in model only: run a checkpoint's \
                           model on the host backend"
                        .into(),
                });
            }
            let mtp = check_setup(setup, &model, drafts)?;
            let Some(gpu) = setup.extension::<Arc<Gpu>>() else {
                return Err(ForwardError::Unsupported {
                    what: "the GPU model forward runs on the CUDA backend".into(),
                });
            };
            let (ih, heads) = (model.config().index_heads, model.config().heads);
            if ih * INDEX_DIM * 4 > 48 << 10 || heads * ROW * 4 > 48 << 10 {
                return Err(ForwardError::Unsupported {
                    what: format!(
                        "{ih} indexer heads, {heads} MLA heads: the GPU kernels keep a token's \
                         queries in 48 KiB of shared memory (at most 96 indexer, 21 MLA heads)"
                    ),
                });
            }
            if drafts > 64 {
                return Err(ForwardError::Unsupported {
                    what: format!("{drafts} draft tokens: at most 64 per step"),
                });
            }
            // Positions up to the page tables' width, and a draft chain's up to 64 past it.
            let max_ctx = setup.metadata.max_blocks_per_seq * 64 + 64;
            let f = Self::new(
                model.clone(),
                setup.device,
                record.clone(),
                gpu.clone(),
                setup.max_num_tokens,
                max_ctx,
                mtp,
                graphs,
                graph_steps.clone(),
                (drafts, setup.max_num_sequences),
            )
            .map_err(cuda)?;
            Ok(Box::new(f) as Box<dyn Forward>)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        model: Arc<Model>,
        device: usize,
        record: Option<Arc<Mutex<Outputs>>>,
        gpu: Arc<Gpu>,
        t_max: usize,
        max_ctx: usize,
        mtp: Mtp,
        graphs: bool,
        graph_steps: Arc<std::sync::atomic::AtomicU64>,
        (drafts, chains): (usize, usize),
    ) -> Result<Self, CudaError> {
        gpu.bind()?;
        let module = load_module(&gpu, include_str!("../../../kernels/model.cu"))?;
        let ordinal = gpu.ordinal();
        let drv = |what: &'static str| move |e| dsa_kv_cuda::driver_error(ordinal, what, e);
        let f = |n: &'static str| module.load_function(n).map_err(drv(n));
        let funcs = Funcs {
            embed: f("m_embed")?,
            rmsnorm: f("m_rmsnorm")?,
            matvec: f("m_matvec")?,
            matvec_t: f("m_matvec_t")?,
            add: f("m_add")?,
            relu: f("m_relu")?,
            rope: f("m_rope")?,
            to_bf16: f("m_to_bf16")?,
            index_scores: f("m_index_scores")?,
            topk: f("m_topk")?,
            attn_scores: f("m_attn_scores")?,
            attn_out: f("m_attn_out")?,
        };
        let c = *model.config();
        let layers = model
            .layers
            .iter()
            .map(|l| DevLayer::new(&gpu, l))
            .collect::<Result<Vec<_>, _>>()?;
        let draft = DevLayer::new(&gpu, &model.draft)?;
        let embed = DeviceBuffer::from_slice(&gpu, &model.embed.w, "model weights")?;
        let w_out = DeviceBuffer::from_slice(&gpu, &model.w_out.w, "model weights")?;
        let table: Vec<f32> = (0..max_ctx as u32)
            .flat_map(|p| {
                (0..ROPE / 2).flat_map(move |i| {
                    let (c, s) = rope_cos_sin(p, i, ROPE);
                    [c, s]
                })
            })
            .collect();
        let rope = DeviceBuffer::from_slice(&gpu, &table, "RoPE table")?;
        let (t, h, ih) = (t_max.max(1), c.hidden, c.index_heads);
        let z = |bytes: usize| DeviceBuffer::zeroed(&gpu, bytes.max(4), "model scratch");
        let s = Scratch {
            tok: z(t * 4)?,
            pos: z(t * 4)?,
            row: z(t * 4)?,
            x: z(t * h * 4)?,
            xn: z(t * h * 4)?,
            kv: z(t * ROW * 4)?,
            kvbf: z(t * ROW * 2)?,
            key: z(t * INDEX_DIM * 4)?,
            keybf: z(t * INDEX_DIM * 2)?,
            keyv: z(t * INDEX_DIM)?,
            keys: z(t * 4)?,
            q: z(t * ih * INDEX_DIM * 4)?,
            qbf: z(t * ih * INDEX_DIM * 2)?,
            qv: z(t * ih * INDEX_DIM)?,
            qs: z(t * ih * 4)?,
            iw: z(t * ih * 4)?,
            scores: z(t * max_ctx * 4)?,
            sel: z(t * max_ctx * 4)?,
            nsel: z(t * 4)?,
            qn: z(t * c.heads * c.nope_dim * 4)?,
            qlat: z(t * c.heads * LATENT * 4)?,
            qpe: z(t * c.heads * ROPE * 4)?,
            ebuf: z(t * c.heads * max_ctx * 4)?,
            rowp: z(t * max_ctx * 8)?,
            olat: z(t * c.heads * LATENT * 4)?,
            hv: z(t * c.heads * c.v_dim * 4)?,
            attn: z(t * h * 4)?,
            hm: z(t * c.mlp * 4)?,
            mo: z(t * h * 4)?,
            logits: z(t * c.vocab * 4)?,
            fail: z(4)?,
        };
        let chains = if drafts > 0 { chains.min(t) } else { 0 };
        let ov = OverlayBuffers {
            chains,
            last: z(chains * 4)?,
            keys: z(chains * 64 * (INDEX_DIM + 4))?,
            rows: z(chains * 64 * 2 * ROW)?,
            slots: z(chains * 8)?,
            vmap: z(chains * 8)?,
            smap: z(chains * 8)?,
        };
        Ok(CudaModelForward {
            model,
            device,
            record,
            gpu,
            _module: module,
            f: funcs,
            layers,
            draft,
            embed,
            w_out,
            rope,
            s,
            t_max: t,
            max_ctx,
            mtp,
            graphs,
            graph: HashMap::new(),
            graph_steps,
            drafts,
            pending: Vec::new(),
            ov,
        })
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.gpu.compute()
    }

    fn matvec(&self, m: MatOp<'_>, n: usize, transposed: bool) -> Result<(), ForwardError> {
        let (rows, cols, groups, xg) = (m.rows as i32, m.cols as i32, m.groups as i32, m.xg as i32);
        let (os, oo, xs, xo, n32) = (m.os as i32, m.oo as i32, m.xs as i32, m.xo as i32, n as i32);
        let (out, w, x) = (m.out.ptr(), m.w.ptr(), m.x.ptr());
        // `m_matvec`: one warp per output (a Lanes32 sum); `m_matvec_t`: one thread per
        // output (an ascending sum).
        let (f, cfg, name) = if transposed {
            (&self.f.matvec_t, grid(n * m.groups * m.cols), "m_matvec_t")
        } else {
            (&self.f.matvec, warps(n * m.groups * m.rows), "m_matvec")
        };
        // SAFETY: every buffer is sized for `t_max ≥ n` tokens of these widths.
        unsafe {
            dsa_kv_cuda::launch!(
                self.stream(), f, cfg, self.gpu.ordinal(), name;
                &out, &os, &oo, &w, &rows, &cols, &x, &xs, &xo, &groups, &xg, &n32,
            )
        }
        .map_err(cuda)
    }

    fn rmsnorm(&self, out: &DeviceBuffer, x: &DeviceBuffer, n: usize) -> Result<(), ForwardError> {
        let (o, xp, n32, h) = (
            out.ptr(),
            x.ptr(),
            n as i32,
            self.model.config().hidden as i32,
        );
        // SAFETY: `[n, hidden]` floats in both buffers.
        unsafe {
            dsa_kv_cuda::launch!(
                self.stream(), &self.f.rmsnorm, warps(n), self.gpu.ordinal(), "m_rmsnorm";
                &o, &xp, &n32, &h,
            )
        }
        .map_err(cuda)
    }

    fn elementwise(
        &self,
        f: &CudaFunction,
        a: &DeviceBuffer,
        b2: Option<&DeviceBuffer>,
        len: usize,
    ) -> Result<(), ForwardError> {
        let (ap, len64) = (a.ptr(), len as i64);
        let bp = b2.map(|b| b.ptr());
        let (stream, c, dev) = (self.stream(), grid(len), self.gpu.ordinal());
        // SAFETY: `len` floats in each buffer.
        match &bp {
            Some(bp) => unsafe {
                dsa_kv_cuda::launch!(stream, f, c, dev, "elementwise"; &ap, bp, &len64)
            },
            None => unsafe { dsa_kv_cuda::launch!(stream, f, c, dev, "elementwise"; &ap, &len64) },
        }
        .map_err(cuda)
    }

    /// RoPE on `count` 64-wide vectors per token of `buf` (`stride` floats per token,
    /// vector `k` at `off + k × kstride`).
    fn rope(
        &self,
        buf: &DeviceBuffer,
        stride: usize,
        off: usize,
        count: usize,
        kstride: usize,
        n: usize,
    ) -> Result<(), ForwardError> {
        let (p, st, of, cnt, ks, pos, tab, n32) = (
            buf.ptr(),
            stride as i32,
            off as i32,
            count as i32,
            kstride as i32,
            self.s.pos.ptr(),
            self.rope.ptr(),
            n as i32,
        );
        let c = grid(n * count * 32);
        // SAFETY: positions below `max_ctx` (the table's rows), buffers sized for `n`.
        unsafe {
            dsa_kv_cuda::launch!(
                self.stream(), &self.f.rope, c, self.gpu.ordinal(), "m_rope";
                &p, &st, &of, &cnt, &ks, &pos, &tab, &n32,
            )
        }
        .map_err(cuda)
    }

    fn to_bf16(
        &self,
        dst: &DeviceBuffer,
        src: &DeviceBuffer,
        len: usize,
    ) -> Result<(), ForwardError> {
        let (d, s, l) = (dst.ptr(), src.ptr(), len as i64);
        // SAFETY: `len` elements in both.
        unsafe {
            dsa_kv_cuda::launch!(
                self.stream(), &self.f.to_bf16, grid(len), self.gpu.ordinal(), "m_to_bf16";
                &d, &s, &l,
            )
        }
        .map_err(cuda)
    }

    /// `x ← embedding(tok)`.
    fn embed(&self, n: usize) -> Result<(), ForwardError> {
        let c = self.model.config();
        let (x, tok, e, n32, h, v) = (
            self.s.x.ptr(),
            self.s.tok.ptr(),
            self.embed.ptr(),
            n as i32,
            c.hidden as i32,
            c.vocab as i32,
        );
        let g = grid(n * c.hidden);
        // SAFETY: `n` tokens, ids reduced modulo the vocabulary.
        unsafe {
            dsa_kv_cuda::launch!(
                self.stream(), &self.f.embed, g, self.gpu.ordinal(), "m_embed";
                &x, &tok, &e, &n32, &h, &v,
            )
        }
        .map_err(cuda)
    }

    /// Writes the KV of layer weights `w` for the `n` tokens (normed inputs in `xn`)
    /// into `cache` through the slot mappings of `m`.
    fn write_kv(&self, w: &DevLayer, dst: KvDst, n: usize) -> Result<(), ForwardError> {
        let h = self.model.config().hidden;
        let s = &self.s;
        let op = |w, rows, out, os, oo| MatOp {
            w,
            rows,
            cols: h,
            out,
            os,
            oo,
            x: &s.xn,
            xs: h,
            xo: 0,
            groups: 1,
            xg: 0,
        };
        self.matvec(op(&w.w_dkv, LATENT, &s.kv, ROW, 0), n, false)?;
        self.matvec(op(&w.w_kr, ROPE, &s.kv, ROW, LATENT), n, false)?;
        self.rope(&s.kv, ROW, LATENT, 1, 0, n)?;
        self.to_bf16(&s.kvbf, &s.kv, n * ROW)?;
        let k = self.gpu.kernels();
        let dev = self.gpu.ordinal();
        // SAFETY: rows for `n` tokens; the slot mapping holds `n` entries (−1: skip);
        // the view is the batch's pool.
        unsafe {
            k.mla_scatter(
                self.stream(),
                dev,
                dst.rows,
                dst.enc,
                s.kvbf.ptr(),
                dst.mla_slots,
                n,
                None,
            )
        }
        .map_err(cuda)?;
        if let Some((base, len, vmap, smap)) = dst.indexer {
            self.matvec(op(&w.w_ik, INDEX_DIM, &s.key, INDEX_DIM, 0), n, false)?;
            self.rope(&s.key, INDEX_DIM, 0, 1, 0, n)?;
            self.to_bf16(&s.keybf, &s.key, n * INDEX_DIM)?;
            // SAFETY: `n` keys and mappings; the cache view is the batch's.
            unsafe {
                k.quantize_indexer(
                    self.stream(),
                    dev,
                    s.keybf.ptr(),
                    s.keyv.ptr(),
                    s.keys.ptr(),
                    n,
                    false,
                    true,
                )
                .map_err(cuda)?;
                k.indexer_k_scatter(
                    self.stream(),
                    dev,
                    base,
                    len,
                    s.keyv.ptr(),
                    s.keys.ptr(),
                    vmap,
                    smap,
                    n,
                    INDEX_DIM,
                    None,
                )
                .map_err(cuda)?;
            }
        }
        Ok(())
    }

    /// One target layer for `n` tokens: KV, indexer top-k, sparse MLA, MLP.
    fn layer(
        &self,
        w: &DevLayer,
        cache: &LayerCache,
        m: &MetadataView,
        n: usize,
    ) -> Result<(), ForwardError> {
        self.rmsnorm(&self.s.xn, &self.s.x, n)?;
        self.write_kv(w, KvDst::of(cache, m)?, n)?;
        self.attend_mlp(w, cache, m, n, None)
    }

    /// The attention (indexer top-k, sparse MLA over `cache`, plus the overlay of a draft
    /// chain) and the MLP of layer weights `w` for `n` tokens whose normed inputs are in
    /// `xn`; adds both to `x`.
    fn attend_mlp(
        &self,
        w: &DevLayer,
        cache: &LayerCache,
        m: &MetadataView,
        n: usize,
        ov: Option<Overlay>,
    ) -> Result<(), ForwardError> {
        let c = *self.model.config();
        let (h, ih, heads) = (c.hidden, c.index_heads, c.heads);
        let s = &self.s;
        let mla = cache.mla.ok_or_else(|| {
            ForwardError::framework(ModelError::Access("a layer without an MLA cache".into()))
        })?;
        let (ov_last, ov_keys, ov_rows) = ov.map_or((0, 0, 0), |o| (o.last, o.keys, o.rows));
        let op = |w, rows, out, os, oo| MatOp {
            w,
            rows,
            cols: h,
            out,
            os,
            oo,
            x: &s.xn,
            xs: h,
            xo: 0,
            groups: 1,
            xg: 0,
        };
        let cols = m.max_blocks_per_seq as i32;
        let (n32, max_ctx) = (n as i32, self.max_ctx as i32);
        let (fail, dev) = (s.fail.ptr(), self.gpu.ordinal());
        let use_index = i32::from(cache.indexer.is_some());
        if let Some(ix) = cache.indexer {
            self.matvec(
                MatOp {
                    groups: ih,
                    ..op(&w.w_iq, INDEX_DIM, &s.q, ih * INDEX_DIM, 0)
                },
                n,
                false,
            )?;
            self.rope(&s.q, ih * INDEX_DIM, 0, ih, INDEX_DIM, n)?;
            self.to_bf16(&s.qbf, &s.q, n * ih * INDEX_DIM)?;
            // SAFETY: `n × ih` query vectors of 128.
            unsafe {
                self.gpu.kernels().quantize_indexer(
                    self.stream(),
                    self.gpu.ordinal(),
                    s.qbf.ptr(),
                    s.qv.ptr(),
                    s.qs.ptr(),
                    n * ih,
                    false,
                    true,
                )
            }
            .map_err(cuda)?;
            self.matvec(op(&w.w_iw, ih, &s.iw, ih, 0), n, false)?;
            let (ih32, tpp) = (ih as i32, ix.tokens_per_page as i32);
            let args = (
                s.scores.ptr(),
                s.pos.ptr(),
                s.row.ptr(),
                s.qv.ptr(),
                s.qs.ptr(),
                s.iw.ptr(),
                m.indexer_page_table.addr,
            );
            // One block of 8 warps per (64 positions, token), the token's dequantized
            // queries in shared memory.
            let g = LaunchConfig {
                grid_dim: (self.max_ctx.div_ceil(64) as u32, n.max(1) as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: (ih * INDEX_DIM * 4) as u32,
            };
            // SAFETY: the page tables of this step's rows; a position whose block-table
            // entry is −1 or whose page is past the pool sets the fail flag and reads
            // nothing.
            unsafe {
                dsa_kv_cuda::launch!(
                    self.stream(), &self.f.index_scores, g, dev, "m_index_scores";
                    &args.0, &max_ctx, &args.1, &args.2, &args.3, &args.4, &args.5, &ih32,
                    &args.6, &m.block_table.addr, &cols, &ix.base, &ix.page_bytes, &ix.pages,
                    &tpp, &ov_last, &ov_keys, &fail, &n32,
                )
            }
            .map_err(cuda)?;
        }
        let topk = c.topk as i32;
        let (sel, nsel, scores, pos) = (s.sel.ptr(), s.nsel.ptr(), s.scores.ptr(), s.pos.ptr());
        // m_topk's `rank` scratch is unused (the V4 forward still passes one).
        let no_rank = 0u64;
        // SAFETY: `max_ctx` entries per token in every buffer.
        unsafe {
            dsa_kv_cuda::launch!(
                self.stream(), &self.f.topk, blocks(n, 256), dev, "m_topk";
                &sel, &nsel, &no_rank, &scores, &max_ctx, &pos, &topk, &use_index, &n32,
            )
        }
        .map_err(cuda)?;
        // Every head at once: the heads' matrices are stacked.
        self.matvec(
            MatOp {
                groups: heads,
                ..op(&w.w_qn, c.nope_dim, &s.qn, heads * c.nope_dim, 0)
            },
            n,
            false,
        )?;
        self.matvec(
            MatOp {
                w: &w.w_uk,
                rows: c.nope_dim,
                cols: LATENT,
                out: &s.qlat,
                os: heads * LATENT,
                oo: 0,
                x: &s.qn,
                xs: heads * c.nope_dim,
                xo: 0,
                groups: heads,
                xg: c.nope_dim,
            },
            n,
            true,
        )?;
        self.matvec(
            MatOp {
                groups: heads,
                ..op(&w.w_qr, ROPE, &s.qpe, heads * ROPE, 0)
            },
            n,
            false,
        )?;
        self.rope(&s.qpe, heads * ROPE, 0, heads, ROPE, n)?;
        let enc = i32::from(mla.encoding == KvDtype::Fp8DsMla);
        let scale = 1.0 / ((c.nope_dim + ROPE) as f32).sqrt();
        let mla_pages = mla.rows.pages as i32;
        let (heads32, tpp, rb) = (
            heads as i32,
            mla.rows.tokens_per_page as i32,
            mla.rows.row_bytes as i32,
        );
        let (olat, qlat, qpe, ebuf, rowp, row, bt) = (
            s.olat.ptr(),
            s.qlat.ptr(),
            s.qpe.ptr(),
            s.ebuf.ptr(),
            s.rowp.ptr(),
            s.row.ptr(),
            m.block_table.addr,
        );
        // One block of 8 warps per (16 selected rows, token), a warp per row (every
        // head's score), the token's queries in shared memory.
        let g = LaunchConfig {
            grid_dim: (self.max_ctx.div_ceil(16) as u32, n.max(1) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (heads * ROW * 4) as u32,
        };
        // SAFETY: selected positions are cached (−1 block-table entries set the flag and
        // read nothing); `ebuf` holds `max_ctx` floats per (token, head), `rowp`
        // `max_ctx` addresses per token.
        unsafe {
            dsa_kv_cuda::launch!(
                self.stream(), &self.f.attn_scores, g, dev, "m_attn_scores";
                &ebuf, &rowp, &qlat, &qpe, &sel, &nsel, &max_ctx, &pos, &row, &bt, &cols,
                &mla.rows.base, &mla.rows.page_stride, &mla_pages, &tpp, &rb, &enc, &scale,
                &heads32, &ov_last, &ov_rows, &fail, &n32,
            )
        }
        .map_err(cuda)?;
        // One block of 128 threads per (128 output elements, token, head).
        let g = LaunchConfig {
            grid_dim: ((LATENT / 128) as u32, (n * heads).max(1) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads the scores and row addresses m_attn_scores wrote (a 0 address
        // is skipped).
        unsafe {
            dsa_kv_cuda::launch!(
                self.stream(), &self.f.attn_out, g, dev, "m_attn_out";
                &olat, &ebuf, &rowp, &nsel, &max_ctx, &pos, &enc, &heads32, &n32,
            )
        }
        .map_err(cuda)?;
        self.matvec(
            MatOp {
                w: &w.w_uv,
                rows: c.v_dim,
                cols: LATENT,
                out: &s.hv,
                os: heads * c.v_dim,
                oo: 0,
                x: &s.olat,
                xs: heads * LATENT,
                xo: 0,
                groups: heads,
                xg: LATENT,
            },
            n,
            false,
        )?;
        self.matvec(
            MatOp {
                w: &w.w_o,
                rows: h,
                cols: heads * c.v_dim,
                out: &s.attn,
                os: h,
                oo: 0,
                x: &s.hv,
                xs: heads * c.v_dim,
                xo: 0,
                groups: 1,
                xg: 0,
            },
            n,
            false,
        )?;
        self.elementwise(&self.f.add, &s.x, Some(&s.attn), n * h)?;
        self.rmsnorm(&s.xn, &s.x, n)?;
        self.matvec(op(&w.w_1, c.mlp, &s.hm, c.mlp, 0), n, false)?;
        self.elementwise(&self.f.relu, &s.hm, None, n * c.mlp)?;
        self.matvec(
            MatOp {
                w: &w.w_2,
                rows: h,
                cols: c.mlp,
                out: &s.mo,
                os: h,
                oo: 0,
                x: &s.hm,
                xs: c.mlp,
                xo: 0,
                groups: 1,
                xg: 0,
            },
            n,
            false,
        )?;
        self.elementwise(&self.f.add, &s.x, Some(&s.mo), n * h)
    }

    /// The whole target forward for `n` token slots (the kernels; no host work).
    fn kernels(
        &self,
        cache: &[LayerCache],
        m: &MetadataView,
        n: usize,
    ) -> Result<(), ForwardError> {
        self.embed(n)?;
        for (w, l) in self.layers.iter().zip(cache) {
            self.layer(w, l, m, n)?;
        }
        let c = self.model.config();
        self.rmsnorm(&self.s.xn, &self.s.x, n)?;
        self.matvec(
            MatOp {
                w: &self.w_out,
                rows: c.vocab,
                cols: c.hidden,
                out: &self.s.logits,
                os: c.vocab,
                oo: 0,
                x: &self.s.xn,
                xs: c.hidden,
                xo: 0,
                groups: 1,
                xg: 0,
            },
            n,
            false,
        )
    }

    /// Uploads the step's token ids, positions and request rows (`slots` entries, the
    /// ones past the batch marked by position −1) and clears the fail flag.
    fn upload_tokens(&self, batch: &Batch<'_>, slots: usize) -> Result<usize, ForwardError> {
        let (mut tok, mut pos, mut row) = (
            Vec::with_capacity(slots),
            Vec::with_capacity(slots),
            Vec::with_capacity(slots),
        );
        for (r, req) in batch.requests.iter().enumerate() {
            for (i, t) in req.tokens.iter().enumerate() {
                tok.push(t.0);
                pos.push((req.num_cached + i as u32) as i32);
                row.push(r as i32);
            }
        }
        self.upload_slots(tok, pos, row, slots)
    }

    /// Uploads token ids, positions and rows padded to `slots` (position −1) and clears
    /// the fail flag; returns the real token count.
    fn upload_slots(
        &self,
        mut tok: Vec<u32>,
        mut pos: Vec<i32>,
        mut row: Vec<i32>,
        slots: usize,
    ) -> Result<usize, ForwardError> {
        let n = tok.len();
        if n > self.t_max || pos.iter().any(|&p| p as usize >= self.max_ctx) {
            return Err(ForwardError::framework(ModelError::Access(format!(
                "a step of {n} tokens past the forward's {} tokens or {} positions",
                self.t_max, self.max_ctx
            ))));
        }
        tok.resize(slots.max(n), 0);
        pos.resize(slots.max(n), -1);
        row.resize(slots.max(n), 0);
        let g = &self.gpu;
        g.upload(&self.s.tok, &tok).map_err(cuda)?;
        g.upload(&self.s.pos, &pos).map_err(cuda)?;
        g.upload(&self.s.row, &row).map_err(cuda)?;
        g.upload(&self.s.fail, &[0i32]).map_err(cuda)?;
        Ok(n)
    }

    /// Reads back `n` tokens' `[n, width]` floats of `buf` (waits for the stream).
    fn download(
        &self,
        buf: &DeviceBuffer,
        n: usize,
        width: usize,
    ) -> Result<Vec<f32>, ForwardError> {
        let mut out = vec![0f32; n * width];
        self.gpu.download(buf, &mut out).map_err(cuda)?;
        Ok(out)
    }

    fn check_fail(&self) -> Result<(), ForwardError> {
        let mut f = [0i32];
        self.gpu.download(&self.s.fail, &mut f).map_err(cuda)?;
        if f[0] != 0 {
            return Err(ForwardError::framework(ModelError::Access(
                "a page-table entry the model needed was −1".into(),
            )));
        }
        Ok(())
    }

    /// Writes the MTP layer's KV of the batch's tokens into cache layer `cache`.
    fn draft_kv(&self, batch: &Batch<'_>, cache: &LayerCache) -> Result<(), ForwardError> {
        let n = self.upload_tokens(batch, 0)?;
        if n == 0 {
            return Ok(());
        }
        self.embed(n)?;
        self.rmsnorm(&self.s.xn, &self.s.x, n)?;
        self.write_kv(&self.draft, KvDst::of(cache, &batch.metadata)?, n)
    }
}

impl CudaModelForward {
    /// The pending requests' draft chains on MTP cache layer `cache` (the batch's cache
    /// and metadata hold the draft KV of every position up to each chain's `last`).
    fn propose(
        &mut self,
        batch: &Batch<'_>,
        cache: &LayerCache,
    ) -> Result<Proposals, ForwardError> {
        let pending = std::mem::take(&mut self.pending);
        let r = pending.len();
        if r == 0 || self.drafts == 0 {
            return Ok(Proposals::new());
        }
        if r > self.ov.chains {
            return Err(ForwardError::framework(ModelError::Access(format!(
                "{r} draft chains past the forward's {}",
                self.ov.chains
            ))));
        }
        let c = *self.model.config();
        let g = self.gpu.clone();
        let hidden: Vec<f32> = pending
            .iter()
            .flat_map(|p| p.hidden.iter().copied())
            .collect();
        g.upload(&self.s.x, &hidden).map_err(cuda)?;
        let last: Vec<i32> = pending.iter().map(|p| p.last as i32).collect();
        g.upload(&self.ov.last, &last).map_err(cuda)?;
        let mla = cache.mla.ok_or_else(|| {
            ForwardError::framework(ModelError::Access("the MTP layer has no MLA cache".into()))
        })?;
        let rb = u64::from(mla.rows.row_bytes);
        let mut dst = KvDst::of(cache, &batch.metadata)?;
        dst.rows = DevRows {
            pool: self.ov.rows.ptr(),
            pool_len: self.ov.rows.len() as u64,
            base: 0,
            block_stride: 64 * rb,
            tokens_per_block: 64,
        };
        dst.mla_slots = self.ov.slots.ptr();
        let page = (64 * (INDEX_DIM + 4)) as i64;
        dst.indexer = dst.indexer.map(|_| {
            (
                self.ov.keys.ptr(),
                self.ov.keys.len() as u64,
                self.ov.vmap.ptr(),
                self.ov.smap.ptr(),
            )
        });
        let ov = Overlay {
            last: self.ov.last.ptr(),
            keys: self.ov.keys.ptr(),
            rows: self.ov.rows.ptr(),
        };
        let mut toks: Vec<u32> = pending.iter().map(|p| p.next).collect();
        let mut proposals = vec![Vec::with_capacity(self.drafts); r];
        let s = &self.s;
        for i in 0..self.drafts {
            let pos = pending
                .iter()
                .map(|p| (p.last + 1) as i32 + i as i32)
                .collect();
            let row = pending.iter().map(|p| p.row as i32).collect();
            self.upload_slots(toks.clone(), pos, row, 0)?;
            let idx = |k: usize, off: i64| k as i64 * off + i as i64;
            let slots: Vec<i64> = (0..r).map(|k| idx(k, 64)).collect();
            let vmap: Vec<i64> = (0..r).map(|k| k as i64 * page + i as i64 * 128).collect();
            let smap: Vec<i64> = (0..r)
                .map(|k| k as i64 * page + 64 * 128 + i as i64 * 4)
                .collect();
            g.upload(&self.ov.slots, &slots).map_err(cuda)?;
            g.upload(&self.ov.vmap, &vmap).map_err(cuda)?;
            g.upload(&self.ov.smap, &smap).map_err(cuda)?;
            // x = embedding(token) + rmsnorm(previous hidden); the chain's KV from the
            // normed embedding, into the overlay.
            self.rmsnorm(&s.mo, &s.x, r)?;
            self.embed(r)?;
            self.rmsnorm(&s.xn, &s.x, r)?;
            self.write_kv(&self.draft, dst, r)?;
            self.elementwise(&self.f.add, &s.x, Some(&s.mo), r * c.hidden)?;
            self.rmsnorm(&s.xn, &s.x, r)?;
            self.attend_mlp(&self.draft, cache, &batch.metadata, r, Some(ov))?;
            self.rmsnorm(&s.xn, &s.x, r)?;
            self.matvec(
                MatOp {
                    w: &self.w_out,
                    rows: c.vocab,
                    cols: c.hidden,
                    out: &s.logits,
                    os: c.vocab,
                    oo: 0,
                    x: &s.xn,
                    xs: c.hidden,
                    xo: 0,
                    groups: 1,
                    xg: 0,
                },
                r,
                false,
            )?;
            let logits = self.download(&s.logits, r, c.vocab)?;
            self.check_fail()?;
            for (k, p) in pending.iter().enumerate() {
                let pos = p.last + 1 + i as u32;
                toks[k] = output_of(&logits[k * c.vocab..(k + 1) * c.vocab], pos).greedy;
                proposals[k].push(toks[k]);
            }
        }
        Ok(pending
            .iter()
            .zip(proposals)
            .map(|(p, d)| (p.id, d.into_iter().map(TokenId).collect()))
            .collect())
    }
}

impl Forward for CudaModelForward {
    fn forward(&mut self, batch: &mut Batch<'_>) -> Result<Sampling, ForwardError> {
        self.pending.clear();
        self.gpu.bind().map_err(cuda)?;
        let c = *self.model.config();
        let decode = batch
            .requests
            .iter()
            .all(|r| r.kind == dsa_kv_core::core::scheduler::RequestKind::Generation);
        // Graphs are captured per bucket of padded token counts (8, 16, 32, …, the
        // largest step), as serving engines capture batch sizes.
        let tokens: usize = batch.requests.iter().map(|r| r.tokens.len()).sum();
        let bucket = tokens.next_power_of_two().max(8).min(self.t_max);
        let graph = self.graphs && decode && tokens <= self.t_max;
        let n = self.upload_tokens(batch, if graph { bucket } else { 0 })?;
        if n == 0 {
            return Ok(Sampling::Sampled(Sampled::default()));
        }
        let cache = &batch.cache.layers[..c.layers];
        let m = batch.metadata;
        if graph {
            let addrs: Vec<u64> = m.buffers().iter().map(|b| b.addr).collect();
            if self.graph.get(&bucket).is_some_and(|(_, at)| *at != addrs) {
                self.graph.remove(&bucket);
            }
            if !self.graph.contains_key(&bucket) {
                let stream = self.stream().clone();
                stream
                    .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(launch_err("begin_capture"))?;
                let r = self.kernels(cache, &m, bucket);
                let g = stream
                    .end_capture(sys::CUgraphInstantiate_flags(0))
                    .map_err(launch_err("end_capture"))?;
                r?;
                let g = g.ok_or_else(|| ForwardError::Unsupported {
                    what: "CUDA graph capture gave an empty graph".into(),
                })?;
                self.graph.insert(bucket, (Graph(g), addrs));
            }
            let (g, _) = &self.graph[&bucket];
            g.0.launch().map_err(launch_err("graph launch"))?;
            self.graph_steps
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        } else {
            self.kernels(cache, &m, n)?;
        }
        let logits = self.download(&self.s.logits, n, c.vocab)?;
        self.check_fail()?;
        let hidden = if self.drafts > 0 {
            self.download(&self.s.x, n, c.hidden)?
        } else {
            Vec::new()
        };
        let mut t0 = 0;
        let mut outcomes = Vec::with_capacity(batch.requests.len());
        let mut kept = Vec::new();
        for (r, req) in batch.requests.iter().enumerate() {
            let k = req.tokens.len();
            let outs: Vec<_> = (0..k)
                .map(|i| {
                    let t = t0 + i;
                    output_of(
                        &logits[t * c.vocab..(t + 1) * c.vocab],
                        req.num_cached + i as u32,
                    )
                })
                .collect();
            let (keep, accepted) = verdict(req, &outs).map_err(ForwardError::framework)?;
            if self.drafts > 0 && req.produces_token {
                let t = t0 + keep;
                self.pending.push(Pending {
                    id: req.id,
                    row: r,
                    last: outs[keep].pos,
                    hidden: hidden[t * c.hidden..(t + 1) * c.hidden].to_vec(),
                    next: outs[keep].greedy,
                });
            }
            outcomes.push(RequestOutcome {
                id: req.id,
                accepted_drafts: accepted,
                next_token: req.produces_token.then_some(TokenId(outs[keep].greedy)),
            });
            if self.record.is_some() {
                kept.push((req.id, outs[..=keep].to_vec()));
            }
            t0 += k;
        }
        if let Some(record) = &self.record {
            let mut o = record.lock().unwrap_or_else(|e| e.into_inner());
            for (id, outs) in &kept {
                o.record(self.device, *id, outs);
            }
        }
        let mut drafts = Proposals::new();
        if let Mtp::Combined { layer, .. } = self.mtp {
            if let Some(l) = batch.cache.layers.get(layer) {
                let l = *l;
                self.draft_kv(batch, &l)?;
                self.check_fail()?;
                drafts = self.propose(batch, &l)?;
            }
        }
        Ok(Sampling::Sampled(
            Sampled::new(outcomes).with_drafts(drafts),
        ))
    }

    fn draft_forward(&mut self, batch: &mut Batch<'_>) -> Result<Proposals, ForwardError> {
        if let Mtp::Separate { .. } = self.mtp {
            self.gpu.bind().map_err(cuda)?;
            if let Some(l) = batch.cache.layers.first() {
                let l = *l;
                self.draft_kv(batch, &l)?;
                self.check_fail()?;
                return self.propose(batch, &l);
            }
        }
        Ok(Proposals::new())
    }
}
