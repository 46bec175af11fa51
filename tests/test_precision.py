"""bf16/fp16: perturb/restore drift is measured, exact restore removes it, bf16 training tracks fp32."""

import pytest
import torch

from hf_zo import ZOConfig, ZOTrainer
from hf_zo.optim import ZOSGD

from tiny_models import lm_dataset, tiny_causal_lm


def _drift_after_lr0_steps(dtype, exact_restore, steps=20):
    model = tiny_causal_lm("opt").to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer = ZOSGD(params, lr=0.0, eps=1e-3, exact_restore=exact_restore)
    batch = torch.arange(2, 34).view(2, 16)
    with torch.no_grad():
        for _ in range(steps):
            optimizer.step(lambda: model(input_ids=batch, labels=batch).loss)
    optimizer.flush()
    return max((p.float() - b.float()).abs().max().item() for p, b in zip(params, before))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_restore_removes_low_precision_drift(dtype):
    assert _drift_after_lr0_steps(dtype, exact_restore=True) == 0.0
    drift = _drift_after_lr0_steps(dtype, exact_restore=False)
    assert 0.0 < drift < 0.05  # subtracting the noise drifts by a few ulps per step; bounded, not exact


def test_exact_restore_is_automatic_for_small_low_precision_sets():
    model = tiny_causal_lm("opt").to(torch.bfloat16)
    assert ZOSGD(model.parameters(), lr=0.0).estimator.exact_restore
    assert not ZOSGD(tiny_causal_lm("opt").parameters(), lr=0.0).estimator.exact_restore


def test_bf16_training_tracks_fp32(tmp_path):
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_causal_lm("opt").to(dtype)
        data = lm_dataset(16)
        args = ZOConfig(
            output_dir=str(tmp_path / str(dtype)),
            max_steps=200,
            per_device_train_batch_size=4,
            learning_rate=3e-3,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
        )
        trainer = ZOTrainer(model=model, args=args, train_dataset=data)
        start = trainer.evaluate(data)["eval_loss"]
        trainer.train()
        losses[dtype] = (start, trainer.evaluate(data)["eval_loss"])
    (fp32_start, fp32_end), (bf16_start, bf16_end) = losses[torch.float32], losses[torch.bfloat16]
    assert fp32_end < fp32_start - 0.3 and bf16_end < bf16_start - 0.3
    assert abs(bf16_end - fp32_end) < 0.15, losses
