#!/usr/bin/env bash
# ulimit_cli.sh LORAKIT BUILD_DIR — every command under an address-space
# limit (ulimit -v) finishes: exit 0, or exit 1 with an out-of-memory
# message; never a hang (each run is under `timeout`), never a signal
# (issue 20 item 12). Before, OpenBLAS was linked and started its thread
# pool at load, retrying a failed 128 MiB mapping forever: every command,
# even --help, hung at 70-190 MB.
# Limits: 16, 40, 70, 120 and 190 MiB, and 6 MiB, where the dynamic loader
# itself cannot map the libraries lorakit links (libc, Open MPI): that run
# may end 127 with the loader's "error while loading shared libraries",
# before any lorakit code runs; nothing else is accepted there either.
# Inputs: the PEFT fixtures, a 4 MiB F32 checkpoint with a rank-4 adapter
# (written here), a 5-step training config (train exits 1 naming
# OpenBLAS's address space where the limit is below it).
set -euo pipefail
LK="$1"
HERE="$(cd "$(dirname "$0")" && pwd)"
FX="$HERE/fixtures/peft"
. "$HERE/util/sh_common.sh"
lk_sh_setup "$LK" lkulimit "a sanitizer build reserves terabytes of shadow address space; ulimit -v cannot apply"
fail() { echo "ulimit_cli.sh: FAIL: $*" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none

python3 - "$work" <<'EOF'
import json, os, struct, sys
d = sys.argv[1]
def write_st(path, tensors):
    hdr, off = {}, 0
    for n, shape in tensors:
        k = 1
        for x in shape: k *= x
        hdr[n] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + 4 * k]}
        off += 4 * k
    h = json.dumps(hdr).encode(); h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h))); f.write(h)
        for n, shape in tensors:
            k = 1
            for x in shape: k *= x
            f.write(struct.pack("<f", 0.25) * k)
n = 1024
write_st(os.path.join(d, "big.safetensors"), [("l.weight", [n, n])])
os.makedirs(os.path.join(d, "ad"))
write_st(os.path.join(d, "ad", "adapter_model.safetensors"),
         [("base_model.model.l.lora_A.weight", [4, n]), ("base_model.model.l.lora_B.weight", [n, 4])])
json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": ["l"]},
          open(os.path.join(d, "ad", "adapter_config.json"), "w"))
EOF
cat >"$work/train.yaml" <<EOT
model: {d_model: 16, n_layers: 1, n_heads: 2}
task: copy
digits: 3
steps: 5
global_batch: 8
lr: 0.003
log_every: 10
eval_examples: 4
output: $work/trained
EOT
cat >"$work/plan.yaml" <<EOT
steps:
  - loras: [{path: $FX/sidecar, strength: 1.0}]
  - loras: []
EOT

runs=0
check() { # LIMIT_KIB NAME ARGS...
  local lim="$1" name="$2"
  shift 2
  local rc=0
  timeout -s KILL 120 bash -c 'ulimit -v "$1"; shift; exec "$@"' _ "$lim" "$LK" "$@" >"$work/o" 2>"$work/e" || rc=$?
  runs=$((runs + 1))
  case "$rc" in
  0) ;;
  1) grep -qi "out of memory" "$work/e" || fail "$name at $((lim / 1024)) MiB: exit 1 without an out-of-memory message: $(head -c 400 "$work/e")" ;;
  127) [ "$lim" -le 8192 ] && grep -q "error while loading shared libraries" "$work/e" ||
    fail "$name at $((lim / 1024)) MiB: exit 127: $(head -c 400 "$work/e")" ;;
  137) fail "$name at $((lim / 1024)) MiB: still running after 120 s (killed): a hang" ;;
  *) fail "$name at $((lim / 1024)) MiB: exit $rc (above 128: a signal) $(head -c 400 "$work/e")" ;;
  esac
  printf ' %s=%s' "$name" "$rc"
}

for mib in 6 16 40 70 120 190; do
  lim=$((mib * 1024))
  printf '%4s MiB:' "$mib"
  rm -rf "$work/f.safetensors" "$work/g.safetensors" "$work/trained"
  check "$lim" help --help
  check "$lim" fuse-help fuse --help
  check "$lim" inspect inspect "$FX/base_bf16.safetensors"
  check "$lim" inspect-adapter inspect "$FX/patterns"
  check "$lim" inspect-4MiB inspect "$work/big.safetensors"
  check "$lim" digest digest "$work/big.safetensors"
  check "$lim" fuse fuse "$FX/base_bf16.safetensors" -l "$FX/sidecar" -o "$work/f.safetensors"
  check "$lim" fuse-4MiB fuse "$work/big.safetensors" -l "$work/ad" -o "$work/g.safetensors"
  check "$lim" config config check "$HERE/fixtures/config/roles.yaml"
  check "$lim" swap swap "$FX/base_bf16.safetensors" --plan "$work/plan.yaml"
  check "$lim" train train "$work/train.yaml"
  echo
done
# The same commands without a limit all succeed (the inputs are valid).
for c in "inspect $work/big.safetensors" "fuse $work/big.safetensors -l $work/ad -o $work/g.safetensors"; do
  # shellcheck disable=SC2086
  "$LK" $c >/dev/null || fail "$c without a limit"
done
echo "ulimit_cli: all passed ($runs runs)"
