// cuda_runtime_api.h -- the host emulation's stand-in for the CUDA runtime API (tests only).
// The few runtime types and calls the kernels' launchers use; lioncub_cuda_emu.cpp defines them.
// An emulated device has a settable number of SMs (lc_emu_configure), which sets the grid sizes
// that lc::grid_for picks, as on a real GPU.
#ifndef LC_EMU_CUDA_RUNTIME_API_H_
#define LC_EMU_CUDA_RUNTIME_API_H_

#include <stddef.h>
#include <stdint.h>

#include "vector_types.h"

typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
} cudaError_t;

typedef enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 } cudaDeviceAttr;

typedef struct CUstream_st* cudaStream_t;

#ifdef __cplusplus
extern "C" {
#endif
cudaError_t cudaGetLastError(void);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
const char* cudaGetErrorString(cudaError_t error);
#ifdef __cplusplus
}
#endif

#endif  // LC_EMU_CUDA_RUNTIME_API_H_
