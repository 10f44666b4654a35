//! Sequences decoded from a peer in counted, capped shapes: a list a peer sends is
//! refused at its first entry past the cap, and its buffer never grows past the cap
//! (plain `Vec` decoding grows by doubling for as long as the input goes on). Used with
//! `#[serde(deserialize_with = "…")]` on every list of the transfer protocol's messages.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

/// Decodes a sequence of at most `MAX` entries.
pub fn vec<'de, D, T, const MAX: usize>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    d.deserialize_seq(Capped::<T, MAX>(PhantomData))
}

/// Decodes `null` or a sequence of at most `MAX` entries.
pub fn option_vec<'de, D, T, const MAX: usize>(d: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    d.deserialize_option(CappedOption::<T, MAX>(PhantomData))
}

struct Capped<T, const MAX: usize>(PhantomData<T>);

impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for Capped<T, MAX> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a sequence of at most {MAX} entries")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let mut out: Vec<T> = Vec::new();
        while let Some(x) = seq.next_element()? {
            if out.len() == MAX {
                return Err(de::Error::custom(format_args!(
                    "more than {MAX} entries, the most this list may hold"
                )));
            }
            if out.len() == out.capacity() {
                // Doubling, but never past the cap.
                out.reserve_exact(out.len().max(4).min(MAX - out.len()));
            }
            out.push(x);
        }
        Ok(out)
    }
}

struct CappedOption<T, const MAX: usize>(PhantomData<T>);

impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for CappedOption<T, MAX> {
    type Value = Option<Vec<T>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "null or a sequence of at most {MAX} entries")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        vec::<D, T, MAX>(d).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize, Debug, PartialEq)]
    struct Msg {
        #[serde(deserialize_with = "vec::<_, _, 5>")]
        list: Vec<u32>,
        #[serde(default, deserialize_with = "option_vec::<_, _, 2>")]
        maybe: Option<Vec<String>>,
    }

    #[test]
    fn lists_up_to_the_cap_decode_and_longer_ones_are_refused() {
        let m: Msg =
            serde_json::from_str(r#"{"list": [1, 2, 3, 4, 5], "maybe": ["a", "b"]}"#).unwrap();
        assert_eq!(m.list, [1, 2, 3, 4, 5]);
        assert!(m.list.capacity() <= 5);
        assert_eq!(
            m.maybe.as_deref(),
            Some(&["a".to_string(), "b".to_string()][..])
        );
        let m: Msg = serde_json::from_str(r#"{"list": [], "maybe": null}"#).unwrap();
        assert_eq!((m.list.len(), m.maybe), (0, None));
        let m: Msg = serde_json::from_str(r#"{"list": []}"#).unwrap();
        assert_eq!(m.maybe, None);
        let e = serde_json::from_str::<Msg>(r#"{"list": [1, 2, 3, 4, 5, 6]}"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "more than 5 entries, the most this list may hold at line 1 column 27"
        );
        let e =
            serde_json::from_str::<Msg>(r#"{"list": [], "maybe": ["a", "b", "c"]}"#).unwrap_err();
        assert!(e.to_string().starts_with("more than 2 entries"), "{e}");
    }

    /// The buffer never grows past the cap, whatever the input's length.
    #[test]
    fn the_buffer_stays_within_the_cap() {
        #[derive(Deserialize)]
        struct Big {
            #[serde(deserialize_with = "vec::<_, _, 1000>")]
            list: Vec<u8>,
        }
        for n in [1usize, 3, 4, 5, 17, 500, 999, 1000] {
            let text = format!("{{\"list\": [{}]}}", vec!["7"; n].join(","));
            let b: Big = serde_json::from_str(&text).unwrap();
            assert_eq!(b.list.len(), n);
            assert!(b.list.capacity() <= 1000, "{n}: {}", b.list.capacity());
        }
    }
}
