package shmipc

// Helpers of the session and receive side that only tests use.

// free reports whether enter would find a slot now.
func (g *spinGovernor) free() bool {
	return g.active.Load() < g.slots.Load() && g.offUntil.Load() == 0
}
