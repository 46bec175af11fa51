"""ZOTrainer's checks of its set-up: what they refuse (with the fix), and the valid set-ups they let through."""

import pytest
import torch
from torch import nn

from hf_zo import ZOSGD, ZOTrainer
from hf_zo.parallel import DistZOPlugin
from hf_zo.parallel.mesh import ZOMesh
from hf_zo.training.checks import check_sampling_fits_layout

from tiny_models import classification_dataset, lm_dataset, tiny_bert_classifier, tiny_causal_lm, zo_args


def test_a_user_optimizer_holding_the_first_order_head_is_refused(tmp_path):
    """The first-order head is trained by AdamW: a ZO optimizer over all parameters would also perturb it."""
    model = tiny_bert_classifier()
    optimizer = ZOSGD(model.parameters(), lr=1e-3, eps=1e-3)
    args = zo_args(tmp_path, max_steps=2, zo_head_init="none", zo_head_training="first_order")
    trainer = ZOTrainer(model=model, args=args, train_dataset=classification_dataset(8), optimizers=(optimizer, None))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(
        ValueError,
        match=r"holds \['classifier.bias', 'classifier.weight'\], the parameters of the head that "
        r"zo_head_training='first_order' trains first-order .* Build the optimizer without them",
    ):
        trainer.train()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_a_user_optimizer_without_the_first_order_head_trains(tmp_path):
    model = tiny_bert_classifier()
    body = [p for name, p in model.named_parameters() if not name.startswith("classifier.")]
    optimizer = ZOSGD(body, lr=1e-3, eps=1e-3)
    args = zo_args(tmp_path, max_steps=2, zo_head_init="none", zo_head_training="first_order")
    head = model.classifier.weight.detach().clone()
    ZOTrainer(model=model, args=args, train_dataset=classification_dataset(8), optimizers=(optimizer, None)).train()
    assert not torch.equal(model.classifier.weight, head)  # stepped by the head's AdamW


class _SelfSupervised(nn.Module):
    """Computes its loss from the inputs alone (an autoencoder): its forward takes no label argument."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 8)
        self.out = nn.Linear(8, 64)

    def forward(self, input_ids):
        logits = self.out(self.embed(input_ids))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.flatten())}


def _unlabelled(n: int = 8) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 64, (6,), generator=generator)} for _ in range(n)]


def test_a_model_that_takes_no_labels_trains_on_unlabelled_batches(tmp_path):
    trainer = ZOTrainer(model=_SelfSupervised(), args=zo_args(tmp_path, max_steps=2), train_dataset=_unlabelled())
    assert trainer.label_names == []
    trainer.train()
    assert trainer.state.global_step == 2


class _InputLossTrainer(ZOTrainer):
    """A subclass that computes the loss itself, from the inputs."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(input_ids=inputs["input_ids"]).logits
        return logits.float().pow(2).mean()


def test_an_overridden_compute_loss_trains_on_unlabelled_batches(tmp_path):
    data = lm_dataset(8).remove_columns("labels")
    with pytest.raises(ValueError, match="The training batches have no labels"):  # the check, without the override
        ZOTrainer(model=tiny_causal_lm(), args=zo_args(tmp_path, max_steps=2), train_dataset=data)
    trainer = _InputLossTrainer(model=tiny_causal_lm(), args=zo_args(tmp_path, max_steps=2), train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == 2


def test_batch_rebalance_with_perturbation_parallelism_is_refused(tmp_path):
    args = zo_args(tmp_path, train_sampling_strategy="batch_rebalance")
    with pytest.raises(
        ValueError, match="train_sampling_strategy='batch_rebalance' cannot feed perturbation parallelism"
    ):
        check_sampling_fits_layout(args, ZOMesh(dp_size=1, pertp_size=2))
    check_sampling_fits_layout(args, ZOMesh(dp_size=2, pertp_size=1))  # one rank per batch: its sampler fits
    args = zo_args(tmp_path, train_sampling_strategy="group_by_length")
    check_sampling_fits_layout(args, ZOMesh(dp_size=1, pertp_size=2))


def test_batch_rebalance_with_perturbation_parallelism_fails_at_construction(tmp_path, monkeypatch):
    """In one process, a faked mesh of two perturbation-parallel ranks: the trainer refuses before training."""

    def setup(self):
        self.mesh = ZOMesh(dp_size=1, pertp_size=2)
        return self.mesh

    monkeypatch.setattr(DistZOPlugin, "setup", setup)
    args = zo_args(tmp_path, train_sampling_strategy="batch_rebalance")
    with pytest.raises(ValueError, match="or set zo_perturbation_parallel_size=1"):
        ZOTrainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_dataset(8))


def test_the_noise_follows_the_device_offloaded_blocks_compute_on(tmp_path):
    """Offloaded blocks rest in CPU memory; `zo_noise_algorithm="auto"` must pick the generator of the device they
    are perturbed on (torch's on a GPU), not of where they rest."""
    from hf_zo.trainer import build_zo_optimizer

    groups = [{"params": [nn.Parameter(torch.zeros(4))], "weight_decay": 0.0}]  # at rest on the CPU
    args = zo_args(tmp_path, zo_noise_algorithm="auto")
    assert build_zo_optimizer(args, groups, device_type="cuda").noise.algorithm == "torch"
    assert build_zo_optimizer(args, groups).noise.algorithm == build_zo_optimizer(args, groups, "cpu").noise.algorithm
