"""What users import: `hf_zo.__all__`, the deprecated alias of a moved module, and the tested dependency ranges that
`import hf_zo` checks."""

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import hf_zo
from hf_zo import dependency_versions
from hf_zo.models import norm_layers

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent


def test_all_lists_the_trainers_configs_optimizers_and_model_helpers():
    pytest.importorskip("trl")
    wanted = {"ZOTrainer", "ZOConfig", "ZOSFTTrainer", "ZOSFTConfig", "ZOSGD", "FZOO", "HiZOO", "LOZO", "ZOAdam"}
    wanted |= {"DistZOPlugin", "load_sequence_classifier", "embedded_llm_path", "norm_module_names", "replay"}
    assert wanted <= set(hf_zo.__all__)
    assert len(hf_zo.__all__) == len(set(hf_zo.__all__))
    for name in hf_zo.__all__:
        assert getattr(hf_zo, name) is not None, name
    namespace = {}
    exec("from hf_zo import *", namespace)
    assert namespace["ZOSFTTrainer"].__module__ == "hf_zo.sft"


def test_norm_tuning_is_a_deprecated_alias_of_where_it_moved():
    sys.modules.pop("hf_zo.norm_tuning", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module("hf_zo.norm_tuning")
    assert any(issubclass(w.category, FutureWarning) and "hf_zo.models" in str(w.message) for w in caught)
    assert alias.norm_module_names is norm_layers.norm_module_names
    assert alias.is_norm_module is norm_layers.is_norm_module


def _pyproject_ranges() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["trl"]]
    return {r.name: str(r.specifier) for r in requirements}


def test_the_checked_ranges_are_pyprojects():
    pins = _pyproject_ranges()
    for name, specifier in {**dependency_versions.RANGES, **dependency_versions.EXTRA_RANGES}.items():
        assert Requirement(f"{name}{specifier}").specifier == Requirement(f"{name}{pins[name]}").specifier, name


def test_a_release_outside_the_range_fails_the_import_naming_the_range(monkeypatch):
    monkeypatch.setattr(dependency_versions.metadata, "version", lambda name: "4.57.1")
    monkeypatch.delenv(dependency_versions.SKIP_VARIABLE, raising=False)
    with pytest.raises(ImportError, match=r"tested with transformers>=5\S* and found transformers 4\.57\.1"):
        dependency_versions.check_dependency_versions({"transformers": dependency_versions.RANGES["transformers"]})
    monkeypatch.setenv(dependency_versions.SKIP_VARIABLE, "1")
    dependency_versions.check_dependency_versions({"transformers": dependency_versions.RANGES["transformers"]})


def test_import_hf_zo_checks_the_installed_releases():
    code = (
        "import importlib.metadata as m; real = m.version\n"
        "m.version = lambda name: '0.1' if name == 'peft' else real(name)\n"
        "import hf_zo"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "hf_zo is tested with peft>=" in result.stderr and "found peft 0.1" in result.stderr
