#!/usr/bin/env bash
# signal_fuse.sh LORAKIT BUILD_DIR — an interrupted `lorakit fuse` leaves no
# temporary behind (README "Output safety").
#
# A real fuse of a 320 MiB sharded checkpoint (2 shards of five F32
# 4096x2048 weights, made here: header by printf, zero data by truncate, so
# it costs no disk reads) is interrupted mid-write:
#   - by SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGQUIT, SIGALRM, SIGUSR1 and SIGUSR2, sent once the temporary holds
#     at least 32 MiB (the process is stopped with SIGSTOP first, checked to
#     be still writing, then sent the signal and continued);
#   - by SIGXFSZ, raised by the kernel itself at a 64 MiB `ulimit -f`;
# each for a one-file output (OUT.tmp.<pid>.<n>) and, for SIGTERM and
# SIGXFSZ, a sharded output (the hidden .OUT.lorakit-tmp-<pid>-<n>/ folder).
# Expected: the exit status is 128 + the signal's number (the process died
# of it), no temporary is left, the previous output is byte for byte as it
# was. SIGKILL cannot be caught: its temporary stays, and the next run
# writing the same output (a small fuse of the test fixtures) removes it and
# says so on stderr, naming the dead process; the same for `train`'s
# outputs (temporaries with a dead pid made by hand).
# Background jobs run with job control (set -m), so SIGINT is not ignored
# in them as it is in a non-interactive shell's background jobs.
set -uo pipefail
set -m
LK=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
FIX=$(cd "$(dirname "$0")" && pwd)/fixtures
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-signal.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
fail=0
ulimit -c 0 # SIGXFSZ's default action dumps core
cd "$TMP" || exit 1

# mk_shard FILE FIRST: five zero F32 4096x2048 tensors blocks.FIRST..FIRST+4.w.weight.
O=4096 I=2048
W=$(( O * I * 4 ))
. "$FIX/../util/st_header.sh"
mk_shard() {
  local hdr="{" off=0 sep="" k
  for k in 0 1 2 3 4; do
    hdr="$hdr$sep\"blocks.$(( $2 + k )).w.weight\":{\"dtype\":\"F32\",\"shape\":[$O,$I],\"data_offsets\":[$off,$(( off + W ))]}"
    off=$(( off + W )) sep=","
  done
  st_header "$hdr}" >"$1"
  truncate -s $(( $(stat -c %s "$1") + off )) "$1"
}
mkdir base
mk_shard base/model-00001-of-00002.safetensors 0
mk_shard base/model-00002-of-00002.safetensors 5
{
  printf '{"metadata": {}, "weight_map": {'
  for k in 0 1 2 3 4 5 6 7 8 9; do
    [ "$k" = 0 ] || printf ', '
    printf '"blocks.%d.w.weight": "model-0000%d-of-00002.safetensors"' "$k" $(( k < 5 ? 1 : 2 ))
  done
  printf '}}\n'
} >base/model.safetensors.index.json
# a rank-1 diffusers adapter on blocks.0 and blocks.9 (zero factors: the
# fuse is real work, the values do not matter here)
hdr='{"blocks.0.w.lora_A.weight":{"dtype":"F32","shape":[1,2048],"data_offsets":[0,8192]},'
hdr="$hdr"'"blocks.0.w.lora_B.weight":{"dtype":"F32","shape":[4096,1],"data_offsets":[8192,24576]},'
hdr="$hdr"'"blocks.9.w.lora_A.weight":{"dtype":"F32","shape":[1,2048],"data_offsets":[24576,32768]},'
hdr="$hdr"'"blocks.9.w.lora_B.weight":{"dtype":"F32","shape":[4096,1],"data_offsets":[32768,49152]}}'
st_header "$hdr" >lora.safetensors
truncate -s $(( $(stat -c %s lora.safetensors) + 49152 )) lora.safetensors
"$LK" inspect base >/dev/null 2>"$TMP/err" || { echo "FAIL setup: base"; cat "$TMP/err"; exit 1; }

# the previous outputs, which every interrupted run must leave as they
# were: a file, and a sharded output folder lorakit wrote (from the small
# test fixtures: a full fuse of the big base costs seconds in fsync)
printf 'previous output\n' >out.safetensors
cp out.safetensors prev.bin
"$LK" fuse "$FIX/sharded/llama" -l "$FIX/sharded/peft" -o outdir >/dev/null 2>"$TMP/err" ||
  { echo "FAIL setup: outdir"; cat "$TMP/err"; exit 1; }
prev_dir=$("$LK" digest outdir)

temps() { find . -maxdepth 1 \( -name 'out.safetensors.tmp.*' -o -name '.outdir.lorakit-tmp-*' \) | sort; }
check_prev() {
  cmp -s out.safetensors prev.bin || { echo "FAIL $1: out.safetensors changed"; fail=1; }
  [ "$("$LK" digest outdir 2>/dev/null)" = "$prev_dir" ] || { echo "FAIL $1: outdir changed"; fail=1; }
  [ -z "$(ls -A outdir | grep -v -e '^\.lorakit-output$' -e '\.safetensors$' -e '\.json$')" ] ||
    { echo "FAIL $1: outdir holds other files"; fail=1; }
}
# the temporary's size (a sharded output: its folder's bytes), 0 if none yet
tsize() {
  local t
  t=$(temps | head -1)
  [ -n "$t" ] || { echo 0; return; }
  du -sb "$t" 2>/dev/null | cut -f1
}

# interrupt SIG OUT: a fuse to OUT, sent SIG once 32 MiB are written; the
# exit status in $rc. Three tries (a loaded machine may finish first).
interrupt() {
  local sig=$1 out=$2 try pid caught
  for try in 1 2 3; do
    "$LK" fuse base -l lora.safetensors -o "$out" >/dev/null 2>"$TMP/err.$sig" &
    pid=$!
    caught=0
    while kill -0 "$pid" 2>/dev/null; do
      if [ "$(tsize)" -ge $(( 32 << 20 )) ]; then
        kill -STOP "$pid"
        # still writing: the temporary is there, so the rename has not happened
        if [ -n "$(temps)" ]; then caught=1; kill -"$sig" "$pid"; fi
        kill -CONT "$pid" 2>/dev/null
        break
      fi
      sleep 0.005
    done
    wait "$pid"
    rc=$?
    # with job control, wait also returns (147) when the job is stopped
    while [ "$rc" = $(( 128 + $(kill -l STOP) )) ]; do wait "$pid"; rc=$?; done
    killed=$pid
    [ "$caught" = 1 ] && return 0
    echo "signal_fuse.sh: $sig: the fuse ended before it could be interrupted (try $try); again"
    printf 'previous output\n' >out.safetensors   # restore what the completed run replaced
    [ "$out" = outdir ] && prev_dir=$("$LK" digest outdir)
  done
  echo "FAIL $sig $out: never caught mid-write in 3 tries"
  fail=1
  return 1
}

# died SIG OUT: the status says SIG ended it, no temporary, the previous output intact.
died() {
  local want=$(( 128 + $(kill -l "$1") ))
  [ "$rc" = "$want" ] || { echo "FAIL $1 $2: exit $rc, expected $want (died of $1)"; cat "$TMP/err.$1"; fail=1; }
  [ -z "$(temps)" ] || { echo "FAIL $1 $2: temporaries left: $(temps)"; fail=1; }
  check_prev "$1 $2"
}

for sig in INT TERM HUP PIPE QUIT ALRM USR1 USR2; do interrupt "$sig" out.safetensors && died "$sig" out.safetensors; done
interrupt TERM outdir && died TERM outdir

# SIGXFSZ from the kernel: the file size limit is hit mid-write
for out in out.safetensors outdir; do
  ( ulimit -f 65536; exec "$LK" fuse base -l lora.safetensors -o "$out" ) >/dev/null 2>"$TMP/err.XFSZ"
  rc=$?
  died XFSZ "$out"
done

# SIGKILL: the temporary stays; the next run writing the same output removes it
for out in out.safetensors outdir; do
  interrupt KILL "$out" || continue
  [ "$rc" = 137 ] || { echo "FAIL KILL $out: exit $rc"; fail=1; }
  left=$(temps)
  [ -n "$left" ] || { echo "FAIL KILL $out: no temporary left to sweep (was SIGKILL caught?)"; fail=1; continue; }
  check_prev "KILL $out"
  # the next run: a small fuse to the same output
  if [ "$out" = outdir ]; then next=("$FIX/sharded/llama" -l "$FIX/sharded/peft:0.5")
  else next=("$FIX/adapters/base.safetensors" -l "$FIX/adapters/diffusers.safetensors"); fi
  "$LK" fuse "${next[@]}" -o "$out" >/dev/null 2>"$TMP/err.kill" ||
    { echo "FAIL KILL $out: the next run failed"; cat "$TMP/err.kill"; fail=1; }
  grep -qF "removed ${left#./}, a temporary" "$TMP/err.kill" &&
    grep -qF "left by process $killed, which is no longer running" "$TMP/err.kill" ||
    { echo "FAIL KILL $out: the next run did not say it removed $left:"; cat "$TMP/err.kill"; fail=1; }
  [ -z "$(temps)" ] || { echo "FAIL KILL $out: temporaries left after the next run: $(temps)"; fail=1; }
  [ "$out" = outdir ] && prev_dir=$("$LK" digest outdir)
  cp out.safetensors prev.bin
done

# train's outputs go the same way: temporaries left by a killed train run
# (made here with the pid of a process that has exited) are removed by the
# next run writing them
cp "$FIX/config/train_tiny.yaml" tr.yaml
dead=$(bash -c 'echo $$')
mkdir tr
printf 'partial' >"tr/model.safetensors.tmp.$dead.0"
printf 'partial' >"tr/loss.csv.tmp.$dead.4"
OPENBLAS_NUM_THREADS=1 "$LK" train tr.yaml --quiet >/dev/null 2>"$TMP/err.train" ||
  { echo "FAIL train: exit $?"; cat "$TMP/err.train"; fail=1; }
for f in model.safetensors loss.csv; do
  [ ! -e "tr/$f.tmp.$dead.0" ] && [ ! -e "tr/$f.tmp.$dead.4" ] || { echo "FAIL train: tr/$f's temporary left"; fail=1; }
  grep -qF "removed tr/$f.tmp.$dead." "$TMP/err.train" || { echo "FAIL train: no word of tr/$f's temporary"; cat "$TMP/err.train"; fail=1; }
done

[ "$fail" = 0 ] && echo "signal_fuse.sh: OK"
exit "$fail"
