package shmipc

// Child processes: the test binary re-executed to run one role of a test
// (internal/proctest), for behaviour that needs a real second process.

import (
	"testing"
	"time"

	"github.com/goshm/shmipc/internal/proctest"
)

// childStartTimeout bounds how long a child may take to say it is ready: a
// loaded machine running -race binaries starts them slowly.
const childStartTimeout = 30 * time.Second

// startChild starts a child as conf says and waits until it is ready. It
// returns the child and what its ready line carried after "ready". A child
// that does not get ready fails the test with its output.
func startChild(t testing.TB, conf proctest.Config) (*proctest.Child, string) {
	t.Helper()
	c := proctest.Start(t, conf)
	info, err := c.WaitReady(childStartTimeout)
	if err != nil {
		t.Fatalf("child %s (%s) did not get ready: %v\n%s", conf.TestName, conf.Role, err, c.Output())
	}
	return c, info
}
