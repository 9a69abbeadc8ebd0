// vector_types.h -- the host emulation's stand-in for CUDA's header of the same name (tests only).
// The vector types the kernels use, with CUDA's sizes and alignments (a 16-byte float4 / uint4
// load in a kernel is a 16-byte aligned load here too).
#ifndef LC_EMU_VECTOR_TYPES_H_
#define LC_EMU_VECTOR_TYPES_H_

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct uint3 { unsigned int x, y, z; };

#endif  // LC_EMU_VECTOR_TYPES_H_
