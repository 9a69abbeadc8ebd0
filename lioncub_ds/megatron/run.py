"""Run a Megatron-LM training script with LionCub swapped in.

    torchrun --nproc_per_node 8 -m lioncub_ds.megatron.run pretrain_gpt.py <Megatron args> --lioncub-comm 1bit

The first argument is the script (``pretrain_gpt.py``, ``pretrain_mamba.py``, ...; a bare name is
looked up in the current directory, then in ``$MEGATRON_LM_DIR``, then on ``sys.path``); when it
is left out (the first argument starts with ``-``), ``pretrain_gpt.py`` is used. Everything else
goes to the script unchanged, with the ``--lioncub-*`` flags added to Megatron's own parser.
What is swapped: see :mod:`lioncub_ds.megatron.training`.
"""
from __future__ import annotations

import os
import runpy
import sys

DEFAULT_SCRIPT = "pretrain_gpt.py"


def find_script(name: str) -> str:
    if os.path.isfile(name):
        return os.path.abspath(name)
    places = [os.getcwd()]
    if os.environ.get("MEGATRON_LM_DIR"):
        places.append(os.environ["MEGATRON_LM_DIR"])
    places += [p for p in sys.path if p]
    for place in places:
        path = os.path.join(place, name)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise SystemExit(f"lioncub_ds.megatron.run: cannot find the Megatron-LM script {name!r} (looked in the current "
                     "directory, $MEGATRON_LM_DIR and sys.path). Run from a Megatron-LM checkout, set "
                     "MEGATRON_LM_DIR, or give the script's path.")


def help_text() -> str:
    """This module's usage and the ``--lioncub-*`` flags it adds (Megatron's own flags: the script's
    ``--help``, which needs the Megatron-LM checkout)."""
    import argparse

    from .args import add_lioncub_args

    parser = add_lioncub_args(argparse.ArgumentParser(prog="python -m lioncub_ds.megatron.run [script.py]",
                                                      add_help=False, usage=argparse.SUPPRESS))
    return __doc__ + "\n" + parser.format_help()


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help") and len(argv) == 1:
        print(help_text())
        return
    script = DEFAULT_SCRIPT
    if argv and not argv[0].startswith("-"):
        script = argv.pop(0)
    path = find_script(script)
    root = os.path.dirname(path)
    if root not in sys.path:
        sys.path.insert(0, root)  # the script imports its neighbours (gpt_builders, model_provider, ...)
    from .training import install
    install()
    sys.argv = [path] + argv
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
