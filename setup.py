"""lioncub_ds: communication-efficient distributed Lion for DeepSpeed and Megatron.

The C++ CPU kernels are JIT-built on first use by ``lioncub_ds.kernels`` (ninja, cached). Set
``LIONCUB_BUILD_EXT=1`` to build them ahead of time (``LIONCUB_BUILD_EXT=1 pip install
--no-build-isolation .``; torch must be importable); add ``LIONCUB_BUILD_CUDA=1`` to also build
the CUDA kernels (needs nvcc and a CUDA torch).
"""
import os
import runpy
import shutil
import sysconfig
from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
# The one table of sources and flags, shared with the JIT loader (lioncub_ds/kernels/loader.py); read with
# runpy so that setup.py needs neither torch nor the package importable.
BUILD = runpy.run_path(str(HERE / "lioncub_ds" / "kernels" / "build.py"))


class BuildPyWithSources(build_py):
    """Ship csrc/ inside the package (lioncub_ds/csrc) so an installed copy can still JIT-build."""

    def run(self):
        super().run()
        if CSRC.is_dir():
            shutil.copytree(CSRC, Path(self.build_lib) / "lioncub_ds" / "csrc", dirs_exist_ok=True)


ext_modules, cmdclass = [], {"build_py": BuildPyWithSources}
if os.environ.get("LIONCUB_BUILD_EXT") == "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    cpp_hash = BUILD["source_hash"](CSRC, BUILD["CPP_SOURCES"], BUILD["CPP_HEADERS"])
    ext_modules.append(
        CppExtension(
            name=BUILD["CPP_MODULE"],  # loaded first by lioncub_ds.kernels.loader
            sources=[f"csrc/{s}" for s in BUILD["CPP_SOURCES"]],
            include_dirs=[str(CSRC)],
            extra_compile_args=list(BUILD["CFLAGS"]) + [f"-DLIONCUB_SRC_HASH=h{cpp_hash}"],
            extra_link_args=list(BUILD["LDFLAGS"]),
        )
    )
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)
    if os.environ.get("LIONCUB_BUILD_CUDA") == "1":
        from torch.utils.cpp_extension import CUDAExtension

        cuda_hash = BUILD["source_hash"](CSRC, BUILD["CUDA_SOURCES"], BUILD["CUDA_HEADERS"])
        ext_modules.append(
            CUDAExtension(
                name=BUILD["CUDA_MODULE"],  # what lioncub_ds.kernels.loader loads for the cuda backend
                sources=[f"csrc/{s}" for s in BUILD["CUDA_SOURCES"]],
                include_dirs=[str(CSRC)],
                extra_compile_args={"cxx": list(BUILD["CFLAGS"]) + list(BUILD["CUDA_DEFINES"])
                                    + [f"-DLIONCUB_SRC_HASH=h{cuda_hash}"],
                                    "nvcc": list(BUILD["NVCC_FLAGS"])},
                extra_link_args=list(BUILD["LDFLAGS"]),
            )
        )

# The DeepSpeed auto-registration hook: a .pth in site-packages puts a stdlib-only finder on
# sys.meta_path that registers "type": "LionCub" when (and only when) deepspeed is imported.
_SITE = os.path.relpath(sysconfig.get_path("purelib"), sysconfig.get_path("data"))
_HOOK = ["lioncub_ds/deepspeed/lioncub_ds_autohook.pth", "lioncub_ds/deepspeed/lioncub_ds_autohook.py"]


class _Distribution(Distribution):
    def has_data(self):  # setuptools' editable install looks for this name; without it data_files are skipped
        return bool(self.data_files)


setup(
    name="lioncub_ds",
    distclass=_Distribution,
    data_files=[(_SITE, _HOOK)],
    version="0.1.0",
    description="Distributed Lion / Lion Cub optimizer with 1-bit vote collectives, for DeepSpeed and Megatron",
    packages=find_packages(include=["lioncub_ds", "lioncub_ds.*"]),
    package_data={"lioncub_ds": ["plan_convergence.json"]},  # the planner's measured convergence costs
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    # the supported ranges (lioncub_ds/deepspeed/_compat.py, lioncub_ds/megatron/_compat.py; tests/test_front_door.py)
    extras_require={"deepspeed": ["deepspeed>=0.19,<0.20"], "megatron": ["megatron-core>=0.16,<0.20"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
