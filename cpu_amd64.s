#include "textflag.h"

// func rdpid() uint32
TEXT ·rdpid(SB), NOSPLIT, $0-4
	// RDPID AX, which the assembler does not know.
	BYTE $0xF3; BYTE $0x0F; BYTE $0xC7; BYTE $0xF8
	MOVL AX, ret+0(FP)
	RET

// func rdtscpAux() uint32
TEXT ·rdtscpAux(SB), NOSPLIT, $0-4
	RDTSCP
	MOVL CX, ret+0(FP)
	RET

// func cpuidRegs(leaf, sub uint32) (a, b, c, d uint32)
TEXT ·cpuidRegs(SB), NOSPLIT, $0-24
	MOVL leaf+0(FP), AX
	MOVL sub+4(FP), CX
	CPUID
	MOVL AX, a+8(FP)
	MOVL BX, b+12(FP)
	MOVL CX, c+16(FP)
	MOVL DX, d+20(FP)
	RET
