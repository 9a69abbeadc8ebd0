"""Lazy DeepSpeed registration of ``"type": "LionCub"`` (stdlib only, import cost ~0).

Installed twice by ``setup.py``: inside the package (``lioncub_ds.deepspeed.lioncub_ds_autohook``)
and as the top-level module ``lioncub_ds_autohook`` next to ``lioncub_ds_autohook.pth`` in
site-packages. The ``.pth`` line imports this module at interpreter start-up; it only
puts one tiny finder at the front of ``sys.meta_path`` (no torch, no lioncub_ds import).

The finder ignores every import except the top-level ``deepspeed`` package. When
``deepspeed`` has finished importing (all of ``deepspeed.runtime`` is loaded by then), the
finder removes itself and imports :mod:`lioncub_ds.deepspeed`, which registers LionCub
with DeepSpeed's engine. A training script that never mentions lioncub_ds can therefore
use ``"optimizer": {"type": "LionCub", ...}`` in its ds_config.

Opt out with ``LIONCUB_DS_AUTOREGISTER=0``. A failure to register never breaks the
``import deepspeed``: it is reported as a warning (the ds_config then fails with
DeepSpeed's own "not a supported DeepSpeed Optimizer").
"""
import os
import sys

_TARGET = "deepspeed"
_MARK = "_lioncub_ds_autohook"
_OFF = ("0", "false", "no", "off")


def enabled() -> bool:
    return os.environ.get("LIONCUB_DS_AUTOREGISTER", "1").strip().lower() not in _OFF


def _register_now():
    if not enabled():
        return
    mod = sys.modules.get("lioncub_ds.deepspeed")
    if mod is not None:
        # Either fully imported (then it registered already) or being imported right now
        # (its register() imported deepspeed and will finish the job itself).
        return
    try:
        import lioncub_ds.deepspeed  # noqa: F401  (registers on import)
    except Exception as exc:  # noqa: BLE001 - never break `import deepspeed`
        import warnings
        warnings.warn(f"lioncub_ds: could not register the LionCub optimizer with DeepSpeed "
                      f"({type(exc).__name__}: {exc}); set LIONCUB_DS_AUTOREGISTER=0 to silence this",
                      RuntimeWarning, stacklevel=2)


def _remove_finders():
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, _MARK, False)]


class _LoaderProxy:
    """Wraps deepspeed's own loader; registers LionCub right after the package executed."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        finally:
            # Leave no trace: the module keeps deepspeed's real loader.
            try:
                module.__loader__ = self._loader
                if getattr(module, "__spec__", None) is not None:
                    module.__spec__.loader = self._loader
            except Exception:  # noqa: BLE001
                pass
        _remove_finders()
        _register_now()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class DeepSpeedImportHook:
    """A ``sys.meta_path`` finder that only reacts to ``import deepspeed`` (once)."""

    _lioncub_ds_autohook = True

    def __init__(self):
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET or self._busy:
            return None
        self._busy = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                if getattr(finder, _MARK, False):
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _LoaderProxy(spec.loader)
        return spec

    # Python < 3.4 protocol, never used; kept so introspection tools do not choke.
    def invalidate_caches(self):
        return None


def install() -> bool:
    """Put the hook in place (or register at once when deepspeed is already imported).

    Returns True when the hook is installed or registration ran, False when disabled.
    """
    if not enabled():
        return False
    if _TARGET in sys.modules:
        _register_now()
        return True
    if not any(getattr(f, _MARK, False) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedImportHook())
    return True


def uninstall() -> None:
    _remove_finders()


if __name__ == "lioncub_ds_autohook":  # imported by the .pth line at start-up
    install()
