package main

// The three transports the benchmark compares, and the gRPC options it
// compares them with. Over shmipc the gRPC-specific code is one call per
// side, shmipcgrpc's options:
//
//	client: grpc.NewClient(shmipcgrpc.Target, append(shmipcgrpc.DialOptions(manager), creds)...)
//	server: grpc.NewServer(append(shmipcgrpc.ServerOptions(), ...)...).Serve(shmipcListener)

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/goshm/shmipc"
	"github.com/goshm/shmipc/shmipcgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
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

// optionSet is one choice of gRPC options: gRPC's defaults (with or
// without raised message limits), or the options tuned for each transport.
type optionSet struct {
	name   string
	limits bool // raise the message size limits to maxMsgSize
	tuned  bool
}

// defaultOptions are gRPC's defaults, with only the message size limits
// raised so that large messages can be sent at all.
func defaultOptions() optionSet { return optionSet{name: "default", limits: true} }

// tunedOptions are the options for a local transport: shmipcgrpc's over
// shmipc; over the sockets and the in-process pipe the same windows and
// write buffer (tunedSocket), with the read buffer that suits each.
func tunedOptions() optionSet { return optionSet{name: "tuned", limits: true, tuned: true} }

// Tuned sizes over the sockets and in-process, as shmipcgrpc has them:
// flow control only has to bound memory, not to probe a network, so the
// windows are large enough that a message of a few MiB never waits for a
// WINDOW_UPDATE; a larger write buffer means fewer, larger writes.
const (
	tunedStreamWindow = 16 << 20
	tunedConnWindow   = 64 << 20
	tunedWriteBuffer  = 256 << 10
	tunedSocketRead   = 256 << 10
)

// readBufferOn is the tuned read buffer of a transport other than shmipc.
// Over a socket a large one saves system calls: one read takes in many
// HTTP/2 frames. Over the in-process pipe (as over shmipc) a read is a copy
// out of memory with no system call, so a read buffer only adds a copy.
func readBufferOn(transport string) int {
	if transport == transportInProc {
		return 0
	}
	return tunedSocketRead
}

// dialOptions are the client's options over transport; m is the session
// manager over shmipc.
func (o optionSet) dialOptions(transport string, m *shmipc.SessionManager) []grpc.DialOption {
	var opts []grpc.DialOption
	switch {
	case transport == transportShmipc && o.tuned:
		opts = shmipcgrpc.DialOptions(m)
	case transport == transportShmipc:
		opts = []grpc.DialOption{grpc.WithContextDialer(m.DialContext)}
	case o.tuned:
		opts = []grpc.DialOption{
			grpc.WithInitialWindowSize(tunedStreamWindow),
			grpc.WithInitialConnWindowSize(tunedConnWindow),
			grpc.WithWriteBufferSize(tunedWriteBuffer),
			grpc.WithReadBufferSize(readBufferOn(transport)),
		}
	}
	if o.limits {
		opts = append(opts, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsgSize), grpc.MaxCallSendMsgSize(maxMsgSize)))
	}
	return opts
}

// serverOptions are the server's options over transport.
func (o optionSet) serverOptions(transport string) []grpc.ServerOption {
	var opts []grpc.ServerOption
	switch {
	case transport == transportShmipc && o.tuned:
		opts = shmipcgrpc.ServerOptions()
	case o.tuned:
		opts = []grpc.ServerOption{
			grpc.InitialWindowSize(tunedStreamWindow),
			grpc.InitialConnWindowSize(tunedConnWindow),
			grpc.WriteBufferSize(tunedWriteBuffer),
			grpc.ReadBufferSize(readBufferOn(transport)),
		}
	}
	if o.limits {
		opts = append(opts, grpc.MaxRecvMsgSize(maxMsgSize), grpc.MaxSendMsgSize(maxMsgSize))
	}
	return opts
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
	dopts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()), callOpts}
	c := &client{}
	target := ""
	switch transport {
	case transportShmipc:
		m, err := shmipc.NewSessionManager(shmipc.SessionManagerConfig{Network: "unix", Address: addr, Config: shmipcConfig()})
		if err != nil {
			return nil, err
		}
		c.manager = m
		target = shmipcgrpc.Target
	case transportUDS:
		target = "unix://" + addr
	case transportTCP:
		target = "passthrough:///" + addr
	default:
		return nil, fmt.Errorf("unknown transport %q", transport)
	}
	dopts = append(dopts, opts.dialOptions(transport, c.manager)...)
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
