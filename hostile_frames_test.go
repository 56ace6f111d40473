package shmipc

// Hostile socket frames: wrong lengths, unknown types, frames of the wrong
// phase, bad magic or version mid-stream, truncation and malformed
// FallbackData, against a real server and a real client.

import (
	"encoding/binary"
	"fmt"
	"io"
	"testing"
	"time"
)

func TestHostileClientFrames(t *testing.T) {
	f := func(length uint32, typ byte, payload ...byte) func(c *hpCtx) {
		return func(c *hpCtx) { c.p.write(rawFrame(length, rawMagic, c.p.version, typ, payload...)) }
	}
	poll := func(c *hpCtx) []byte { return rawFrame(8, rawMagic, c.p.version, 1) }
	cases := []hpCase{
		{name: "Polling of length 9", do: f(9, 1, 0), want: []string{"Polling", "9"}},
		{name: "StreamClose of length 13", do: f(13, 2, 0, 0, 0, 2, 0), want: []string{"StreamClose", "13"}},
		{name: "StreamClose of length 8", do: f(8, 2), want: []string{"StreamClose", "8"}},
		{name: "HotRestart of length 15", do: f(15, 8, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestart", "15"}},
		{name: "HotRestartAck of length 15", do: f(15, 9, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestartAck", "15"}},
		{name: "HotRestart to a server", do: f(16, 8, 0, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestart"}},
		{name: "unknown type 10", do: f(8, 10), want: []string{"type", "10"}},
		{name: "unknown type 255", do: f(8, 255), want: []string{"type", "255"}},
		{name: "ShareMemoryByMemfd in the running phase", do: func(c *hpCtx) {
			c.p.write(rawPathFrame(c.p.version, 5, "/dev/shm/a", "/dev/shm/b"))
		}, want: []string{"ShareMemoryByMemfd"}},
		{name: "AckReadyRecvFD in the running phase", do: f(8, 7), want: []string{"AckReadyRecvFD"}},
		{name: "bad magic mid-stream", do: func(c *hpCtx) {
			b := append(poll(c), rawFrame(12, rawMagic, c.p.version, 2, 0, 0, 0, 99)...)
			c.p.write(append(b, rawFrame(8, 0x7759, c.p.version, 1)...))
		}, want: []string{"magic"}},
		{name: "version 0 mid-stream", do: func(c *hpCtx) {
			c.p.write(append(poll(c), rawFrame(8, rawMagic, 0, 1)...))
		}, want: []string{"version"}},
		{name: "frame split across writes then bad magic", do: func(c *hpCtx) {
			b := append(poll(c), 0, 0, 0, 8, 0x58)
			c.p.write(b[:5])
			time.Sleep(5 * time.Millisecond)
			c.p.write(b[5:])
			time.Sleep(5 * time.Millisecond)
			c.p.write([]byte{0x77, c.p.version, 1})
		}, want: []string{"magic"}},
		{name: "truncated frame then EOF", do: func(c *hpCtx) {
			c.p.write(rawFrame(12, rawMagic, c.p.version, 2, 0, 0))
			c.p.conn.CloseWrite()
		}, is: io.ErrUnexpectedEOF, want: []string{"inside"}},
		{name: "truncated header then EOF", do: func(c *hpCtx) {
			c.p.write(rawFrame(8, rawMagic, c.p.version, 1)[:5])
			c.p.conn.CloseWrite()
		}, is: io.ErrUnexpectedEOF, want: []string{"inside"}},
		{name: "FallbackData larger than MaxFallbackFrameSize", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, minFallbackFrame+1, 2, 0, "x"))
		}, want: []string{"FallbackData", fmt.Sprint(minFallbackFrame + 1)}},
		{name: "FallbackData of length 0xFFFFFFFF", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0xFFFFFFFF, 2, 0, "x"))
		}, want: []string{"FallbackData", "4294967295"}},
		{name: "FallbackData shorter than its id and status", do: f(12, 3, 0, 0, 0, 2), want: []string{"FallbackData", "12"}},
		{name: "FallbackData for stream id 0", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, 0, 0, "x"))
		}, want: []string{"stream id 0"}},
		{name: "FallbackData with status 1", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, 2, 1, "x"))
		}, want: []string{"status"}},
		{name: "FallbackData with status 0x2FF", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, 2, 0x2FF, "x"))
		}, want: []string{"status"}},
		// Legal frames: the documented behaviour.
		{name: "FallbackData for an unknown stream opens it", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, 55, 0, "fallback open"))
		}, survive: func(c *hpCtx) error {
			fr, err := c.p.readFrame()
			if err != nil {
				return err
			}
			if fr[7] != 3 || binary.BigEndian.Uint32(fr[8:]) != 55 || string(fr[16:]) != "fallback open" {
				return fmt.Errorf("reply % x, want FallbackData for stream 55", fr)
			}
			return nil
		}},
		{name: "StreamClose for an unknown stream is ignored", do: f(12, 2, 0, 0, 1, 0), survive: hpSurviveRoundTrip},
		{name: "HotRestartAck to a server is ignored", do: f(16, 9, 0, 0, 0, 0, 0, 0, 0, 7), survive: hpSurviveRoundTrip},
		{name: "Polling with an empty queue", do: f(8, 1), survive: hpSurviveRoundTrip},
	}
	env := startTestServer(t, defaultConsumerSpinTime)
	for _, mode := range bothModes {
		for _, tc := range cases {
			t.Run(modeName(mode)+"/"+tc.name, func(t *testing.T) {
				c := hpServerCase(t, env, mode, false)
				tc.do(c)
				hpFinish(c, tc)
				env.checkGood(t)
			})
		}
	}
}

func TestHostileServerFrames(t *testing.T) {
	f := func(length uint32, typ byte, payload ...byte) func(c *hpCtx) {
		return func(c *hpCtx) { c.p.write(rawFrame(length, rawMagic, c.p.version, typ, payload...)) }
	}
	cases := []hpCase{
		{name: "Polling of length 9", do: f(9, 1, 0), want: []string{"Polling", "9"}},
		{name: "StreamClose of length 13", do: f(13, 2, 0, 0, 0, 2, 0), want: []string{"StreamClose", "13"}},
		{name: "HotRestart of length 15", do: f(15, 8, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestart", "15"}},
		{name: "HotRestartAck to a client", do: f(16, 9, 0, 0, 0, 0, 0, 0, 0, 1), want: []string{"HotRestartAck"}},
		{name: "unknown type 10", do: f(8, 10), want: []string{"type", "10"}},
		{name: "AckShareMemory in the running phase", do: f(8, 6), want: []string{"AckShareMemory"}},
		{name: "bad magic mid-stream", do: func(c *hpCtx) {
			c.p.write(append(rawFrame(8, rawMagic, c.p.version, 1), rawFrame(8, 0x5877, c.p.version, 1)...))
		}, want: []string{"magic"}},
		{name: "version 0 mid-stream", do: func(c *hpCtx) {
			c.p.write(append(rawFrame(8, rawMagic, c.p.version, 1), rawFrame(8, rawMagic, 0, 1)...))
		}, want: []string{"version"}},
		{name: "truncated frame then EOF", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 100, c.id, 0, "short"))
			c.p.conn.CloseWrite()
		}, is: io.ErrUnexpectedEOF, want: []string{"inside"}},
		{name: "FallbackData larger than MaxFallbackFrameSize", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, minFallbackFrame+1, c.id, 0, "x"))
		}, want: []string{"FallbackData", fmt.Sprint(minFallbackFrame + 1)}},
		{name: "FallbackData for stream id 0", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, 0, 0, "x"))
		}, want: []string{"stream id 0"}},
		{name: "FallbackData with status 1", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, c.id, 1, "x"))
		}, want: []string{"status"}},
		{name: "HotRestart is ignored by the client", do: f(16, 8, 0, 0, 0, 0, 0, 0, 0, 1), survive: hpSurviveRoundTrip},
		{name: "StreamClose for an unknown stream is ignored", do: f(12, 2, 0, 0, 1, 0), survive: hpSurviveRoundTrip},
		{name: "FallbackData on the open stream", do: func(c *hpCtx) {
			c.p.write(rawFallbackFrame(c.p.version, 0, c.id, 0, "fallback data"))
		}, survive: func(c *hpCtx) error { return c.expectData(c.id, "fallback data") }},
	}
	env := startTestServer(t, defaultConsumerSpinTime)
	for _, mode := range bothModes {
		for _, tc := range cases {
			t.Run(modeName(mode)+"/"+tc.name, func(t *testing.T) {
				c := hpClientCase(t, mode, false)
				tc.do(c)
				hpFinish(c, tc)
				env.checkGood(t)
			})
		}
	}
}
