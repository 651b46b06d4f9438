#!/bin/sh
# long_functions.sh — list the C functions longer than a limit (default 80
# lines, counted from the line holding the name to the closing brace), longest
# first. Uses only Universal Ctags (Debian package universal-ctags) and awk.
# Usage: tools/dev/long_functions.sh [limit] [dir-or-files...]   (default: src)
# Output: <lines> <file>:<line> <function>
set -eu
limit=${1:-80}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] || set -- src
ctags -R --languages=C --kinds-C=f --fields=+ne -x --_xformat='%N	%F	%n	%{end}' -o - "$@" |
  awk -F'\t' -v lim="$limit" '$4 != "" { n = $4 - $3 + 1; if (n > lim) printf "%d %s:%d %s\n", n, $2, $3, $1 }' |
  sort -k1,1nr -k2,2
