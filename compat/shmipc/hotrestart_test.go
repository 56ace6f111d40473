package shmipc

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// TestHotRestartProcess: a SessionManager sends requests without pause to
// callback server v1 (a child); server v2 (another child) calls
// NewListener on the same path; v1 runs HotRestart and waits for
// IsHotRestartDone. No request may fail, and once v1 has exited the
// requests still succeed, served by v2; the manager's sessions report the
// restart in their metrics.
func TestHotRestartProcess(t *testing.T) {
	prefix := testPrefix(t)
	sock := filepath.Join(t.TempDir(), "s.sock")
	const epoch = 3
	args := map[string]string{"SOCK": sock, "PREFIX": prefix, "EPOCH": strconv.Itoa(epoch)}
	v1, _ := startChild(t, "hr-server", args)

	conf := DefaultSessionManagerConfig()
	conf.Config = testConfig(prefix)
	conf.Address = sock
	conf.SessionNum = 2
	sm, err := NewSessionManager(conf)
	if err != nil {
		t.Fatal(err)
	}
	defer sm.Close()
	one := func(i int) error {
		st, err := sm.GetStream()
		if err != nil {
			return err
		}
		st.SetDeadline(time.Now().Add(5 * time.Second))
		if err := request(st, payload(16+i%5000, uint64(i))); err != nil {
			st.Close()
			return err
		}
		sm.PutBack(st)
		return nil
	}
	var (
		stop     atomic.Bool
		requests atomic.Int64
		mu       sync.Mutex
		failures []string
		wg       sync.WaitGroup
	)
	for w := range 3 {
		wg.Go(func() {
			for i := w << 20; !stop.Load(); i++ {
				if err := one(i); err != nil {
					mu.Lock()
					failures = append(failures, err.Error())
					mu.Unlock()
				}
				requests.Add(1)
				time.Sleep(200 * time.Microsecond)
			}
		})
	}
	time.Sleep(200 * time.Millisecond)
	v2, _ := startChild(t, "hr-server", args)
	if err := v1.Signal(syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	if line := readLine(t, v1, "hotrestart"); line != "hotrestart done" {
		t.Fatalf("v1: %q", line)
	}
	readLine(t, v1, "closed")
	before := requests.Load()
	time.Sleep(300 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	if requests.Load()-before < 10 {
		t.Errorf("only %d requests after v1 closed its listener", requests.Load()-before)
	}
	mu.Lock()
	if len(failures) > 0 {
		t.Errorf("%d of %d requests failed: %s", len(failures), requests.Load(), strings.Join(failures[:min(5, len(failures))], "; "))
	}
	mu.Unlock()

	if err := v1.CloseStdin(); err != nil {
		t.Fatal(err)
	}
	readLine(t, v1, "served ")
	if err := v1.Wait(20 * time.Second); err != nil {
		t.Fatalf("v1: %v\n%s", err, v1.Output())
	}
	for i := range 20 {
		if err := one(i); err != nil {
			t.Fatalf("request after v1 exited: %v", err)
		}
	}
	st, err := sm.GetStream()
	if err != nil {
		t.Fatal(err)
	}
	if _, q, _ := st.Session().GetMetrics(); q.HotRestartSuccessCount != 1 || q.HotRestartErrorCount != 0 {
		t.Errorf("metrics: %d hot restarts, %d failed; want 1, 0", q.HotRestartSuccessCount, q.HotRestartErrorCount)
	}
	sm.PutBack(st)
	if err := sm.Close(); err != nil {
		t.Fatal(err)
	}
	if err := v2.CloseStdin(); err != nil {
		t.Fatal(err)
	}
	var served int
	if _, err := fmt.Sscanf(readLine(t, v2, "served "), "served %d", &served); err != nil || served < 20 {
		t.Errorf("v2 served %d requests (%v), want at least 20", served, err)
	}
	if err := v2.Wait(20 * time.Second); err != nil {
		t.Fatalf("v2: %v\n%s", err, v2.Output())
	}
}
