// lioncub_cpu_local.cpp -- C++ CPU kernels of the local half of a step (local step, momentum, int8 codes), once per instruction set.
#include "lioncub_cpu_detail.h"

#define LC_BODY "lioncub_cpu_local.inl"
#include "lioncub_cpu_isa_instantiate.h"
#undef LC_BODY
