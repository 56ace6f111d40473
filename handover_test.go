package shmipc

import (
	"sync"
	"sync/atomic"
	"testing"
)

// TestHandoverMutex: a goroutine that finds the mutex held leaves its work
// to the holder, which sees the debt after it unlocks; with the mutex free
// it takes it. Under contention no debt is lost: every one is paid, by its
// setter or by a holder.
func TestHandoverMutex(t *testing.T) {
	var m handoverMutex
	if !m.tryLockOrLeave() {
		t.Fatal("tryLockOrLeave on a free mutex did not take it")
	}
	m.Unlock()
	m.Lock()
	var debt atomic.Bool
	debt.Store(true)
	if m.tryLockOrLeave() {
		t.Fatal("tryLockOrLeave took a held mutex")
	}
	m.Unlock()
	if !debt.Load() {
		t.Fatal("the holder does not see the debt left to it")
	}

	// Each worker adds debts and pays what it finds, as writePolling and
	// unlockW do; at the end nothing is owed.
	var owed, paid atomic.Int64
	var flag atomic.Bool
	held := 0 // guarded by m
	pay := func() {
		for flag.Load() {
			if !m.tryLockOrLeave() {
				return
			}
			if flag.Swap(false) {
				paid.Store(owed.Load())
			}
			m.Unlock()
		}
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20000 {
				owed.Add(1)
				flag.Store(true)
				pay()
				m.Lock()
				held++
				m.Unlock()
				pay()
			}
		}()
	}
	wg.Wait()
	if held != 4*20000 {
		t.Errorf("%d critical sections, want %d", held, 4*20000)
	}
	if flag.Load() {
		t.Errorf("a debt was left unpaid: %d owed, paid up to %d", owed.Load(), paid.Load())
	}
}
