// The SiLU-and-multiply row kernel of this CPU (no torch headers), shared by the silu_mul_bf16 op
// (fused_bf16.cpp, where the kernels live) and packed_linear_bf16's SiLU epilogue
// (packed_linear_bf16.cpp): y[i] = bf16(bf16(silu(g[i])) * u[i]) for i < n, fused_bf16.cpp's
// arithmetic (the lookup table, 16 lanes, 8 lanes or scalar: the same bits on every path).
#pragma once

#include <cstdint>

namespace sequoia_kernels::cpu {

using SiluMulRowFn = void (*)(const uint16_t* g, const uint16_t* u, int64_t n, uint16_t* y);

// The kernel this CPU runs (chosen once per process, within ATEN_CPU_CAPABILITY's cap).
SiluMulRowFn silu_mul_row_fn();

}  // namespace sequoia_kernels::cpu
