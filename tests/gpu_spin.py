"""The tests' and benchmarks' busy kernel: ``mnopt_spin(ns)`` keeps its
stream busy for ``ns`` nanoseconds (one thread watching the GPU's global
timer), so that what is queued behind it waits, or is timed without the
host's launch gaps.  Needs CuPy (and a GPU to run, not to compile)."""

SPIN_SOURCE = r'''
extern "C" __global__ void mnopt_spin(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
}
'''



def spin_kernel():
    """SPIN_SOURCE's kernel: ``k((1,), (1,), (numpy.int64(ns),))``."""
    import cupy
    return cupy.RawKernel(SPIN_SOURCE, 'mnopt_spin')
