#!/usr/bin/env bash
# The shm-versus-Unix-socket comparison behind the README's figures and
# docs/bench/HISTORY.md, in one run:
#
#   1. BenchmarkPingPong (bench_test.go): in-process ping-pong with exactly
#      1, 8 and 64 streams (shm) or connections (uds), 64 B … 4 MB, -count 5;
#      then the same while 2 CPU-hog processes compete for the cores (-hogs 2).
#   2. example/pingpong -streams 64: 64 streams × 4 KiB between two
#      processes, shm and uds taking turns for 5 rounds; uncontended and with
#      -hogs 2.
#   3. example/pingpong: single-stream latency between two processes at each
#      size, and the CPU an idle session costs.
#
# in three phases: uncontended (files without a suffix), with the 2 hogs
# (-hogs2), and uncontended again right after the hogs have stopped
# (-after; in one process only 8 streams in the full form), which shows
# that the figures come back once the CPU is free.
#
# Before and after all of it, when ../shared/limits is there and a C
# compiler is, the machine's own limits (limits.txt): round trips between
# two processes by busy-spin, futex and Unix socket at 64 B, 4 KiB and
# 64 KiB, with no Go and nothing of shmipc in them. On the 2-vCPU VMs these
# move by 3-4x between runs (where the host puts the two vCPUs), and every
# cross-process figure moves with them: read a run's figures against the
# limits of the same run.
#
# Usage: docs/bench/run.sh [-quick] [output directory]
#
# The output directory (default docs/bench/results, or a new temporary one
# with -quick) receives the raw outputs, benchstat's tables (if benchstat can
# be fetched through the module proxy) and summary.txt: per streams and size
# the medians of ns/op, the shm/uds ratio, the max/min spread over the runs
# and the slowest/fastest stream ratio. `uptime` is recorded before and after
# every step: the numbers mean little if the machine was busy.
#
# -quick is the CI form (about a minute): 3 sizes, 200 round trips, one run
# each, short cross-process measurements.
#
# Environment (full form): BENCH (the -bench pattern, e.g.
# 'BenchmarkPingPong$/^streams=8$'), BENCHTIME (1s), COUNT (5), ROUNDS (5),
# DURATION (2s); and PHASES, which phases to run, of "0 2 after" (e.g.
# PHASES="2 after": the hogs and what follows them).
set -euo pipefail
cd "$(dirname "$0")/../.."

quick=0
if [ "${1:-}" = "-quick" ]; then
    quick=1
    shift
fi
if [ $# -gt 0 ]; then
    out=$1
elif [ $quick = 1 ]; then
    out=$(mktemp -d "${TMPDIR:-/tmp}/shmipc-bench.XXXXXX")
else
    out=docs/bench/results
fi
mkdir -p "$out"

if [ $quick = 1 ]; then
    # Sizes whose 64 streams fit the default shared-memory region at once.
    bench='BenchmarkPingPong$/^streams=(1|8|64)$/^size=(64B|4KB|64KB)$'
    benchflags=(-benchtime 200x -count 1)
    streamsflags=(-quick)
    pingpongflags=(-quick -transports shm,uds)
else
    bench=${BENCH:-'BenchmarkPingPong$'}
    benchflags=(-benchtime "${BENCHTIME:-1s}" -count "${COUNT:-5}")
    streamsflags=(-rounds "${ROUNDS:-5}" -duration "${DURATION:-2s}")
    pingpongflags=(-transports shm,uds)
fi

log() { printf '\n=== %s\n' "$*"; }
load() { printf '%s  %s\n' "$1" "$(uptime)" | tee -a "$out/uptime.txt"; }

: > "$out/uptime.txt"
{
    go version
    echo "nproc $(nproc)"
    git log -1 --format='commit %h %s' 2>/dev/null || true
} | tee "$out/env.txt"

# summarize prints, from go test -bench output, one row per streams and size:
# medians over the runs, shm/uds, spread (max/min ns/op) and fairness. A
# failed sub-benchmark shows as FAIL, a skipped one (go test -v says why) as
# SKIP. limit is the shm/uds ns/op target and
# applies to the streams count in at (all for "all").
summarize() { # file limit at
    awk -v limit="$2" -v at="$3" '
    function sorted(s, a,   n, i, j, t) {
        n = split(s, a, " ")
        for (i = 2; i <= n; i++) {
            t = a[i] + 0
            for (j = i - 1; j >= 1 && a[j] + 0 > t; j--) a[j + 1] = a[j]
            a[j + 1] = t
        }
        return n
    }
    function median(s,   a, n) {
        n = sorted(s, a)
        if (n == 0) return ""
        return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    function spread(s,   a, n) {
        n = sorted(s, a)
        return n > 0 && a[1] > 0 ? a[n] / a[1] : 0
    }
    function us(t,   m) {
        m = median(ns[t])
        if (m != "") return sprintf("%.2f", m / 1000)
        return t in skipped ? "SKIP" : "FAIL"
    }
    function key(name,   p) {
        sub(/-[0-9]+$/, "", name)
        split(name, p, "/")
        sub(/^streams=/, "", p[2]); sub(/^size=/, "", p[3]); sub(/^transport=/, "", p[4])
        k = p[2] SUBSEP p[3]
        if (!(k in seen)) { seen[k] = 1; order[++rows] = k }
        return k SUBSEP p[4]
    }
    $1 ~ /^BenchmarkPingPong\// {
        t = key($1)
        for (i = 2; i < NF; i++) {
            if ($(i + 1) == "ns/op") ns[t] = ns[t] " " $i
            if ($(i + 1) == "slowest/fastest") sf[t] = sf[t] " " $i
            if ($(i + 1) == "allocs/op" && $i + 0 > allocs[t] + 0) allocs[t] = $i
        }
    }
    {
        for (i = 2; i < NF; i++)
            if ($(i - 1) == "---" && $(i + 1) ~ /^BenchmarkPingPong\/.*\//) {
                if ($i == "FAIL:") failed[key($(i + 1))]++
                if ($i == "SKIP:") skipped[key($(i + 1))]++
            }
    }
    END {
        printf "%-7s %-6s %10s %10s %8s %11s %11s %13s %13s %10s %5s  %s\n", "streams", "size", "shm µs/op", "uds µs/op", "shm/uds",
            "shm max/min", "uds max/min", "shm slow/fast", "uds slow/fast", "shm allocs", "fails", "target"
        for (r = 1; r <= rows; r++) {
            k = order[r]; split(k, p, SUBSEP)
            s = k SUBSEP "shm"; u = k SUBSEP "uds"
            ms = median(ns[s]); mu = median(ns[u])
            ratio = ms != "" && mu > 0 ? sprintf("%.2f", ms / mu) : "-"
            note = ""
            if (at == "all" || at == p[1]) {
                note = "shm/uds <= " limit
                if (ratio == "-" || ratio + 0 > limit + 0) note = note " MISSED"
                if (at != "all" && spread(ns[s]) > 2) note = note "; shm spread > 2 MISSED"
            }
            printf "%-7s %-6s %10s %10s %8s %11.2f %11.2f %13s %13s %10s %5d  %s\n", p[1], p[2], us(s), us(u), ratio,
                spread(ns[s]), spread(ns[u]), median(sf[s]), median(sf[u]), allocs[s] + 0, failed[s] + failed[u], note
        }
    }' "$1"
}

# benchstat compares shm with uds per streams and size; it writes all its
# tables to file.benchstat and shows the first, time per round trip.
benchstat() { # file
    if go run golang.org/x/perf/cmd/benchstat@latest -col /transport "$1" > "$1.benchstat" 2> "$1.benchstat.err"; then
        awk '/^$/ { exit } { print }' "$1.benchstat"
    else
        echo "(benchstat not available: $(tail -1 "$1.benchstat.err"))"
    fi
}

# The tool, built once; go test builds its own binary.
tool=$(mktemp -d "${TMPDIR:-/tmp}/shmipc-pingpong.XXXXXX")
trap 'rm -rf "$tool"' EXIT
go build -o "$tool/pingpong" ./example/pingpong

# limits measures the machine's physical limits (see the top) into
# limits.txt, if the C programs and a compiler are at hand.
limitsrc=../shared/limits
havelimits=0
if [ -f "$limitsrc/pingpong.c" ] && command -v cc >/dev/null &&
    cc -O2 -o "$tool/limits-pingpong" "$limitsrc/pingpong.c" 2>"$tool/cc.err"; then
    havelimits=1
fi
limits() { # label
    [ $havelimits = 1 ] || return 0
    log "physical limits ($1)"
    {
        echo "--- $1"
        for mode in spin futex uds; do
            for size in 64 4096 65536; do
                iters=20000
                [ $size -gt 4096 ] && iters=5000
                [ $quick = 1 ] && iters=500
                "$tool/limits-pingpong" $mode $size $iters split
            done
        done
    } 2>&1 | tee -a "$out/limits.txt"
}
: > "$out/limits.txt"
limits before

for phase in ${PHASES:-0 2 after}; do
    suffix=""; limit=0.3; at=8; hogs=$phase; phasebench=$bench; what="1/8/64 streams"
    case $phase in
    0) ;;
    after)
        # The uncontended figures again, right after the hogs of the phase
        # before have stopped: spinning, switched off while they ran, must
        # come back. In one process only the 8 streams the target is about
        # (unless BENCH says otherwise).
        suffix="-after"; hogs=0
        if [ $quick = 0 ] && [ -z "${BENCH:-}" ]; then
            phasebench='BenchmarkPingPong$/^streams=8$'; what="8 streams"
        fi
        ;;
    *) suffix="-hogs$phase"; limit=1.0; at=all ;;
    esac
    [ "$phase" = after ] && what="$what, after the hogs stopped"

    log "in-process ping-pong, $what, $hogs CPU hogs"
    load "before go test$suffix"
    # A sub-benchmark that fails or is skipped is reported in the summary;
    # the others still run. -v shows why one was skipped.
    go test -v -run XXX -bench "$phasebench" "${benchflags[@]}" -timeout 0 . -hogs $hogs > "$out/pingpong$suffix.txt" 2>&1 || true
    load "after go test$suffix"
    summarize "$out/pingpong$suffix.txt" $limit $at | tee "$out/summary$suffix.txt"
    benchstat "$out/pingpong$suffix.txt"

    log "cross-process, 64 streams × 4 KiB, $hogs CPU hogs${suffix:+ ($phase)}"
    load "before streams$suffix"
    "$tool/pingpong" -streams 64 -hogs $hogs "${streamsflags[@]}" -json "$out/streams$suffix.json" | tee "$out/streams$suffix.txt"
    load "after streams$suffix"

    log "cross-process, single stream, $hogs CPU hogs${suffix:+ ($phase)}"
    load "before pingpong$suffix"
    "$tool/pingpong" -hogs $hogs "${pingpongflags[@]}" -svg "$out/latency$suffix.svg" -json "$out/latency$suffix.json" | tee "$out/latency$suffix.txt"
    load "after pingpong$suffix"
done

limits after

leftover=$(ls /dev/shm | grep -c '^shmipc' || true)
log "done: results in $out ($leftover shmipc files in /dev/shm, from this run or others)"
