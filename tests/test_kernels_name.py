"""The checkout's folder kernels/ (our Triton code, installed as ``fused_transformer.kernels``) never answers
``import kernels``, a name that belongs to the PyPI package transformers imports: checked in fresh processes started
in the checkout's root, where that folder leads sys.path, as ``python -m pytest`` and a user's ``python -c`` see it."""
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(code: str, cwd: pathlib.Path = ROOT) -> dict:
    """Run ``code`` with ``python -c`` in ``cwd`` (sys.path[0] is then that folder) and return the JSON it prints
    last."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _pypi_kernels_folder() -> pathlib.Path:
    try:
        distribution = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the PyPI package kernels is not installed (transformers >= 5.25 installs it; the test extra does)")
    return pathlib.Path(distribution.locate_file("kernels")).resolve()


def test_from_the_root_import_kernels_is_the_pypi_package_and_transformers_models_import():
    pypi_kernels = _pypi_kernels_folder()
    found = _run(
        "import json, sys\n"
        "import kernels\n"
        "import transformers.activations\n"
        "from transformers import (AutoModelForCausalLM, BertModel, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,\n"
        "                          T5ForConditionalGeneration)\n"
        "model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,\n"
        "    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))\n"
        "import fused_transformer.kernels\n"
        "from fused_transformer.kernels import attention\n"
        "print(json.dumps(dict(kernels=kernels.__file__, hub=sys.modules['kernels'].__file__,\n"
        "    ours=fused_transformer.kernels.__file__, attention=attention.__file__, model=type(model).__name__)))\n")
    assert pathlib.Path(found["kernels"]).resolve() == pypi_kernels / "__init__.py"
    assert found["hub"] == found["kernels"]
    assert pathlib.Path(found["ours"]).resolve() == ROOT / "kernels" / "__init__.py"
    assert pathlib.Path(found["attention"]).resolve() == ROOT / "kernels" / "attention" / "__init__.py"
    assert found["model"] == "LlamaForCausalLM"


def test_from_the_root_import_kernels_without_the_pypi_package_is_module_not_found():
    """sys.path without site-packages stands for an environment without the PyPI package: the folder does not answer,
    and leaves nothing behind in sys.modules."""
    found = _run(
        "import json, sys\n"
        "sys.path[:] = [entry for entry in sys.path if 'site-packages' not in entry]\n"
        "try:\n"
        "    import kernels\n"
        "    print(json.dumps(dict(imported=kernels.__file__)))\n"
        "except ModuleNotFoundError as e:\n"
        "    print(json.dumps(dict(missing=e.name, left='kernels' in sys.modules)))\n")
    assert found == {"missing": "kernels", "left": False}


def test_a_built_wheel_ships_the_kernels_as_fused_transformer_kernels_only(tmp_path):
    pypi_kernels = _pypi_kernels_folder()
    source = tmp_path / "source"  # a copy: pip builds in the tree it is given, and leaves build/ there
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for folder in ("fused_transformer", "kernels"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    env = {**os.environ, "FUSED_TRANSFORMER_SKIP_CPU_BUILD": "1"}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(source)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("fused_transformer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "fused_transformer/kernels/__init__.py" in names
    assert "fused_transformer/kernels/attention/fwd.py" in names
    assert not [n for n in names if n.startswith("kernels/")], "the wheel must not install a top-level kernels"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    found = _run(
        "import json, sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        "import fused_transformer.kernels, kernels\n"
        "from fused_transformer.kernels import attention\n"
        "print(json.dumps(dict(ours=fused_transformer.kernels.__file__, attention=attention.__file__,\n"
        "    kernels=kernels.__file__)))\n", cwd=tmp_path)
    assert pathlib.Path(found["ours"]).resolve() == (site / "fused_transformer" / "kernels" / "__init__.py").resolve()
    assert pathlib.Path(found["attention"]).resolve().is_relative_to(site.resolve())
    assert pathlib.Path(found["kernels"]).resolve() == pypi_kernels / "__init__.py"
