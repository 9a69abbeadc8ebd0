"""lioncub_ds: communication-efficient distributed Lion for DeepSpeed and Megatron.

The C++ CPU kernels are JIT-built on first use by ``lioncub_ds.ops`` (ninja,
cached). Set ``LIONCUB_BUILD_EXT=1`` to build them ahead of time; add
``LIONCUB_BUILD_CUDA=1`` to also build the CUDA kernels (needs nvcc and a CUDA torch).
"""
import os

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}
if os.environ.get("LIONCUB_BUILD_EXT") == "1":
    from lioncub_ds_build import extensions  # noqa: E402  (local helper, see below)

    ext_modules, cmdclass = extensions()

setup(
    name="lioncub_ds",
    version="0.1.0",
    description="Distributed Lion / Lion Cub optimizer with 1-bit vote collectives, for DeepSpeed and Megatron",
    packages=find_packages(include=["lioncub_ds", "lioncub_ds.*"]),
    package_data={"lioncub_ds": ["csrc/**/*"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    extras_require={"deepspeed": ["deepspeed"], "megatron": ["megatron-core"]},
    entry_points={"deepspeed.optimizers": []},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
