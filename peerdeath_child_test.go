package shmipc

// The child of the peer death tests: TestPeerDeathChild, a shmipc server or
// client (or a raw peer that stalls in the handshake) that the parent kills,
// and what it does on each stream.

import (
	"io"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
	"github.com/goshm/shmipc/internal/shm"
	"github.com/goshm/shmipc/internal/wire"
	"golang.org/x/sys/unix"
)

const (
	pdChildTest = "TestPeerDeathChild"
	// pdBound is the asserted bound on how long a blocked call may take to
	// fail after the peer is killed; the target is 100 ms.
	pdBound = 2 * time.Second
)

// pdConfig returns the configuration kind ("default" or "small") in mode.
// Timeouts are long so that only the peer's death can end a blocked call.
func pdConfig(kind string, mode MemMapType, prefix string) *Config {
	conf := DefaultConfig()
	conf.MemMapType = mode
	conf.ShareMemoryPathPrefix = prefix
	conf.ShareMemoryBufferCap = 16 << 20
	conf.InitializeTimeout = 30 * time.Second
	conf.ConnectionWriteTimeout = 60 * time.Second
	conf.WriteSpaceTimeout = 60 * time.Second
	if strings.HasPrefix(kind, "small") {
		conf.QueueCap = 16
		conf.ShareMemoryBufferCap = 1 << 20
		conf.BufferSliceSizes = ReferenceSliceSizes()
	}
	conf.FallbackWhenFull = kind == "small-fwf"
	return conf
}

var pdHello = []byte("HELO")

// pdOnce prints line once per child process.
var pdOnce sync.Map

func pdPrintOnce(line string) {
	if _, loaded := pdOnce.LoadOrStore(line, true); !loaded {
		proctest.Println(line)
	}
}

// pdBehave runs the child's side of one stream after the hello.
func pdBehave(t *testing.T, st *Stream, behavior string) {
	switch behavior {
	case "echo":
		_ = mpServeEcho(st)
	case "idle":
		_, _ = st.Read(make([]byte, 1))
	case "sink": // read and throw away
		buf := make([]byte, 256<<10)
		for {
			if _, err := st.Read(buf); err != nil {
				return
			}
		}
	case "stream": // send large messages without end, drain what comes
		go func() {
			buf := make([]byte, 64<<10)
			for {
				if _, err := st.Read(buf); err != nil {
					return
				}
			}
		}()
		rng := rand.New(rand.NewPCG(rand.Uint64(), 0))
		for seq := uint32(0); ; seq++ {
			n := 256<<10 + rng.IntN(2<<20)
			if err := skSend(st, seq, skBody(rng, n), 0, skReserveIf(rng.IntN(3) == 0), nil); err != nil {
				return
			}
			if seq == 2 {
				pdPrintOnce("streaming")
			}
		}
	case "hold": // keep every slice read; send back what was read
		r := &skReader{st: st, hold: true, rng: rand.New(rand.NewPCG(1, 2))}
		var held int
		for {
			_, n, err := r.next()
			if err != nil {
				return
			}
			held += n
			if r.seq == 8 {
				rng := rand.New(rand.NewPCG(3, 4))
				for i := range 8 {
					if err := skSend(st, uint32(i), skBody(rng, 100<<10), 0, skViaWriteBytes, nil); err != nil {
						return
					}
				}
				proctest.Println("held " + strconv.Itoa(held))
			}
		}
	case "mixed": // the kill loop's workload
		pdMixed(st, rand.Uint64(), 1<<20, nil)
	default:
		t.Errorf("unknown behavior %q", behavior)
	}
}

// pdMixed runs the full-duplex mixed workload on st until it fails: one
// goroutine sends checksummed messages of 1 B to max bytes, the caller's
// reads and verifies the peer's. It returns the read error and sends the
// write error to werr if not nil.
func pdMixed(st *Stream, seed uint64, max int, werr chan<- error) error {
	go func() {
		rng := rand.New(rand.NewPCG(seed, 7))
		var err error
		for seq := uint32(0); err == nil; seq++ {
			err = skSend(st, seq, skBody(rng, skSize(rng, max)), 0, skReserveIf(rng.IntN(4) == 0), nil)
		}
		if werr != nil {
			werr <- err
		}
	}()
	r := &skReader{st: st, rng: rand.New(rand.NewPCG(seed, 8))}
	for {
		if _, _, err := r.next(); err != nil {
			return err
		}
	}
}

// TestPeerDeathChild is the body of the child processes. Arguments: SOCK,
// PREFIX, MODE, CONF (config kind), SIDE (server: listen on SOCK; client:
// dial SOCK and open NSTREAMS streams), BEHAVIOR (what to do on each
// stream, after the opener sent "HELO"), or SIDE raw-server / raw-client
// with STAGE, a peer that stalls in the handshake.
func TestPeerDeathChild(t *testing.T) {
	if proctest.Role() == "" {
		t.Skip("runs only as the child process of the peer-death tests")
	}
	sock := proctest.MustArg(t, "SOCK")
	prefix := proctest.MustArg(t, "PREFIX")
	mode := mpParseMode(t, proctest.MustArg(t, "MODE"))
	conf := pdConfig(proctest.MustArg(t, "CONF"), mode, prefix)
	behavior := proctest.Arg("BEHAVIOR")
	switch side := proctest.MustArg(t, "SIDE"); side {
	case "server":
		ln, err := Listen("unix", sock, conf)
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go serveStreams(ln, func(st *Stream) {
			defer st.Close()
			hello := make([]byte, len(pdHello))
			if _, err := io.ReadFull(st, hello); err != nil {
				return
			}
			pdBehave(t, st, behavior)
		})
		proctest.Ready()
		<-proctest.StdinClosed()

	case "client":
		sess, err := Dial("unix", sock, conf)
		if err != nil {
			t.Fatal(err)
		}
		defer sess.Close()
		n, _ := strconv.Atoi(proctest.MustArg(t, "NSTREAMS"))
		for range n {
			st, err := sess.OpenStream()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := st.Write(pdHello); err != nil {
				t.Fatal(err)
			}
			go func() {
				defer st.Close()
				pdBehave(t, st, behavior)
			}()
		}
		proctest.Ready()
		<-proctest.StdinClosed()

	case "raw-server":
		pdRawServer(t, sock, proctest.MustArg(t, "STAGE"))
	case "raw-client":
		pdRawClient(t, sock, prefix, proctest.MustArg(t, "STAGE"))
	default:
		t.Fatalf("unknown SIDE %q", side)
	}
}

// pdRawServer accepts one connection and stalls at stage: "accept" (never
// answers), "exchange" (answers the version exchange), "ackfd" (also takes
// the region fds).
func pdRawServer(t *testing.T, sock, stage string) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	proctest.Ready()
	c, err := ln.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	h := make(wire.Header, wire.HeaderSize)
	if stage != "accept" {
		if _, err := io.ReadFull(c, h); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(wire.AppendEvent(nil, wire.VersionMemfd, wire.TypeExchangeProtoVersion)); err != nil {
			t.Fatal(err)
		}
	}
	if stage == "ackfd" {
		if _, err := io.ReadFull(c, h); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, make([]byte, h.Length()-wire.HeaderSize)); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(wire.AppendEvent(nil, wire.VersionMemfd, wire.TypeAckReadyRecvFD)); err != nil {
			t.Fatal(err)
		}
		oob := make([]byte, unix.CmsgSpace(16))
		if _, _, _, _, err := c.ReadMsgUnix(make([]byte, 1), oob); err != nil {
			t.Fatal(err)
		}
	}
	proctest.Println("stalled")
	<-proctest.StdinClosed()
	c.Close()
	ln.Close()
}

// pdRawClient connects and stalls at stage: "exchange" (sent
// ExchangeProtoVersion only), "paths" (got AckReadyRecvFD, sends no fds),
// "partial" (a version 2 path message cut short), "mapped" (completed a
// memfd handshake with its own regions, then does nothing).
func pdRawClient(t *testing.T, sock, prefix, stage string) {
	raw, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	c := raw.(*net.UnixConn)
	qpath, bpath := prefix+"_raw_queue_0", prefix+"_raw_buffer"
	switch stage {
	case "exchange":
		if _, err := c.Write(wire.AppendEvent(nil, wire.VersionMemfd, wire.TypeExchangeProtoVersion)); err != nil {
			t.Fatal(err)
		}
	case "paths":
		if err := clExchange(c); err != nil {
			t.Fatal(err)
		}
		f, _ := wire.AppendPaths(nil, wire.VersionMemfd, wire.TypeShareMemoryByMemfd, qpath, bpath)
		if _, err := c.Write(f); err != nil {
			t.Fatal(err)
		}
		if err := clExpectFrame(c, wire.TypeAckReadyRecvFD); err != nil {
			t.Fatal(err)
		}
	case "partial":
		f, _ := wire.AppendPaths(nil, wire.VersionFilePath, wire.TypeShareMemoryByFilePath, qpath, bpath)
		if _, err := c.Write(f[:len(f)-5]); err != nil {
			t.Fatal(err)
		}
	case "mapped":
		bufFd, err := clMemfd(bpath, 1<<20, true)
		if err != nil {
			t.Fatal(err)
		}
		qsize := shm.QueueRegionSize(16)
		qFd, err := clMemfd(qpath, qsize, false)
		if err != nil {
			t.Fatal(err)
		}
		mem, err := unix.Mmap(qFd, 0, qsize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		shm.InitQueues(mem, 16)
		if err := clSendMemfds(c, qpath, bpath, bufFd, qFd); err != nil {
			t.Fatal(err)
		}
		if err := clExpectFrame(c, wire.TypeAckShareMemory); err != nil {
			t.Fatal(err)
		}
	default:
		t.Fatalf("unknown STAGE %q", stage)
	}
	proctest.Println("stalled")
	<-proctest.StdinClosed()
	c.Close()
}
