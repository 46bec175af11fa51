"""The releases of hf_zo's dependencies that its tests run against, checked when hf_zo is imported.

`RANGES` are pyproject.toml's ranges (tests/test_dependency_versions.py keeps the two equal; docs/results/
compatibility.md records the suite run at each end). A release outside them fails at import with a message that names
the range, rather than later with an error from a private `Trainer` method. `HF_ZO_SKIP_VERSION_CHECK=1` skips the
check, to try another release at one's own risk.
"""

from __future__ import annotations

import os
from importlib import metadata

from packaging.specifiers import SpecifierSet

RANGES = {
    "torch": ">=2.6",
    "transformers": ">=5.16,<6",
    "peft": ">=0.18,<1",
    "accelerate": ">=1.10.1,<2",
}
"""What `import hf_zo` needs."""

EXTRA_RANGES = {"trl": ">=1.16,<2"}
"""What an optional part needs: TRL for `ZOSFTTrainer` (`pip install "hf-zo[trl]"`)."""

SKIP_VARIABLE = "HF_ZO_SKIP_VERSION_CHECK"


def check_dependency_versions(ranges: dict[str, str] = RANGES) -> None:
    """Raise an `ImportError` naming the tested range for an installed package outside it (one not installed is left
    to its own import's error)."""
    if os.environ.get(SKIP_VARIABLE, "") not in ("", "0"):
        return
    for name, specifier in ranges.items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if not SpecifierSet(specifier).contains(version, prereleases=True):
            raise ImportError(
                f"hf_zo is tested with {name}{specifier} and found {name} {version}. Install a release in that range: "
                f'pip install "{name}{specifier}" (or set {SKIP_VARIABLE}=1 to try this one at your own risk).'
            )


check_dependency_versions()  # on `import hf_zo`, before anything reaches transformers' private Trainer methods
