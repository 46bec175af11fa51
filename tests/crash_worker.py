"""A training run that the crash-safety tests kill with SIGKILL and resume (run as a script).

Usage: python crash_worker.py OUTPUT_DIR [slow|offload]. Resumes from the last complete checkpoint in OUTPUT_DIR if
any, prints "STEP n" after every optimizer step (and "SAVING" inside each checkpoint save with `slow`), and writes
the final weights to OUTPUT_DIR/final_state.pt. With `offload`, the blocks stream from the disk tier (dual engine,
ZO-SGD), the weights of the steps being written back to the block files as the kill lands.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from hf_zo import ZOConfig, ZOTrainer  # noqa: E402

from tiny_models import lm_dataset, tiny_causal_lm  # noqa: E402


class ReportSteps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        print(f"STEP {state.global_step}", flush=True)


def main(output_dir: str, mode: str) -> None:
    torch.set_num_threads(1)
    offload = {}
    if mode == "offload":
        offload = {"zo_engine": "dual", "zo_offload": "disk", "zo_offload_dir": os.path.join(output_dir, "blocks")}
    args = ZOConfig(
        output_dir=output_dir,
        max_steps=16,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        zo_optimizer="zo_sgd" if offload else "zo_adam",
        seed=3,
        **offload,
    )
    trainer = ZOTrainer(
        model=tiny_causal_lm("opt"), args=args, train_dataset=lm_dataset(24), callbacks=[ReportSteps()]
    )
    if mode == "slow":  # widen the window in which a kill lands inside a checkpoint save
        save_rng_state = trainer._save_rng_state

        def slow_save_rng_state(folder):
            print("SAVING", flush=True)
            time.sleep(0.3)
            save_rng_state(folder)

        trainer._save_rng_state = slow_save_rng_state
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    trainer.train(resume_from_checkpoint=last)
    trainer.save_model()
    torch.save(trainer.model.state_dict(), os.path.join(output_dir, "final_state.pt"))
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
