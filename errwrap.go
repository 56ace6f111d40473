package shmipc

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
)

// Every error of this package starts with "shmipc: ", and many wrap another
// of them, so joined naively the prefix would come back at each level:
// errorf says it once, at the start.

const errPrefix = "shmipc: "

// prefixedError is an error whose message says errPrefix once.
type prefixedError struct{ err error }

func (e *prefixedError) Error() string { return oncePrefixed(e.err.Error()) }
func (e *prefixedError) Unwrap() error { return e.err }

// oncePrefixed drops the prefix of the errors that s quotes after its own.
func oncePrefixed(s string) string {
	s = strings.ReplaceAll(s, ": "+errPrefix, ": ")
	return strings.ReplaceAll(s, "("+errPrefix, "(")
}

// errorf is fmt.Errorf whose message says "shmipc: " once.
func errorf(format string, a ...any) error {
	return &prefixedError{fmt.Errorf(format, a...)}
}

// netError is the error of op (dial, listen) on network and address that
// failed with err: the prefix and err when err names them already (a
// *net.OpError or an *os.PathError), else all of them.
func netError(op, network, address string, err error) error {
	var oe *net.OpError
	var pe *os.PathError
	if errors.As(err, &oe) || errors.As(err, &pe) {
		return errorf(errPrefix+"%w", err)
	}
	return errorf(errPrefix+"%s %s %s: %w", op, network, address, err)
}
