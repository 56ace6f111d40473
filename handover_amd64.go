package shmipc

// countHolders: see handoverMutex. Atomic stores are full fences here.
const countHolders = false
