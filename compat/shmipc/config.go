package shmipc

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	shm "github.com/goshm/shmipc"
)

// Config is the configuration of a session: shmipc-go's fields over the
// root package's Config, whose other tunables keep their defaults.
// QueueCap must be a positive multiple of 16. QueuePath is not used: the
// queue region is named after ShareMemoryPathPrefix, like the buffer
// region. LogOutput receives log records at the level SetLogLevel sets
// (nil: none). Monitor, if set, receives the metrics of each session.
type Config struct {
	ConnectionWriteTimeout time.Duration      // bounds each write to the socket
	InitializeTimeout      time.Duration      // bounds the handshake
	QueueCap               uint32             // elements of each IO queue
	QueuePath              string             // not used
	ShareMemoryBufferCap   uint32             // size of a session's buffer region
	ShareMemoryPathPrefix  string             // names the regions a client creates
	LogOutput              io.Writer          // where log records go
	BufferSliceSizes       []*SizePercentPair // size classes of the buffer region
	MemMapType             MemMapType         // memfd or /dev/shm file regions
	Monitor                Monitor            // receives the sessions' metrics
}

// SizePercentPair is one size class of the buffer region: slices of Size
// bytes taking Percent of it.
type SizePercentPair struct {
	Size    uint32
	Percent uint32
}

// MemMapType says how a client shares its regions with the server.
type MemMapType uint8

const (
	// MemMapTypeDevShmFile creates files under ShareMemoryPathPrefix and
	// sends their paths (protocol version 2); it works over TCP too.
	MemMapTypeDevShmFile MemMapType = 0
	// MemMapTypeMemFd passes memfds over the Unix socket (version 3).
	MemMapTypeMemFd MemMapType = 1
)

// DefaultConfig returns this library's defaults (the root package's
// DefaultConfig) in shmipc-go's fields, with logs to os.Stdout.
func DefaultConfig() *Config {
	rc := shm.DefaultConfig()
	c := &Config{
		ConnectionWriteTimeout: rc.ConnectionWriteTimeout,
		InitializeTimeout:      rc.InitializeTimeout,
		QueueCap:               rc.QueueCap,
		ShareMemoryBufferCap:   rc.ShareMemoryBufferCap,
		ShareMemoryPathPrefix:  rc.ShareMemoryPathPrefix,
		LogOutput:              os.Stdout,
		MemMapType:             MemMapTypeMemFd,
	}
	if rc.MemMapType == shm.MemMapTypeDevShmFile {
		c.MemMapType = MemMapTypeDevShmFile
	}
	for _, p := range rc.BufferSliceSizes {
		c.BufferSliceSizes = append(c.BufferSliceSizes, &SizePercentPair{Size: p.Size, Percent: p.Percent})
	}
	return c
}

// rootConfig converts c (nil: DefaultConfig()) to the root package's
// Config. A nil class in BufferSliceSizes is an invalid config.
func rootConfig(c *Config) (*shm.Config, error) {
	rc := shm.DefaultConfig()
	if c == nil {
		c = DefaultConfig()
	}
	rc.ConnectionWriteTimeout = c.ConnectionWriteTimeout
	rc.InitializeTimeout = c.InitializeTimeout
	rc.QueueCap = c.QueueCap
	rc.ShareMemoryBufferCap = c.ShareMemoryBufferCap
	rc.ShareMemoryPathPrefix = c.ShareMemoryPathPrefix
	rc.MemMapType = shm.MemMapTypeMemFd
	if c.MemMapType == MemMapTypeDevShmFile {
		rc.MemMapType = shm.MemMapTypeDevShmFile
	}
	rc.BufferSliceSizes = make([]shm.SizePercentPair, len(c.BufferSliceSizes))
	for i, p := range c.BufferSliceSizes {
		if p == nil {
			return nil, fmt.Errorf("%w: BufferSliceSizes[%d] is nil", shm.ErrInvalidConfig, i)
		}
		rc.BufferSliceSizes[i] = shm.SizePercentPair{Size: p.Size, Percent: p.Percent}
	}
	if c.LogOutput != nil {
		rc.Logger = slog.New(slog.NewTextHandler(c.LogOutput, &slog.HandlerOptions{Level: &logLevel}))
	}
	if err := rc.Verify(); err != nil {
		short := *rc
		short.ShareMemoryPathPrefix = "/dev/shm/s"
		if short.Verify() == nil {
			return nil, fmt.Errorf("%w: %w", ErrFileNameTooLong, err)
		}
		return nil, err
	}
	return rc, nil
}

// VerifyConfig reports the first invalid field of config, in an error
// wrapping the root package's ErrInvalidConfig.
func VerifyConfig(config *Config) error {
	if config == nil {
		return fmt.Errorf("%w: nil Config", shm.ErrInvalidConfig)
	}
	_, err := rootConfig(config)
	return err
}

// logLevel is the level of every logger made from a Config.LogOutput.
var logLevel slog.LevelVar

func init() { logLevel.Set(slog.LevelWarn) }

// SetLogLevel sets the level of the log records written to every Config's
// LogOutput: 0 trace, 1 debug, 2 info, 3 warn (the default), 4 error, 5 and
// above nothing. It applies to sessions already running too.
func SetLogLevel(l int) {
	levels := []slog.Level{slog.LevelDebug, slog.LevelDebug, slog.LevelInfo, slog.LevelWarn, slog.LevelError}
	logLevel.Set(levels[min(max(l, 0), len(levels)-1)])
	if l >= len(levels) {
		logLevel.Set(slog.LevelError + 4)
	}
}
