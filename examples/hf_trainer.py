"""The Hugging Face `Trainer` saving through DCS: `DCSCallback` and `resume_from_checkpoint`.

    dcs up                                        # another shell (a worker on this host, Redis)
    set -a; . .dcs-run/dcs.env; set +a            # the same settings in this shell
    python examples/hf_trainer.py --steps 30      # saves steps 10, 20, 30
    python examples/hf_trainer.py --steps 50      # resumes from step 30, saves 40 and 50

A one-layer GPT-2 built from its config (nothing downloaded) trained by transformers' own `Trainer` with
`save_strategy="steps"`, `save_steps=10`; each save is a committed DCS step (`dcs ckpt list --run hf-example`)
holding the model, optimizer, scheduler, RNG and trainer state, and no `checkpoint-N` folder is written. Started
again it resumes from the newest verified step. docs/integrations/hf_trainer.md has the details.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from dcs_tasks import DCSConfig
from dcs_tasks.integrations.hf import DCSCallback


class SayWhereItStarts(TrainerCallback):
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step:
            print(f"resumed from step {state.global_step}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="hf-example")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=16))
    tokens = torch.randint(0, 128, (256, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in tokens]

    dcs = DCSCallback(args.run, DCSConfig())  # DCS_* environment: DCS_REDIS_URL, DCS_CHECKPOINT_DIR, ...
    with tempfile.TemporaryDirectory() as output_dir:  # the Trainer's logs; no checkpoint folder lands there
        training = TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=8,
            save_strategy="steps",
            save_steps=10,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[dcs])
        trainer.add_callback(SayWhereItStarts())
        # resume_from_checkpoint(): the newest verified step laid out for the Trainer; None when there is none yet
        trainer.train(resume_from_checkpoint=dcs.resume_from_checkpoint())  # its end waits for the saves in flight
    steps = [info.step for info in dcs.checkpointer.list()]
    dcs.close()
    print(f"trained to step {trainer.state.global_step}; committed steps: {steps}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
