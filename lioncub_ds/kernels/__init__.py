"""Kernel build support. :mod:`lioncub_ds.kernels.build` is the one table of the native sources and
flags, read by the JIT loader (:mod:`lioncub_ds._native`) and by ``setup.py``."""
