#!/usr/bin/env bash
# Do shmipc's figures follow the machine? Alternates, N times (default 8),
# a busy-spin round trip of 64 B and of 64 KiB between two processes in C
# (../shared/limits/pingpong.c: no Go, no shmipc; a copy in and a copy out
# each way, the processes pinned to the two CPUs) with three of shmipc's
# figures: the p50 of a single stream's round trip between two processes
# at 64 B and at 64 KiB (example/pingpong), 8 streams × 1 MB in one
# process (BenchmarkPingPong, µs per round trip), and 8 streams × 256 KB in
# one process over shm and over Unix sockets with their ratio (issue 10's
# target is 0.3 or less). One line per pass. When a
# shmipc figure moves between passes together with the C program's, the
# move is the machine's (where the host runs the two vCPUs, what else it
# runs), not shmipc's.
#
# Usage: docs/bench/modes.sh [N]
set -euo pipefail
cd "$(dirname "$0")/../.."

n=${1:-8}
limits=../shared/limits/pingpong.c
[ -f "$limits" ] || { echo "modes.sh: $limits not found" >&2; exit 1; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/shmipc-modes.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cc -O2 -o "$tmp/limits" "$limits"
go build -o "$tmp/pingpong" ./example/pingpong
go test -c -o "$tmp/shmipc.test" .

spin() { # size: the C busy-spin round trip's median in µs
    "$tmp/limits" spin "$1" 2000 split | sed -n 's/.*median=\([0-9]*\).*/\1/p' | awk '{ printf "%.2f", $1 / 1000 }'
}

printf '%-5s %12s %12s %14s %14s %16s %24s\n' pass "C spin 64 B" "C spin 64K" "shm p50 64 B" "shm p50 64K" "8 × 1 MB (µs)" "8 × 256 KB shm, uds (µs)"
for i in $(seq "$n"); do
    c64=$(spin 64)
    c64k=$(spin 65536)
    shm=$("$tmp/pingpong" -transports shm -sizes 64,64k -n 5000 -minrun 300ms -idle 0 -svg "")
    p64=$(printf '%s\n' "$shm" | awk '$1 == "shm" && $3 == "B" { print $5 " " $6 }')
    p64k=$(printf '%s\n' "$shm" | awk '$1 == "shm" && $2 == "64" && $3 == "KiB" { print $5 " " $6 }')
    inproc=$("$tmp/shmipc.test" -test.run XXX -test.bench 'BenchmarkPingPong$/^streams=8$/^size=1MB$/transport=shm' -test.benchtime 0.5s |
        awk '/ns\/op/ { printf "%.1f", $3 / 1000 }')
    r256=$("$tmp/shmipc.test" -test.run XXX -test.bench 'BenchmarkPingPong$/^streams=8$/^size=256KB$' -test.benchtime 0.5s |
        awk '/transport=shm.*ns\/op/ { s = $3 } /transport=uds.*ns\/op/ { u = $3 } END { if (s && u) printf "%.1f %.1f %.2f", s / 1000, u / 1000, s / u }')
    printf '%-5s %9s µs %9s µs %14s %14s %16s %24s\n' "$i" "$c64" "$c64k" "$p64" "$p64k" "$inproc" "$r256"
done
