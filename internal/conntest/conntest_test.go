package conntest

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/goshm/shmipc"
	"golang.org/x/net/nettest"
)

// TestStreamIsNetConn runs nettest.TestConn, the conformance suite for
// net.Conn implementations (basic I/O, ping-pong, racy reads and writes,
// deadlines in the past, present and future, Close unblocking calls,
// concurrent methods), on the two ends of a shmipc stream: over a Unix
// socket with memfd regions and with /dev/shm files, and over TCP
// loopback.
func TestStreamIsNetConn(t *testing.T) {
	for _, tc := range []struct {
		name    string
		network string
		mode    shmipc.MemMapType
	}{
		{"unix memfd", "unix", shmipc.MemMapTypeMemFd},
		{"unix file", "unix", shmipc.MemMapTypeDevShmFile},
		{"tcp file", "tcp", shmipc.MemMapTypeDevShmFile},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nettest.TestConn(t, func() (net.Conn, net.Conn, func(), error) {
				return streamPair(t, tc.network, tc.mode)
			})
		})
	}
}

// streamPair opens a session and a stream on it, and returns the stream's
// client end and its server end.
func streamPair(t *testing.T, network string, mode shmipc.MemMapType) (c1, c2 net.Conn, stop func(), err error) {
	prefix := fmt.Sprintf("/dev/shm/shmipc_conntest_%d_%08x", os.Getpid(), rand.Uint32())
	conf := shmipc.DefaultConfig()
	conf.MemMapType = mode
	conf.ShareMemoryPathPrefix = prefix
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(t.TempDir(), "s.sock")
	}
	ln, err := shmipc.Listen(network, addr, conf)
	if err != nil {
		return nil, nil, nil, err
	}
	var sess *shmipc.Session
	stop = func() {
		if c1 != nil {
			c1.Close()
		}
		if c2 != nil {
			c2.Close()
		}
		if sess != nil {
			sess.Close()
		}
		ln.CloseAll()
		removeUnder(prefix)
	}
	fail := func(err error) (net.Conn, net.Conn, func(), error) {
		stop()
		return nil, nil, nil, err
	}
	if sess, err = shmipc.Dial(network, ln.Addr().String(), conf); err != nil {
		return fail(err)
	}
	st, err := sess.OpenStream()
	if err != nil {
		return fail(err)
	}
	c1 = st
	// A stream opens implicitly: the server learns of it with its first
	// data (the Shmipc protocol has no open message). The byte is read
	// before the suite starts.
	if _, err := c1.Write([]byte{0}); err != nil {
		return fail(err)
	}
	if c2, err = ln.Accept(); err != nil {
		return fail(err)
	}
	var b [1]byte
	if _, err := c2.Read(b[:]); err != nil {
		return fail(err)
	}
	return c1, c2, stop, nil
}

// removeUnder removes the files whose path starts with prefix (file mode
// regions left behind).
func removeUnder(prefix string) {
	dir, base := filepath.Dir(prefix), filepath.Base(prefix)
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), base) {
			_ = os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}
