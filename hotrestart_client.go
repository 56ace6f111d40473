package shmipc

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/goshm/shmipc/internal/wire"
)

// Hot restart, client side (docs/protocol.md §10, SessionManager's doc; the
// server side is in hotrestart_server.go).

// smHotRestart is the hot-restart state of a SessionManager.
type smHotRestart struct {
	mu        sync.Mutex
	ready     bool // the slots exist
	running   bool
	started   time.Time // when the running (or last) restart started
	completed int       // restarts that replaced every session and acknowledged
	failed    int       // restarts that timed out
}

// minHotRestartInterval is the least time between the starts of two hot
// restarts of a manager, so that a server sending HotRestart over and over
// cannot make it dial sessions and create regions in a loop.
const minHotRestartInterval = time.Second

// onHotRestart runs on s's receive loop and must not block. The first
// HotRestart on a current session starts the switch to the new server;
// HotRestart on a parked session, during a switch, or within
// minHotRestartInterval of the start of the last one, is ignored.
func (m *SessionManager) onHotRestart(s *Session, epoch uint64) {
	m.hr.mu.Lock()
	defer m.hr.mu.Unlock()
	if !m.hr.ready || m.hr.running || m.slotOf(s) == nil || // nil: s is parked
		time.Since(m.hr.started) < minHotRestartInterval { // a zero started is long past
		return
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return
	}
	m.wg.Add(1)
	m.mu.Unlock()
	m.hr.running = true
	m.hr.started = time.Now()
	randID := uint64(time.Now().UnixNano()) + rand.Uint64()
	go m.runHotRestart(epoch, randID, time.Now().Add(hotRestartTimeout))
}

// hotRestarting reports whether a hot restart is switching the sessions.
func (m *SessionManager) hotRestarting() bool {
	m.hr.mu.Lock()
	defer m.hr.mu.Unlock()
	return m.hr.running
}

// runHotRestart dials a new session for every slot, parks the old ones, and
// once all are replaced acknowledges on every old session and closes each
// when its streams are done. At the deadline it gives up: parked sessions
// are closed without acknowledging.
func (m *SessionManager) runHotRestart(epoch, randID uint64, deadline time.Time) {
	defer m.wg.Done()
	ctx, cancel := context.WithDeadline(m.ctx, deadline)
	defer cancel()

	// The regions' prefix becomes <prefix>_epoch_<epoch>_<randID>.
	conf := *m.conf.Config
	conf.ShareMemoryPathPrefix = fmt.Sprintf("%s_epoch_%d_%d", conf.ShareMemoryPathPrefix, epoch, randID)
	if conf.Verify() != nil { // too long for file mode: keep the plain names
		conf.ShareMemoryPathPrefix = m.conf.Config.ShareMemoryPathPrefix
	}

	var parked []*Session
	replaced := 0
	for _, sl := range m.slots {
		ns := m.dialUntil(ctx, &conf)
		if ns == nil {
			break
		}
		old, idle, installed := sl.swap(ns, nil)
		for _, is := range idle {
			is.st.Close()
		}
		if !installed { // the manager closed
			ns.Close()
			break
		}
		if old != nil {
			parked = append(parked, old)
		}
		replaced++
	}
	if replaced < len(m.slots) {
		m.endHotRestart(false)
		for _, s := range parked {
			s.Close()
		}
		return
	}
	for _, s := range parked {
		if s.IsClosed() {
			continue
		}
		if err := s.ec.write(wire.AppendHotRestart(nil, s.version, wire.TypeHotRestartAck, epoch)); err != nil {
			_ = s.sendFailed("send HotRestartAck", err)
		}
	}
	m.endHotRestart(true)
	m.drainParked(parked)
}

// endHotRestart records the end of a restart; another may start.
func (m *SessionManager) endHotRestart(ok bool) {
	m.hr.mu.Lock()
	defer m.hr.mu.Unlock()
	m.hr.running = false
	if ok {
		m.hr.completed++
	} else {
		m.hr.failed++
	}
}

// dialUntil dials a session with conf, retrying until ctx is done (nil).
func (m *SessionManager) dialUntil(ctx context.Context, conf *Config) *Session {
	backoff := m.conf.MinReconnectBackoff
	for {
		s, err := m.dialWith(ctx, conf)
		if err == nil {
			return s
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil
		}
		backoff = min(2*backoff, m.conf.MaxReconnectBackoff)
	}
}

// drainParked closes each parked session once no stream is open on it (the
// streams handed out before the switch have been put back or closed), once
// the old server closed it, or after hotRestartTimeout at the latest.
func (m *SessionManager) drainParked(parked []*Session) {
	deadline := time.Now().Add(hotRestartTimeout)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for len(parked) > 0 {
		rest := parked[:0]
		for _, s := range parked {
			s.mu.Lock()
			n := len(s.streams)
			s.mu.Unlock()
			if n == 0 || s.IsClosed() || !time.Now().Before(deadline) {
				s.Close()
				continue
			}
			rest = append(rest, s)
		}
		parked = rest
		if len(parked) == 0 {
			return
		}
		select {
		case <-tick.C:
		case <-m.ctx.Done():
			for _, s := range parked {
				s.Close()
			}
			return
		}
	}
}

// swap installs s as the slot's session, if the slot's current session
// passes ok (any does when ok is nil), and returns the one it replaces (nil
// if the slot was being re-dialed) and that one's idle streams, which the
// caller closes. It fails once the manager has closed. Waiters for a
// healthy session (GetStreamContext) look again: the slot may have been
// empty, or its session dead and not yet noticed.
func (sl *smSlot) swap(s *Session, ok func(cur *Session) bool) (old *Session, idle []idleStream, swapped bool) {
	m := sl.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, nil, false
	}
	sl.mu.Lock()
	if ok != nil && !ok(sl.sess) {
		sl.mu.Unlock()
		return nil, nil, false
	}
	old, idle = sl.sess, sl.idle
	sl.sess, sl.idle, sl.lastErr = s, nil, nil
	sl.mu.Unlock()
	close(m.healthy)
	m.healthy = make(chan struct{})
	return old, idle, true
}

// HotRestarts returns how many hot restarts the manager has completed
// (every session replaced and acknowledged) and how many timed out.
func (m *SessionManager) HotRestarts() (completed, failed int) {
	m.hr.mu.Lock()
	defer m.hr.mu.Unlock()
	return m.hr.completed, m.hr.failed
}
