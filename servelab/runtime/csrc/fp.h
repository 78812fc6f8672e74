/* A rounding barrier: keeps the compiler from fusing a product into the add that follows it
 * (-ffp-contract=fast), where a kernel must round exactly as PyTorch or its other build does. */
#pragma once
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define SL_ROUNDED(v) __asm__("" : "+x"(v))
#else
#define SL_ROUNDED(v) do { volatile __typeof__(v) sl_tmp_ = (v); (v) = sl_tmp_; } while (0)
#endif
