//! When a request ends, decided token by token from Dynamo's stop conditions (plain,
//! synchronous logic; the serving loop applies it).
//!
//! The runtime itself ends a request at its `max_new_tokens` (`max_tokens`); everything
//! else is decided here: end-of-sequence ids (unless `ignore_eos`), stop token ids that
//! are not returned (`stop_token_ids`, `stop_token_ids_hidden`) and those that are
//! (`stop_token_ids_visible`), none of them before `min_tokens`. Stop *strings* are
//! matched on text by Dynamo's frontend, which then stops the request (the worker sees a
//! cancellation).

use dynamo_backend_common::{FinishReason, PreprocessedRequest};

/// The stop rule of one request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopRule {
    /// End-of-sequence ids (empty with `ignore_eos`): the token is not returned.
    pub eos: Vec<u32>,
    /// Stop ids whose token is not returned.
    pub hidden: Vec<u32>,
    /// Stop ids whose token is returned.
    pub visible: Vec<u32>,
    /// No stop id applies before this many generated tokens.
    pub min_tokens: u32,
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
    /// The rule of a request as the frontend preprocessed it.
    pub fn of(r: &PreprocessedRequest) -> StopRule {
        let s = &r.stop_conditions;
        let ignore_eos = s.ignore_eos.unwrap_or(false);
        let list = |v: &Option<Vec<u32>>| v.clone().unwrap_or_default();
        // `ignore_eos` drops every stop id too (`StopConditions::apply_ignore_eos`).
        if ignore_eos {
            return StopRule {
                min_tokens: s.min_tokens.unwrap_or(0),
                ..StopRule::default()
            };
        }
        let mut hidden = list(&s.stop_token_ids);
        hidden.extend(list(&s.stop_token_ids_hidden));
        StopRule {
            eos: r.eos_token_ids.clone(),
            hidden,
            visible: list(&s.stop_token_ids_visible),
            min_tokens: s.min_tokens.unwrap_or(0),
        }
    }

    /// The verdict on `token`, the `n`-th generated token (from 1).
    pub fn verdict(&self, token: u32, n: u32) -> Verdict {
        if n < self.min_tokens {
            return Verdict::Emit;
        }
        if self.eos.contains(&token) {
            Verdict::End(FinishReason::EoS)
        } else if self.hidden.contains(&token) {
            Verdict::End(FinishReason::Stop)
        } else if self.visible.contains(&token) {
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
        let rule = StopRule::of(&r);
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
        let rule = StopRule::of(&r);
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
        let rule = StopRule::of(&r);
        for t in [10, 12, 13] {
            assert_eq!(rule.verdict(t, 5), Verdict::Emit);
        }
    }
}
