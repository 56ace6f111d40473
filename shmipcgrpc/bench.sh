#!/usr/bin/env bash
# BenchmarkUnaryEcho (bench_test.go) with the machine's state recorded:
# gRPC unary echo between two processes, shmipc with shmipcgrpc's options
# against a Unix socket with gRPC's defaults, taking turns within each run.
#
# Usage: shmipcgrpc/bench.sh [output file]     (COUNT=5, BENCHTIME=1s)
#
# Prints the CPU, the load, and, when ../shared/limits/pingpong.c and a C
# compiler are at hand, the machine's busy-spin round trip between two
# processes before and after (no Go, no shmipc: on 2-vCPU VMs it moves by
# 3-4x with where the host puts the vCPUs, and every cross-process figure
# moves with it). Then the benchmark's raw output, and per size the median
# (min-max) over the runs of the p50 and p99 ratios shm/uds, and the median
# p50 and p99 of each transport.
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-$(mktemp "${TMPDIR:-/tmp}/shmipcgrpc-bench.XXXXXX")}
count=${COUNT:-5}
benchtime=${BENCHTIME:-1s}
tool=$(mktemp -d "${TMPDIR:-/tmp}/shmipcgrpc-tool.XXXXXX")
trap 'rm -rf "$tool"' EXIT

spin() { # label
    if [ -x "$tool/pingpong" ]; then
        printf 'busy-spin round trip, 64 B (%s): ' "$1"
        "$tool/pingpong" spin 64 20000 split
    fi
}
limits=../../shared/limits/pingpong.c
if [ -f "$limits" ] && command -v cc >/dev/null; then
    cc -O2 -o "$tool/pingpong" "$limits" || true
fi

{
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(go version)"
    grep -m1 'model name' /proc/cpuinfo || true
    echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    spin before
    go test -run '^$' -bench 'BenchmarkUnaryEcho' -count "$count" -benchtime "$benchtime" -timeout 0 .
    spin after
    echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
} 2>&1 | tee "$out"

echo
echo "per size, over the $count runs: median (min-max) of each run's ratio shm/uds, and the median p50 and p99 of each"
awk '
/^BenchmarkUnaryEcho\// {
    size = $1; sub(/^BenchmarkUnaryEcho\//, "", size); sub(/-[0-9]+$/, "", size)
    if (!(size in seen)) { seen[size] = 1; order[++nsizes] = size }
    k = ++runs[size]
    for (i = 3; i < NF; i += 2) v[size, $(i + 1), k] = $i
}
function med(size, unit,   a, i, m, t, j) {
    m = runs[size]
    for (i = 1; i <= m; i++) a[i] = v[size, unit, i]
    for (i = 2; i <= m; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
    lo = a[1]; hi = a[m]
    return m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2
}
function us(ns) { return ns >= 1e6 ? sprintf("%.2f ms", ns / 1e6) : sprintf("%.0f µs", ns / 1e3) }
END {
    printf "| calls in flight/size | p50 shm/uds | p99 shm/uds | shm p50 | uds p50 | shm p99 | uds p99 |\n"
    printf "|---|---:|---:|---:|---:|---:|---:|\n"
    for (s = 1; s <= nsizes; s++) {
        size = order[s]
        r50 = med(size, "p50-shm/uds"); l50 = lo; h50 = hi
        r99 = med(size, "p99-shm/uds"); l99 = lo; h99 = hi
        printf "| %s | %.2f (%.2f-%.2f) | %.2f (%.2f-%.2f) | %s | %s | %s | %s |\n", size, r50, l50, h50, r99, l99, h99,
            us(med(size, "shm-p50-ns")), us(med(size, "uds-p50-ns")), us(med(size, "shm-p99-ns")), us(med(size, "uds-p99-ns"))
    }
}' "$out" | tee -a "$out"
echo
echo "(raw output and summary: $out)"
