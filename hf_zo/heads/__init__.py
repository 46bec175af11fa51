"""Classification heads that zeroth-order training can cope with.

A newly initialised head is where ZO struggles most: the two-point estimate spreads one scalar over every trainable
parameter, so a random head and a frozen body learn almost nothing in a few thousand steps. Two remedies, selected
by `ZOConfig.zo_head_init` and `ZOConfig.zo_head_training`:

- **linear probing** (`probe`, MeZO's LP-then-MeZO): before ZO starts, the head's input features are collected over
  a random sample of the training set (one forward pass per example, no gradients) and a logistic regression fitted
  on them is written into the head's last `nn.Linear`;
- **first-order head** (`first_order`): the head is trained with exact gradients (a small AdamW on the head
  parameters only) while the body stays zeroth-order. The head is taken out of the ZO parameter set; its gradients
  come from the two ZO forward passes themselves (autograd is switched on at the head's input and the input is
  detached), so the only extra memory is the head's activations, gradients and AdamW moments. Under DistZO2 the
  gradients are summed over the mesh in one process's order (`gradients`).

`callback` applies the options to a `ZOTrainer` run.
"""

from .callback import (
    HEAD_OPTIMIZER_NAME,
    ZOHeads,
    find_head_modules,
    first_order_parameter_names,
    head_parameter_names,
    is_sequence_classifier,
    prepare_zo_heads,
    resolve_head_options,
)
from .first_order import FirstOrderHead, schedule_scale
from .gradients import sum_in_single_process_order
from .probe import (
    PROBE_L2_GRID,
    collect_head_inputs,
    cross_validated_l2,
    example_lengths,
    fit_linear_probe,
    fit_logistic_regression,
    last_trainable_linear,
    probe_examples,
)

__all__ = [
    "HEAD_OPTIMIZER_NAME",
    "PROBE_L2_GRID",
    "FirstOrderHead",
    "ZOHeads",
    "collect_head_inputs",
    "cross_validated_l2",
    "example_lengths",
    "find_head_modules",
    "first_order_parameter_names",
    "fit_linear_probe",
    "fit_logistic_regression",
    "head_parameter_names",
    "is_sequence_classifier",
    "last_trainable_linear",
    "prepare_zo_heads",
    "probe_examples",
    "resolve_head_options",
    "schedule_scale",
    "sum_in_single_process_order",
]
