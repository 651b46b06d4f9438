# st_header.sh — sourced by the shell tests that write safetensors files with
# printf (no Python in CI). st_header HEADER_JSON prints a file's prefix: the
# 8-byte little-endian header length, then the header padded with spaces to
# a multiple of 8 bytes (the alignment the format recommends); the tensor
# data follows it.
st_header() {
  local hdr="$1" n pad
  n=${#hdr}
  pad=$(( (8 - n % 8) % 8 ))
  hdr="$hdr$(printf '%*s' "$pad" '')"
  n=$(( n + pad ))
  printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x\\x00\\x00\\x00\\x00' \
    $((n & 255)) $((n >> 8 & 255)) $((n >> 16 & 255)) $((n >> 24 & 255)))"
  printf '%s' "$hdr"
}
