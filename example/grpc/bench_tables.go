package main

// The benchmark's results as Markdown tables: unary, per-call shmipc
// counts and streaming, with each transport against the Unix socket.

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"
)

// printTables prints the unary, per-call shmipc and streaming tables as
// Markdown.
func printTables(cfg benchConfig, r results, out io.Writer) {
	fmt.Fprintln(out, "Unary echo, one call at a time. CPU is user + system time of both processes per call, sleeps")
	fmt.Fprintln(out, "their threads' voluntary context switches per call; \"vs UDS\" is the median over the rounds of")
	fmt.Fprintln(out, "the round's p50 over the Unix socket's p50 in the same round, with the same option set.")
	fmt.Fprintln(out)
	t := table{header: []string{"options", "size", "transport", "p50", "p99", "calls/s", "CPU/call", "sleeps", "vs UDS"}}
	for _, opts := range cfg.options {
		for _, size := range cfg.sizes {
			uds := r.unary[cellKey{opts, transportUDS, size}]
			for _, tr := range benchTransports(cfg) {
				c := r.unary[cellKey{opts, tr, size}]
				if c == nil || c.calls == 0 {
					continue
				}
				p50 := c.percentile(0.50)
				t.add(opts, sizeName(size), tr, fmtDur(p50), fmtDur(c.percentile(0.99)),
					fmt.Sprintf("%.0f", float64(c.calls)/c.elapsed.Seconds()),
					fmtDur(c.cpu/time.Duration(c.calls)), fmt.Sprintf("%.1f", float64(c.sleeps)/float64(c.calls)),
					blockRatio(c, uds))
			}
		}
	}
	t.write(out)

	fmt.Fprintln(out)
	fmt.Fprintln(out, "Over shmipc, per unary call: messages (stream writes) and wake-ups (Polling frames) sent by each side.")
	fmt.Fprintln(out)
	t = table{header: []string{"options", "size", "client msgs", "server msgs", "client wake-ups", "server wake-ups"}}
	for _, opts := range cfg.options {
		for _, size := range cfg.sizes {
			c := r.unary[cellKey{opts, transportShmipc, size}]
			if c == nil || c.calls == 0 {
				continue
			}
			n := float64(c.calls)
			t.add(opts, sizeName(size), fmt.Sprintf("%.2f", float64(c.cliMsgs)/n), fmt.Sprintf("%.2f", float64(c.srvMsgs)/n),
				fmt.Sprintf("%.2f", float64(c.cliWakeups)/n), fmt.Sprintf("%.2f", float64(c.srvWakeups)/n))
		}
	}
	t.write(out)
	fmt.Fprintln(out)
	fmt.Fprintf(out, "Server streaming: one stream receives %d MiB in messages of the given size. CPU is both processes.\n", cfg.streamBytes>>20)
	fmt.Fprintln(out)
	t = table{header: []string{"options", "message", "transport", "MB/s", "msgs/s", "CPU/MB", "vs UDS"}}
	for _, opts := range cfg.options {
		for _, size := range cfg.streamSizes {
			uds := r.stream[cellKey{opts, transportUDS, size}]
			for _, tr := range benchTransports(cfg) {
				c := r.stream[cellKey{opts, tr, size}]
				if c == nil || c.elapsed == 0 {
					continue
				}
				t.add(opts, sizeName(size), tr, fmt.Sprintf("%.0f", c.mbPerSec()),
					fmt.Sprintf("%.0f", float64(c.calls)/c.elapsed.Seconds()),
					fmtDur(time.Duration(float64(c.cpu)/(float64(c.bytes)/1e6))), blockRatio(c, uds))
			}
		}
	}
	t.write(out)
}

// blockRatio is the median over rounds of c's block value over base's in
// the same round: blocks of one round ran one right after the other, so a
// change in the machine's load affects both.
func blockRatio(c, base *cell) string {
	if c == nil || base == nil || len(base.blocks) != len(c.blocks) || len(c.blocks) == 0 {
		return "-"
	}
	r := make([]float64, len(c.blocks))
	for i := range r {
		r[i] = c.blocks[i] / base.blocks[i]
	}
	slices.Sort(r)
	m := r[len(r)/2]
	if len(r)%2 == 0 {
		m = (r[len(r)/2-1] + r[len(r)/2]) / 2
	}
	return fmt.Sprintf("%.2f×", m)
}

// table is a Markdown table with padded columns; the options and transport
// columns are aligned left, the others right.
type table struct {
	header []string
	rows   [][]string
}

func (t *table) add(cells ...string) { t.rows = append(t.rows, cells) }

func (t *table) write(out io.Writer) {
	width := make([]int, len(t.header))
	for _, row := range append([][]string{t.header}, t.rows...) {
		for i, c := range row {
			width[i] = max(width[i], len([]rune(c)))
		}
	}
	left := make([]bool, len(t.header))
	for i, h := range t.header {
		left[i] = h == "options" || h == "transport"
	}
	line := func(row []string) {
		var b strings.Builder
		for i, c := range row {
			pad := strings.Repeat(" ", width[i]-len([]rune(c)))
			if left[i] {
				fmt.Fprintf(&b, "| %s%s ", c, pad)
			} else {
				fmt.Fprintf(&b, "| %s%s ", pad, c)
			}
		}
		fmt.Fprintln(out, b.String()+"|")
	}
	line(t.header)
	sep := make([]string, len(width))
	for i, w := range width {
		if left[i] {
			sep[i] = strings.Repeat("-", w)
		} else {
			sep[i] = strings.Repeat("-", w-1) + ":"
		}
	}
	line(sep)
	for _, row := range t.rows {
		line(row)
	}
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

func fmtDur(d time.Duration) string {
	switch {
	case d >= 10*time.Millisecond:
		return fmt.Sprintf("%.1f ms", float64(d)/1e6)
	case d >= time.Millisecond:
		return fmt.Sprintf("%.2f ms", float64(d)/1e6)
	}
	return fmt.Sprintf("%.0f µs", float64(d)/1e3)
}
