package shmipc

// Child process roles of the scale_* tests.

import (
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

const scChildTest = "TestScaleChild"

// TestScaleChild runs one role of the scale tests' child processes.
func TestScaleChild(t *testing.T) {
	role := proctest.Role()
	if role == "" {
		t.Skip("helper process for the scale tests")
	}
	sock := proctest.Arg("SOCK")
	prefix := proctest.Arg("PREFIX")
	mode := MemMapTypeMemFd
	if proctest.Arg("MODE") != "" {
		mode = mpParseMode(t, proctest.Arg("MODE"))
	}
	conf := scConfig(mode, prefix)
	switch role {
	case "churn-client":
		scChurnClient(t, sock, conf, proctest.Arg("BEHAVIOR"))
	case "handshake-killer":
		scHandshakeKiller(sock, conf)
	case "echo-server":
		scEchoServerChild(t, sock, conf)
	case "rtt-client":
		scRTTClient(t, sock, conf)
	case "slow-reader":
		scSlowReader(t, sock, conf)
	default:
		t.Fatalf("unknown role %q", role)
	}
}

// scChurnClient dials, opens several streams, exchanges data, then behaves
// as behavior says.
func scChurnClient(t *testing.T, sock string, conf *Config, behavior string) {
	sess, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	const nStreams = 4
	streams := make([]*Stream, nStreams)
	for i := range streams {
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatalf("OpenStream: %v", err)
		}
		st.SetDeadline(time.Now().Add(30 * time.Second))
		for j, n := range []int{64, 8 << 10, 200 << 10} {
			if err := mpRoundTrip(st, mpPayload(n, uint64(100*i+j)), (i+j)%2 == 0); err != nil {
				t.Fatalf("stream %d: %v", i, err)
			}
		}
		streams[i] = st
	}
	switch behavior {
	case "clean":
		for i, st := range streams {
			if i%2 == 0 {
				if err := mpCloseByServer(st); err != nil {
					t.Errorf("close by server: %v", err)
				}
			}
			st.Close()
		}
		sess.Close()
		proctest.Println("done")
	case "exit":
		proctest.Println("done")
		os.Exit(0) // no Close of anything
	case "killwrite":
		// Write frames on every stream without reading the echoes: the
		// server's replies fill our region, its writers wait for room.
		for _, st := range streams {
			go func() {
				p := scFrame(mpPayload(256<<10, 7))
				st.SetDeadline(time.Time{})
				for {
					if _, err := st.Write(p); err != nil {
						return
					}
				}
			}()
		}
		time.Sleep(50 * time.Millisecond)
		proctest.Println("busy")
		select {}
	case "killread":
		// Hold a zero-copy slice of a reply and block in reads on every
		// stream; the server is idle in reads too.
		st := streams[0]
		if _, err := st.Write(scFrame(mpPayload(64<<10, 9))); err != nil {
			t.Fatal(err)
		}
		if _, err := st.BufferReader().ReadBytes(4 + 64<<10); err != nil {
			t.Fatal(err)
		}
		for _, st := range streams {
			st.SetDeadline(time.Time{})
			go st.Read(make([]byte, 10))
		}
		proctest.Println("busy")
		select {}
	case "killmidframe":
		// Half of a 1 MiB frame: the server waits in the middle of it,
		// others streams with echoes in flight.
		hdr := make([]byte, 4)
		binary.BigEndian.PutUint32(hdr, 1<<20)
		if _, err := streams[0].Write(append(hdr, make([]byte, 300<<10)...)); err != nil {
			t.Fatal(err)
		}
		for _, st := range streams[1:] {
			if _, err := st.Write(scFrame(mpPayload(100<<10, 3))); err != nil {
				t.Fatal(err)
			}
		}
		proctest.Println("busy")
		select {}
	default:
		t.Fatalf("unknown behavior %q", behavior)
	}
}

// scHandshakeKiller dials over and over on several goroutines (and opens raw
// connections that say nothing or half a frame) until killed.
func scHandshakeKiller(sock string, conf *Config) {
	proctest.Println("busy")
	for g := range 4 {
		go func() {
			for i := 0; ; i++ {
				if g == 0 {
					c, err := net.Dial("unix", sock)
					if err == nil {
						if i%2 == 0 {
							c.Write([]byte{0, 0, 0})
						}
						// left open: the kill closes it
						_ = c
						time.Sleep(time.Millisecond)
					}
					continue
				}
				s, err := Dial("unix", sock, conf)
				if err == nil {
					if st, err := s.OpenStream(); err == nil {
						st.Write(scFrame([]byte("x")))
					}
					if i%2 == 0 {
						s.Close()
					}
				}
			}
		}()
	}
	select {}
}

// scEchoServerChild serves the echo protocol until stdin closes. A stream
// whose first frame is "STATS" gets back a line of stats instead.
// RLIMIT_NOFILE is lowered to NOFILE if given.
func scEchoServerChild(t *testing.T, sock string, conf *Config) {
	if v := proctest.Arg("NOFILE"); v != "" {
		n, _ := strconv.ParseUint(v, 10, 64)
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: n, Max: n}); err != nil {
			t.Fatalf("setrlimit: %v", err)
		}
	}
	ln, err := Listen("unix", sock, conf)
	if err != nil {
		t.Fatalf("Listen: %v", err)
	}
	var wg sync.WaitGroup
	serveStreamsCounted(ln, &wg, func(st *Stream) { _ = mpServeEcho(st) })
	usr := make(chan os.Signal, 1)
	signal.Notify(usr, syscall.SIGUSR1)
	go func() {
		for range usr {
			proctest.Println("stats " + scTakeSelf(conf.ShareMemoryPathPrefix).String())
		}
	}()
	proctest.Ready(strconv.Itoa(os.Getpid()))
	<-proctest.StdinClosed()
	runtime.GC()
	s := scTakeSelf(conf.ShareMemoryPathPrefix)
	proctest.Println("final " + s.String())
	ln.CloseAll()
}

// scSlowReader dials, sends echo requests on STREAMS streams and never reads
// the replies: the server's replies fill the buffer region.
func scSlowReader(t *testing.T, sock string, conf *Config) {
	sess, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	n, _ := strconv.Atoi(proctest.Arg("STREAMS"))
	for i := range n {
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			p := scFrame(mpPayload(200<<10, uint64(i)))
			for {
				if _, err := st.Write(p); err != nil {
					fmt.Fprintln(os.Stderr, "slow reader write:", err)
					return
				}
			}
		}()
	}
	proctest.Ready()
	<-proctest.StdinClosed()
}

// scRTTClient runs round trips on 4 streams until stdin closes and prints
// "result <count> <max latency ms> <errors>".
func scRTTClient(t *testing.T, sock string, conf *Config) {
	sess, err := Dial("unix", sock, conf)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	defer sess.Close()
	var mu sync.Mutex
	var count, errs int
	var maxLat time.Duration
	var firstErr error
	stop := proctest.StdinClosed()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := sess.OpenStream()
			if err != nil {
				mu.Lock()
				errs++
				firstErr = err
				mu.Unlock()
				return
			}
			defer st.Close()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				st.SetDeadline(time.Now().Add(30 * time.Second))
				start := time.Now()
				err := mpRoundTrip(st, mpPayload(32<<10, uint64(g*1000+i)), i%2 == 0)
				d := time.Since(start)
				mu.Lock()
				if err != nil {
					errs++
					if firstErr == nil {
						firstErr = err
					}
				} else {
					count++
					maxLat = max(maxLat, d)
				}
				mu.Unlock()
				if err != nil {
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		}()
	}
	proctest.Ready()
	wg.Wait()
	proctest.Println(fmt.Sprintf("result %d %d %d %v", count, maxLat.Milliseconds(), errs, firstErr))
}
