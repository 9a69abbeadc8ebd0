// lioncub_cpu_isa_instantiate.h -- compiles the kernel body LC_BODY (a file name) twice: in
// namespace isa_avx2 with the AVX2 target (x86 only) and in namespace isa_base for the portable
// baseline. LC_AVX2 tells the body which. Included once per translation unit, after
// lioncub_cpu_detail.h, with LC_BODY defined. No include guard on purpose.
#ifndef LC_BODY
#error "define LC_BODY (the kernel body file) before including lioncub_cpu_isa_instantiate.h"
#endif
#if LIONCUB_X86
#pragma GCC push_options
#pragma GCC target("avx2,popcnt,f16c")
#define LC_AVX2 1
namespace lioncub {
namespace cpu {
namespace isa_avx2 {
#include "lioncub_cpu_isa.h"
#include LC_BODY
}  // namespace isa_avx2
}  // namespace cpu
}  // namespace lioncub
#undef LC_AVX2
#pragma GCC pop_options
#endif
#define LC_AVX2 0
namespace lioncub {
namespace cpu {
namespace isa_base {
#include "lioncub_cpu_isa.h"
#include LC_BODY
}  // namespace isa_base
}  // namespace cpu
}  // namespace lioncub
#undef LC_AVX2
