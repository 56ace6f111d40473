//go:build race && amd64

#include "textflag.h"

// See shmatomic_race_amd64.go. Loads are plain moves and stores XCHG, as
// in sync/atomic on amd64 without the race detector.

// func shmLoadInt32Asm(p *int32) int32
TEXT ·shmLoadInt32Asm(SB), NOSPLIT, $0-12
	MOVQ	p+0(FP), AX
	MOVL	0(AX), AX
	MOVL	AX, ret+8(FP)
	RET

// func shmLoadUint32Asm(p *uint32) uint32
TEXT ·shmLoadUint32Asm(SB), NOSPLIT, $0-12
	JMP	·shmLoadInt32Asm(SB)

// func shmLoadInt64Asm(p *int64) int64
TEXT ·shmLoadInt64Asm(SB), NOSPLIT, $0-16
	MOVQ	p+0(FP), AX
	MOVQ	0(AX), AX
	MOVQ	AX, ret+8(FP)
	RET

// func shmStoreUint32Asm(p *uint32, v uint32)
TEXT ·shmStoreUint32Asm(SB), NOSPLIT, $0-12
	MOVQ	p+0(FP), BX
	MOVL	v+8(FP), AX
	XCHGL	AX, 0(BX)
	RET

// func shmStoreInt64Asm(p *int64, v int64)
TEXT ·shmStoreInt64Asm(SB), NOSPLIT, $0-16
	MOVQ	p+0(FP), BX
	MOVQ	v+8(FP), AX
	XCHGQ	AX, 0(BX)
	RET

// func shmAddInt32Asm(p *int32, d int32) int32
TEXT ·shmAddInt32Asm(SB), NOSPLIT, $0-20
	MOVQ	p+0(FP), BX
	MOVL	d+8(FP), AX
	MOVL	AX, CX
	LOCK
	XADDL	AX, 0(BX)
	ADDL	CX, AX
	MOVL	AX, ret+16(FP)
	RET

// func shmCASUint32Asm(p *uint32, old, new uint32) bool
TEXT ·shmCASUint32Asm(SB), NOSPLIT, $0-17
	MOVQ	p+0(FP), BX
	MOVL	old+8(FP), AX
	MOVL	new+12(FP), CX
	LOCK
	CMPXCHGL	CX, 0(BX)
	SETEQ	ret+16(FP)
	RET
