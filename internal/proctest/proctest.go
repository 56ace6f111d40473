// Package proctest is a small harness for tests that need a second, real
// process.
//
// The second process is the test binary itself (os.Executable, or os.Args[0]
// if that fails), re-executed with -test.run=^TestName$ so that exactly one
// test function runs in it, and with the environment variable
// SHMIPC_TEST_CHILD set to a role name. That test function checks Role: in a
// normal test run the role is empty and the function skips itself; in a
// child it runs the code of the role. Arguments travel in environment
// variables SHMIPC_TEST_ARG_<name> (Config.Args, read with Arg).
//
// Parent side:
//
//	c := proctest.Start(t, proctest.Config{
//		TestName: "TestMultiProcessChild",
//		Role:     "echo-server",
//		Args:     map[string]string{"SOCK": sock},
//	})
//	if _, err := c.WaitReady(10 * time.Second); err != nil {
//		t.Fatalf("child did not start: %v\n%s", err, c.Output())
//	}
//	... talk to the child ...
//	if err := c.Stop(10 * time.Second); err != nil {
//		t.Errorf("child: %v\n%s", err, c.Output())
//	}
//
// Child side:
//
//	func TestMultiProcessChild(t *testing.T) {
//		switch proctest.Role() {
//		case "":
//			t.Skip("helper process for the multi-process tests")
//		case "echo-server":
//			ln := listen(proctest.Arg("SOCK"))
//			proctest.Ready()
//			<-proctest.StdinClosed() // the parent is done (or dead)
//			ln.Close()
//		}
//	}
//
// A child never outlives its usefulness: it runs with -test.timeout
// (Config.Timeout, 60 s by default), after which the testing package panics
// and prints every goroutine's stack; a role that serves until told to stop should wait on
// StdinClosed, which also fires when the parent dies; and Start registers a
// cleanup that kills the child if it is still running when the test ends, and
// logs its output if the test failed.
//
// A child reports its result through its exit status: a role that returns
// normally makes the child test pass (status 0), t.Fatal in the child makes it
// fail (status 1), and so does a data race found by the race detector in a
// -race binary. Wait and Stop return an error for anything but status 0.
package proctest

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
)

const (
	// RoleEnv is the environment variable that selects the role of a child;
	// it is unset in the parent.
	RoleEnv = "SHMIPC_TEST_CHILD"

	// ArgEnvPrefix is put before the name of each argument passed in
	// Config.Args to form its environment variable.
	ArgEnvPrefix = "SHMIPC_TEST_ARG_"

	// ReadyLine is the line a child prints on stdout (with Ready) once it is
	// ready; it may be followed by a space and extra information.
	ReadyLine = "ready"

	// DefaultTimeout is the self-destruct timeout of a child.
	DefaultTimeout = 60 * time.Second

	// waitDelay bounds how long Wait keeps reading the output of a child
	// that has exited but whose output pipes are still held open.
	waitDelay = 2 * time.Second
)

// ErrTimeout is returned (wrapped) by the methods that wait for the child
// when their timeout passes first.
var ErrTimeout = errors.New("proctest: timed out waiting for the child")

// ----------------------------------------------------------------------------
// Child side

// Role returns the role this process was started with, or "" when it is not
// a child (a normal test run).
func Role() string { return os.Getenv(RoleEnv) }

// IsChild reports whether this process is a child started by Start.
func IsChild() bool { return Role() != "" }

// Arg returns the argument name passed by the parent in Config.Args, or "".
func Arg(name string) string { return os.Getenv(ArgEnvPrefix + name) }

// MustArg returns the argument name, failing the (child) test if the parent
// did not pass it.
func MustArg(t testing.TB, name string) string {
	t.Helper()
	v, ok := os.LookupEnv(ArgEnvPrefix + name)
	if !ok {
		t.Fatalf("proctest: the parent passed no argument %q", name)
	}
	return v
}

var stdoutMu sync.Mutex

// Println prints one line on the child's stdout at once, where the parent
// reads it with ReadLine.
func Println(a ...any) {
	stdoutMu.Lock()
	defer stdoutMu.Unlock()
	fmt.Fprintln(os.Stdout, a...)
}

// Ready tells the parent the child is ready: it prints ReadyLine, followed
// by info (joined with spaces) if given. The parent's WaitReady returns info.
func Ready(info ...string) {
	if len(info) == 0 {
		Println(ReadyLine)
		return
	}
	Println(ReadyLine + " " + strings.Join(info, " "))
}

var (
	stdinOnce   sync.Once
	stdinClosed = make(chan struct{})
)

// StdinClosed returns a channel that is closed when the child's stdin
// reaches end of file: when the parent calls CloseStdin or Stop, or dies.
// The first call starts a goroutine that reads (and discards) stdin.
func StdinClosed() <-chan struct{} {
	stdinOnce.Do(func() {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			close(stdinClosed)
		}()
	})
	return stdinClosed
}
