package shmipc

// A client that never reads its replies (its buffer region full, the
// server's writers waiting for room) must not slow down or break other
// clients of the same server; fd exhaustion in a server process must not
// stop it for good nor make it spin.

import (
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// scRTT starts rtt-clients, lets them run for d and returns their results.
func scRTT(t *testing.T, sock, prefix string, mode MemMapType, n int, d time.Duration) []string {
	var cs []*proctest.Child
	for range n {
		c, _ := startChild(t, proctest.Config{TestName: scChildTest, Role: "rtt-client", Args: map[string]string{"SOCK": sock, "PREFIX": prefix, "MODE": mode.String()}})
		cs = append(cs, c)
	}
	time.Sleep(d)
	var out []string
	for _, c := range cs {
		c.CloseStdin()
		var res string
		for {
			line, err := c.ReadLine(60 * time.Second)
			if err != nil {
				t.Fatalf("rtt client: %v\n%s", err, c.Output())
			}
			if r, ok := strings.CutPrefix(line, "result "); ok {
				res = r
				break
			}
		}
		c.Wait(30 * time.Second)
		out = append(out, res)
	}
	return out
}

func TestScaleSlowReaderIsolation(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	if testing.Short() {
		t.Skip("-short: a scale test of several processes for several seconds")
	}
	for _, mode := range bothModes {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "scslow")
			conf := scConfig(mode, prefix)
			sock := scSock(t)
			srv := clStartEcho(t, sock, conf)
			defer srv.close(t)

			alone := scRTT(t, sock, prefix, mode, 2, 2*time.Second)
			t.Logf("round trips without a slow reader (count maxms errs): %v", alone)

			var slows []*proctest.Child
			for range 3 {
				c, _ := startChild(t, proctest.Config{TestName: scChildTest, Role: "slow-reader", Args: map[string]string{"SOCK": sock, "PREFIX": prefix, "MODE": mode.String(), "STREAMS": "8"}})
				slows = append(slows, c)
			}
			time.Sleep(time.Second) // their regions fill, the server's writers wait
			with := scRTT(t, sock, prefix, mode, 2, 5*time.Second)
			t.Logf("round trips with 3 slow readers (count maxms errs): %v", with)
			for _, r := range with {
				var count, maxms, errs int
				fmt.Sscanf(r, "%d %d %d", &count, &maxms, &errs)
				// Bounds for a slow machine: what they catch is a client
				// stalled or failing, not a slower one.
				if errs > 0 || count < 10 || maxms > 10000 {
					t.Errorf("a client's round trips suffered from slow readers of the same server: count=%d max=%dms errors=%d (%s); alone: %v", count, maxms, errs, r, alone)
				}
			}
			for _, c := range slows {
				c.Kill()
				c.Wait(10 * time.Second)
			}
		})
	}
}

func TestScaleFdExhaustion(t *testing.T) {
	if proctest.IsChild() {
		t.Skip()
	}
	if testing.Short() {
		t.Skip("-short: a scale test: a server process run out of descriptors")
	}
	for _, mode := range testModes() {
		t.Run(mode.String(), func(t *testing.T) {
			prefix := shmPrefix(t, "scfd")
			conf := scConfig(mode, prefix)
			sock := scSock(t)
			srv := scStartServer(t, sock, prefix, mode, map[string]string{"NOFILE": "48"})
			defer srv.Stop(20 * time.Second)

			base := scParseStats(scChildStats(t, srv))
			// Connect until the server cannot take more.
			var mu sync.Mutex
			var sessions []*Session
			failed := 0
			var firstErr error
			var wg sync.WaitGroup
			sem := make(chan struct{}, 8)
			for i := range 80 {
				wg.Add(1)
				sem <- struct{}{}
				go func() {
					defer wg.Done()
					defer func() { <-sem }()
					s, err := Dial("unix", sock, conf)
					if err == nil {
						err = scEchoCheck(s, uint64(i))
						if err != nil {
							s.Close()
						}
					}
					mu.Lock()
					defer mu.Unlock()
					if err != nil {
						failed++
						if firstErr == nil {
							firstErr = err
						}
						return
					}
					sessions = append(sessions, s)
				}()
			}
			wg.Wait()
			t.Logf("%d sessions served, %d failed (first: %v)", len(sessions), failed, firstErr)
			if failed == 0 {
				t.Fatalf("the fd limit was not reached")
			}
			// At the limit, with a connection waiting in the backlog: CPU use.
			pending := make(chan error, 1)
			go func() {
				s, err := Dial("unix", sock, conf)
				if err == nil {
					s.Close()
				}
				pending <- err
			}()
			time.Sleep(300 * time.Millisecond)
			c0 := scCPUTicks(srv.Pid())
			time.Sleep(3 * time.Second)
			ticks := scCPUTicks(srv.Pid()) - c0
			t.Logf("server CPU at the fd limit: %d ticks in 3s (100 ticks = 1 CPU-second)", ticks)
			if ticks > 60 {
				t.Errorf("server uses %d%% of a CPU at the fd limit", ticks/3)
			}
			<-pending
			for _, s := range sessions {
				s.Close()
			}
			// Served again once clients have left.
			var err error
			deadline := time.Now().Add(30 * time.Second)
			for {
				var s *Session
				s, err = Dial("unix", sock, conf)
				if err == nil {
					err = scEchoCheck(s, 99)
					s.Close()
				}
				if err == nil || time.Now().After(deadline) {
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			if err != nil {
				t.Errorf("server not serving 30s after the clients left: %v\n%s", err, scChildStats(t, srv))
			}
			var line string
			deadline = time.Now().Add(30 * time.Second)
			for {
				line = scChildStats(t, srv)
				m := scParseStats(line)
				if m["liveSessions"] == 0 && m["memfdMaps"] == 0 && m["prefixMaps"] == 0 && m["serverBufCache"] == 0 && m["fds"] <= base["fds"] {
					break
				}
				if time.Now().After(deadline) {
					t.Errorf("server resources not released 30s after every client left (fd limit was hit):\n base  %v\n after %s", base, line)
					break
				}
				time.Sleep(300 * time.Millisecond)
			}
			t.Logf("server after: %s", line)
		})
	}
}

// Child process roles of the scale_* tests.

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
