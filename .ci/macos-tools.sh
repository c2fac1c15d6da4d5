#!/usr/bin/env bash
# Build macOS's own make and rsyncs (GNU make 3.81, rsync 2.6.9, Apple's openrsync) from the
# Apple source tarballs in .ci/macos-tools/, once per tarball content, and print their bin dir.
# Cache: ${MACOS_TOOLS_CACHE:-~/.cache/thunder-runbook}/macos-tools-<sha256 of the sources>;
# a re-run with the same sources is instant. Needs clang and libbsd-dev (apt-get).
# Usage: bash .ci/macos-tools.sh            -> prints e.g. ~/.cache/thunder-runbook/macos-tools-1a2b.../bin
#        bash .ci/macos-tools.sh --cached   -> the same if already built, else exit 1 (never builds)
set -euo pipefail
src=$(cd "$(dirname "$0")/macos-tools" && pwd)
key=$(cat "$src"/build.sh "$src"/*.tar.gz | sha256sum | cut -c1-16)
dest=${MACOS_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/thunder-runbook}/macos-tools-$key
if [ "${1:-}" = --cached ]; then
    [ -x "$dest/bin/openrsync" ] && [ -x "$dest/bin/rsync269" ] && [ -x "$dest/bin/make" ] || exit 1
fi
if [ ! -x "$dest/bin/openrsync" ] || [ ! -x "$dest/bin/rsync269" ] || [ ! -x "$dest/bin/make" ]; then
    tmp=$dest.tmp.$$
    rm -rf "$tmp"
    bash "$src/build.sh" "$tmp" >&2
    rm -rf "$dest" && mv "$tmp" "$dest"
fi
echo "$dest/bin"
