#!/bin/bash
# install.sh — `make install` works: installs the build into a temporary
# prefix (what `make install PREFIX=...` runs), checks the layout (headers,
# shared + static library, CLI, lorakit.pc), then compiles a small program
# against the INSTALLED copy with `pkg-config --cflags --libs lorakit`
# (PKG_CONFIG_PATH pointed at it), links it to the shared library with an
# rpath, runs it, and checks its digest against the installed CLI's.
# Usage: bash install.sh <path-to-lorakit> <build-dir>   (as ctest runs it)
set -euo pipefail
BUILD=$(cd "$2" && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-install.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
PREFIX="$TMP/prefix"

fail() { echo "install.sh: FAIL: $*" >&2; exit 1; }

cmake --install "$BUILD" --prefix "$PREFIX" >"$TMP/install.log" 2>&1 || { cat "$TMP/install.log"; fail "cmake --install"; }

LIBDIR=$(dirname "$(find "$PREFIX" -name lorakit.pc -path '*/pkgconfig/*' | head -1)")
[ -n "$LIBDIR" ] && [ -f "$LIBDIR/lorakit.pc" ] || fail "lorakit.pc not installed"
LIBDIR=$(dirname "$LIBDIR")
for f in include/lorakit/lorakit.h include/lorakit/safetensors.h include/lorakit/digest.h bin/lorakit; do
  [ -e "$PREFIX/$f" ] || fail "$f not installed"
done
[ -f "$LIBDIR/liblorakit.a" ] || fail "static library not installed"
ls "$LIBDIR"/liblorakit.so* >/dev/null 2>&1 || fail "shared library not installed"

export PKG_CONFIG_PATH="$LIBDIR/pkgconfig"
pkg-config --exists lorakit || fail "pkg-config does not find lorakit"
[ "$(pkg-config --modversion lorakit)" != "" ] || fail "no version"
CFLAGS=$(pkg-config --cflags lorakit)
LIBS=$(pkg-config --libs lorakit)
case "$CFLAGS" in *"$PREFIX"*) ;; *) fail "cflags do not point into the prefix: $CFLAGS" ;; esac

# A sanitizer build installs an instrumented library: link the runtime too.
SAN=""
if grep -q '^LK_SANITIZE:BOOL=ON' "$BUILD/CMakeCache.txt" 2>/dev/null; then
  SAN="-fsanitize=address,undefined"
fi

cat >"$TMP/prog.c" <<'EOF'
/* Uses the installed lorakit: write, reopen and digest a file. */
#include <stdio.h>
#include <string.h>
#include <lorakit/lorakit.h>

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    float w[4] = {1.0f, 2.0f, 3.0f, 4.0f};
    uint16_t h[2];
    lk_from_f32(h, w, LK_DTYPE_BF16, 2);
    lk_tensor t[2] = {
        {.name = "w", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {2, 2}, .nbytes = sizeof w, .data = w},
        {.name = "h", .dtype = LK_DTYPE_BF16, .ndim = 1, .shape = {2}, .nbytes = sizeof h, .data = h},
    };
    const char *meta[] = {"by", "install test"};
    if (lk_st_save(argv[1], t, 2, meta, 1) != LK_OK) { fprintf(stderr, "%s\n", lk_last_error()); return 1; }
    lk_st *st;
    if (lk_st_open(argv[1], &st) != LK_OK) { fprintf(stderr, "%s\n", lk_last_error()); return 1; }
    char hex[LK_DIGEST_HEX];
    if (lk_digest_st(st, hex) != LK_OK || lk_st_count(st) != 2 ||
        strcmp(lk_st_metadata_get(st, "by"), "install test") != 0) return 1;
    lk_st_close(st);
    printf("%s\n", hex);
    return 0;
}
EOF
# shellcheck disable=SC2086
cc -std=c11 -Wall -Werror $SAN $CFLAGS "$TMP/prog.c" -o "$TMP/prog" $LIBS -Wl,-rpath,"$LIBDIR" \
  || fail "cannot compile against the installed lorakit"
ldd "$TMP/prog" | grep "$LIBDIR/liblorakit.so" >/dev/null || fail "prog is not linked to the installed shared library"
OUT=$("$TMP/prog" "$TMP/t.safetensors") || fail "prog failed"
[[ "$OUT" =~ ^[0-9a-f]{32}$ ]] || fail "prog printed '$OUT'"
CLI=$("$PREFIX/bin/lorakit" digest "$TMP/t.safetensors") || fail "installed CLI failed"
[ "$OUT" = "$CLI" ] || fail "digest $OUT (library) != $CLI (installed CLI)"
"$PREFIX/bin/lorakit" --version | grep "^lorakit " >/dev/null || fail "installed CLI --version"

# The model-family tables are installed, and the installed CLI and library
# find them beside themselves (not in the source tree): a diffusers Flux LoRA
# (transformer.single_transformer_blocks.0.attn.to_k) onto a BFL-named base
# (single_blocks.0.linear1, q,k,v,mlp fused) needs the flux table (its detect
# line wants double_blocks.0.img_attn.qkv/proj and img_in, all three).
for f in flux sd1 sdxl openclip sd3 wan hunyuan-video ltx; do
  [ -f "$PREFIX/share/lorakit/families/$f.lkmap" ] || fail "data/families/$f.lkmap not installed"
done
python3 "$(dirname "$0")/gen_flux_pair.py" "$TMP" || fail "cannot write the Flux test files"
LORAKIT_LOG=info "$PREFIX/bin/lorakit" fuse "$TMP/flux.safetensors" -l "$TMP/lora.safetensors" -o "$TMP/fused.safetensors" \
  2>"$TMP/fuse.log" >/dev/null || { cat "$TMP/fuse.log"; fail "installed CLI: fuse through the flux table"; }
grep -qF "model family flux ($(realpath "$PREFIX")/share/lorakit/families/flux.lkmap)" "$TMP/fuse.log" \
  || { cat "$TMP/fuse.log"; fail "the installed CLI did not use the installed flux table"; }
# The same run through PATH (argv[0] "lorakit", no folder: the CLI finds
# itself through /proc/self/exe, not argv[0]).
(cd "$TMP" && PATH="$PREFIX/bin:$PATH" LORAKIT_LOG=info lorakit fuse flux.safetensors -l lora.safetensors \
  -o fused2.safetensors 2>"$TMP/fuse2.log" >/dev/null) || { cat "$TMP/fuse2.log"; fail "CLI from PATH: fuse"; }
grep -qF "model family flux ($(realpath "$PREFIX")/share/lorakit/families/flux.lkmap)" "$TMP/fuse2.log" \
  || { cat "$TMP/fuse2.log"; fail "the CLI run from PATH did not use the installed flux table"; }
echo "install.sh: OK ($PREFIX, digest $OUT)"
