package shmipc

import (
	"errors"
	"sync"
	"time"
)

// smSlot is one session of a SessionManager's fixed set and its pool of
// idle streams. When the session ends, the slot re-dials it, with backoff,
// until the manager closes (watch).
type smSlot struct {
	m     *SessionManager
	index int

	mu      sync.Mutex
	sess    *Session // nil while it is being re-dialed
	idle    []idleStream
	lastErr error // why the last dial failed

	refused chan *Session // a session whose server refused a stream (SessionManager.refused)

	renewing sync.Mutex // held while a session that ran out of stream ids is replaced (renew)
}

// refusedMinAge is how long a session serves, and how long after the last
// attempt, before a refused stream makes its slot dial a replacement; the
// wait grows up to refusedMaxWait (refusals.replace).
const (
	refusedMinAge  = time.Second
	refusedMaxWait = 16 * time.Second
)

type idleStream struct {
	st    *Stream
	since time.Time
}

// popIdle takes the newest usable idle stream of the slot, or nil.
func (sl *smSlot) popIdle() *Stream {
	var dead []*Stream
	defer func() {
		for _, st := range dead { // Close may write to the socket: not under sl.mu
			st.Close()
		}
	}()
	sl.mu.Lock()
	defer sl.mu.Unlock()
	for len(sl.idle) > 0 {
		is := sl.idle[len(sl.idle)-1]
		sl.idle[len(sl.idle)-1] = idleStream{}
		sl.idle = sl.idle[:len(sl.idle)-1]
		is.st.pooled = false
		// The server may have closed the stream while it was idle, or sent
		// something it should not have.
		if poolable(is.st) {
			return is.st
		}
		dead = append(dead, is.st)
	}
	return nil
}

// openStream opens a stream on the slot's session. It returns nil and the
// reason when the slot has no healthy session.
func (sl *smSlot) openStream() (*Stream, error) {
	sl.mu.Lock()
	s, lastErr := sl.sess, sl.lastErr
	sl.mu.Unlock()
	if s == nil {
		if lastErr == nil {
			lastErr = errors.New("session is being re-dialed")
		}
		return nil, lastErr
	}
	st, err := s.OpenStream()
	if errors.Is(err, ErrStreamIDsExhausted) {
		if ns := sl.renew(s); ns != nil {
			return ns.OpenStream()
		}
	}
	return st, err
}

// renew replaces the slot's session s, which has opened its last stream
// id, with a new session (install). It returns the slot's session after
// that (one another caller renewed it with, if s was renewed meanwhile),
// or nil when no new session could be dialed.
func (sl *smSlot) renew(s *Session) *Session {
	sl.renewing.Lock()
	defer sl.renewing.Unlock()
	if cur := sl.current(); cur != s {
		return cur
	}
	if sl.m.hotRestarting() { // it replaces the sessions itself
		return nil
	}
	ns, err := sl.m.dial()
	if err != nil {
		return nil
	}
	if !sl.install(s, ns) {
		return sl.current()
	}
	return ns
}

// install makes ns the slot's session in place of s and retires s: its
// idle streams are closed, those handed out are closed as they are put
// back, and s ends with the last of them. If s is no longer the slot's
// session (a hot restart replaced it) or the manager has closed, it closes
// ns instead and reports false.
func (sl *smSlot) install(s, ns *Session) bool {
	_, idle, ok := sl.swap(ns, func(cur *Session) bool { return cur == s })
	if !ok {
		ns.Close()
		return false
	}
	for _, is := range idle {
		is.st.Close()
	}
	s.retire()
	sl.m.closeRetired(s)
	return true
}

// putBack pools st if it belongs to this slot's session; it reports whether
// st belonged here (if so, it was pooled or closed).
func (sl *smSlot) putBack(st *Stream) bool {
	sl.mu.Lock()
	mine := sl.sess == st.s
	pool := mine && !st.pooled // pooled twice, it would be handed out twice
	full := pool && len(sl.idle) >= sl.m.conf.MaxIdleStreams
	if pool && !full {
		st.pooled = true
		sl.idle = append(sl.idle, idleStream{st: st, since: time.Now()})
	}
	sl.mu.Unlock()
	if full {
		st.Close() // not under sl.mu: Close may write to the socket
	}
	return mine
}

// watch waits for the slot's session to die, then drops its pool and
// re-dials it with backoff, until the manager closes. The backoff goes on
// growing across sessions that die young, so that a server that drops each
// session after the handshake is not re-dialed in a storm; it starts again
// from MinReconnectBackoff once a session stayed up for MaxReconnectBackoff.
func (sl *smSlot) watch(s *Session) {
	m := sl.m
	defer m.wg.Done()
	backoff := m.conf.MinReconnectBackoff
	born := time.Now()
	var ref refusals
	defer ref.stop()
	for {
		select {
		case <-s.closed:
		case r := <-sl.refused:
			if r != sl.current() || r.IsClosed() {
				continue
			}
			if r != s { // a hot restart installed r while s, parked, drains
				s, born = r, time.Now()
			}
			s, born = ref.replace(sl, s, born)
			continue
		case <-ref.retry:
			ref.retry = nil
			if ref.pending == s && !s.IsClosed() && sl.current() == s {
				s, born = ref.replace(sl, s, born)
			}
			continue
		case <-m.ctx.Done():
			return
		}
		sl.mu.Lock()
		var idle []idleStream
		cur := sl.sess
		if cur == s {
			idle = sl.idle
			sl.sess, sl.idle, sl.lastErr = nil, nil, s.Err()
		}
		sl.mu.Unlock()
		if cur != s && cur != nil { // a hot restart replaced s: watch its successor
			s, born = cur, time.Now()
			continue
		}
		for _, is := range idle {
			is.st.Close()
		}
		s.Close() // wait for its receive loop
		if time.Since(born) >= m.conf.MaxReconnectBackoff {
			backoff = m.conf.MinReconnectBackoff // it was healthy
		}

		for {
			t := time.NewTimer(backoff)
			select {
			case <-t.C:
			case <-m.ctx.Done():
				t.Stop()
				return
			}
			backoff = min(2*backoff, m.conf.MaxReconnectBackoff)
			ns, err := m.dial()
			if err == nil {
				cur := sl.attach(ns)
				if cur != ns { // the manager closed (nil), or a hot restart installed a session meanwhile
					ns.Close()
				}
				if cur == nil {
					return
				}
				s, born = cur, time.Now()
				break
			}
			if m.ctx.Err() != nil {
				return
			}
			sl.mu.Lock()
			sl.lastErr = err
			sl.mu.Unlock()
		}
	}
}

// refusals paces a slot's replacements after refused streams (watch).
type refusals struct {
	wait    time.Duration // between replacements; 0 means refusedMinAge
	last    time.Time     // of the last attempt
	timer   *time.Timer
	retry   <-chan time.Time // fires when a deferred refusal is due
	pending *Session         // the session that deferred refusal was on
}

// due returns how long a session born at born must still serve, or the
// slot wait since its last attempt, before a refusal replaces it. After a
// quiet spell of four waits the wait starts again from refusedMinAge.
func (r *refusals) due(born time.Time) time.Duration {
	if r.wait == 0 || (!r.last.IsZero() && time.Since(r.last) > 4*r.wait) {
		r.wait = refusedMinAge
	}
	return max(r.wait-time.Since(born), r.wait-time.Since(r.last))
}

// later remembers a refusal on s to act on after d, unless one is pending.
func (r *refusals) later(s *Session, d time.Duration) {
	if r.retry != nil && r.pending == s {
		return
	}
	r.stop()
	r.timer = time.NewTimer(d)
	r.retry, r.pending = r.timer.C, s
}

func (r *refusals) stop() {
	if r.timer != nil {
		r.timer.Stop()
	}
	r.timer, r.retry, r.pending = nil, nil, nil
}

// replace acts on a refusal on s, the slot's session since born, and
// returns the slot's session and its birth time. Until s has served long
// enough (due), or while a hot restart runs, it comes back to it later.
// Then it replaces s (replaceRefused). A replacement that reaches the same
// server process (or pid 0) means an application that closes new streams
// unanswered, not a stopping server: the wait doubles, up to
// refusedMaxWait. Another process resets it.
func (r *refusals) replace(sl *smSlot, s *Session, born time.Time) (*Session, time.Time) {
	if wait := r.due(born); wait > 0 || sl.m.hotRestarting() {
		r.later(s, max(wait, refusedMinAge/4))
		return s, born
	}
	r.stop()
	r.last = time.Now()
	ns := sl.replaceRefused(s)
	if ns == nil {
		return s, born
	}
	if pid := ns.peerPid(); pid == 0 || pid == s.peerPid() {
		r.wait = min(2*r.wait, refusedMaxWait)
	} else {
		r.wait = refusedMinAge
	}
	return ns, time.Now()
}

// replaceRefused replaces the slot's session s, whose server refused a
// stream: a server stopping gracefully (Listener.Close) ends its sessions
// only once their last stream is closed, so a pool that kept reusing its
// streams would keep it from stopping. It dials the server that now listens
// at the address and installs the new session, which it returns; nil when
// the dial fails (s stays, and the next refusal tries again).
func (sl *smSlot) replaceRefused(s *Session) *Session {
	ns, err := sl.m.dial()
	if err != nil {
		return nil
	}
	if sl.m.hotRestarting() { // it replaces the sessions itself
		ns.Close()
		return nil
	}
	if !sl.install(s, ns) {
		return nil
	}
	return ns
}

// current returns the slot's session (nil while it is re-dialed).
func (sl *smSlot) current() *Session {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	return sl.sess
}

// closeRetired closes a retired session s when the manager closes, if it
// has not ended by then.
func (m *SessionManager) closeRetired(s *Session) {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		s.Close()
		return
	}
	m.wg.Add(1)
	m.mu.Unlock()
	go func() {
		defer m.wg.Done()
		select {
		case <-s.closed:
		case <-m.ctx.Done():
			s.Close()
		}
	}()
}

// attach installs a re-dialed session in the empty slot and returns it,
// unless the manager has closed (nil) or a hot restart installed a session
// in the meantime (that session is returned instead).
func (sl *smSlot) attach(s *Session) *Session {
	var cur *Session // not set if the manager has closed
	// An empty slot pools no streams (putBack pools only on the slot's
	// session), so swap hands back none to close.
	if _, _, ok := sl.swap(s, func(c *Session) bool { cur = c; return c == nil }); ok {
		return s
	}
	return cur
}
