package shmipc

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	shm "github.com/goshm/shmipc"
	"github.com/goshm/shmipc/internal/proctest"
)

// The tests' request protocol: a request is a 4-byte big-endian length and
// that many bytes; the reply is the same with "echo:" before the bytes.
const replyPrefix = "echo:"

// childTest is the test function that runs the child processes' roles.
const childTest = "TestCompatChild"

// testPrefix returns a unique ShareMemoryPathPrefix and removes files
// left under it when the test ends.
func testPrefix(t testing.TB) string {
	t.Helper()
	p := fmt.Sprintf("/dev/shm/compat_%d_%08x", os.Getpid(), rand.Uint32())
	t.Cleanup(func() {
		files, _ := filepath.Glob(p + "*")
		for _, f := range files {
			os.Remove(f)
		}
	})
	return p
}

// testConfig is DefaultConfig with a 32 MiB region of the reference
// classes, regions named after prefix, and no logs.
func testConfig(prefix string) *Config {
	c := DefaultConfig()
	c.ShareMemoryBufferCap = shm.ReferenceBufferCap
	c.BufferSliceSizes = nil
	for _, p := range shm.ReferenceSliceSizes() {
		c.BufferSliceSizes = append(c.BufferSliceSizes, &SizePercentPair{Size: p.Size, Percent: p.Percent})
	}
	c.ShareMemoryPathPrefix = prefix
	c.LogOutput = nil
	return c
}

// payload returns n bytes that depend on seed.
func payload(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, uint64(n)))
	p := make([]byte, n)
	for i := range p {
		p[i] = 'a' + byte(r.IntN(26))
	}
	return p
}

// request sends p as one request on st, with Reserve and WriteBytes, and
// reads the reply with ReadBytes; it checks the reply and releases it.
func request(st *Stream, p []byte) error {
	w := st.BufferWriter()
	hdr, err := w.Reserve(4)
	if err != nil {
		return err
	}
	binary.BigEndian.PutUint32(hdr, uint32(len(p)))
	if _, err := w.WriteBytes(p); err != nil {
		return err
	}
	if err := st.Flush(false); err != nil {
		return err
	}
	r := st.BufferReader()
	h, err := r.ReadBytes(4)
	if err != nil {
		return fmt.Errorf("reading the reply's length: %w", err)
	}
	n := int(binary.BigEndian.Uint32(h))
	if n != len(replyPrefix)+len(p) {
		return fmt.Errorf("reply of %d bytes to a request of %d", n, len(p))
	}
	if pre, err := r.ReadString(len(replyPrefix)); err != nil || pre != replyPrefix {
		return fmt.Errorf("reply starts %q (%v)", pre, err)
	}
	body, err := r.ReadBytes(len(p))
	if err != nil {
		return err
	}
	if string(body) != string(p) {
		return fmt.Errorf("reply body differs from the request (%d bytes)", len(p))
	}
	st.ReleaseReadAndReuse()
	return nil
}

// serveRequest reads one request from r and writes its reply on st; it
// returns the request's length.
func serveRequest(st *Stream, r BufferReader) (int, error) {
	h, err := r.ReadBytes(4)
	if err != nil {
		return 0, err
	}
	n := int(binary.BigEndian.Uint32(h))
	body, err := r.ReadBytes(n)
	if err != nil {
		return 0, err
	}
	return n, reply(st, body)
}

// reply writes the reply to body on st.
func reply(st *Stream, body []byte) error {
	w := st.BufferWriter()
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], uint32(len(replyPrefix)+len(body)))
	for _, b := range hdr {
		if err := w.WriteByte(b); err != nil {
			return err
		}
	}
	if err := w.WriteString(replyPrefix); err != nil {
		return err
	}
	if _, err := w.WriteBytes(body); err != nil {
		return err
	}
	if err := st.Flush(false); err != nil {
		return err
	}
	st.ReleaseReadAndReuse()
	return nil
}

// rootRequest is request for a stream of the root package.
func rootRequest(st *shm.Stream, p []byte) error {
	msg := binary.BigEndian.AppendUint32(nil, uint32(len(p)))
	if _, err := st.Write(append(msg, p...)); err != nil {
		return err
	}
	r := st.BufferReader()
	h, err := r.ReadBytes(4)
	if err != nil {
		return err
	}
	got, err := r.ReadBytes(int(binary.BigEndian.Uint32(h)))
	if err != nil {
		return err
	}
	if string(got) != replyPrefix+string(p) {
		return fmt.Errorf("reply of %d bytes differs", len(got))
	}
	r.ReleasePreviousRead()
	return nil
}

// rootServe serves requests on a stream of the root package until it ends.
func rootServe(st *shm.Stream) {
	r := st.BufferReader()
	for {
		h, err := r.ReadBytes(4)
		if err != nil {
			return
		}
		body, err := r.ReadBytes(int(binary.BigEndian.Uint32(h)))
		if err != nil {
			return
		}
		msg := binary.BigEndian.AppendUint32(nil, uint32(len(replyPrefix)+len(body)))
		msg = append(append(msg, replyPrefix...), body...)
		r.ReleasePreviousRead()
		if _, err := st.Write(msg); err != nil {
			return
		}
	}
}

// startChild starts a child in role with args and waits until it is
// ready; it returns the child and its ready line's information.
func startChild(t *testing.T, role string, args map[string]string) (*proctest.Child, string) {
	t.Helper()
	c := proctest.Start(t, proctest.Config{TestName: childTest, Role: role, Args: args})
	info, err := c.WaitReady(30 * time.Second)
	if err != nil {
		t.Fatalf("child %s did not get ready: %v\n%s", role, err, c.Output())
	}
	return c, info
}

// readLine returns the next line of c that starts with prefix, skipping
// others.
func readLine(t *testing.T, c *proctest.Child, prefix string) string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		line, err := c.ReadLine(time.Until(deadline))
		if err != nil {
			t.Fatalf("waiting for %q from the child: %v\n%s", prefix, err, c.Output())
		}
		if strings.HasPrefix(line, prefix) {
			return line
		}
	}
	t.Fatalf("no %q from the child\n%s", prefix, c.Output())
	return ""
}
