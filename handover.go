package shmipc

import (
	"runtime"
	"sync"
	"sync/atomic"
)

// handoverMutex is a mutex whose holder does work that other goroutines
// left to it when they found it held, so that those need not wait: a
// wake-up owed to the peer (eventConn.pollOwed), the rest of a stream's
// Close (Stream.closeOwed). A goroutine with such work sets its debt flag
// (an atomic) and calls tryLockOrLeave; the holder looks at the flags after
// Unlock.
//
// Why the holders count: sync.Mutex.TryLock begins with a plain load of the
// mutex state, which a weakly ordered CPU (arm64) may perform before the
// debt flag's store is visible to the holder's core. holders is changed
// and read only with atomics, which Go keeps sequentially consistent: if
// tryLockOrLeave sees a holder, that holder's decrement, and its look at
// the flags after it, come later in that order than the debt's store.
type handoverMutex struct {
	mu      sync.Mutex
	holders atomic.Int32 // goroutines between Lock and Unlock (0 or 1), if countHolders
}

// countHolders is false on amd64, where an atomic store is XCHG, a full
// fence, so the plain load of TryLock cannot pass the debt's store.
const countHolders = runtime.GOARCH != "amd64"

func (m *handoverMutex) Lock() {
	m.mu.Lock()
	if countHolders {
		m.holders.Add(1)
	}
}

// Unlock releases the mutex; the caller then looks at debts left to it.
func (m *handoverMutex) Unlock() {
	if countHolders {
		m.holders.Add(-1)
	}
	m.mu.Unlock()
}

// tryLockOrLeave takes the mutex and reports true, or reports false when a
// holder will look at the debt the caller set before calling it.
func (m *handoverMutex) tryLockOrLeave() bool {
	for {
		if m.mu.TryLock() {
			if countHolders {
				m.holders.Add(1)
			}
			return true
		}
		if !countHolders || m.holders.Load() > 0 {
			return false
		}
		// Taken and not yet counted, or counted out and not yet released (or
		// handed to a waiter that has not run yet): a moment.
		runtime.Gosched()
	}
}
