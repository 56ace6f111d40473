package shmipc

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// TestCgroupCPULimit reads CPU quotas from cgroup trees laid out as the
// kernel does: v2 (cpu.max, the smallest of the cgroup and its ancestors)
// and v1 (cpu.cfs_quota_us over cpu.cfs_period_us), and none.
func TestCgroupCPULimit(t *testing.T) {
	write := func(path, data string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name  string
		files map[string]string
		want  float64
	}{
		{"v2 nested", map[string]string{
			"proc":                 "0::/pod/app\n",
			"root/pod/cpu.max":     "150000 100000\n",
			"root/pod/app/cpu.max": "max 100000\n",
			"root/cpu.max":         "max 100000\n",
		}, 1.5},
		{"v2 none", map[string]string{"proc": "0::/app\n", "root/app/cpu.max": "max 100000\n"}, 0},
		{"v1", map[string]string{
			"proc": "4:memory:/x\n3:cpu,cpuacct:/docker/c1\n",
			"root/cpu,cpuacct/docker/c1/cpu.cfs_quota_us":  "200000\n",
			"root/cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000\n",
			"root/cpu,cpuacct/cpu.cfs_quota_us":            "-1\n",
			"root/cpu,cpuacct/cpu.cfs_period_us":           "100000\n",
		}, 2},
		{"v1 unlimited", map[string]string{
			"proc":                       "1:cpu:/\n",
			"root/cpu/cpu.cfs_quota_us":  "-1\n",
			"root/cpu/cpu.cfs_period_us": "100000\n",
		}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for name, data := range tc.files {
				write(filepath.Join(dir, name), data)
			}
			if got := cgroupCPULimit(filepath.Join(dir, "root"), filepath.Join(dir, "proc")); got != tc.want {
				t.Errorf("limit %v CPUs, want %v", got, tc.want)
			}
		})
	}
}

// TestSpinGovernorFollowsGOMAXPROCS: the process's spinning slots follow
// GOMAXPROCS when it changes at run time: half the CPUs the process may use
// (spinSlots: the host's, or its CPU quota), and at most GOMAXPROCS.
func TestSpinGovernorFollowsGOMAXPROCS(t *testing.T) {
	prev := runtime.GOMAXPROCS(0)
	defer func() {
		runtime.GOMAXPROCS(prev)
		procs.read(time.Now())
	}()
	half := runtime.NumCPU() / 2
	if q := int(cpuQuota.limit.Load()); q > 0 && q < runtime.NumCPU() {
		half = q / 2
	}
	for _, n := range []int{1, 6, 2} {
		runtime.GOMAXPROCS(n)
		procs.read(time.Now()) // what a spinner does every procsRefresh
		if got, want := spinning.slots.Load(), int32(min(n, half)); got != want {
			t.Errorf("GOMAXPROCS %d, %d CPUs to share: %d slots, want %d", n, 2*half, got, want)
		}
	}
	if half == 0 {
		return // a single CPU: nothing ever spins
	}
	// With no slot, refused looks size the governor again.
	spinning.resize(0)
	runtime.GOMAXPROCS(4)
	for range starvedLooks {
		if spinning.enter() {
			spinning.exit()
			break
		}
	}
	if got, want := spinning.slots.Load(), int32(min(4, half)); got != want {
		t.Errorf("after a governor with no slot refused %d looks: %d slots, want %d", starvedLooks, got, want)
	}
}
