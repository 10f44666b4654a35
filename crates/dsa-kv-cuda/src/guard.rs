//! From a step's fail flag (`kernels/guard.cu`) back to the error the host reference
//! gives for the same batch. Pure host code, so it is tested against the host reference
//! on every branch without a GPU.

use super::kernels::GuardFailure;
use dsa_kv_core::ops::mla::RowView;
use dsa_kv_core::ops::OpError;

/// One guarded write of a step, by its op number: what the host reference checks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum GuardedOp {
    /// An indexer scatter into a layer view of `cache_len` bytes: payloads of `width`
    /// bytes at the value mappings, 4-byte scale words at the scale mappings.
    Indexer { cache_len: u64, width: u64 },
    /// An MLA scatter through a row view of a `cache_len`-byte pool (and, for NVFP4, a
    /// block-scale view of its own pool), at the token-slot mappings.
    Mla {
        view: RowView,
        cache_len: u64,
        scales: Option<(RowView, u64)>,
    },
}

/// The step's mappings the guarded ops read (host copies of what was uploaded).
#[derive(Clone, Copy)]
pub(crate) struct GuardMaps<'a> {
    pub(crate) value: &'a [i64],
    pub(crate) scale: &'a [i64],
    pub(crate) rows: &'a [i64],
}

/// What the guard kernels would leave in the flag for op number `index` alone: its first
/// out-of-range token (value / data row before scale word / scale row), computed on the
/// host from the same mappings, so a step is refused before the op is enqueued and the
/// device never has to be asked.
pub(crate) fn host_check(op: &GuardedOp, index: u32, maps: GuardMaps<'_>) -> Option<GuardFailure> {
    let first = |map: &[i64], bad: &dyn Fn(i64) -> bool| map.iter().position(|&o| o >= 0 && bad(o));
    let candidates: [(Option<usize>, u32); 2] = match *op {
        GuardedOp::Indexer { cache_len, width } => [
            (first(maps.value, &|o| o as u64 + width > cache_len), 0),
            (first(maps.scale, &|o| o as u64 + 4 > cache_len), 1),
        ],
        GuardedOp::Mla {
            view,
            cache_len,
            scales,
        } => [
            (
                first(maps.rows, &|s| {
                    view.offset(s) + u64::from(view.row_bytes) > cache_len
                }),
                0,
            ),
            (
                scales.and_then(|(sv, len)| {
                    first(maps.rows, &|s| sv.offset(s) + u64::from(sv.row_bytes) > len)
                }),
                1,
            ),
        ],
    };
    candidates
        .iter()
        .filter_map(|&(t, which)| t.map(|t| (t, which)))
        .min()
        .map(|(token, which)| GuardFailure {
            op: index,
            token,
            which,
        })
}

/// The host reference's error for the failure the flag names, or why the flag cannot be
/// right (an op or token the step does not have).
pub(crate) fn guard_error(
    ops: &[GuardedOp],
    f: GuardFailure,
    maps: GuardMaps<'_>,
) -> Result<OpError, String> {
    let op = ops
        .get(f.op as usize)
        .ok_or_else(|| format!("fail flag names op {} of {}", f.op, ops.len()))?;
    let at = |map: &[i64], what: &str| {
        map.get(f.token).copied().ok_or_else(|| {
            format!(
                "fail flag names {what} mapping {} of {}",
                f.token,
                map.len()
            )
        })
    };
    let (offset, bytes, cache_len) = match (*op, f.which) {
        (GuardedOp::Indexer { cache_len, width }, 0) => {
            (at(maps.value, "value")?, width, cache_len)
        }
        (GuardedOp::Indexer { cache_len, .. }, _) => (at(maps.scale, "scale")?, 4, cache_len),
        (
            GuardedOp::Mla {
                view, cache_len, ..
            },
            0,
        ) => {
            let off = view.offset(at(maps.rows, "row")?);
            (off as i64, u64::from(view.row_bytes), cache_len)
        }
        (GuardedOp::Mla { scales, .. }, _) => {
            let (view, len) =
                scales.ok_or("fail flag names the scale view of a row op without one")?;
            let off = view.offset(at(maps.rows, "row")?);
            (off as i64, u64::from(view.row_bytes), len)
        }
    };
    Ok(OpError::OutOfBounds {
        token: f.token,
        offset,
        end: offset + bytes as i64,
        cache_len: cache_len as usize,
    })
}

#[cfg(test)]
mod tests {
    //! Each branch against the host reference: the flag a guard kernel would leave (the
    //! first out-of-range token, value before scale), turned back into an error, must be
    //! the error the host op returns for the same batch.

    use half::bf16;

    use super::*;
    use dsa_kv_core::ops::indexer_k::{indexer_k_scatter, IndexerMappings};
    use dsa_kv_core::ops::mla::{mla_scatter_fp8, mla_scatter_nvfp4};

    /// What `guard_offsets` leaves for one op: min over (token << 1 | which).
    fn flag_offsets(op: u32, maps: &[(&[i64], u64, u32)], cache_len: u64) -> Option<GuardFailure> {
        let mut best: Option<(usize, u32)> = None;
        for &(map, bytes, which) in maps {
            for (t, &o) in map.iter().enumerate() {
                if o >= 0 && o as u64 + bytes > cache_len {
                    best = best.min_by_key_opt((t, which));
                }
            }
        }
        best.map(|(token, which)| GuardFailure { op, token, which })
    }

    /// What `guard_rows` leaves for one op over its views (`which` = index).
    fn flag_rows(op: u32, slots: &[i64], views: &[(RowView, u64)]) -> Option<GuardFailure> {
        let mut best: Option<(usize, u32)> = None;
        for (which, (v, len)) in views.iter().enumerate() {
            for (t, &s) in slots.iter().enumerate() {
                if s >= 0 && v.offset(s) + u64::from(v.row_bytes) > *len {
                    best = best.min_by_key_opt((t, which as u32));
                }
            }
        }
        best.map(|(token, which)| GuardFailure { op, token, which })
    }

    trait MinOpt {
        fn min_by_key_opt(self, x: (usize, u32)) -> Self;
    }
    impl MinOpt for Option<(usize, u32)> {
        fn min_by_key_opt(self, x: (usize, u32)) -> Self {
            Some(self.map_or(x, |b| b.min(x)))
        }
    }

    const NO_MAP: &[i64] = &[];

    #[test]
    fn indexer_value_and_scale_failures_give_the_host_error() {
        let len = 5 * 64 * 132;
        let n = 6;
        let vm: Vec<i64> = (0..n as i64).map(|i| i * 128).collect();
        let sm: Vec<i64> = (0..n as i64).map(|i| 64 * 128 + i * 4).collect();
        // (value map, scale map) variants: payload out at 4; scale out at 2 and payload
        // out at 4 (scale wins, earlier token); both out at token 3 (value wins).
        let cases: Vec<(Vec<i64>, Vec<i64>)> = vec![
            {
                let mut v = vm.clone();
                v[4] = len as i64 - 100;
                (v, sm.clone())
            },
            {
                let (mut v, mut s) = (vm.clone(), sm.clone());
                s[2] = len as i64 - 2;
                v[4] = len as i64;
                (v, s)
            },
            {
                let (mut v, mut s) = (vm.clone(), sm.clone());
                v[3] = len as i64;
                s[3] = len as i64;
                (v, s)
            },
        ];
        for (v, s) in cases {
            let mut cache = vec![0u8; len];
            let host = indexer_k_scatter(
                &mut cache,
                &vec![1u8; n * 128],
                &vec![2u8; n * 4],
                IndexerMappings {
                    value: &v,
                    scale: &s,
                },
                128,
            )
            .unwrap_err();
            let f = flag_offsets(7, &[(&v, 128, 0), (&s, 4, 1)], len as u64).unwrap();
            let ops = vec![
                GuardedOp::Indexer {
                    cache_len: 0,
                    width: 0
                };
                7
            ]
            .into_iter()
            .chain([GuardedOp::Indexer {
                cache_len: len as u64,
                width: 128,
            }])
            .collect::<Vec<_>>();
            let maps = GuardMaps {
                value: &v,
                scale: &s,
                rows: NO_MAP,
            };
            assert_eq!(guard_error(&ops, f, maps), Ok(host));
            // The host pre-check finds the same token as the kernels.
            assert_eq!(host_check(&ops[7], 7, maps), Some(f));
        }
    }

    #[test]
    fn row_failures_give_the_host_error() {
        let view = RowView {
            base: 576 * 64,
            block_stride: 2 * 576 * 64,
            tokens_per_block: 64,
            row_bytes: 576,
        };
        let len = 3 * view.block_stride as usize;
        let slots: Vec<i64> = vec![0, 5, -1, 64 * 3, 70];
        let mut cache = vec![0u8; len];
        let rows = vec![bf16::ONE; slots.len() * 576];
        let host = mla_scatter_fp8(&mut cache, &view, &rows, &slots, 1.0).unwrap_err();
        let f = flag_rows(0, &slots, &[(view, len as u64)]).unwrap();
        let ops = [GuardedOp::Mla {
            view,
            cache_len: len as u64,
            scales: None,
        }];
        let maps = GuardMaps {
            value: NO_MAP,
            scale: NO_MAP,
            rows: &slots,
        };
        assert_eq!(guard_error(&ops, f, maps), Ok(host));
        assert_eq!(host_check(&ops[0], 0, maps), Some(f));
        // In range: nothing to refuse.
        let ok = GuardMaps {
            rows: &slots[..2],
            ..maps
        };
        assert_eq!(host_check(&ops[0], 0, ok), None);
    }

    #[test]
    fn nvfp4_data_and_scale_failures_give_the_host_error() {
        let data = RowView {
            base: 0,
            block_stride: 64 * 288,
            tokens_per_block: 64,
            row_bytes: 288,
        };
        let scale = RowView {
            base: 0,
            block_stride: 64 * 36,
            tokens_per_block: 64,
            row_bytes: 36,
        };
        // The scale pool holds one block less: slot 130 fails its scale row only; slot
        // 200 fails both (data first).
        for (slots, data_blocks, scale_blocks) in [
            (vec![1i64, 130, 200], 4usize, 2usize),
            (vec![1i64, 200, 130], 3, 2),
        ] {
            let (dl, sl) = (data_blocks * 64 * 288, scale_blocks * 64 * 36);
            let (mut dc, mut sc) = (vec![0u8; dl], vec![0u8; sl]);
            let rows = vec![bf16::ONE; slots.len() * 576];
            let host =
                mla_scatter_nvfp4(&mut dc, &data, &mut sc, &scale, &rows, &slots).unwrap_err();
            let f = flag_rows(2, &slots, &[(data, dl as u64), (scale, sl as u64)]).unwrap();
            let mla = GuardedOp::Mla {
                view: data,
                cache_len: dl as u64,
                scales: Some((scale, sl as u64)),
            };
            let ops = [mla, mla, mla];
            let maps = GuardMaps {
                value: NO_MAP,
                scale: NO_MAP,
                rows: &slots,
            };
            assert_eq!(guard_error(&ops, f, maps), Ok(host), "slots {slots:?}");
            assert_eq!(host_check(&mla, 2, maps), Some(f), "slots {slots:?}");
        }
    }

    #[test]
    fn a_flag_naming_what_the_step_lacks_is_an_error_not_a_panic() {
        let ops = [GuardedOp::Indexer {
            cache_len: 10,
            width: 4,
        }];
        let maps = GuardMaps {
            value: &[1],
            scale: &[1],
            rows: NO_MAP,
        };
        let bad_op = GuardFailure {
            op: 3,
            token: 0,
            which: 0,
        };
        assert!(guard_error(&ops, bad_op, maps).is_err());
        let bad_token = GuardFailure {
            op: 0,
            token: 9,
            which: 1,
        };
        assert!(guard_error(&ops, bad_token, maps).is_err());
        let no_scales = GuardFailure {
            op: 0,
            token: 0,
            which: 1,
        };
        let mla = [GuardedOp::Mla {
            view: RowView {
                base: 0,
                block_stride: 64,
                tokens_per_block: 64,
                row_bytes: 1,
            },
            cache_len: 1,
            scales: None,
        }];
        let rows = GuardMaps {
            value: NO_MAP,
            scale: NO_MAP,
            rows: &[5],
        };
        assert!(guard_error(&mla, no_scales, rows).is_err());
    }
}
