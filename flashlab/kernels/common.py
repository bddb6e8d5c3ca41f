"""Constants every kernel shares. Kernels index with unsigned integers (U): Numba adds a negative-index check to
every signed index, which in the inner loops costs more instructions than the multiply-adds themselves."""
import numpy as np

U = np.uint64
I = np.int64  # positions under alignment and windows can be negative
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG = -1.0e30  # a finite "-inf" for masked scores: fastmath lets the compiler assume there are no infinities
FASTMATH = {"contract", "afn", "arcp"}  # fused multiply-adds and fast exp2/log2/division; NaN/inf rules kept
