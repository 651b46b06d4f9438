#!/usr/bin/env bash
# input_nonregular.sh LORAKIT BUILD_DIR — a FIFO or a device given where
# lorakit reads a file (a checkpoint, an index, a shard, an adapter, an
# adapter_config.json, a plan, a YAML config, a train base) is refused at
# once, naming the path and what it is, instead of blocking in open(2)
# forever (a FIFO with no writer) or reading a device.
#
# Every command runs under `timeout`, so a regression fails here (exit 124)
# instead of hanging CI. The FIFOs and the character device are made in a
# temporary folder (mkfifo; mknod of the null device's numbers, as root
# only: skipped, and said so, elsewhere). Expectation: exit 1 and
# "lorakit: PATH: is a FIFO, not a regular file" (resp. "a character
# device"), the wording of lk_open_input (src/core/file.c).
set -uo pipefail
LK=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
SRC=$(cd "$(dirname "$0")" && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-nonreg.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
fail=0
export OPENBLAS_NUM_THREADS=1
T=${LK_TEST_T:-10} # seconds: each command answers in milliseconds; a blocked open never does

# refused NAME PATH KIND CMD...: exit 1 within T seconds, the message names PATH and KIND.
refused() {
  local name=$1 path=$2 kind=$3
  shift 3
  timeout -k 2 "$T" "$LK" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "FAIL $name: lorakit $* still running after ${T}s (blocked on $path)"; fail=1; return
  fi
  if [ "$rc" != 1 ]; then echo "FAIL $name: exit $rc, expected 1"; cat "$TMP/err"; fail=1; return; fi
  if ! grep -qF -- "$path: is $kind, not a regular file" "$TMP/err"; then
    echo "FAIL $name: stderr does not say '$path: is $kind, not a regular file':"; cat "$TMP/err"; fail=1
  fi
}

cd "$TMP" || exit 1
FIX="$SRC/fixtures"
cp "$FIX/adapters/base.safetensors" base.safetensors
cp "$FIX/adapters/diffusers.safetensors" lora.safetensors
cp -r "$FIX/sharded/llama" sharded
cp -r "$FIX/sharded/peft" peft
# the inputs themselves work
timeout "$T" "$LK" inspect base.safetensors >/dev/null 2>&1 || { echo "FAIL setup: base.safetensors"; fail=1; }
timeout "$T" "$LK" inspect sharded >/dev/null 2>&1 || { echo "FAIL setup: sharded"; fail=1; }

mkfifo fifo.safetensors fifo.safetensors.index.json fifo.yaml
refused ckpt-inspect fifo.safetensors "a FIFO" inspect fifo.safetensors
refused ckpt-digest fifo.safetensors "a FIFO" digest fifo.safetensors
refused ckpt-fuse fifo.safetensors "a FIFO" fuse fifo.safetensors -l lora.safetensors -o out.safetensors
refused index-digest fifo.safetensors.index.json "a FIFO" digest fifo.safetensors.index.json
refused adapter-fuse fifo.safetensors "a FIFO" fuse base.safetensors -l fifo.safetensors -o out.safetensors
refused plan-swap fifo.yaml "a FIFO" swap base.safetensors --plan fifo.yaml
refused config-check fifo.yaml "a FIFO" config check fifo.yaml
refused train-config fifo.yaml "a FIFO" train fifo.yaml
[ -e out.safetensors ] && { echo "FAIL: a refused fuse wrote out.safetensors"; fail=1; }

# an index in a folder (picked by name) that is a FIFO
mkdir idxdir && mkfifo idxdir/model.safetensors.index.json
refused index-folder idxdir/model.safetensors.index.json "a FIFO" inspect idxdir

# a shard of a sharded set replaced by a FIFO
cp -r sharded shfifo
rm shfifo/model-00002-of-00003.safetensors && mkfifo shfifo/model-00002-of-00003.safetensors
refused shard-digest model-00002-of-00003.safetensors "a FIFO" digest shfifo
refused shard-fuse model-00002-of-00003.safetensors "a FIFO" fuse shfifo -l peft -o outdir
[ -e outdir ] && { echo "FAIL: a refused fuse wrote outdir"; fail=1; }

# a train base that is a FIFO
cat >train.yaml <<EOT
base: fifo.safetensors
task: copy
digits: 3
steps: 2
global_batch: 4
lr: 0.01
output: trained
models:
  student:
    lora: {enable: true, rank: 2, target_modules: [to_q]}
EOT
refused train-base fifo.safetensors "a FIFO" train train.yaml

# a PEFT folder whose adapter_config.json is a FIFO: refused naming it
# (not read as absent, which would fuse at alpha = r)
cp -r peft peftfifo && rm peftfifo/adapter_config.json && mkfifo peftfifo/adapter_config.json
refused peft-config-inspect peftfifo/adapter_config.json "a FIFO" inspect peftfifo
refused peft-config-fuse peftfifo/adapter_config.json "a FIFO" fuse sharded -l peftfifo -o outdir2
[ -e outdir2 ] && { echo "FAIL: a refused fuse wrote outdir2"; fail=1; }

# a character device (our own node with /dev/null's numbers: reads would
# return nothing; it must be refused, not read)
if mknod chardev.safetensors c 1 3 2>/dev/null; then
  refused dev-inspect chardev.safetensors "a character device" inspect chardev.safetensors
  refused dev-adapter chardev.safetensors "a character device" fuse base.safetensors -l chardev.safetensors -o out.safetensors
  mknod chardev.yaml c 1 3
  refused dev-plan chardev.yaml "a character device" swap base.safetensors --plan chardev.yaml
  rm -f chardev.safetensors chardev.yaml
else
  echo "input_nonregular.sh: mknod not permitted here: character-device inputs skipped"
fi

# the FIFOs are still FIFOs (nothing replaced them)
for f in fifo.safetensors fifo.yaml shfifo/model-00002-of-00003.safetensors; do
  [ -p "$f" ] || { echo "FAIL: $f is no longer a FIFO"; fail=1; }
done
[ "$fail" = 0 ] && echo "input_nonregular.sh: OK"
exit "$fail"
