#!/usr/bin/env bash
# layers.sh — the build enforces the layer graph (README "Architecture"):
# a layer's include tree holds its own headers and those of the layers below
# it, never one above, and an upward call does not link against the layer
# check libraries (-Wl,--no-undefined), and no two source files call each
# other, directly or round a circle. The expected graph is written here by
# hand from the README diagram, independently of CMakeLists.txt.
# Usage: bash layers.sh <path-to-lorakit> <build-dir>   (as ctest runs it)
set -u
BUILD=$(cd "$2" && pwd)
L="$BUILD/layers"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-layers.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
fail=0
CC=${CC:-cc}

# layer: a public header it owns, an internal header it owns
declare -A PUB=([core]=status.h [device]=device.h [io]=safetensors.h [adapter]=adapter.h [fuse]=fuse.h
                [comm]=comm.h [serve]=tracker.h [lora]=lora.h [app]=lorakit.h)
declare -A INT=([core]=core/file.h [device]=device/backend.h [io]=io/yaml_doc.h [adapter]=adapter/config.h
                [fuse]=fuse/fuse.h [comm]=comm/backend.h [serve]=serve/tracker.h
                [lora]=lora/gemm.h [app]=app/model.h)
# what each layer may see (itself and everything below it)
declare -A SEES=([core]="core" [device]="device core" [io]="io core" [adapter]="adapter io core"
                 [fuse]="fuse device adapter io core" [comm]="comm core"
                 [serve]="serve fuse device comm adapter io core" [lora]="lora fuse device comm adapter io core"
                 [app]="app serve lora fuse device comm adapter io core")

compiles() { # layer header-include-line
  printf '#include "%s"\nint lk_layer_probe;\n' "$2" >"$TMP/p.c"
  $CC -std=gnu11 -D_GNU_SOURCE -fsyntax-only -I"$L/$1/include" -I"$L/$1/src" \
      $(pkg-config --cflags jansson yaml-0.1 libxxhash 2>/dev/null) "$TMP/p.c" 2>/dev/null
}

for l in core device io adapter fuse comm serve lora app; do
  [ -d "$L/$l/include" ] || { echo "FAIL no include tree for layer $l under $L"; fail=1; continue; }
  for m in core device io adapter fuse comm serve lora app; do
    case " ${SEES[$l]} " in *" $m "*) want=0 ;; *) want=1 ;; esac
    for h in "lorakit/${PUB[$m]}" "${INT[$m]}"; do
      compiles "$l" "$h"; got=$?
      [ $got -ne 0 ] && got=1
      if [ "$got" != "$want" ]; then
        echo "FAIL layer $l including $h: $([ $want = 0 ] && echo 'should compile' || echo 'should not compile')"
        fail=1
      fi
    done
  done
done

# an upward call does not link: io calling the tracker (serve). The check
# libraries are not built under the sanitizers (see CMakeLists.txt).
LIBDIR="$BUILD/layer_check"
if ! grep -q '^LK_SANITIZE:BOOL=ON' "$BUILD/CMakeCache.txt" && [ ! -f "$LIBDIR/liblk_layer_io.so" ]; then
  echo "FAIL no layer check library $LIBDIR/liblk_layer_io.so"; fail=1
fi
if [ -f "$LIBDIR/liblk_layer_io.so" ]; then
  printf 'int lk_tracker_reset(void *, void *);\nint lk_probe(void) { return lk_tracker_reset(0, 0); }\n' >"$TMP/up.c"
  LIBS="-Wl,-rpath-link,$LIBDIR $(pkg-config --libs jansson yaml-0.1 libxxhash libpcre2-8) -lm -lpthread"
  # shellcheck disable=SC2086
  if $CC -shared -fPIC "$TMP/up.c" -o "$TMP/up.so" -Wl,--no-undefined -L"$LIBDIR" -llk_layer_io $LIBS 2>"$TMP/e"; then
    echo "FAIL an upward call from io to serve linked"; fail=1
  elif ! grep -q "undefined reference to .lk_tracker_reset" "$TMP/e"; then
    echo "FAIL the upward link failed for another reason:"; cat "$TMP/e"; fail=1
  fi
  # and a downward one does: serve calling io
  printf 'int lk_st_count(const void *);\nint lk_probe(void) { return lk_st_count(0); }\n' >"$TMP/down.c"
  # shellcheck disable=SC2086
  if ! $CC -shared -fPIC "$TMP/down.c" -o "$TMP/down.so" -Wl,--no-undefined -L"$LIBDIR" -llk_layer_io $LIBS 2>"$TMP/e"; then
    echo "FAIL a downward call to io did not link:"; cat "$TMP/e"; fail=1
  fi
fi
# No circle between source files: A -> B when A uses a symbol B defines
# (read from the built objects); a leaf (a kernel path, a reader) never
# calls back into its caller. tools/dev/source_circles.sh prints each circle.
SRC=$(cd "$(dirname "$0")/.." && pwd)
if ! sh "$SRC/tools/dev/source_circles.sh" "$BUILD" >"$TMP/circles" 2>&1; then
  echo "FAIL circles between source files:"; cat "$TMP/circles"; fail=1
fi

[ $fail = 0 ] && echo "layers.sh: OK"
exit $fail
