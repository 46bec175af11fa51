"""ZOTrainer against the installed transformers: the pinned range holds it, and every `Trainer` method the ZO mixins
override or call still exists with a signature they fit, so a release that renames or reshapes one fails here."""

import inspect
from pathlib import Path

import pytest
import transformers
from packaging.requirements import Requirement
from transformers import Trainer

from hf_zo.trainer import ZOTrainer, ZOTrainerMixin

tomllib = pytest.importorskip("tomllib")

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"

CALLED_TRAINER_MEMBERS = (
    "_get_output_dir",
    "_move_model_to_device",
    "_prepare_inputs",
    "_set_signature_columns_if_needed",
    "compute_loss",
    "compute_loss_context_manager",
    "get_decay_parameter_names",
    "get_test_dataloader",
    "push_to_hub",
)
"""`Trainer` methods the mixins call without overriding them."""


def _transformers_requirement() -> Requirement:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (pin,) = [Requirement(d) for d in dependencies if Requirement(d).name == "transformers"]
    return pin


ZO_OWN_METHODS = {"flush_pending_update"}
"""Methods of the mixins that are ZO's own though their names do not say `zo`."""


def _mixin_overrides() -> dict[str, object]:
    """The methods the ZO mixins define that are not ZO's own (whose names say `zo`): `Trainer` overrides."""
    mixins = [cls for cls in ZOTrainerMixin.__mro__ if cls is not object]
    return {
        name: member
        for cls in reversed(mixins)
        for name, member in vars(cls).items()
        if inspect.isfunction(member)
        and not name.startswith("__")
        and "zo" not in name.lower()
        and name not in ZO_OWN_METHODS
    }


def test_the_installed_transformers_is_in_the_pinned_range():
    pin = _transformers_requirement()
    assert pin.specifier, "pin transformers to the releases the private overrides are tested against"
    assert any(spec.operator in ("<", "<=", "==", "~=") for spec in pin.specifier), f"{pin} has no upper bound"
    assert pin.specifier.contains(transformers.__version__), (
        f"transformers {transformers.__version__} is outside the tested range {pin}: run the suite on it and widen "
        "the pin in pyproject.toml, or install a release inside it."
    )


def test_every_overridden_trainer_method_still_exists():
    overrides = _mixin_overrides()
    assert {"_save_checkpoint", "_load_optimizer_and_scheduler", "_get_train_sampler", "_wrap_model"} <= set(overrides)
    missing = sorted(name for name in overrides if not hasattr(Trainer, name))
    assert not missing, f"transformers {transformers.__version__}'s Trainer no longer has {missing}"
    missing = sorted(name for name in CALLED_TRAINER_MEMBERS if not hasattr(Trainer, name))
    assert not missing, f"transformers {transformers.__version__}'s Trainer no longer has {missing}"


def _fits(ours: inspect.Signature, theirs: inspect.Signature) -> list[str]:
    """What a call that `Trainer` makes with `theirs` would do wrong against `ours` (empty: nothing)."""
    problems = []
    kinds = {p.kind for p in ours.parameters.values()}
    var_positional, var_keyword = inspect.Parameter.VAR_POSITIONAL in kinds, inspect.Parameter.VAR_KEYWORD in kinds
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    our_positional = [p.name for p in ours.parameters.values() if p.kind in positional]
    their_positional = [p for p in theirs.parameters.values() if p.kind in positional]
    for index, param in enumerate(their_positional):
        if index < len(our_positional):
            if our_positional[index] != param.name:
                problems.append(f"argument {index} is {param.name!r} in Trainer, {our_positional[index]!r} here")
        elif not var_positional and not (var_keyword and param.default is not inspect.Parameter.empty):
            # An optional argument that **kwargs takes is passed on by name (as Trainer's own calls pass them).
            problems.append(f"Trainer's argument {param.name!r} is not taken")
    for param in theirs.parameters.values():
        if param.kind == inspect.Parameter.KEYWORD_ONLY and param.name not in ours.parameters and not var_keyword:
            problems.append(f"Trainer's keyword argument {param.name!r} is not taken")
    for param in ours.parameters.values():
        required = param.default is inspect.Parameter.empty and param.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        if required and param.name not in theirs.parameters:
            problems.append(f"{param.name!r} is required here but Trainer has no such argument")
    return problems


@pytest.mark.parametrize("name", sorted(_mixin_overrides()))
def test_each_override_takes_the_arguments_trainer_passes(name):
    ours = inspect.signature(getattr(ZOTrainer, name))
    theirs = inspect.signature(getattr(Trainer, name))
    assert not _fits(ours, theirs), f"{name}{ours} against Trainer.{name}{theirs}: {_fits(ours, theirs)}"
