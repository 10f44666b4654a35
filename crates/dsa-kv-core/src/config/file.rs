//! Reading a file a user or a checkpoint names, bounded: it must be a regular file (a
//! link to `/dev/zero` would grow memory without end, a FIFO would hang the reader), no
//! longer than the caller's limit, and never more than that many bytes are read even if
//! it grows while being read.

use std::io::Read;
use std::path::Path;

/// The largest configuration file read (an engine configuration, a checkpoint's
/// `config.json`): 1 MiB, far above the few KiB they take.
pub const MAX_CONFIG_FILE_BYTES: u64 = 1 << 20;

/// Why a file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// Opening or reading failed.
    #[error("{0}")]
    Io(String),
    /// Not a regular file.
    #[error("not a regular file (a {kind}): name the file itself")]
    NotRegular {
        /// What it is: directory, FIFO, character device, …
        kind: &'static str,
    },
    /// Longer than the limit.
    #[error("{len} bytes, over the limit of {max} bytes for this file")]
    TooLarge {
        /// Its length (at least; a file that grows while read is cut at `max + 1`).
        len: u64,
        /// The limit.
        max: u64,
    },
}

/// Reads the regular file at `path` (after following links), at most `max_bytes` long.
///
/// The file is opened without blocking (so a FIFO with no writer is refused, not waited
/// on) and checked on the open descriptor, so a file swapped for another kind after a
/// check is still caught.
pub fn read_regular(path: &Path, max_bytes: u64) -> Result<Vec<u8>, FileError> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let file = opts.open(path).map_err(|e| FileError::Io(e.to_string()))?;
    let meta = file.metadata().map_err(|e| FileError::Io(e.to_string()))?;
    if !meta.is_file() {
        return Err(FileError::NotRegular {
            kind: kind_of(&meta.file_type()),
        });
    }
    if meta.len() > max_bytes {
        return Err(FileError::TooLarge {
            len: meta.len(),
            max: max_bytes,
        });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| FileError::Io(e.to_string()))?;
    if bytes.len() as u64 > max_bytes {
        return Err(FileError::TooLarge {
            len: bytes.len() as u64,
            max: max_bytes,
        });
    }
    Ok(bytes)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_text(path: &Path, max_bytes: u64) -> Result<String, FileError> {
    String::from_utf8(read_regular(path, max_bytes)?)
        .map_err(|e| FileError::Io(format!("not UTF-8 text: {}", e.utf8_error())))
}

/// A JSON document that does not decode: where, and what the decoder said.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", path.as_deref().map(|p| format!("{p}: ")).unwrap_or_default())]
pub struct JsonError {
    /// The path of fields and indices to the value at fault (`kv_cache.max_tokens`,
    /// `layers[3]`); `None` at the top level.
    pub path: Option<String>,
    /// The decoder's message, with the line and column.
    pub message: String,
}

/// Parses JSON into `T`; an error names where it happened: the path of fields and
/// indices (`kv_cache.max_tokens: invalid type: string "lots", expected u64 at line 1
/// column 30`), as the TOML and YAML readers do.
pub fn json_with_path<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, JsonError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        // `?` stands for a key the decoder had not read yet (the input ended there).
        let path = e.path().to_string();
        let path = path.trim_end_matches(".?");
        JsonError {
            path: (path != "." && path != "?").then(|| path.to_string()),
            message: e.inner().to_string(),
        }
    })?;
    // Trailing characters are an error, as in `serde_json::from_str`.
    de.end().map_err(|e| JsonError {
        path: None,
        message: e.to_string(),
    })?;
    Ok(value)
}

/// The deepest nesting a YAML document may have before it is parsed (see
/// [`yaml_too_deep`]): configurations here are three levels deep.
pub const MAX_YAML_NESTING: usize = 64;

/// The first line (1-based) of `text` whose nesting, counted generously, passes `max`,
/// and that count. The count is the line's indentation in columns (a level needs at
/// least one), plus its compact entries (`- - x`, `? `), plus the flow collections
/// (`[`, `{`) open there, which may span lines; brackets inside quotes or after a
/// comment's `#` are not counted. One pass over the text: the YAML parser's own time
/// grows with the square of the depth, so the depth is checked before it runs.
pub fn yaml_too_deep(text: &str, max: usize) -> Option<(usize, usize)> {
    let mut flow = 0usize;
    for (i, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start_matches(' ').len();
        let mut rest = &line[indent..];
        let mut compact = 0;
        while let Some(r) = ["- ", "? ", "-\t", "?\t"]
            .iter()
            .find_map(|p| rest.strip_prefix(p))
        {
            compact += 1;
            rest = r.trim_start();
        }
        let mut peak = flow;
        let mut quote: Option<char> = None;
        let mut prev = ' ';
        let mut escaped = false;
        for c in rest.chars() {
            match quote {
                Some('"') if escaped => escaped = false,
                Some('"') if c == '\\' => escaped = true,
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None => match c {
                    '"' | '\'' => quote = Some(c),
                    '#' if prev == ' ' || prev == '\t' => break,
                    '[' | '{' => {
                        flow += 1;
                        peak = peak.max(flow);
                    }
                    ']' | '}' => flow = flow.saturating_sub(1),
                    _ => {}
                },
            }
            prev = c;
        }
        let depth = indent + compact + peak;
        if depth > max {
            return Some((i + 1, depth));
        }
    }
    None
}

fn kind_of(t: &std::fs::FileType) -> &'static str {
    if t.is_dir() {
        return "directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "FIFO";
        }
        if t.is_char_device() {
            return "character device";
        }
        if t.is_block_device() {
            return "block device";
        }
        if t.is_socket() {
            return "socket";
        }
    }
    "special file"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("dsa-kv-file-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&d);
        d
    }

    #[test]
    fn regular_files_up_to_the_limit_are_read() {
        let p = tmp("ok");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(read_regular(&p, 10).unwrap(), b"0123456789");
        assert_eq!(
            read_regular(&p, 9),
            Err(FileError::TooLarge { len: 10, max: 9 })
        );
        assert_eq!(read_regular_text(&p, 10).unwrap(), "0123456789");
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        assert!(matches!(read_regular_text(&p, 10), Err(FileError::Io(m)) if m.contains("UTF-8")));
        std::fs::remove_file(&p).unwrap();
        assert!(matches!(read_regular(&p, 10), Err(FileError::Io(_))));
        assert_eq!(
            read_regular(&std::env::temp_dir(), 10),
            Err(FileError::NotRegular { kind: "directory" })
        );
    }

    #[test]
    fn yaml_depth_counts_indentation_entries_and_brackets() {
        let ok = "kv_cache:\n  max_tokens: 1  # a [comment\nmodel:\n  name: \"a[b\"\n";
        assert_eq!(yaml_too_deep(ok, 4), None);
        assert_eq!(yaml_too_deep("a: [[[1]]]\n", 3), None);
        assert_eq!(yaml_too_deep("a: [[[[1]]]]\n", 3), Some((1, 4)));
        assert_eq!(yaml_too_deep("a: [\n [\n  [\n   [1]]]]\n", 5), Some((4, 7)));
        assert_eq!(yaml_too_deep("- - - - x\n", 3), Some((1, 4)));
        assert_eq!(yaml_too_deep("a:\n    b: 1\n", 3), Some((2, 4)));
        assert_eq!(yaml_too_deep("a: '[[[['\n", 1), None);
    }

    #[test]
    fn json_errors_name_the_field() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        struct Inner {
            #[allow(dead_code)]
            n: u64,
        }
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct Outer {
            inner: Vec<Inner>,
        }
        let e = json_with_path::<Outer>(r#"{"inner": [{"n": 1}, {"n": "x"}]}"#).unwrap_err();
        assert_eq!(e.path.as_deref(), Some("inner[1].n"));
        assert_eq!(
            e.to_string(),
            "inner[1].n: invalid type: string \"x\", expected u64 at line 1 column 30"
        );
        let e = json_with_path::<Outer>(r#"{"inner": []} x"#).unwrap_err();
        assert_eq!(e.to_string(), "trailing characters at line 1 column 15");
    }

    /// `/dev/zero` (directly and through a link) and a FIFO with no writer are refused
    /// at once (before: the first grew memory without bound, the second hung).
    #[cfg(unix)]
    #[test]
    fn devices_and_fifos_are_refused_without_reading() {
        assert_eq!(
            read_regular(Path::new("/dev/zero"), 1 << 20),
            Err(FileError::NotRegular {
                kind: "character device"
            })
        );
        let link = tmp("zero-link");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        assert_eq!(
            read_regular(&link, 1 << 20),
            Err(FileError::NotRegular {
                kind: "character device"
            })
        );
        std::fs::remove_file(&link).unwrap();
        let fifo = tmp("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            assert_eq!(
                read_regular(&fifo, 1 << 20),
                Err(FileError::NotRegular { kind: "FIFO" })
            );
            std::fs::remove_file(&fifo).unwrap();
        }
    }
}
