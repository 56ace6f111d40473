package main

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
)

// The chart: two panels side by side, p50 and p99 round-trip time against
// message size, both axes logarithmic, one line per transport, sharing one
// y scale so that the panels can be compared at a glance. Hand-written SVG
// 1.1, no scripts, no external fonts.

const (
	chartW      = 1200
	chartH      = 660
	marginL     = 92 // room for the first panel's y tick labels and axis title
	marginR     = 32
	panelGap    = 104 // room for the second panel's y tick labels and axis title
	plotTop     = 168
	plotBottom  = chartH - 112
	headerX     = 32
	fontFamily  = "system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"
	markerSize  = 4.5
	xPad        = 36 // from the panel's sides to the first and last size
	seriesWidth = 2.5
)

// series styles: Okabe–Ito colours, which stay apart for colour-blind eyes,
// and a different marker shape for each transport for grey-scale prints.
var seriesStyle = map[string]struct{ color, marker string }{
	"shm": {"#0072B2", "circle"},
	"uds": {"#D55E00", "square"},
	"tcp": {"#009E73", "diamond"},
}

type chartPanel struct {
	key, title string
	value      func(summary) float64
}

var chartPanels = []chartPanel{
	{"p50", "Median (p50)", func(s summary) float64 { return s.P50 }},
	{"p99", "p99", func(s summary) float64 { return s.P99 }},
}

func writeSVG(path string, rep *report, transports []string) error {
	return os.WriteFile(path, chartSVG(rep, transports), 0o644)
}

// chartSVG draws the results of rep for the given transports.
func chartSVG(rep *report, transports []string) []byte {
	var b bytes.Buffer
	pf := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }

	// Scales. x: log2(size), half a step of room on either side. y: the
	// 1-2-5 values just outside the smallest and largest plotted latency.
	var sizes []int
	lo, hi := math.Inf(1), math.Inf(-1)
	minN, maxN := math.MaxInt, 0
	for _, s := range rep.Results {
		if !slices.Contains(sizes, s.Size) {
			sizes = append(sizes, s.Size)
		}
		for _, p := range chartPanels {
			if v := p.value(s); v > 0 {
				lo, hi = math.Min(lo, v), math.Max(hi, v)
			}
		}
		minN, maxN = min(minN, s.N), max(maxN, s.N)
	}
	if len(sizes) == 0 || math.IsInf(lo, 0) {
		lo, hi = 1, 1000
		sizes = []int{64, 1 << 20}
	}
	slices.Sort(sizes)
	xMin, xMax := math.Log2(float64(sizes[0])), math.Log2(float64(sizes[len(sizes)-1]))
	if xMax-xMin < 1 {
		xMin, xMax = xMin-1, xMax+1
	}
	yLo, yHi := niceBelow(lo*0.9), niceAbove(hi*1.1) // no marker on a border
	if yHi <= yLo {
		yHi = niceAbove(yLo * 1.01)
	}
	panelW := float64(chartW-marginL-marginR-panelGap) / 2
	plotH := float64(plotBottom - plotTop)
	xOf := func(panel int, size int) float64 {
		x0 := float64(marginL) + float64(panel)*(panelW+panelGap)
		return x0 + xPad + (math.Log2(float64(size))-xMin)/(xMax-xMin)*(panelW-2*xPad)
	}
	yOf := func(v float64) float64 {
		return float64(plotBottom) - (math.Log10(v)-math.Log10(yLo))/(math.Log10(yHi)-math.Log10(yLo))*plotH
	}

	pf(`<?xml version="1.0" encoding="UTF-8"?>` + "\n")
	pf(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="%s">`+"\n",
		chartW, chartH, chartW, chartH, esc(fontFamily))
	pf(`<rect width="100%%" height="100%%" fill="#ffffff"/>` + "\n")

	// Header: title, machine, legend.
	pf(`<text x="%d" y="44" font-size="24" font-weight="600" fill="#1a1a1a">Round-trip latency between two processes (lower is better)</text>`+"\n", headerX)
	pf(`<text x="%d" y="72" font-size="14" fill="#555">%s · %s · %s</text>`+"\n",
		headerX, esc(rep.Machine), esc(rep.Go), rep.Time.Format("2006-01-02"))
	lx := float64(headerX)
	for _, tr := range transports {
		st := styleOf(tr)
		pf(`<g class="legend-item">`)
		pf(`<line x1="%.1f" y1="108" x2="%.1f" y2="108" stroke="%s" stroke-width="%.1f" stroke-linecap="round"/>`, lx, lx+34, st.color, seriesWidth)
		marker(&b, st.marker, lx+17, 108, st.color)
		pf(`<text x="%.1f" y="113" font-size="14"><tspan font-weight="600" fill="#1a1a1a">%s</tspan><tspan fill="#555" dx="7">%s</tspan></text>`,
			lx+44, esc(tr), esc(transportInfo[tr]))
		pf("</g>\n")
		lx += 44 + textWidth(tr+" "+transportInfo[tr], 14) + 40
	}

	for pi, p := range chartPanels {
		x0 := float64(marginL) + float64(pi)*(panelW+panelGap)
		x1 := x0 + panelW
		pf(`<g class="panel" data-panel="%s">`+"\n", p.key)
		pf(`<text x="%.1f" y="%d" font-size="16" font-weight="600" fill="#1a1a1a">%s</text>`+"\n", x0, plotTop-16, esc(p.title))
		pf(`<rect x="%.1f" y="%d" width="%.1f" height="%.1f" fill="#fafafa"/>`+"\n", x0, plotTop, panelW, plotH)

		// y grid and tick labels.
		ticks := niceTicks(yLo, yHi)
		decades := math.Log10(yHi / yLo)
		for _, t := range ticks {
			y := yOf(t)
			major := isPow10(t)
			color := "#e6e6e6"
			if major {
				color = "#c8c8c8"
			}
			pf(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="1"/>`+"\n", x0, y, x1, y, color)
			if major || decades <= 3.6 {
				pf(`<text x="%.1f" y="%.1f" font-size="12" fill="#444" text-anchor="end">%s</text>`+"\n", x0-8, y+4, esc(fmtTick(t)))
			}
		}
		// x grid and tick labels, one per measured size; a label that would
		// touch the previous one is left out.
		lastLabel := math.Inf(-1)
		for _, size := range sizes {
			x := xOf(pi, size)
			pf(`<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e6e6e6" stroke-width="1"/>`+"\n", x, plotTop, x, plotBottom)
			pf(`<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#888" stroke-width="1"/>`+"\n", x, plotBottom, x, plotBottom+5)
			label := fmtSize(size)
			if w := textWidth(label, 12); x-w/2 > lastLabel+6 {
				pf(`<text x="%.1f" y="%d" font-size="12" fill="#444" text-anchor="middle">%s</text>`+"\n", x, plotBottom+20, esc(label))
				lastLabel = x + w/2
			}
		}
		// Axes.
		pf(`<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#888" stroke-width="1"/>`+"\n", x0, plotBottom, x1, plotBottom)
		pf(`<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#888" stroke-width="1"/>`+"\n", x0, plotTop, x0, plotBottom)
		pf(`<text x="%.1f" y="%d" font-size="13" fill="#333" text-anchor="middle">message size (each way, log scale)</text>`+"\n", x0+panelW/2, plotBottom+46)
		ym := float64(plotTop+plotBottom) / 2
		pf(`<text x="%.1f" y="%.1f" font-size="13" fill="#333" text-anchor="middle" transform="rotate(-90 %.1f %.1f)">round-trip time (log scale)</text>`+"\n",
			x0-66, ym, x0-66, ym)

		// One line per transport, with a marker and a tooltip at each point.
		for _, tr := range transports {
			st := styleOf(tr)
			var pts []string
			type point struct {
				x, y float64
				tip  string
			}
			var marks []point
			for _, s := range rep.Results {
				if s.Transport != tr || p.value(s) <= 0 {
					continue
				}
				x, y := xOf(pi, s.Size), yOf(p.value(s))
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", x, y))
				marks = append(marks, point{x, y, fmt.Sprintf("%s, %s: %s %s (n = %d)", tr, fmtSize(s.Size), p.key, fmtUs(p.value(s)), s.N)})
			}
			pf(`<g class="series-group" data-transport="%s">`+"\n", esc(tr))
			pf(`<polyline class="series" data-transport="%s" data-panel="%s" fill="none" stroke="%s" stroke-width="%.1f" stroke-linejoin="round" stroke-linecap="round" points="%s"/>`+"\n",
				esc(tr), p.key, st.color, seriesWidth, strings.Join(pts, " "))
			for _, m := range marks {
				pf(`<g><title>%s</title>`, esc(m.tip))
				marker(&b, st.marker, m.x, m.y, st.color)
				pf("</g>\n")
			}
			pf("</g>\n")
		}
		pf("</g>\n")
	}

	count := thousands(maxN)
	if minN < maxN {
		count = thousands(minN) + " to " + thousands(maxN)
	}
	pf(`<text x="%d" y="%d" font-size="12" fill="#777">Client and echo server are separate processes. Each point is the p50 or p99 of %s timed round trips (see the table) after a warm-up.</text>`+"\n",
		headerX, chartH-34, count)
	if slices.Contains(transports, "shm") {
		pf(`<text x="%d" y="%d" font-size="12" fill="#777">shm: shmipc DefaultConfig, the client copies the message into shared memory and reads the echo in place; uds and tcp: net.Conn with reused buffers.</text>`+"\n",
			headerX, chartH-16)
	}
	pf("</svg>\n")
	return b.Bytes()
}

func styleOf(tr string) struct{ color, marker string } {
	if s, ok := seriesStyle[tr]; ok {
		return s
	}
	return struct{ color, marker string }{"#666666", "circle"}
}

// marker draws a marker shape centred on (x, y), with a white rim so that
// markers on top of each other stay distinguishable.
func marker(b *bytes.Buffer, shape string, x, y float64, color string) {
	const rim = `stroke="#ffffff" stroke-width="1.5"`
	r := markerSize
	switch shape {
	case "square":
		s := r * 1.75
		fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s" %s/>`, x-s/2, y-s/2, s, s, color, rim)
	case "diamond":
		d := r * 1.35
		fmt.Fprintf(b, `<polygon points="%.1f,%.1f %.1f,%.1f %.1f,%.1f %.1f,%.1f" fill="%s" %s/>`,
			x, y-d, x+d, y, x, y+d, x-d, y, color, rim)
	default:
		fmt.Fprintf(b, `<circle cx="%.1f" cy="%.1f" r="%.1f" fill="%s" %s/>`, x, y, r, color, rim)
	}
}

// niceBelow is the largest of 1, 2, 5 × 10^k at or below v; niceAbove the
// smallest at or above v.
func niceBelow(v float64) float64 {
	e := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{5, 2, 1} {
		if m*e <= v*(1+1e-9) {
			return m * e
		}
	}
	return e
}

func niceAbove(v float64) float64 {
	e := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*e >= v*(1-1e-9) {
			return m * e
		}
	}
	return 10 * e
}

// niceTicks returns the 1, 2, 5 × 10^k values from lo to hi.
func niceTicks(lo, hi float64) []float64 {
	var out []float64
	for e := math.Pow(10, math.Floor(math.Log10(lo))); e <= hi*(1+1e-9); e *= 10 {
		for _, m := range []float64{1, 2, 5} {
			if v := m * e; v >= lo*(1-1e-9) && v <= hi*(1+1e-9) {
				out = append(out, v)
			}
		}
	}
	return out
}

func isPow10(v float64) bool {
	l := math.Log10(v)
	return math.Abs(l-math.Round(l)) < 1e-9
}

// fmtTick formats a tick value in microseconds: 500 ns, 20 µs, 1 ms.
func fmtTick(v float64) string {
	g := func(x float64) string { return strconv.FormatFloat(x, 'g', 3, 64) }
	switch {
	case v < 1:
		return g(v*1000) + " ns"
	case v < 1000:
		return g(v) + " µs"
	case v < 1e6:
		return g(v/1000) + " ms"
	}
	return g(v/1e6) + " s"
}

// textWidth estimates the rendered width of s in a sans-serif font.
func textWidth(s string, size float64) float64 {
	w := 0.0
	for _, r := range s {
		switch {
		case r == ' ' || r == '.' || r == ',' || r == '(' || r == ')' || r == 'i' || r == 'l' || r == 't' || r == 'f':
			w += 0.3
		case r >= 'A' && r <= 'Z' || r == 'm' || r == 'w':
			w += 0.72
		default:
			w += 0.6
		}
	}
	return w * size
}

func esc(s string) string {
	var b strings.Builder
	xml.EscapeText(&b, []byte(s))
	return b.String()
}

// thousands formats n with thousands separators: 50,072.
func thousands(n int) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
