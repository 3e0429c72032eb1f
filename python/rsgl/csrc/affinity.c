/* Pinning the calling thread's OpenMP team to CPUs, one thread per CPU. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

/* Thread i of a team of n (the caller is thread 0) may run only on cpus[i]. libgomp keeps a
   master thread's workers in the order it started them, so later teams of up to n threads
   from the same caller (these kernels', torch's) run on the same pinned threads. Returns
   how many threads could not be pinned (all of them where the OS has no such call). */
int rsgl_bind_omp_threads(const int* cpus, int n) {
#if defined(__linux__)
    int failed = 0;
#pragma omp parallel num_threads(n) reduction(+ : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        failed += sched_setaffinity(0, sizeof(set), &set) != 0;
    }
    return failed;
#else
    (void)cpus;
    return n;
#endif
}
