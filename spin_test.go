package shmipc

import (
	"testing"
	"time"
)

// TestSpinCooldown: a spinner that lost its core once pauses spinning for
// the shortest cool-down; losing it again right after each cool-down (an
// oversubscribed CPU) doubles the cool-down up to the longest; after a calm
// spell it starts over from the shortest.
func TestSpinCooldown(t *testing.T) {
	g := newSpinGovernor(4)
	t0 := time.Unix(1000, 0)
	off := func() time.Duration { return time.Duration(g.offUntil.Load() - t0.UnixNano()) }

	// Once: the shortest cool-down, from when the gap was noticed.
	g.pressure(t0.Add(-time.Millisecond), t0)
	if got := off(); got != minSpinCooldown {
		t.Fatalf("first cool-down %v, want %v", got, minSpinCooldown)
	}

	// Lost again by the first spin after each cool-down: doubles, up to the
	// longest.
	want := minSpinCooldown
	for range 12 {
		end := time.Unix(0, g.offUntil.Load())
		now := end.Add(2 * time.Millisecond) // noticed after a 2 ms gap
		g.pressure(end.Add(10*time.Microsecond), now)
		want = min(2*want, maxSpinCooldown)
		if got := time.Duration(g.offUntil.Load() - now.UnixNano()); got != want {
			t.Fatalf("cool-down %v after lasting pressure, want %v", got, want)
		}
	}

	// A calm spell (more than four cool-downs long) starts over.
	end := time.Unix(0, g.offUntil.Load())
	calm := end.Add(5 * maxSpinCooldown)
	g.pressure(calm, calm.Add(time.Millisecond))
	if got := time.Duration(g.offUntil.Load() - calm.Add(time.Millisecond).UnixNano()); got != minSpinCooldown {
		t.Fatalf("cool-down %v after a calm spell, want %v", got, minSpinCooldown)
	}

	// An occasional lost slice, well apart from the last cool-down's end,
	// never escalates.
	for i := range 5 {
		end := time.Unix(0, g.offUntil.Load())
		since := end.Add(100 * time.Millisecond)
		g.pressure(since, since.Add(time.Millisecond))
		if got := time.Duration(g.offUntil.Load() - since.Add(time.Millisecond).UnixNano()); got != minSpinCooldown {
			t.Fatalf("occasional pressure %d: cool-down %v, want %v", i, got, minSpinCooldown)
		}
	}
	if !g.free(false) && time.Now().UnixNano() > g.offUntil.Load() {
		t.Error("free reports no slot with none taken and no cool-down running")
	}
}
