"""A Hugging Face Trainer on a tiny randomly initialised GPT-2 (no download), with a slow collator
(data) and a forward that sleeps. `--callback` adds steptimer.hf.StepTimerCallback instead."""

import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from sleepy import SLEEP_MS


class SleepyGPT2(GPT2LMHeadModel):
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            time.sleep(SLEEP_MS["forward"] / 1e3)
        return super().forward(*args, **kwargs)


def collate(rows):
    time.sleep(SLEEP_MS["data"] / 1e3)
    ids = torch.stack([r["input_ids"] for r in rows])
    return {"input_ids": ids, "labels": ids.clone()}


if __name__ == "__main__":
    out, accum = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = SleepyGPT2(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32))
    data = [{"input_ids": torch.randint(0, 128, (16,))} for _ in range(4 * accum * 12)]
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=accum, max_steps=12,
        report_to=[], use_cpu=True, save_strategy="no", dataloader_num_workers=0, logging_steps=100,
        max_grad_norm=1.0, disable_tqdm=True, remove_unused_columns=False,
    )
    callbacks = []
    if "--callback" in sys.argv:
        from steptimer.hf import StepTimerCallback

        callbacks.append(StepTimerCallback(warmup_steps=1, log_every_n_steps=4))
    Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=callbacks).train()
    print("TRAINED")
