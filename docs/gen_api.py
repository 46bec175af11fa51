"""Regenerate docs/api.md from the code: `python docs/gen_api.py` (from the repository root).

Every public object (the `__all__` of each module below) gets its signature and the first paragraph of its
docstring; `ZOConfig` gets its whole docstring. tests/test_examples.py checks that no public name is missing.
"""

import importlib
import inspect
import os
import re

HEADER = """# API reference

Every public object of hf_zo, by module, with its signature and what it is for. The objects re-exported by
`import hf_zo` (its `__all__`) are: `ZOConfig`, `ZOTrainer`, `ZOSFTConfig` and `ZOSFTTrainer` (TRL's `SFTTrainer`
under ZO, imported on first use; `pip install "hf-zo[trl]"`), the optimizers (`ZOOptimizer`, `ZOSGD`, `ZOSGDMomentum`,
`ZOSGDSign`, `ZOSGDConservative`, `ZOAdam`, `LOZO`, `HiZOO`, `FZOO`, `ZO_OPTIMIZERS`), the pooled sentence-encoder
classifier (`PooledEncoderConfig`, `PooledEncoderForSequenceClassification`, `load_sequence_classifier`), the model
helpers (`embedded_llm_path`, `norm_module_names`, `is_norm_module`), `PromptClassification`, the estimator
(`ZORecord`, `LazyParameters`, `SPSAEstimator`), the noise (`Noise`, `NoiseUpdate`, `perturb_`,
`restore_and_update_`) and the trajectory API (`ZOTrajectory`, `ZOTrajectoryStep`, `ZOTrajectoryCallback`,
`replay`, `push_trajectory_to_hub`, `TRAJECTORY_NAME`, `TrajectoryFormatError`, `TrajectoryMismatchError`).
Everything else is imported from its module (`from hf_zo.heads import fit_linear_probe`). Signatures and summaries
are taken from the code; the docstrings (`help(obj)`) have the full argument lists.

The command line: `hf-zo replay BASE TRAJECTORY OUT` and `hf-zo inspect TRAJECTORY` (module `hf_zo.cli`, see
[trajectories](trajectory.md)) and `hf-zo embedded-llm` (prints the embedded LLM's folder); `python -m hf_zo.demo` is
`make demo`; `examples/train.py` is described in
[examples/README.md](../examples/README.md).

## Trainer and configuration

"""

SECTIONS = [
    (
        "Trainer and configuration",
        "hf_zo.trainer",
        ["ZOTrainer", "ZOTrainerMixin", "build_zo_optimizer"],
    ),
    ("", "hf_zo.training.config", ["ZOConfig", "HEAD_INIT_CHOICES", "HEAD_TRAINING_CHOICES"]),
    ("Learning rate and eps by method", "hf_zo.training.defaults", None),
    ("Set-up checks", "hf_zo.training.checks", None),
    ("Arguments given to the trainer", "hf_zo.training.arguments", None),
    ("Pending updates", "hf_zo.training.pending_updates", None),
    ("Parameter groups", "hf_zo.training.param_groups", None),
    ("Model and data under the distributed layout", "hf_zo.training.layout", None),
    ("The head options of a ZO run", "hf_zo.training.heads", None),
    (
        "Crash-safe checkpoints",
        "hf_zo.training.checkpointing",
        [
            "ZOCheckpointingMixin",
            "GlobalStepStamp",
            "check_resumable",
            "clean_interrupted_saves",
            "publish_checkpoint",
            "replace_files_atomically",
        ],
    ),
    ("TRL: supervised fine-tuning under ZO", "hf_zo.sft", None),
    (
        "Tested dependency versions",
        "hf_zo.dependency_versions",
        ["RANGES", "EXTRA_RANGES", "check_dependency_versions"],
    ),
    ("Optimizers", "hf_zo.optim", None),
    ("Estimator", "hf_zo.estimator", ["ZORecord", "LazyParameters", "SPSAEstimator", "make_record"]),
    (
        "Noise",
        "hf_zo.noise",
        [
            "Noise",
            "NoiseUpdate",
            "perturb_",
            "restore_and_update_",
            "mix_seed",
            "resolve_noise_algorithm",
            "NOISE_DISTRIBUTIONS",
            "NOISE_ALGORITHMS",
        ],
    ),
    ("Noise kernel (Philox-4x32-10 + Box-Muller)", "hf_zo.philox", None),
    ("Classification heads", "hf_zo.heads", None),
    ("Sentence-encoder classifiers", "hf_zo.models.pooled_classifier", None),
    ("Norm tuning (PEFT `LNTuningConfig` on any model)", "hf_zo.models.norm_layers", None),
    ("The embedded LLM", "hf_zo.models.smollm2", None),
    ("Quantized bases (bitsandbytes)", "hf_zo.models.quantized", None),
    ("Prompt-based classification (MeZO's recipe)", "hf_zo.prompts", None),
    ("PEFT's warnings that nobody can act on", "hf_zo.peft_warnings", None),
    ("Training batches grouped by length", "hf_zo.training.sampling", None),
    ("Metrics", "hf_zo.metrics", None),
    ("Execution engines", "hf_zo.engine", None),
    ("Offload", "hf_zo.offload", None),
    ("Distributed (DistZO2)", "hf_zo.parallel", None),
    ("Trajectories", "hf_zo.trajectory", None),
]


def first_paragraphs(doc, n=1):
    if not doc:
        return ""
    doc = inspect.cleandoc(doc)
    parts = [p for p in re.split(r"\n\s*\n", doc) if p.strip()]
    return "\n\n".join(parts[:n])


def summary(doc):
    """The first paragraph of `doc` on one line."""
    return " ".join(first_paragraphs(doc, 1).split()) if doc else ""


def signature(obj):
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    sig = re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", sig)
    sig = re.sub(r" at 0x[0-9a-f]+", "", sig)
    sig = re.sub(r"(: |-> )'([^']*)'", r"\1\2", sig)
    return sig


out = []
for title, modname, names in SECTIONS:
    mod = importlib.import_module(modname)
    names = names or list(mod.__all__)
    if title:
        out.append(f"## {title}\n")
    out.append(f"Module `{modname}`.\n")
    for name in names:
        obj = getattr(mod, name)
        if inspect.isclass(obj):
            kind = "class"
            sig = "(output_dir=None, ..., zo_eps=1e-3, ...)" if name in ("ZOConfig", "ZOSFTConfig") else signature(obj)
            out.append(f"### `{name}{sig}`\n")
            out.append(f"*class* `{obj.__module__}.{name}`\n")
            if name == "ZOConfig":
                body = inspect.cleandoc(obj.__doc__).split("\n", 2)[2]
                out.append("```text\n" + body.strip() + "\n```\n")
            else:
                out.append(first_paragraphs(obj.__doc__, 1) + "\n")
            methods = [
                m
                for m, v in vars(obj).items()
                if not m.startswith("_") and callable(v) and getattr(v, "__doc__", None)
            ]
            props = [m for m, v in vars(obj).items() if not m.startswith("_") and isinstance(v, property)]
            if methods or props:
                for m in methods:
                    v = getattr(obj, m)
                    method_sig = signature(v).replace("(self, ", "(").replace("(self)", "()")
                    out.append(f"- `{m}{method_sig}`: {summary(v.__doc__)}")
                for m in props:
                    out.append(f"- `{m}` (property): {summary(vars(obj)[m].__doc__)}")
                out.append("")
        elif callable(obj):
            out.append(f"### `{name}{signature(obj)}`\n")
            out.append(f"*function* `{obj.__module__}.{name}`\n")
            out.append(first_paragraphs(obj.__doc__, 1) + "\n")
        else:
            if isinstance(obj, str) and os.path.isabs(obj):  # a path inside the package: the same on every machine
                obj = os.path.relpath(obj, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            out.append(f"### `{name}`\n")
            out.append(
                f"*constant* `{modname}.{name}` = `{obj!r}`\n"
                if len(repr(obj)) < 100
                else f"*constant* `{modname}.{name}`\n"
            )
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "api.md")
with open(path, "w") as f:
    f.write(HEADER + "\n".join(out).rstrip() + "\n")
