#!/usr/bin/env bash
# prepare.sh -- run on the CPU machine (has git + the fetch mirrors, no GPU).
# Assembles a self-contained carry folder with several DeepGEMM source trees (no .git),
# the CUTLASS / fmt headers pinned by those commits (shared when the pins agree), and the
# GPU-side scripts (build.sh, smoke.py, segv_trace.c).
#
# Usage:
#   prepare.sh [--dest DIR] [--commits "54e2261 0f5f266 38f8ef7"] [--force]
#
# Defaults: DEST=target/deepgemm-src of this checkout (git-ignored; benches/oracles/run.sh
#   finds it there; carry it to the GPU machine), COMMITS=54e2261 (upstream's HEAD of
#   2026-06-23, the one checked on the H200 on 2026-12-03).
#
# Needs the mirrors (obtain them with the `fetch` tool first):
#   /work/.mirror/deepseek-ai+DeepGEMM/repo   (github:deepseek-ai/DeepGEMM)
#   /work/.mirror/NVIDIA+cutlass/repo         (github:NVIDIA/cutlass)
#   /work/.mirror/fmtlib+fmt/repo             (github:fmtlib/fmt)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEST=$(cd "$HERE/../../.." && pwd)/target/deepgemm-src
COMMITS="54e2261"
FORCE=0
DG_MIRROR=${DG_MIRROR:-/work/.mirror/deepseek-ai+DeepGEMM/repo}
CUTLASS_MIRROR=${CUTLASS_MIRROR:-/work/.mirror/NVIDIA+cutlass/repo}
FMT_MIRROR=${FMT_MIRROR:-/work/.mirror/fmtlib+fmt/repo}
MAX_MIB=${MAX_MIB:-40}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --dest) DEST="$2"; shift 2 ;;
        --commits) COMMITS="$2"; shift 2 ;;
        --force) FORCE=1; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

for m in "$DG_MIRROR" "$CUTLASS_MIRROR" "$FMT_MIRROR"; do
    git --git-dir="$m" rev-parse --git-dir >/dev/null 2>&1 || { echo "missing mirror: $m (use the fetch tool)" >&2; exit 1; }
done

# Refuse to write into a non-ignored path of a git checkout (the carry must stay out of commits)
DEST=$(realpath -m "$DEST")
anc="$DEST"
while [[ ! -d "$anc" ]]; do anc=$(dirname "$anc"); done
if top=$(git -C "$anc" rev-parse --show-toplevel 2>/dev/null); then
    if ! git -C "$top" check-ignore -q "$DEST"; then
        echo "refusing: $DEST is inside the git checkout $top but is not git-ignored" >&2
        echo "  (add an ignore rule to $top/.git/info/exclude first, or pick another --dest)" >&2
        exit 1
    fi
fi

if [[ -e "$DEST" && -n "$(ls -A "$DEST" 2>/dev/null)" ]]; then
    if [[ $FORCE -eq 1 ]]; then rm -rf "$DEST"; else echo "$DEST exists and is not empty (use --force)" >&2; exit 1; fi
fi
mkdir -p "$DEST"

MANIFEST="$DEST/MANIFEST.txt"
echo "# DeepGEMM carry folder, assembled $(date -u +%FT%TZ) by prepare.sh" > "$MANIFEST"

declare -A CUTLASS_PINS=()
declare -A FMT_PINS=()
for c in $COMMITS; do
    full=$(git --git-dir="$DG_MIRROR" rev-parse --verify "$c^{commit}")
    short=${full:0:7}
    dir="$DEST/dg-$short"
    mkdir -p "$dir"
    # git archive does not include submodule contents; third-party/{cutlass,fmt} are added below
    git --git-dir="$DG_MIRROR" archive --format=tar "$full" | tar -x -C "$dir" \
        --exclude='.github' --exclude='third-party/cutlass' --exclude='third-party/fmt'
    cut_pin=$(git --git-dir="$DG_MIRROR" ls-tree "$full" third-party/cutlass | awk '{print $3}')
    fmt_pin=$(git --git-dir="$DG_MIRROR" ls-tree "$full" third-party/fmt | awk '{print $3}')
    CUTLASS_PINS[$cut_pin]=1
    FMT_PINS[$fmt_pin]=1
    echo "$short" > "$dir/.dg_commit"
    echo "$cut_pin" > "$dir/.cutlass_pin"
    echo "$fmt_pin" > "$dir/.fmt_pin"
    printf 'deepgemm %s %s  cutlass=%s fmt=%s  date=%s\n' "$short" "$full" "${cut_pin:0:7}" "${fmt_pin:0:7}" \
        "$(git --git-dir="$DG_MIRROR" show -s --format=%cs "$full")" >> "$MANIFEST"
done

# Third-party headers, one copy per distinct pin: third-party/cutlass-<pin7>/include, third-party/fmt-<pin7>/include
mkdir -p "$DEST/third-party"
for pin in "${!CUTLASS_PINS[@]}"; do
    git --git-dir="$CUTLASS_MIRROR" cat-file -e "$pin^{commit}" || { echo "cutlass commit $pin not in mirror" >&2; exit 1; }
    d="$DEST/third-party/cutlass-${pin:0:7}"
    mkdir -p "$d"
    git --git-dir="$CUTLASS_MIRROR" archive --format=tar "$pin" include LICENSE.txt | tar -x -C "$d"
    echo "cutlass ${pin:0:7} $pin -> third-party/cutlass-${pin:0:7}/include" >> "$MANIFEST"
done
for pin in "${!FMT_PINS[@]}"; do
    git --git-dir="$FMT_MIRROR" cat-file -e "$pin^{commit}" || { echo "fmt commit $pin not in mirror" >&2; exit 1; }
    d="$DEST/third-party/fmt-${pin:0:7}"
    mkdir -p "$d"
    git --git-dir="$FMT_MIRROR" archive --format=tar "$pin" include src LICENSE | tar -x -C "$d"
    echo "fmt ${pin:0:7} $pin -> third-party/fmt-${pin:0:7}/{include,src}" >> "$MANIFEST"
done

# GPU-side scripts
cp "$HERE/build.sh" "$HERE/smoke.py" "$HERE/segv_trace.c" "$DEST/"
chmod +x "$DEST/build.sh" "$DEST/smoke.py"

# No symlinks may travel (build.sh creates the links it needs at run time)
if [[ -n "$(find "$DEST" -type l | head -1)" ]]; then
    echo "warning: removing symlinks from the carry:" >&2
    find "$DEST" -type l -print -delete >&2
fi

bytes=$(du -sb "$DEST" | awk '{print $1}')
files=$(find "$DEST" -type f | wc -l)
mib=$(awk -v b="$bytes" 'BEGIN{printf "%.1f", b/1048576}')
{
    echo "size_bytes $bytes"
    echo "size_mib $mib"
    echo "files $files"
} >> "$MANIFEST"
du -sh "$DEST"/* "$DEST"/third-party/* 2>/dev/null | sort -h | tail -12
echo "carry folder: $DEST  ($mib MiB, $files files)"
if awk -v m="$mib" -v lim="$MAX_MIB" 'BEGIN{exit !(m > lim)}'; then
    echo "WARNING: carry is larger than ${MAX_MIB} MiB" >&2
fi
