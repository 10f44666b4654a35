//! The msgpack payload of the vLLM / Dynamo KV-event wire format.
//!
//! A payload is one batch, always a msgpack array `[timestamp, events,
//! data_parallel_rank]` (vLLM's `KVEventBatch`, a `msgspec` struct with
//! `array_like=True`). Each event is tagged by its type and comes in one of two shapes,
//! because consumers differ ([`WireEncoding`]):
//!
//! * **array** (what vLLM sends): `["BlockStored", block_hashes, parent_block_hash,
//!   token_ids, block_size, lora_id, medium, lora_name]`, `["BlockRemoved",
//!   block_hashes, medium]`, `["AllBlocksCleared"]`;
//! * **map**: the same fields by name, with the tag under `"type"`.
//!
//! Block hashes are unsigned 64-bit integers ([`BlockKey::hash64`](dsa_kv_core::core::BlockKey::hash64));
//! `medium` is `"GPU"` or `"CPU_PINNED"`. The crate knows LoRA adapters by id: a block
//! of an adapter's scope carries `lora_id` and, as `lora_name`, the id in decimal
//! (routers salt their own block hashes with the name, so a router asked about a request
//! of adapter 7 is asked with the name `"7"`).

use serde::Serialize;

use crate::actors::EventBatch;
use dsa_kv_core::core::RouterEvent;

/// How each event of a batch is shaped on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum WireEncoding {
    /// Positional arrays, the tag first (vLLM's `array_like=True`; the default).
    #[default]
    Array,
    /// Maps by field name, the tag under `"type"`.
    Map,
}

impl std::str::FromStr for WireEncoding {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "array" => Ok(WireEncoding::Array),
            "map" => Ok(WireEncoding::Map),
            other => Err(format!(
                "unknown wire encoding {other:?}: expected \"array\" or \"map\""
            )),
        }
    }
}

#[derive(Serialize)]
struct StoredArray<'a>(
    &'static str,
    &'a [u64],
    Option<u64>,
    &'a [u32],
    u32,
    Option<u64>,
    &'static str,
    Option<String>,
);

#[derive(Serialize)]
struct RemovedArray<'a>(&'static str, &'a [u64], &'static str);

/// A one-element array (a newtype struct would serialize as the bare string).
#[derive(Serialize)]
struct ClearedArray((&'static str,));

#[derive(Serialize)]
struct StoredMap<'a> {
    #[serde(rename = "type")]
    tag: &'static str,
    block_hashes: &'a [u64],
    parent_block_hash: Option<u64>,
    token_ids: &'a [u32],
    block_size: u32,
    lora_id: Option<u64>,
    medium: &'static str,
    lora_name: Option<String>,
}

#[derive(Serialize)]
struct RemovedMap<'a> {
    #[serde(rename = "type")]
    tag: &'static str,
    block_hashes: &'a [u64],
    medium: &'static str,
}

#[derive(Serialize)]
struct ClearedMap {
    #[serde(rename = "type")]
    tag: &'static str,
}

#[derive(Serialize)]
#[serde(untagged)]
enum WireEvent<'a> {
    StoredArray(StoredArray<'a>),
    RemovedArray(RemovedArray<'a>),
    ClearedArray(ClearedArray),
    StoredMap(StoredMap<'a>),
    RemovedMap(RemovedMap<'a>),
    ClearedMap(ClearedMap),
}

fn wire_event(e: &RouterEvent, encoding: WireEncoding) -> WireEvent<'_> {
    match (e, encoding) {
        (
            RouterEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_id,
                lora_name,
            },
            _,
        ) => {
            let lora_name = lora_name
                .clone()
                .or_else(|| lora_id.map(|id| id.to_string()));
            let medium = medium.as_str();
            match encoding {
                WireEncoding::Array => WireEvent::StoredArray(StoredArray(
                    "BlockStored",
                    block_hashes,
                    *parent_block_hash,
                    token_ids,
                    *block_size,
                    *lora_id,
                    medium,
                    lora_name,
                )),
                WireEncoding::Map => WireEvent::StoredMap(StoredMap {
                    tag: "BlockStored",
                    block_hashes,
                    parent_block_hash: *parent_block_hash,
                    token_ids,
                    block_size: *block_size,
                    lora_id: *lora_id,
                    medium,
                    lora_name,
                }),
            }
        }
        (
            RouterEvent::BlockRemoved {
                block_hashes,
                medium,
            },
            WireEncoding::Array,
        ) => WireEvent::RemovedArray(RemovedArray("BlockRemoved", block_hashes, medium.as_str())),
        (
            RouterEvent::BlockRemoved {
                block_hashes,
                medium,
            },
            WireEncoding::Map,
        ) => WireEvent::RemovedMap(RemovedMap {
            tag: "BlockRemoved",
            block_hashes,
            medium: medium.as_str(),
        }),
        (RouterEvent::AllBlocksCleared, WireEncoding::Array) => {
            WireEvent::ClearedArray(ClearedArray(("AllBlocksCleared",)))
        }
        (RouterEvent::AllBlocksCleared, WireEncoding::Map) => WireEvent::ClearedMap(ClearedMap {
            tag: "AllBlocksCleared",
        }),
    }
}

/// The msgpack payload of one batch: `[timestamp, events, data_parallel_rank]`.
pub fn encode_batch(
    batch: &EventBatch,
    encoding: WireEncoding,
    data_parallel_rank: Option<i32>,
) -> Vec<u8> {
    let events: Vec<WireEvent<'_>> = batch
        .events
        .iter()
        .map(|e| wire_event(e, encoding))
        .collect();
    let payload = (batch.timestamp, events, data_parallel_rank);
    // Maps name their fields; arrays (tuples, tuple structs) stay positional either way.
    rmp_serde::to_vec_named(&payload)
        .expect("invariant: msgpack encoding of plain numbers, strings and lists cannot fail")
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsa_kv_core::core::Medium;

    #[test]
    fn medium_wire_names_are_the_serde_names() {
        for m in [Medium::Gpu, Medium::CpuPinned] {
            assert_eq!(
                serde_json::to_string(&m).unwrap(),
                format!("\"{}\"", m.as_str())
            );
        }
    }

    fn batch() -> EventBatch {
        EventBatch {
            seq: 3,
            timestamp: 1.5,
            events: vec![
                RouterEvent::BlockStored {
                    block_hashes: vec![u64::MAX],
                    parent_block_hash: None,
                    token_ids: vec![1, 2],
                    block_size: 2,
                    medium: Medium::Gpu,
                    lora_id: Some(7),
                    lora_name: None,
                },
                RouterEvent::BlockRemoved {
                    block_hashes: vec![5],
                    medium: Medium::CpuPinned,
                },
                RouterEvent::AllBlocksCleared,
            ],
        }
    }

    /// Byte-exact golden payloads, written out by hand from the msgpack spec.
    #[test]
    fn array_payload_is_byte_exact() {
        let got = encode_batch(&batch(), WireEncoding::Array, Some(0));
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x93); // three events
                         // ["BlockStored", [u64::MAX], nil, [1, 2], 2, 7, "GPU", "7"]
        want.push(0x98);
        want.push(0xab);
        want.extend_from_slice(b"BlockStored");
        want.extend_from_slice(&[0x91, 0xcf]);
        want.extend_from_slice(&u64::MAX.to_be_bytes());
        want.extend_from_slice(&[0xc0, 0x92, 0x01, 0x02, 0x02, 0x07, 0xa3]);
        want.extend_from_slice(b"GPU");
        want.extend_from_slice(&[0xa1, b'7']);
        // ["BlockRemoved", [5], "CPU_PINNED"]
        want.extend_from_slice(&[0x93, 0xac]);
        want.extend_from_slice(b"BlockRemoved");
        want.extend_from_slice(&[0x91, 0x05, 0xaa]);
        want.extend_from_slice(b"CPU_PINNED");
        // ["AllBlocksCleared"]
        want.extend_from_slice(&[0x91, 0xb0]);
        want.extend_from_slice(b"AllBlocksCleared");
        want.push(0x00); // data_parallel_rank 0
        assert_eq!(got, want);
    }

    #[test]
    fn map_payload_names_every_field() {
        let got = encode_batch(&batch(), WireEncoding::Map, None);
        // The batch stays an array of three; the events are maps.
        assert_eq!(&got[..2], &[0x93, 0xcb]);
        assert_eq!(*got.last().unwrap(), 0xc0, "rank nil");
        let text = String::from_utf8_lossy(&got);
        for field in [
            "type",
            "BlockStored",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "BlockRemoved",
            "AllBlocksCleared",
            "CPU_PINNED",
        ] {
            assert!(text.contains(field), "{field} missing");
        }
        // The stored event is a map of 8 entries, the removed one of 3, the clear of 1.
        let stored_at = got.windows(1).position(|w| w[0] == 0x88).expect("fixmap 8");
        assert_eq!(
            got[stored_at + 1..stored_at + 6],
            [0xa4, b't', b'y', b'p', b'e']
        );
        assert!(got.contains(&0x83), "fixmap 3");
        assert!(got.contains(&0x81), "fixmap 1");
    }

    #[test]
    fn encoding_names_parse() {
        assert_eq!("array".parse(), Ok(WireEncoding::Array));
        assert_eq!("map".parse(), Ok(WireEncoding::Map));
        assert!("json"
            .parse::<WireEncoding>()
            .unwrap_err()
            .contains("array"));
    }
}
