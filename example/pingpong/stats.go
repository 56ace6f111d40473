package main

import (
	"bufio"
	"fmt"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

// summary is what one measurement (a transport at a message size) yields.
type summary struct {
	Transport string  `json:"transport"`
	Size      int     `json:"size_bytes"`
	N         int     `json:"round_trips"`
	P50       float64 `json:"p50_us"`
	P99       float64 `json:"p99_us"`
	P999      float64 `json:"p999_us"` // 0 when N < minP999

	Mean      float64  `json:"mean_us"`
	Min       float64  `json:"min_us"`
	Max       float64  `json:"max_us"`
	MBps      float64  `json:"mb_per_s"` // 10^6 bytes/s, both directions
	ClientCPU float64  `json:"client_cpu_us_per_op"`
	ServerCPU float64  `json:"server_cpu_us_per_op"`
	Wakeups   *float64 `json:"wakeups_per_op,omitempty"` // shm only
}

// minP999 is the sample count below which p99.9 is the maximum or close to
// it, and not worth printing.
const minP999 = 1000

func (s summary) hasP999() bool { return s.N >= minP999 }

// summarize computes the statistics of the round-trip times lat (sorted in
// place) and the CPU time both processes spent on them.
func summarize(transport string, size int, lat []time.Duration, clientCPU, serverCPU time.Duration) summary {
	slices.Sort(lat)
	n := len(lat)
	var sum time.Duration
	for _, d := range lat {
		sum += d
	}
	s := summary{
		Transport: transport,
		Size:      size,
		N:         n,
		P50:       us(percentile(lat, 0.50)),
		P99:       us(percentile(lat, 0.99)),
		Mean:      us(sum) / float64(n),
		Min:       us(lat[0]),
		Max:       us(lat[n-1]),
		MBps:      2 * float64(size) * float64(n) / sum.Seconds() / 1e6,
		ClientCPU: us(clientCPU) / float64(n),
		ServerCPU: us(serverCPU) / float64(n),
	}
	if s.hasP999() {
		s.P999 = us(percentile(lat, 0.999))
	}
	return s
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// percentile returns the nearest-rank p-quantile of the sorted samples.
func percentile(sorted []time.Duration, p float64) time.Duration {
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

// CPU time of a whole process (all threads, user + system), read from the
// kernel's per-process CPU clock: the scheduler's runtime in nanoseconds,
// which is what utime+stime in /proc/<pid>/stat are derived from, without
// their 10 ms granularity. A process may read any process's clock on Linux
// (clock_getcpuclockid(3)); if that ever fails we fall back to
// /proc/<pid>/stat.

// processClock is MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED) from the kernel.
func processClock(pid int) uintptr { return uintptr((^pid)<<3 | 2) }

const clockProcessCPUTimeID = 2 // CLOCK_PROCESS_CPUTIME_ID

func clockCPU(clock uintptr) (time.Duration, bool) {
	var ts syscall.Timespec
	_, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clock, uintptr(unsafe.Pointer(&ts)), 0)
	if errno != 0 {
		return 0, false
	}
	return time.Duration(ts.Nano()), true
}

// selfCPU is the CPU time this process has used.
func selfCPU() time.Duration {
	if d, ok := clockCPU(clockProcessCPUTimeID); ok {
		return d
	}
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// procCPU is the CPU time process pid has used.
func procCPU(pid int) time.Duration {
	if d, ok := clockCPU(processClock(pid)); ok {
		return d
	}
	d, _ := procStatCPU(pid)
	return d
}

// procStatCPU reads utime+stime from /proc/<pid>/stat.
func procStatCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may contain spaces; fields after it are
	// counted from its closing parenthesis. utime and stime are fields 14, 15.
	rest := string(b[strings.LastIndexByte(string(b), ')')+1:])
	f := strings.Fields(rest)
	if len(f) < 13 {
		return 0, fmt.Errorf("short /proc/%d/stat", pid)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("bad /proc/%d/stat", pid)
	}
	const userHZ = 100 // sysconf(_SC_CLK_TCK) on every Linux Go supports
	return time.Duration(ut+st) * time.Second / userHZ, nil
}

// machine describes the host for titles: CPU model and core count.
func machine() string {
	model := ""
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() && model == "" {
			k, v, ok := strings.Cut(sc.Text(), ":")
			switch strings.TrimSpace(k) {
			case "model name", "Model", "Hardware", "cpu model":
				if ok {
					model = strings.Join(strings.Fields(v), " ")
				}
			}
		}
		f.Close()
	}
	if model == "" {
		model = runtime.GOARCH + " CPU"
	}
	cores := "cores"
	if runtime.NumCPU() == 1 {
		cores = "core"
	}
	return fmt.Sprintf("%s, %d %s", model, runtime.NumCPU(), cores)
}

// fmtSize formats a byte count in binary units: 64 B, 4 KiB, 1 MiB, 1.5 MiB.
func fmtSize(n int) string {
	units := []string{"B", "KiB", "MiB", "GiB"}
	v, u := float64(n), 0
	for v >= 1024 && u < len(units)-1 {
		v /= 1024
		u++
	}
	return strings.TrimSuffix(strconv.FormatFloat(v, 'f', 1, 64), ".0") + " " + units[u]
}

// fmtUs formats microseconds with three significant digits and a unit.
func fmtUs(v float64) string {
	switch {
	case v <= 0:
		return "-"
	case v < 1:
		return sig3(v*1000) + " ns"
	case v < 1000:
		return sig3(v) + " µs"
	case v < 1e6:
		return sig3(v/1000) + " ms"
	}
	return sig3(v/1e6) + " s"
}

func sig3(v float64) string {
	switch {
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

const maxSize = 64 << 20

// parseSizes parses a comma-separated list of sizes such as "64,1k,4KiB,1m".
// k and m (with or without i/B) are binary multiples.
func parseSizes(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		num := strings.TrimRight(strings.ToLower(f), "bi")
		mult := 1
		switch {
		case strings.HasSuffix(num, "k"):
			mult, num = 1<<10, strings.TrimSuffix(num, "k")
		case strings.HasSuffix(num, "m"):
			mult, num = 1<<20, strings.TrimSuffix(num, "m")
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(num), 64)
		if err != nil || v <= 0 || v*float64(mult) > maxSize {
			return nil, fmt.Errorf("bad size %q: want a positive byte count such as 64, 4k or 1m, at most 64m", f)
		}
		out = append(out, int(v*float64(mult)))
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no sizes in %q", s)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// loadAverage is the system's 1, 5 and 15 minute load average, as
// uptime(1) prints it, or "?" where /proc/loadavg cannot be read.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if err != nil || len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// goVersion is the Go release and platform this program runs on.
func goVersion() string {
	return fmt.Sprintf("%s %s/%s", runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
