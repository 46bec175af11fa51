"""How far do weights drift when perturb/restore runs in low precision? (issue: MeZO's silent fp16 divergence)

For a random OPT (the `small` shape of step_cost.py unless --shape says otherwise), runs N ZO-SGD steps with
learning rate 0 (so any change is drift) in fp32, bf16 and fp16, with the default restore (subtract the noise)
and with `exact_restore=True` (copy back), and prints one JSON line per case: the largest absolute change, the RMS
change relative to the weights' RMS, and the median change in units of the weight's ulp (nonzero weights), per step.

    python benchmarks/precision_drift.py --steps 50
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_zo.optim import ZOSGD


def build(shape: str, dtype: torch.dtype):
    from step_cost import build_model

    return build_model(shape, lora=False).to(dtype).eval()


def drift(shape: str, dtype: torch.dtype, exact_restore: bool, steps: int, eps: float) -> dict:
    model = build(shape, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer = ZOSGD(params, lr=0.0, eps=eps, exact_restore=exact_restore)
    vocab = model.config.vocab_size
    batch = torch.randint(2, vocab, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(steps):
            optimizer.step(lambda: model(input_ids=batch, labels=batch).loss)
    optimizer.flush()
    delta = torch.cat([(p.float() - b.float()).flatten() for p, b in zip(params, before)])
    base = torch.cat([b.float().flatten() for b in before])
    ulp = torch.cat([_ulp(b).flatten() for b in before])
    return {
        "shape": shape,
        "dtype": str(dtype).replace("torch.", ""),
        "exact_restore": exact_restore,
        "steps": steps,
        "eps": eps,
        "max_abs_drift": delta.abs().max().item(),
        "relative_rms_drift": (delta.pow(2).mean().sqrt() / base.pow(2).mean().sqrt()).item(),
        "median_ulps_per_step_nonzero_weights": (delta.abs() / ulp)[base != 0].median().item() / steps,
        "changed_fraction": (delta != 0).float().mean().item(),
    }


def _ulp(tensor: torch.Tensor) -> torch.Tensor:
    next_up = torch.nextafter(tensor, torch.full_like(tensor, float("inf")))
    return (next_up.float() - tensor.float()).abs()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="small")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--eps", type=float, default=1e-3)
    args = parser.parse_args()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for exact in (False, True):
            print(json.dumps(drift(args.shape, dtype, exact, args.steps, args.eps)), flush=True)


if __name__ == "__main__":
    main()
