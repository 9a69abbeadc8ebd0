"""Environment report, in the spirit of ``ds_report``: ``python -m lioncub_ds.env [--json]``.

Versions of python / torch / deepspeed / megatron-core (imported lazily; "not installed"
when absent), the kernel backend lioncub_ds uses for CPU tensors (this may JIT-build the
C++ kernels on first use; set ``LIONCUB_KERNELS=torch`` to skip), whether CUDA is
available, where nvcc is and its version, and which backend CUDA tensors would use.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys

__all__ = ["collect", "format_report", "main"]

NOT_INSTALLED = "not installed"


def _version_of(module: str, dist_name: str | None = None) -> str:
    try:
        from importlib import metadata
        try:
            return metadata.version(dist_name or module)
        except metadata.PackageNotFoundError:
            pass
        if importlib.util.find_spec(module) is None:
            return NOT_INSTALLED
        mod = importlib.import_module(module)
        return str(getattr(mod, "__version__", "installed (version unknown)"))
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
        return f"error: {type(exc).__name__}: {exc}"


def _nvcc() -> dict:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    path = shutil.which("nvcc")
    if path is None and cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        path = os.path.join(cuda_home, "bin", "nvcc")
    if path is None:
        return {"path": None, "version": None}
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        m = re.search(r"release\s+([0-9.]+)(?:,\s*V([0-9.]+))?", out)
        version = (m.group(2) or m.group(1)) if m else out.strip().splitlines()[-1] if out.strip() else "unknown"
    except Exception as exc:  # noqa: BLE001
        version = f"error: {type(exc).__name__}"
    return {"path": path, "version": version}


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _backend(device_type: str) -> str:
    """The backend name, plus the loader's fallback warning (captured, not printed) when there is one."""
    logger = logging.getLogger("lioncub_ds")
    cap = _Capture()
    logger.addHandler(cap)
    try:
        from . import kernels
        name = kernels.active_backend_name(device_type)
    except Exception as exc:  # noqa: BLE001
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"unavailable ({type(exc).__name__}{': ' + first[:160] if first else ''})"
    finally:
        logger.removeHandler(cap)
    if cap.messages:
        why = re.sub(r"^lioncub_ds:\s*", "", cap.messages[-1])
        m = re.search(r"unavailable \((.*)\); using", why)
        return f"{name} (fallback: {(m.group(1) if m else why)[:160]})"
    return name


def _torch_version() -> str:
    try:
        import torch
        return str(torch.__version__)
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
        return f"error: {type(exc).__name__}: {exc}"


def collect(probe_cuda_backend: bool = True) -> dict:
    """Everything the report shows, as a JSON-able dict."""
    info: dict = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        # torch's own version string (with its local tag, e.g. "2.11.0+cu130"): the package
        # metadata may drop the tag, and the tag says which build (CPU, CUDA 13) this is.
        "torch": _torch_version(),
        "deepspeed": _version_of("deepspeed"),
        "megatron-core": _version_of("megatron.core", "megatron-core"),
        "lioncub_ds": _version_of("lioncub_ds"),
        "LIONCUB_KERNELS": os.environ.get("LIONCUB_KERNELS", "auto (unset)"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
    }
    cuda = {"available": False, "torch_cuda": None, "device_count": 0, "devices": []}
    try:
        import torch
        info["torch_threads"] = torch.get_num_threads()
        cuda["torch_cuda"] = torch.version.cuda
        cuda["available"] = bool(torch.cuda.is_available())
        if cuda["available"]:
            cuda["device_count"] = torch.cuda.device_count()
            cuda["devices"] = [torch.cuda.get_device_name(i) for i in range(cuda["device_count"])]
        import torch.distributed as dist
        info["distributed_backends"] = ", ".join(
            b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                            ("mpi", dist.is_mpi_available())) if ok) or "none"
    except Exception as exc:  # noqa: BLE001
        cuda["error"] = f"{type(exc).__name__}: {exc}"
    info["cuda"] = cuda
    info["nvcc"] = _nvcc()
    info["kernel_backend_cpu"] = _backend("cpu")
    if probe_cuda_backend:
        be = _backend("cuda")
        info["kernel_backend_cuda"] = be if cuda["available"] else f"{be} (no CUDA device here)"
    return info


def format_report(info: dict) -> str:
    cuda, nvcc = info["cuda"], info["nvcc"]
    rows = [
        ("python", info["python"]),
        ("platform", info["platform"]),
        ("torch", info["torch"]),
        ("deepspeed", info["deepspeed"]),
        ("megatron-core", info["megatron-core"]),
        ("lioncub_ds", info["lioncub_ds"]),
        ("torch.distributed", info.get("distributed_backends", "?")),
        ("threads", f"torch {info.get('torch_threads', '?')}, OMP_NUM_THREADS={info['OMP_NUM_THREADS']}"),
        ("LIONCUB_KERNELS", info["LIONCUB_KERNELS"]),
        ("kernels (cpu)", info["kernel_backend_cpu"]),
        ("cuda available", ("yes: " + ", ".join(cuda["devices"])) if cuda["available"]
         else f"no (torch built with CUDA {cuda['torch_cuda']})" if cuda["torch_cuda"] else "no (CPU-only torch)"),
        ("nvcc", f"{nvcc['path']} (release {nvcc['version']})" if nvcc["path"] else "not found"),
        ("kernels (cuda)", info.get("kernel_backend_cuda", "n/a")),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 50)
    out = [line, "lioncub_ds environment report", line]
    out += [f"{k:<{width}} : {v}" for k, v in rows]
    out.append(line)
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lioncub_ds.env", description="Report the lioncub_ds environment.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    info = collect()
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
    else:
        print(format_report(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
