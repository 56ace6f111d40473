package shmipc

// Helpers of the session and receive side that only tests use.

// free reports whether enter would find a slot now.
func (g *spinGovernor) free() bool {
	return g.active.Load() < g.slots.Load() && g.offUntil.Load() == 0
}

// freeCounts returns the free slices of each list: those on the free list
// and those this process has parked (circulation.go).
func (m *bufferManager) freeCounts() []int32 {
	free, _ := m.counts()
	return free
}
