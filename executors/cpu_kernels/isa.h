/* Which vector instructions the kernels' wide paths run on, chosen at run time.
 *
 * The library is compiled for AVX2 + FMA on every x86-64 machine (build.py: a kernel cache
 * may be shared between hosts), and the AVX-512 paths are functions of that target alone:
 * they run where the CPU and the OS have AVX-512 F and BW, unless someone asked for AVX2
 * (me_isa: the tests compare the two, which compute the same FMA chains bit for bit). */
#ifndef MODELEXEC_ISA_H
#define MODELEXEC_ISA_H

/* The attribute of the AVX-512 paths' functions. */
#define ME_AVX512 __attribute__((target("avx512f,avx512bw")))

/* -1 until asked, then 1 where the wide paths run on AVX-512, 0 for AVX2 (weight_panel.c). */
extern int isa_avx512;

/* 1 where the wide paths run on AVX-512; the CPU is asked once. */
static inline int use_avx512(void) {
    int isa = __atomic_load_n(&isa_avx512, __ATOMIC_RELAXED);
    if (isa < 0) {
        __builtin_cpu_init();
        isa = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
        __atomic_store_n(&isa_avx512, isa, __ATOMIC_RELAXED);
    }
    return isa;
}

#endif
