"""Test support shared by the tests, the benchmarks and the examples (never needed in training).

* :func:`run_ranks`, :func:`free_port`: spawn N gloo ranks on 127.0.0.1, collect their results.
* :mod:`.nccl_contract`: a wrapper around torch.distributed that checks NCCL's rules on CPU.
* :mod:`.megatron_cpu_shim`: lets megatron-core's CUDA-only code paths run on CPU ranks.
* :mod:`.exit_abort`: reproducer for the SIGABRT at interpreter exit (docs/deepspeed.md).
"""
from . import nccl_contract
from .spawn import RankError, free_port, run_ranks

__all__ = ["RankError", "free_port", "run_ranks", "nccl_contract"]
