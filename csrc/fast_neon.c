/*
 * fast_neon.c - the blocked path (fast_impl.h) for AArch64 Advanced SIMD.
 * Compiles to nothing on other targets.
 */
#if defined(__aarch64__)
#endif
