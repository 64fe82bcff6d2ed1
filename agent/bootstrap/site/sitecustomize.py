"""steplens bootstrap entry when this directory is on PYTHONPATH (site does not read .pth files there).

Does nothing unless STEPLENS_BOOTSTRAP=1, never raises, then hands over to the next `sitecustomize`
on sys.path (the one this file shadows), so an image's own sitecustomize still runs.
"""

import os
import sys


def _steplens_bootstrap() -> None:
    if os.environ.get("STEPLENS_BOOTSTRAP") == "1":
        try:
            import steplens_bootstrap
            steplens_bootstrap.install()
        except Exception:  # the user's program starts whatever happens here
            pass


def _chain() -> None:
    try:
        import importlib.machinery
        import importlib.util
        here = os.path.dirname(os.path.abspath(__file__))
        rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is not None and spec.loader is not None and spec.origin != os.path.abspath(__file__):
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
    except Exception:
        pass


_steplens_bootstrap()
_chain()
