#include "textflag.h"

// func CPURelax()
TEXT ·CPURelax(SB), NOSPLIT, $0-0
	YIELD
	YIELD
	YIELD
	YIELD
	RET
