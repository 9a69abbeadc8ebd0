"""TEST-ONLY: run Megatron-LM's own pretrain_gpt.py with LionCub on a CPU-only machine.

    torchrun --nproc_per_node 1 tests/megatron_lm_cpu_launcher.py pretrain_gpt.py <Megatron args> \\
        --distributed-backend gloo --use-cpu-initialization --transformer-impl local ...

Run from a Megatron-LM checkout (tag core_v0.16.1 for megatron-core 0.16.1; its megatron/training,
megatron/legacy, megatron/post_training, megatron/rl, pretrain_gpt.py, gpt_builders.py and
model_provider.py on PYTHONPATH after the megatron-core wheel; Megatron-LM also imports ``six``).
Megatron-LM asserts CUDA at start-up, so besides the test shim (lioncub_ds.testing.megatron_cpu_shim) this
launcher makes ``torch.cuda.is_available()`` say True and turns off four GPU-only start-up steps:
the triton batch-invariant kernels module (imported unconditionally), the CUDA fused-kernel build,
the dataset helper ``make`` (the wheel ships the built .so, no Makefile) and the torch.compile
warm-up of the CUDA fusions. Then it runs ``python -m lioncub_ds.megatron.run`` (the supported
entry point) exactly as a user would. Never use this on a GPU machine.
"""
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lioncub_ds.testing import megatron_cpu_shim  # noqa: E402,F401

megatron_cpu_shim.install()
import torch  # noqa: E402

torch.cuda.is_available = lambda: True  # Megatron-LM: assert torch.cuda.is_available(), "Megatron requires CUDA."
torch.cuda.device_count = lambda: 1
_bik = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")


def _no_batch_invariant_mode(*a, **k):
    raise RuntimeError("--batch-invariant-mode needs triton (not on a CPU machine)")


_bik.enable_batch_invariant_mode = _no_batch_invariant_mode
sys.modules[_bik.__name__] = _bik
import megatron.core.datasets.utils as _datasets_utils  # noqa: E402

_datasets_utils.compile_helpers = lambda: None
import megatron.legacy.fused_kernels as _fused_kernels  # noqa: E402

_fused_kernels.load = lambda args: None
import megatron.training.training as _training  # noqa: E402

_training.set_jit_fusion_options = lambda *a, **k: None

from lioncub_ds.megatron.run import main  # noqa: E402

if __name__ == "__main__":
    main()
