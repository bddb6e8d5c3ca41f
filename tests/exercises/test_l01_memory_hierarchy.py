"""Lesson 01's exercises (arithmetic intensity, the roofline): each checker passes the solution and correct
answers written differently, grades the blank "not implemented", and rejects kept wrong solutions."""
import numpy as np

from exercise_harness import Lesson

LESSON = Lesson("01_memory_hierarchy", min_alternatives=2)
mutant, alternative = LESSON.mutant, LESSON.alternative


# -- kept wrong solutions ----------------------------------------------------------------------------
mutant("matmul_intensity")(lambda M, N, K, b: M * N * K / (b * (M * K + K * N + M * N)))  # one FLOP per (i,j,k)
mutant("matmul_intensity")(lambda M, N, K, b: 2 * M * N * K / (b * (M * K + K * N)))  # forgets writing C
mutant("matmul_intensity")(lambda M, N, K, b: 2 * M * N * K / (M * K + K * N + M * N))  # elements, not bytes
mutant("matmul_intensity")(lambda M, N, K, b: 2 * M * N * K / (b * 3 * M * N))  # assumes square matrices

mutant("softmax_intensity")(lambda rows, cols, b: 5 * rows * cols / (b * rows * cols))  # forgets the writes
mutant("softmax_intensity")(lambda rows, cols, b: 5 / (2 * b) * cols)  # grows with the row length
mutant("softmax_intensity")(lambda rows, cols, b: 5 * rows * cols / 2)  # bytes_per_element ignored
mutant("softmax_intensity")(lambda rows, cols, b: 1 / (2 * b))  # one FLOP per element


@mutant("roofline")
def roofline_max(intensity, peak, bw):
    return max(peak, bw * intensity), "memory" if intensity < peak / bw else "compute"


@mutant("roofline")
def roofline_labels_swapped(intensity, peak, bw):
    return min(peak, bw * intensity), "compute" if intensity < peak / bw else "memory"


@mutant("roofline")
def roofline_ridge_inverted(intensity, peak, bw):
    return min(peak, bw * intensity), "memory" if intensity < bw / peak else "compute"


@mutant("roofline")
def roofline_divides(intensity, peak, bw):
    return min(peak, bw / intensity), "memory" if intensity < peak / bw else "compute"


@mutant("roofline", "at the ridge point itself")
def roofline_memory_at_the_ridge(intensity, peak, bw):
    return min(peak, bw * intensity), "memory" if intensity <= peak / bw else "compute"


# -- correct alternatives ----------------------------------------------------------------------------
@alternative("matmul_intensity")
def intensity_per_byte(M, N, K, bytes_per_element):
    elements = M * K + K * N + M * N
    return (2.0 * M * N * K / elements) / bytes_per_element


@alternative("matmul_intensity")
def intensity_in_steps(M, N, K, bytes_per_element):
    flops = 0
    flops += M * N * K  # multiplies
    flops += M * N * K  # adds
    return flops / float(np.dot([M * K, K * N, M * N], [bytes_per_element] * 3))


@alternative("softmax_intensity")
def softmax_per_element(rows, cols, bytes_per_element):
    return 5 / (2 * bytes_per_element)


@alternative("softmax_intensity")
def softmax_counted(rows, cols, bytes_per_element):
    n = rows * cols
    return (n + n + n + n + n) / (n * bytes_per_element + n * bytes_per_element)


@alternative("roofline")
def roofline_by_comparing_times(intensity, peak_flops, bandwidth):
    memory_rate = bandwidth * intensity
    if memory_rate < peak_flops:
        return memory_rate, "memory"
    return peak_flops, "compute"


@alternative("roofline")
def roofline_with_ridge(intensity, peak_flops, bandwidth):
    ridge = peak_flops / bandwidth
    bound = "compute" if intensity >= ridge else "memory"
    return float(np.minimum(peak_flops, intensity * bandwidth)), bound


globals().update(LESSON.standard_tests())
