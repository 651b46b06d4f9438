#!/bin/sh
# source_circles.sh — the circles in the graph between lorakit's source
# files: an edge A -> B when A.c uses (calls, reads) a symbol that B.c
# defines, read from the built objects' symbol tables (nm), so it sees
# every call whichever header declared it. A circle (A -> B -> ... -> A)
# means neither file can be understood, tested or replaced without the
# other: a leaf (a kernel, a parser) must not call back into its caller.
# Uses only binutils' nm and awk.
# Usage: tools/dev/source_circles.sh <build-dir>  [-v: print every edge]
# Prints one line per circle (its files, and the edges inside it), exits 1
# if there is any, 0 if none, 2 when the build holds no library objects.
set -eu
build=$1
verbose=${2:-}
objs=$(find "$build/CMakeFiles" -path '*/lk_*.dir/src/*' -name '*.c.o' ! -path '*/lk_layer_*' | sort)
[ -n "$objs" ] || { echo "source_circles.sh: no objects under $build/CMakeFiles/lk_<layer>.dir" >&2; exit 2; }
# two nm runs over all objects; -A starts each line with "<object>:"
{ nm -A -g --defined-only $objs | sed 's/^/D /'; nm -A -u $objs | sed 's/^/U /'; } |
  awk '{ f = $2; sub(/\.o:.*/, "", f); sub(/.*\.dir\//, "", f); print $1, f, $NF }' |
  awk -v verbose="$verbose" '
  $1 == "D" { def[$3] = def[$3] " " $2; node[$2] = 1; next }
  $1 == "U" { use[++nu] = $2 " " $3; node[$2] = 1 }
  END {
    n = 0; for (f in node) id[f] = ++n; for (f in node) name[id[f]] = f
    for (i = 1; i <= nu; i++) {
      split(use[i], u, " "); k = split(def[u[2]], ds, " ")
      for (j = 1; j <= k; j++) if (ds[j] != u[1]) {
        e = id[u[1]] SUBSEP id[ds[j]]
        if (!(e in edge)) { edge[e] = u[2]; R[e] = 1; if (verbose != "") print "edge " u[1] " -> " ds[j] " (" u[2] ")" }
      }
    }
    for (k = 1; k <= n; k++) for (i = 1; i <= n; i++) if ((i SUBSEP k) in R)
      for (j = 1; j <= n; j++) if ((k SUBSEP j) in R) R[i SUBSEP j] = 1
    circles = 0
    for (i = 1; i <= n; i++) {
      if (done[i] || !((i SUBSEP i) in R)) continue
      members = ""; cnt = 0
      for (j = 1; j <= n; j++) if ((i SUBSEP j) in R && (j SUBSEP i) in R) { done[j] = 1; m[++cnt] = j }
      for (a = 1; a <= cnt; a++) for (b = a + 1; b <= cnt; b++) if (name[m[b]] < name[m[a]]) { t = m[a]; m[a] = m[b]; m[b] = t }
      line = ""; for (a = 1; a <= cnt; a++) line = line (a > 1 ? ", " : "") name[m[a]]
      es = ""
      for (a = 1; a <= cnt; a++) for (b = 1; b <= cnt; b++) if ((m[a] SUBSEP m[b]) in edge)
        es = es "; " name[m[a]] " -> " name[m[b]] " (" edge[m[a] SUBSEP m[b]] ")"
      print "circle: " line es
      circles++
    }
    exit circles > 0
  }'
