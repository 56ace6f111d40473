package shmipc

// failure is why this side ended the stream (fail), or nil.
func (st *Stream) failure() error {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.failErr
}
