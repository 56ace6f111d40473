package shmipc

import (
	"bufio"
	"bytes"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// The CPUs spinning is rationed to (spinGovernor): half the CPUs the
// process may use, since the peer process needs the other half, and at most
// GOMAXPROCS, since a spinner holds a processor. A cgroup CPU quota (v2
// cpu.max, v1 cpu.cfs_quota_us over cpu.cfs_period_us) counts, not the
// host's CPUs: in a container limited to 2 CPUs of a 64-core host, half is
// 1 spinner, not 32. The quota, a few file reads, is read again at most
// every quotaRefresh, on a goroutine of its own; GOMAXPROCS, see procs.

const (
	quotaRefresh = time.Second
	starvedLooks = 1 << 10
)

var cpuQuota struct {
	limit   atomic.Int32 // CPUs the quota gives, rounded up; 0: no quota
	readAt  atomic.Int64 // when it was last read (UnixNano)
	reading atomic.Bool
	starved atomic.Uint32 // slots refused for want of any (spinGovernor.starve)
}

// spinSlots is how many goroutines of the process may spin at once when it
// runs goroutines on procs processors. It reads the quota again if due.
func spinSlots(procs int) int {
	now := time.Now().UnixNano()
	if at := cpuQuota.readAt.Load(); (at == 0 || now-at > int64(quotaRefresh)) && cpuQuota.reading.CompareAndSwap(false, true) {
		cpuQuota.readAt.Store(now)
		if at == 0 {
			refreshQuota() // the first time, before the governor is sized
		} else {
			go refreshQuota()
		}
	}
	cpus := runtime.NumCPU()
	if q := int(cpuQuota.limit.Load()); q > 0 && q < cpus {
		cpus = q
	}
	return min(procs, cpus/2)
}

func refreshQuota() {
	defer cpuQuota.reading.Store(false)
	q := cgroupCPULimit("/sys/fs/cgroup", "/proc/self/cgroup")
	cpuQuota.limit.Store(int32(math.Ceil(min(q, math.MaxInt32))))
}

// resize sets the governor's slots (spinSlots). It writes only what
// changes: the word is read on every spin.
func (g *spinGovernor) resize(slots int) {
	if n := int32(slots); g.slots.Load() != n {
		g.slots.Store(n)
	}
}

// starve is enter for a process with no slots: every starvedLooks calls
// it sizes the governor again, since nothing else does while none spins.
// It reports false.
func (g *spinGovernor) starve() bool {
	if cpuQuota.starved.Add(1)%starvedLooks == 0 && g == spinning {
		g.resize(spinSlots(runtime.GOMAXPROCS(0)))
	}
	return false
}

// cgroupCPULimit returns the CPUs the process's cgroup CPU quota gives (0:
// none, or none found): the smallest quota/period of its cgroup and its
// ancestors, found under root (the cgroup file systems' mount point) from
// the paths the file procCgroup (/proc/self/cgroup) names.
func cgroupCPULimit(root, procCgroup string) float64 {
	data, err := os.ReadFile(procCgroup)
	if err != nil {
		return 0
	}
	limit := 0.0
	take := func(q float64) {
		if q > 0 && (limit == 0 || q < limit) {
			limit = q
		}
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		f := strings.SplitN(sc.Text(), ":", 3)
		if len(f) != 3 {
			continue
		}
		if f[0] == "0" && f[1] == "" { // cgroup v2
			for _, mount := range []string{root, filepath.Join(root, "unified")} {
				if dirExists(mount) {
					walkCgroup(filepath.Join(mount, f[2]), mount, func(dir string) { take(readCPUMax(dir)) })
				}
			}
			continue
		}
		if !slices.Contains(strings.Split(f[1], ","), "cpu") {
			continue
		}
		for _, m := range []string{"cpu", "cpu,cpuacct", "cpuacct,cpu"} {
			mount := filepath.Join(root, m)
			if dirExists(mount) {
				walkCgroup(filepath.Join(mount, f[2]), mount, func(dir string) { take(readCFS(dir)) })
				break
			}
		}
	}
	return limit
}

// walkCgroup calls f for dir and each of its parents up to top.
func walkCgroup(dir, top string, f func(string)) {
	for {
		f(dir)
		if dir == top || len(dir) <= len(top) {
			return
		}
		dir = filepath.Dir(dir)
	}
}

func dirExists(dir string) bool {
	fi, err := os.Stat(dir)
	return err == nil && fi.IsDir()
}

// readCPUMax reads a cgroup v2 cpu.max ("max 100000" or "50000 100000").
func readCPUMax(dir string) float64 {
	data, err := os.ReadFile(filepath.Join(dir, "cpu.max"))
	if err != nil {
		return 0
	}
	f := strings.Fields(string(data))
	if len(f) != 2 || f[0] == "max" {
		return 0
	}
	return ratio(f[0], f[1])
}

// readCFS reads a cgroup v1 quota (cpu.cfs_quota_us, -1 for none) over its
// period (cpu.cfs_period_us).
func readCFS(dir string) float64 {
	q, err1 := os.ReadFile(filepath.Join(dir, "cpu.cfs_quota_us"))
	p, err2 := os.ReadFile(filepath.Join(dir, "cpu.cfs_period_us"))
	if err1 != nil || err2 != nil {
		return 0
	}
	return ratio(strings.TrimSpace(string(q)), strings.TrimSpace(string(p)))
}

func ratio(quota, period string) float64 {
	q, err1 := strconv.ParseFloat(quota, 64)
	p, err2 := strconv.ParseFloat(period, 64)
	if err1 != nil || err2 != nil || q <= 0 || p <= 0 {
		return 0
	}
	return q / p
}
