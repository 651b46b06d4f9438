#!/bin/bash
# adapter_config_unreadable.sh — an adapter_config.json that exists but is
# not a readable regular file is an error naming the path and why, never
# read as absent (issue 20, item 4: the adapter would fuse at alpha = r,
# scale 1 instead of the config's 2). For the folder form and the sidecar
# form (a .safetensors file with the config beside it): a dangling symlink
# (an HF cache snapshot whose blob is missing), a folder, a FIFO (must not
# block: the command runs under a timeout), no read permission (as root,
# checked as user nobody through setpriv; skipped with the reason when that
# cannot be done). The control: no config at all still fuses, with the
# "alpha defaults to r" warning. A link loop is named as one. In a folder,
# an adapter_model.safetensors that is a FIFO or a dangling link is named
# by what it is (not "folder has no adapter_model.safetensors", and the
# folder's other weights file is not taken instead).
# Usage: bash adapter_config_unreadable.sh <path-to-lorakit> <build-dir>
set -uo pipefail
LK=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
RUN=("$LK")   # the command line that runs lorakit (as another user for the permission case)
FX=$(cd "$(dirname "$0")/fixtures/adapters" && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-cfg-io.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
source "$(dirname "$0")/util/cli_expect.sh"
LK_EXPECT_TIMEOUT=20


B=$FX/base.safetensors
chmod 755 "$TMP"
# fresh FOLDER holding the fixture's adapter_model.safetensors, no config
fresh() { rm -rf "$TMP/$1"; mkdir -p "$TMP/$1"; chmod 755 "$TMP/$1"; cp "$FX/peft/adapter_model.safetensors" "$TMP/$1/"; }

for form in folder sidecar; do
  target() { [ $form = folder ] && echo "$TMP/$1" || echo "$TMP/$1/adapter_model.safetensors"; }
  O=$TMP/out_$form.safetensors

  # control: no config at all is "no config" (warned), and fuses
  fresh c0
  expect 0 fuse "$B" -l "$(target c0)" -o "$O"
  err_has "alpha defaults to r"
  rm -f "$O"

  # a dangling symlink (a missing HF cache blob)
  fresh c1
  ln -s ../../blobs/0123abcd "$TMP/c1/adapter_config.json"
  expect 1 fuse "$B" -l "$(target c1)" -o "$O"
  err_has "$TMP/c1/adapter_config.json is a symbolic link to '../../blobs/0123abcd', which does not exist"
  [ -e "$O" ] && fail "$form: output written after a dangling config"
  expect 1 inspect "$(target c1)"
  err_has "which does not exist"

  # a link loop (QA: the message read "which Too many levels of symbolic links (a dangling link ...)")
  fresh c5
  ln -s adapter_config.json "$TMP/c5/adapter_config.json"
  expect 1 inspect "$(target c5)"
  err_has "$TMP/c5/adapter_config.json is a symbolic link to 'adapter_config.json' that cannot be followed: a link loop (too many levels of symbolic links)"

  # a folder
  fresh c2
  mkdir "$TMP/c2/adapter_config.json"
  expect 1 fuse "$B" -l "$(target c2)" -o "$O"
  err_has "adapter_config.json exists but cannot be read: $TMP/c2/adapter_config.json: is a folder, not a regular file"

  # a FIFO: refused at once (no writer: a blocking open would never return)
  fresh c3
  mkfifo "$TMP/c3/adapter_config.json"
  expect 1 fuse "$B" -l "$(target c3)" -o "$O"
  err_has "$TMP/c3/adapter_config.json: is a FIFO, not a regular file"
  [ -e "$O" ] && fail "$form: output written after a FIFO config"

  # no read permission: root reads anything, so run as nobody
  fresh c4
  cp "$FX/peft/adapter_config.json" "$TMP/c4/"
  chmod 000 "$TMP/c4/adapter_config.json"
  if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null &&
     setpriv --reuid=65534 --regid=65534 --clear-groups test -r "$FX/base.safetensors" 2>/dev/null &&
     setpriv --reuid=65534 --regid=65534 --clear-groups test -x "$LK" 2>/dev/null; then
    chmod 777 "$TMP"
    RUN=(setpriv --reuid=65534 --regid=65534 --clear-groups "$LK")
    expect 1 inspect "$(target c4)"
    err_has "adapter_config.json exists but cannot be read: $TMP/c4/adapter_config.json: cannot open: Permission denied"
    RUN=("$LK")
    chmod 755 "$TMP"
  elif [ "$(id -u)" != 0 ]; then
    expect 1 inspect "$(target c4)"
    err_has "cannot open: Permission denied"
  else
    echo "adapter_config_unreadable.sh: SKIP the permission case: running as root and cannot run as nobody (setpriv missing, or the build is not readable by nobody)"
  fi
done
# the adapter file itself in a folder: something there that cannot be read is named by what it is,
# never "folder has no adapter_model.safetensors" (QA: a FIFO and a dangling link were reported so)
rm -rf "$TMP/m1" "$TMP/m2" "$TMP/m3"; mkdir -p "$TMP/m1" "$TMP/m2" "$TMP/m3"
cp "$FX/peft/adapter_config.json" "$TMP/m1/"; cp "$FX/peft/adapter_config.json" "$TMP/m2/"
mkfifo "$TMP/m1/adapter_model.safetensors"
expect 1 inspect "$TMP/m1"
err_has "$TMP/m1: $TMP/m1/adapter_model.safetensors: is a FIFO, not a regular file"
ln -s ../blobs/feed "$TMP/m2/adapter_model.safetensors"
cp "$FX/peft/adapter_model.safetensors" "$TMP/m2/pytorch_lora_weights.safetensors" # not taken instead
expect 1 fuse "$B" -l "$TMP/m2" -o "$TMP/out_m2.safetensors"
err_has "$TMP/m2/adapter_model.safetensors is a symbolic link to '../blobs/feed', which does not exist"
[ -e "$TMP/out_m2.safetensors" ] && fail "output written after a dangling adapter file"
cp "$FX/peft/adapter_config.json" "$TMP/m3/" # no weights file there at all
expect 1 fuse "$B" -l "$TMP/m3" -o "$TMP/out_m3.safetensors"
err_has "$TMP/m3: folder has no adapter_model.safetensors"
echo "adapter_config_unreadable.sh: ok"
