package shmipc

import (
	"io"
	"testing"
	"time"
)

// TestOnDataNextRequestInSameSlice: a request/reply exchange whose server
// handles each request with OnData, reading it with io.ReadFull (Read
// releases what it read at once) and writing the reply, then doing some
// work before returning. The client reads the reply with ReadBytes and
// sends the next request of the same size.
//
// A stream keeps the slice it received for its next message (reuse.go), so
// the request, the reply and the next request all travel in the same slice
// of shared memory: when the next request has arrived by the time fn
// returns, it lies where the one fn read did, with the same length. OnData
// must still see that fn consumed something, and hand it the next request.
func TestOnDataNextRequestInSameSlice(t *testing.T) {
	waitsInParallel(t)
	mzModes(t, func(t *testing.T) {
		_, cli, srv := mzPair(t, nil)
		const size = 64
		handled := make(chan int, 1000)
		count := 0
		done := OnData(srv, func(st *Stream) error {
			// One request per call: OnData calls again at once when unread
			// data remains and something was consumed.
			if st.BufferReader().Len() >= size {
				req := make([]byte, size)
				if _, err := io.ReadFull(st, req); err != nil {
					return err
				}
				if _, err := st.Write(req); err != nil {
					return err
				}
				count++
				handled <- count
				time.Sleep(2 * time.Millisecond) // some work after the reply
			}
			return nil
		})
		msg := make([]byte, size)
		cli.SetReadDeadline(time.Now().Add(mzTimeout))
		for i := range shortOr(200, 60) { // each takes 2 ms of the callback's work
			msg[0] = byte(i)
			if _, err := cli.Write(msg); err != nil {
				t.Fatal(err)
			}
			select {
			case <-handled:
			case <-time.After(3 * time.Second):
				t.Fatalf("request %d (of the same size as the one before it) was never handed to the OnData callback: "+
					"server stream has %d unread bytes", i, srv.BufferReader().Len())
			}
			rep, err := cli.BufferReader().ReadBytes(size)
			if err != nil {
				t.Fatalf("reply %d: %v", i, err)
			}
			if rep[0] != byte(i) {
				t.Fatalf("reply %d: got %d", i, rep[0])
			}
			cli.BufferReader().ReleasePreviousRead()
		}
		cli.Close()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("OnData: %v", err)
			}
		case <-time.After(mzTimeout):
			t.Errorf("OnData did not end")
		}
	})
}
