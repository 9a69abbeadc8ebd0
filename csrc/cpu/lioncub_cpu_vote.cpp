// lioncub_cpu_vote.cpp -- C++ CPU kernels of the vote half of a step (counting, decisions, apply), once per instruction set.
#include "lioncub_cpu_detail.h"

#define LC_BODY "lioncub_cpu_vote.inl"
#include "lioncub_cpu_isa_instantiate.h"
#undef LC_BODY
