#!/usr/bin/env bash
# output_guard.sh LORAKIT BUILD_DIR — what an output may replace (README
# "Output safety"): never an input, never anything but a regular file.
#
#  1. -o onto an input, by any path, is refused before anything is written,
#     naming the input, and every input keeps its bytes: a shard of a
#     sharded base (the bug: exit 0 and the base no longer opened), the base
#     index, a symlink and a hard link to a shard, a PEFT folder's
#     adapter_config.json and adapter_model.safetensors, an adapter file
#     whose config sits beside it; `train` outputs onto its base and config.
#  2. -o onto a FIFO, a socket or (as root) a character device of our own
#     (mknod with /dev/null's numbers in a temporary folder; never a real
#     device) is refused and the node is still there, of the same kind;
#     likewise for a sharded output and for `train`'s output files.
#  3. a sharded output replaces only a folder lorakit wrote (.lorakit-output
#     lists every file in it): an empty folder and a lorakit folder are
#     fine, a folder with a file of the user's is refused naming the file.
# Expectations: the messages of src/io/out_file.c and out_dir.c; the bytes
# are compared with cmp against copies taken before.
set -uo pipefail
LK=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
SRC=$(cd "$(dirname "$0")" && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-outguard.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
fail=0
export OPENBLAS_NUM_THREADS=1

# refused NAME MESSAGE CMD...: exit 1, stderr holds MESSAGE.
refused() {
  local name=$1 msg=$2
  shift 2
  timeout -k 2 60 "$LK" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  if [ "$rc" != 1 ]; then echo "FAIL $name: exit $rc, expected 1"; cat "$TMP/err"; fail=1; return; fi
  grep -qF -- "$msg" "$TMP/err" || { echo "FAIL $name: stderr lacks '$msg':"; cat "$TMP/err"; fail=1; }
}
# same NAME DIR1 DIR2: the two folders hold the same files, byte for byte.
same() { diff -r "$2" "$3" >/dev/null || { echo "FAIL $1: $2 changed"; diff -r "$2" "$3" | head; fail=1; }; }
no_temp() {
  local left
  left=$(find "$TMP/w" -name '*.tmp.*' -o -name '*lorakit-tmp*' | head -3)
  [ -z "$left" ] || { echo "FAIL $1: temporaries left: $left"; fail=1; }
}

FIX="$SRC/fixtures"
mkdir -p "$TMP/w" && cd "$TMP/w" || exit 1
cp -r "$FIX/sharded/llama" base && cp -r base "$TMP/base.orig"
cp -r "$FIX/sharded/peft" peft && cp -r peft "$TMP/peft.orig"
# an adapter file with its config beside it (read as the folder would be)
mkdir side && cp peft/adapter_model.safetensors side/lora.safetensors && cp peft/adapter_config.json side/
cp -r side "$TMP/side.orig"
ln -s base/model-00002-of-00003.safetensors link.safetensors
ln base/model-00003-of-00003.safetensors hard.safetensors
"$LK" inspect base >/dev/null || { echo "FAIL setup"; exit 1; }

# 1. onto an input
refused shard "output base/model-00001-of-00003.safetensors is the same file as the base shard" \
  fuse base -l peft -o base/model-00001-of-00003.safetensors
refused index "is the same file as the base index" fuse base -l peft -o base/model.safetensors.index.json
refused symlink "output link.safetensors is the same file as the base shard" fuse base -l peft -o link.safetensors
refused hardlink "output hard.safetensors is the same file as the base shard" fuse base -l peft -o hard.safetensors
refused peft-config "output peft/adapter_config.json is the same file as the adapter config" \
  fuse base/model-00001-of-00003.safetensors --allow-unmatched -l peft -o peft/adapter_config.json
refused peft-file "output peft/adapter_model.safetensors is the same file as the adapter" \
  fuse base -l peft -o peft/adapter_model.safetensors
refused side-config "output side/adapter_config.json is the same file as the adapter config" \
  fuse base/model-00001-of-00003.safetensors --allow-unmatched -l side/lora.safetensors -o side/adapter_config.json
refused base-folder "was not written by lorakit" fuse base -l peft -o base
same inputs-base base "$TMP/base.orig"
same inputs-peft peft "$TMP/peft.orig"
same inputs-side side "$TMP/side.orig"
no_temp inputs

# train: its outputs onto its base (full-model training from a base in the
# output folder) and onto its own config
cp "$FIX/config/train_tiny.yaml" tr.yaml
"$LK" train tr.yaml --quiet >/dev/null 2>"$TMP/err" || { echo "FAIL train setup"; cat "$TMP/err"; fail=1; }
cp tr/model.safetensors "$TMP/model.orig"
sed -e 's|^model:.*|base: tr/model.safetensors|' tr.yaml >tr2.yaml
refused train-base "output tr/model.safetensors is the same file as the base tr/model.safetensors" train tr2.yaml --quiet
cmp -s tr/model.safetensors "$TMP/model.orig" || { echo "FAIL train-base: the base changed"; fail=1; }
sed -e 's|^output:.*|output: .|' tr.yaml >tr/train.json
refused train-config "is the same file as the config tr/train.json" train tr/train.json --quiet
grep -q "^output: .$" tr/train.json || { echo "FAIL train-config: the config changed"; fail=1; }

# 2. onto a node that is not a regular file
mkfifo fifo.safetensors
refused fifo "fifo.safetensors: exists and is a FIFO; an output replaces only a regular file" \
  fuse base -l peft -o fifo.safetensors
[ -p fifo.safetensors ] || { echo "FAIL fifo: no longer a FIFO"; fail=1; }
mkfifo fifodir
refused fifo-sharded "fifodir: exists and is a FIFO, not a folder" fuse base -l peft -o fifodir
[ -p fifodir ] || { echo "FAIL fifo-sharded: no longer a FIFO"; fail=1; }
if command -v python3 >/dev/null; then
  python3 -c 'import socket,sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' sock.safetensors
  refused socket "sock.safetensors: exists and is a socket" fuse base -l peft -o sock.safetensors
  [ -S sock.safetensors ] || { echo "FAIL socket: no longer a socket"; fail=1; }
else
  echo "output_guard.sh: no python3 to make a socket: the socket case is skipped"
fi
rm -f tr/loss.csv
if mknod null.safetensors c 1 3 2>/dev/null && mknod nulldir c 1 3 && mknod tr/loss.csv c 1 3; then
  refused chardev "null.safetensors: exists and is a character device" fuse base -l peft -o null.safetensors
  refused chardev-sharded "nulldir: exists and is a character device, not a folder" fuse base -l peft -o nulldir
  refused chardev-train "tr/loss.csv: exists and is a character device" train tr.yaml --quiet
  for n in null.safetensors nulldir tr/loss.csv; do
    [ -c "$n" ] || { echo "FAIL chardev: $n is no longer a character device"; fail=1; }
  done
  rm -f null.safetensors nulldir tr/loss.csv
else
  echo "output_guard.sh: mknod not permitted here: the character-device cases are skipped"
fi
no_temp special

# 3. sharded output folders
mkdir empty
"$LK" fuse base -l peft -o empty >/dev/null 2>"$TMP/err" || { echo "FAIL empty folder"; cat "$TMP/err"; fail=1; }
[ -f empty/.lorakit-output ] && grep -q '"model.safetensors.index.json"' empty/.lorakit-output ||
  { echo "FAIL .lorakit-output"; fail=1; }
d1=$("$LK" digest empty)
"$LK" fuse base -l peft:0.5 -o empty >/dev/null 2>"$TMP/err" || { echo "FAIL replace"; cat "$TMP/err"; fail=1; }
d2=$("$LK" digest empty)
[ "$d1" != "$d2" ] || { echo "FAIL replace: the folder was not replaced"; fail=1; }
echo mine >empty/notes.txt
refused user-file "the output folder holds notes.txt, which lorakit did not write there" fuse base -l peft -o empty
[ "$("$LK" digest empty)" = "$d2" ] && [ "$(cat empty/notes.txt)" = mine ] || { echo "FAIL user-file: changed"; fail=1; }
rm empty/notes.txt
refused own-input "is the same file as the base shard" fuse empty -l peft -o empty
[ "$("$LK" digest empty)" = "$d2" ] || { echo "FAIL own-input: changed"; fail=1; }
no_temp sharded
same inputs-base-end base "$TMP/base.orig"

[ "$fail" = 0 ] && echo "output_guard.sh: OK"
exit "$fail"
