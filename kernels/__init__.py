"""Triton kernels, installed as ``fused_transformer.kernels``: one op per module; ``toolchain`` says which Triton
releases they build with.

In a checkout, this folder also sits where ``import kernels`` looks first whenever the checkout's root leads sys.path
(``python -m pytest``, ``python -c`` run there). That name belongs to the PyPI package ``kernels`` (Hugging Face's hub
kernels, which transformers imports), so imported under it this file hands the import on to that package, or fails as
if the folder were not there.
"""
if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _import_the_pypi_kernels(name: str, checkout_root: str):
        """Import ``name`` as if ``checkout_root`` were not on sys.path, and leave it in sys.modules for the import
        statement that ran this file to return."""
        path = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != checkout_root]
        for finder in sys.meta_path:
            if finder is importlib.machinery.PathFinder:
                spec = finder.find_spec(name, path)
            elif hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, None)
            else:
                continue
            if spec is not None:
                break
        else:
            raise ModuleNotFoundError(
                f"No module named {name!r} (the checkout's folder kernels/ is fused_transformer.kernels, not the PyPI "
                f"package {name!r})", name=name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)

    _import_the_pypi_kernels(__name__, os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
else:
    from .._env import triton_interpreting

    if triton_interpreting():
        from .toolchain import patch_interpreter

        patch_interpreter()
