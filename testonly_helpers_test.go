package shmipc

// Library helpers that only tests use.

// createRegion is createRegionPerm with permissions 0o600.
func createRegion(mode MemMapType, path string, size int) (*region, int, error) {
	return createRegionPerm(mode, path, size, 0o600)
}

// bufferRegionSize is the space a region of plans occupies.
func bufferRegionSize(plans []listPlan) uint64 {
	n := uint64(managerHeaderSize)
	for _, p := range plans {
		n += listHeaderSize + uint64(p.count)*(uint64(p.sliceCap)+sliceHeaderSize)
	}
	return n
}

// maxSliceCap is the data capacity of the largest slice.
func (m *bufferManager) maxSliceCap() uint32 {
	return m.lists[m.bySize[len(m.bySize)-1]].sliceCap
}

// pop takes one free slice from list li (docs/protocol.md §6.8). It returns the
// absolute offset of the slice header, or 0 when the list has no slice to
// spare. An error means the list is corrupt.
func (m *bufferManager) pop(li int) (uint32, error) {
	return m.popLeaving(li, 0)
}

// pop removes the oldest element of q. It reports false when q is empty.
func (q *ioQueue) pop() (queueElem, bool, error) {
	e, ok, err := q.peek()
	if ok {
		q.skip()
	}
	return e, ok, err
}

// end is the offset just past the last slice of l.
func (l *sliceList) end() uint32 { return l.area + l.count*l.stride }

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

// failure is why this side ended the stream (fail), or nil.
func (st *Stream) failure() error {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.failErr
}
