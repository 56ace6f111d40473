package main

// The three transports the benchmark compares, and the gRPC options it
// compares them with. Over shmipc the only gRPC-specific code is two lines:
//
//	client: grpc.NewClient("passthrough:///shmipc", grpc.WithContextDialer(manager.DialContext), ...)
//	server: grpcServer.Serve(shmipcListener)

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/goshm/shmipc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"
)

// Transports.
const (
	transportShmipc = "shmipc"
	transportUDS    = "uds"
	transportTCP    = "tcp"
)

var allTransports = []string{transportShmipc, transportUDS, transportTCP}

// maxMsgSize is the largest message the example sends or accepts; gRPC's
// default limit for receiving is 4 MiB.
const maxMsgSize = 64 << 20

// optionSet is one choice of gRPC options. Every transport gets the same
// options, except for the read buffer of the tuned set (readBufferOn).
type optionSet struct {
	name   string
	dial   []grpc.DialOption
	server []grpc.ServerOption
	tuned  bool
}

// on returns the options for one transport.
func (o optionSet) on(transport string) ([]grpc.DialOption, []grpc.ServerOption) {
	dial, server := slices.Clone(o.dial), slices.Clone(o.server)
	if o.tuned {
		n := readBufferOn(transport)
		dial = append(dial, grpc.WithReadBufferSize(n))
		server = append(server, grpc.ReadBufferSize(n))
	}
	return dial, server
}

// defaultOptions are gRPC's defaults, with only the message size limits
// raised so that large messages can be sent at all.
func defaultOptions() optionSet {
	return optionSet{
		name: "default",
		dial: []grpc.DialOption{
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsgSize), grpc.MaxCallSendMsgSize(maxMsgSize)),
		},
		server: []grpc.ServerOption{grpc.MaxRecvMsgSize(maxMsgSize), grpc.MaxSendMsgSize(maxMsgSize)},
	}
}

// Tuned sizes for a transport that never drops or reorders data and whose
// peer is on the same host: flow control only has to bound memory, not to
// probe a network, so the windows are large enough that a message of a few
// MiB never waits for a WINDOW_UPDATE; a larger write buffer means fewer,
// larger writes on the connection.
var (
	tunedStreamWindow int32 = 16 << 20
	tunedConnWindow   int32 = 64 << 20
	tunedWriteBuffer        = 256 << 10
	tunedSocketRead         = 256 << 10
	// tunedPool saves gRPC's clearing of every buffer it takes from its pool
	// (dirtyPool), whatever the transport. It is set through gRPC's
	// experimental package.
	tunedPool = &dirtyPool{}
)

// readBufferOn is the tuned read buffer of a transport. Over a socket a
// large one saves system calls: one read takes in many HTTP/2 frames. Over
// shmipc (and the in-process pipe) a read is a copy out of memory with no
// system call, so a read buffer only adds a copy: gRPC reads each frame
// straight into its own buffer with none (0). At 1 MiB that is about a
// tenth of a call's time over shmipc, and over a Unix socket the same
// setting is 1.7 times slower.
func readBufferOn(transport string) int {
	if transport == transportShmipc || transport == transportInProc {
		return 0
	}
	return tunedSocketRead
}

// tunedOptions are the options this example recommends for a local
// transport: the same windows and write buffer for all, and the read
// buffer that suits each (readBufferOn).
func tunedOptions() optionSet {
	o := defaultOptions()
	o.name = "tuned"
	o.tuned = true
	o.dial = append(o.dial,
		grpc.WithInitialWindowSize(tunedStreamWindow),
		grpc.WithInitialConnWindowSize(tunedConnWindow),
		grpc.WithWriteBufferSize(tunedWriteBuffer),
		experimental.WithBufferPool(tunedPool),
	)
	o.server = append(o.server,
		grpc.InitialWindowSize(tunedStreamWindow),
		grpc.InitialConnWindowSize(tunedConnWindow),
		grpc.WriteBufferSize(tunedWriteBuffer),
		experimental.BufferPool(tunedPool),
	)
	return o
}

func optionsByName(name string) (optionSet, error) {
	switch name {
	case "default":
		return defaultOptions(), nil
	case "tuned":
		return tunedOptions(), nil
	}
	return optionSet{}, fmt.Errorf("unknown option set %q (default, tuned)", name)
}

// listen listens for one transport: a shmipc Listener on a socket in dir, a
// Unix socket in dir, or TCP on a free loopback port. It returns the
// listener and the address clients dial.
func listen(transport, dir string) (net.Listener, string, error) {
	switch transport {
	case transportShmipc:
		path := filepath.Join(dir, "shmipc.sock")
		ln, err := shmipc.Listen("unix", path, shmipcConfig())
		return ln, path, err
	case transportUDS:
		path := filepath.Join(dir, "grpc.sock")
		ln, err := net.Listen("unix", path)
		return ln, path, err
	case transportTCP:
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, "", err
		}
		return ln, ln.Addr().String(), nil
	}
	return nil, "", fmt.Errorf("unknown transport %q", transport)
}

// spinEnv, when set, is the shmipc ConsumerSpinTime of both sides (the
// benchmark's -spin flag; the server process inherits it).
const spinEnv = "SHMIPC_GRPC_EXAMPLE_SPIN"

// shmipcConfig is the shmipc configuration of both sides.
var shmipcConfig = func() *shmipc.Config {
	conf := shmipc.DefaultConfig()
	if v := os.Getenv(spinEnv); v != "" {
		if d, err := time.ParseDuration(v); err == nil {
			conf.ConsumerSpinTime = d
		}
	}
	return conf
}

// client is a gRPC client connection over one transport.
type client struct {
	*grpc.ClientConn
	manager *shmipc.SessionManager // shmipc only
}

// dial connects a gRPC client to addr over transport.
func dial(transport, addr string, opts optionSet) (*client, error) {
	dialOpts, _ := opts.on(transport)
	dopts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		callOpts,
	}, dialOpts...)
	c := &client{}
	target := ""
	switch transport {
	case transportShmipc:
		m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{Network: "unix", Address: addr, Config: shmipcConfig()})
		if err != nil {
			return nil, err
		}
		c.manager = m
		target = "passthrough:///shmipc"
		dopts = append(dopts, grpc.WithContextDialer(m.DialContext))
	case transportUDS:
		target = "unix://" + addr
	case transportTCP:
		target = "passthrough:///" + addr
	default:
		return nil, fmt.Errorf("unknown transport %q", transport)
	}
	cc, err := grpc.NewClient(target, dopts...)
	if err != nil {
		c.Close()
		return nil, err
	}
	c.ClientConn = cc
	return c, nil
}

// Close closes the connection and, over shmipc, the session manager.
func (c *client) Close() error {
	var err error
	if c.ClientConn != nil {
		err = c.ClientConn.Close()
	}
	if c.manager != nil {
		c.manager.Close()
	}
	return err
}

// connect dials and makes one call, so that the connection is up.
func connect(ctx context.Context, transport, addr string, opts optionSet) (*client, error) {
	c, err := dial(transport, addr, opts)
	if err != nil {
		return nil, err
	}
	if _, err := echo(ctx, c, []byte("hello")); err != nil {
		c.Close()
		return nil, fmt.Errorf("first call over %s: %w", transport, err)
	}
	return c, nil
}

// tempDir makes a private directory for sockets; short, because a Unix
// socket path is limited to 108 bytes.
func tempDir() (string, error) {
	return os.MkdirTemp("", fmt.Sprintf("shmipc-grpc-%d-", os.Getpid()))
}
