//! When a request ends, decided token by token from Dynamo's stop conditions (plain,
//! synchronous logic; the serving loop applies it).
//!
//! The runtime itself ends a request at its `max_new_tokens` (`max_tokens`); everything
//! else is decided here: end-of-sequence ids (unless `ignore_eos`), stop token ids that
//! are not returned (`stop_token_ids`, `stop_token_ids_hidden`) and those that are
//! (`stop_token_ids_visible`), none of them before `min_tokens`. Stop *strings* are
//! matched on text by Dynamo's frontend, which then stops the request (the worker sees a
//! cancellation).
//!
//! The lists come from clients and every token of the one serving loop is checked
//! against them, so each list is bounded ([`MAX_STOP_IDS`], refused past it) and held as
//! a sorted set: a verdict is three binary searches, whatever the lists.

use dynamo_backend_common::{FinishReason, PreprocessedRequest};

/// Ids a request may send in each of `stop_token_ids`, `stop_token_ids_hidden`,
/// `stop_token_ids_visible` and `eos_token_ids`.
pub const MAX_STOP_IDS: usize = 256;

/// A request's stop-id list is longer than [`MAX_STOP_IDS`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{field} lists {len} token ids; at most {MAX_STOP_IDS} are accepted per list: send fewer \
     (stop strings are matched by the frontend and need none)"
)]
pub struct TooManyStopIds {
    /// The request's field.
    pub field: &'static str,
    /// How many ids it listed.
    pub len: usize,
}

/// Token ids, sorted and each once: membership is a binary search.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct IdSet(Box<[u32]>);

impl IdSet {
    fn of<'a>(lists: impl IntoIterator<Item = &'a [u32]>) -> IdSet {
        let mut ids: Vec<u32> = lists.into_iter().flatten().copied().collect();
        ids.sort_unstable();
        ids.dedup();
        IdSet(ids.into_boxed_slice())
    }

    fn contains(&self, token: u32) -> bool {
        self.0.binary_search(&token).is_ok()
    }
}

/// The stop rule of one request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopRule {
    /// End-of-sequence ids (empty with `ignore_eos`): the token is not returned.
    eos: IdSet,
    /// Stop ids whose token is not returned.
    hidden: IdSet,
    /// Stop ids whose token is returned.
    visible: IdSet,
    /// No stop id applies before this many generated tokens.
    min_tokens: u32,
}

/// What to do with one generated token.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Return it; the request goes on (unless it reached `max_tokens`).
    Emit,
    /// Return it, and end the request with this reason.
    EmitAndEnd(FinishReason),
    /// Do not return it; end the request with this reason.
    End(FinishReason),
}

impl StopRule {
    /// The rule of a request as the frontend preprocessed it, or which of its lists is
    /// longer than [`MAX_STOP_IDS`].
    pub fn of(r: &PreprocessedRequest) -> Result<StopRule, TooManyStopIds> {
        let s = &r.stop_conditions;
        let lists: [(&'static str, &[u32]); 4] = [
            (
                "stop_token_ids",
                s.stop_token_ids.as_deref().unwrap_or_default(),
            ),
            (
                "stop_token_ids_hidden",
                s.stop_token_ids_hidden.as_deref().unwrap_or_default(),
            ),
            (
                "stop_token_ids_visible",
                s.stop_token_ids_visible.as_deref().unwrap_or_default(),
            ),
            ("eos_token_ids", &r.eos_token_ids),
        ];
        // Checked whether or not `ignore_eos` drops them: a request is refused for what
        // it sent.
        if let Some(&(field, ids)) = lists.iter().find(|(_, ids)| ids.len() > MAX_STOP_IDS) {
            return Err(TooManyStopIds {
                field,
                len: ids.len(),
            });
        }
        let [stop, hidden, visible, eos] = lists.map(|(_, ids)| ids);
        let min_tokens = s.min_tokens.unwrap_or(0);
        // `ignore_eos` drops every stop id too (`StopConditions::apply_ignore_eos`).
        if s.ignore_eos.unwrap_or(false) {
            return Ok(StopRule {
                min_tokens,
                ..StopRule::default()
            });
        }
        Ok(StopRule {
            eos: IdSet::of([eos]),
            hidden: IdSet::of([stop, hidden]),
            visible: IdSet::of([visible]),
            min_tokens,
        })
    }

    /// The verdict on `token`, the `n`-th generated token (from 1).
    pub fn verdict(&self, token: u32, n: u32) -> Verdict {
        if n < self.min_tokens {
            return Verdict::Emit;
        }
        if self.eos.contains(token) {
            Verdict::End(FinishReason::EoS)
        } else if self.hidden.contains(token) {
            Verdict::End(FinishReason::Stop)
        } else if self.visible.contains(token) {
            Verdict::EmitAndEnd(FinishReason::Stop)
        } else {
            Verdict::Emit
        }
    }
}

#[cfg(test)]
mod tests {
    use dynamo_backend_common::{OutputOptions, SamplingOptions, StopConditions};

    use super::*;

    fn request(s: StopConditions, eos: Vec<u32>) -> PreprocessedRequest {
        PreprocessedRequest::builder()
            .model("m".to_string())
            .token_ids(vec![1, 2, 3])
            .stop_conditions(s)
            .sampling_options(SamplingOptions::default())
            .output_options(OutputOptions::default())
            .eos_token_ids(eos)
            .build()
            .unwrap()
    }

    #[test]
    fn each_kind_of_stop_id_ends_the_request_its_own_way() {
        let r = request(
            StopConditions {
                stop_token_ids: Some(vec![10]),
                stop_token_ids_hidden: Some(vec![11]),
                stop_token_ids_visible: Some(vec![12]),
                ..Default::default()
            },
            vec![13],
        );
        let rule = StopRule::of(&r).expect("within the limits");
        assert_eq!(rule.verdict(10, 1), Verdict::End(FinishReason::Stop));
        assert_eq!(rule.verdict(11, 1), Verdict::End(FinishReason::Stop));
        assert_eq!(rule.verdict(12, 1), Verdict::EmitAndEnd(FinishReason::Stop));
        assert_eq!(rule.verdict(13, 1), Verdict::End(FinishReason::EoS));
        assert_eq!(rule.verdict(14, 1), Verdict::Emit);
    }

    #[test]
    fn no_stop_before_min_tokens() {
        let r = request(
            StopConditions {
                min_tokens: Some(3),
                stop_token_ids_visible: Some(vec![12]),
                ..Default::default()
            },
            vec![13],
        );
        let rule = StopRule::of(&r).expect("within the limits");
        assert_eq!(rule.verdict(13, 1), Verdict::Emit);
        assert_eq!(rule.verdict(12, 2), Verdict::Emit);
        assert_eq!(rule.verdict(13, 3), Verdict::End(FinishReason::EoS));
        assert_eq!(rule.verdict(12, 3), Verdict::EmitAndEnd(FinishReason::Stop));
    }

    #[test]
    fn ignore_eos_drops_every_stop_id() {
        let r = request(
            StopConditions {
                ignore_eos: Some(true),
                stop_token_ids: Some(vec![10]),
                stop_token_ids_visible: Some(vec![12]),
                ..Default::default()
            },
            vec![13],
        );
        let rule = StopRule::of(&r).expect("within the limits");
        for t in [10, 12, 13] {
            assert_eq!(rule.verdict(t, 5), Verdict::Emit);
        }
    }

    #[test]
    fn long_unsorted_lists_give_the_verdicts_of_a_linear_scan() {
        // Ids with repeats, out of order, overlapping between kinds; the verdict of every
        // id must be the first list's that holds it (eos, hidden, visible), as a scan of
        // the lists in that order decides.
        let ids = |seed: u32, n: u32| -> Vec<u32> {
            (0..n).map(|i| (seed * 7919 + i * 104_729) % 700).collect()
        };
        let (stop, hidden, visible, eos) = (ids(1, 256), ids(2, 256), ids(3, 256), ids(4, 256));
        let r = request(
            StopConditions {
                stop_token_ids: Some(stop.clone()),
                stop_token_ids_hidden: Some(hidden.clone()),
                stop_token_ids_visible: Some(visible.clone()),
                ..Default::default()
            },
            eos.clone(),
        );
        let rule = StopRule::of(&r).expect("at the limit");
        let mut seen = [0u32; 4];
        for t in 0..800 {
            let want = if eos.contains(&t) {
                Verdict::End(FinishReason::EoS)
            } else if stop.contains(&t) || hidden.contains(&t) {
                Verdict::End(FinishReason::Stop)
            } else if visible.contains(&t) {
                Verdict::EmitAndEnd(FinishReason::Stop)
            } else {
                Verdict::Emit
            };
            seen[match want {
                Verdict::End(FinishReason::EoS) => 0,
                Verdict::End(_) => 1,
                Verdict::EmitAndEnd(_) => 2,
                Verdict::Emit => 3,
            }] += 1;
            assert_eq!(rule.verdict(t, 1), want, "token {t}");
        }
        assert!(
            seen.iter().all(|&n| n > 0),
            "every verdict exercised: {seen:?}"
        );
        // Each id held once per set.
        let distinct = |l: &[&[u32]]| IdSet::of(l.iter().copied()).0.len();
        assert_eq!(rule.eos.0.len(), distinct(&[eos.as_slice()]));
        assert_eq!(
            rule.hidden.0.len(),
            distinct(&[stop.as_slice(), hidden.as_slice()])
        );
        assert!(
            rule.hidden.0.windows(2).all(|w| w[0] < w[1]),
            "sorted, no repeats"
        );
    }

    #[test]
    fn a_list_past_the_limit_is_refused_naming_it() {
        let long: Vec<u32> = (0..MAX_STOP_IDS as u32 + 1).collect();
        let at_limit: Vec<u32> = (0..MAX_STOP_IDS as u32).collect();
        let r = request(
            StopConditions {
                stop_token_ids_hidden: Some(at_limit.clone()),
                stop_token_ids_visible: Some(long.clone()),
                // Counted even though `ignore_eos` would drop the list.
                ignore_eos: Some(true),
                ..Default::default()
            },
            at_limit,
        );
        let err = StopRule::of(&r).expect_err("257 ids");
        assert_eq!(
            err,
            TooManyStopIds {
                field: "stop_token_ids_visible",
                len: 257
            }
        );
        assert_eq!(
            err.to_string(),
            "stop_token_ids_visible lists 257 token ids; at most 256 are accepted per list: \
             send fewer (stop strings are matched by the frontend and need none)"
        );
        let r = request(StopConditions::default(), long);
        assert_eq!(StopRule::of(&r).expect_err("eos").field, "eos_token_ids");
    }
}
