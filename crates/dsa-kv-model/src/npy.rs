//! A writer of NumPy's `.npy` format, version 1.0 (what `numpy.load` reads): the magic
//! `\x93NUMPY`, version bytes `1 0`, a little-endian `u16` header length, then an ASCII
//! Python dict `{'descr': …, 'fortran_order': False, 'shape': (…), }` padded with
//! spaces to a multiple of 64 bytes and ending in `\n`, then the data in C order.

use std::io::{self, Write};
use std::path::Path;

/// An element type `.npy` can hold, little-endian.
pub(crate) trait NpyElem: Copy {
    /// NumPy's type string.
    const DESCR: &'static str;
    /// Appends the element's bytes.
    fn put(self, out: &mut Vec<u8>);
}

impl NpyElem for u8 {
    const DESCR: &'static str = "|u1";
    fn put(self, out: &mut Vec<u8>) {
        out.push(self);
    }
}

impl NpyElem for u16 {
    const DESCR: &'static str = "<u2";
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl NpyElem for i32 {
    const DESCR: &'static str = "<i4";
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl NpyElem for f32 {
    const DESCR: &'static str = "<f4";
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

/// The header of an array of `descr` elements shaped `shape`: magic, version, length,
/// the dict, padding; a multiple of 64 bytes.
pub(crate) fn header(descr: &str, shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple}, }}");
    // magic (6) + version (2) + length (2) + dict + '\n' ≡ 0 (mod 64).
    let unpadded = 10 + dict.len() + 1;
    dict.extend(std::iter::repeat_n(
        ' ',
        unpadded.next_multiple_of(64) - unpadded,
    ));
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

/// Writes `data` (C order, `shape`'s product elements) to `path`.
pub(crate) fn write<T: NpyElem>(path: &Path, shape: &[usize], data: &[T]) -> io::Result<()> {
    let n: usize = shape.iter().product();
    if n != data.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "shape {shape:?} holds {n} elements, the data {}",
                data.len()
            ),
        ));
    }
    let mut out = header(T::DESCR, shape);
    out.reserve(std::mem::size_of_val(data));
    for &v in data {
        v.put(&mut out);
    }
    std::fs::File::create(path)?.write_all(&out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Golden header bytes, as `numpy.save` writes them.
    #[test]
    fn headers_are_numpys() {
        let h = header("<f4", &[2, 3]);
        let dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
        assert_eq!(h.len(), 128);
        assert_eq!(&h[..10], b"\x93NUMPY\x01\x00\x76\x00");
        assert_eq!(&h[10..10 + dict.len()], dict.as_bytes());
        assert!(h[10 + dict.len()..127].iter().all(|&b| b == b' '));
        assert_eq!(h[127], b'\n');
        let one = header("|u1", &[5]);
        assert!(String::from_utf8_lossy(&one).contains("'shape': (5,), }"));
        assert_eq!(header("<i4", &[1, 2, 3, 4, 5, 6, 7, 8, 9]).len() % 64, 0);
    }

    #[test]
    fn data_follows_the_header_little_endian() {
        let dir = std::env::temp_dir().join(format!("dsa-kv-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npy");
        write(&p, &[2], &[1i32, -1]).unwrap();
        let b = std::fs::read(&p).unwrap();
        assert_eq!(&b[128..], [1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
        assert!(write(&p, &[3], &[1u8]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
