"""torchtitan's own Trainer (torchtitan.trainer.Trainer, as `python -m torchtitan.train` builds it) on
attnres' model spec, in one CPU process: run by tests/integrations/test_titan_trainer.py as
``python titan_cpu_trainer.py WORKDIR STEPS [torchtitan flags...]`` (or under ``torchrun`` for several
gloo processes); rank 0 prints {step: loss} as JSON.

torchtitan 0.3 trains on CUDA only: its device module, device type and process-group timeouts are
module globals set for CUDA at import. This script points them at the CPU before the Trainer is
built (test-only: the integration under test does not touch them), joins a gloo group (torchtitan
then skips its own NCCL one), and feeds the Trainer a byte-level tokenizer and a JSON
lines corpus written from attnres' bundled Shakespeare.
"""

import json
import os
import sys
import types

import torch.distributed as dist


def cpu_device_module():
    """What torchtitan calls on its device module, for the CPU."""
    return types.SimpleNamespace(
        set_device=lambda device: None,
        device_count=lambda: 1,
        get_device_name=lambda device=None: "cpu",
        current_device=lambda: 0,
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=2**30),
        reset_peak_memory_stats=lambda: None,
        empty_cache=lambda: None,
        memory_stats=lambda device=None: {},
        synchronize=lambda device=None: None,
        is_available=lambda: True,
    )


def write_assets(work: str) -> None:
    """The tokenizer (``work/tokenizer``) and the data (``work/data``)."""
    from attnres.data import prepare_data
    from attnres.hf import hf_tokenizer

    data = prepare_data(tokenizer="byte")
    tokenizer_dir, data_dir = os.path.join(work, "tokenizer"), os.path.join(work, "data")
    if not os.path.isdir(data_dir):
        hf_tokenizer(data.tokenizer).save_pretrained(tokenizer_dir)
        os.makedirs(data_dir)
        text = data.tokenizer.decode([int(t) for t in data.train.tokens[:100_000]])
        with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
            for i in range(0, len(text), 2000):
                f.write(json.dumps({"text": text[i : i + 2000]}) + "\n")


def main(work: str, steps: int, flags: list[str]) -> dict[int, float]:
    if "RANK" not in os.environ:  # not under torchrun: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29731")
    dist.init_process_group("gloo")
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type, titan_utils.device_module = "cpu", cpu_device_module()
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as titan_dist

    parallel_dims.device_type = "cpu"
    titan_dist.set_pg_timeouts = lambda *args, **kwargs: None  # gloo groups have no set_timeout here
    import torchtitan.components.metrics as metrics
    from torchtitan.config.manager import ConfigManager

    tokenizer_dir, data_dir = os.path.join(work, "tokenizer"), os.path.join(work, "data")
    if dist.get_rank() == 0:
        write_assets(work)
    dist.barrier()
    config = ConfigManager().parse_args(
        ["--module", "attnres.integrations.torchtitan", "--config", "block_debugmodel"]
        + ["--hf_assets_path", tokenizer_dir, "--dataloader.dataset_path", data_dir]
        + ["--dump_folder", os.path.join(work, "out"), "--training.steps", str(steps)]
        + ["--training.seq_len", "64", "--training.local_batch_size", "2", "--debug.seed", "0"]
        + ["--training.mixed_precision_param", "float32", "--optimizer.implementation", "for-loop"]
        + flags
    )
    config.model_spec.model.lm.vocab_size = 256  # the byte tokenizer's vocabulary

    losses: dict[int, float] = {}
    log_metrics = metrics.MetricsProcessor.log

    def record(self, step, global_avg_loss, *args, **kwargs):
        losses[step] = float(global_avg_loss)
        return log_metrics(self, step, global_avg_loss, *args, **kwargs)

    metrics.MetricsProcessor.log = record
    trainer = config.build()
    trainer.train()
    trainer.close()
    return losses


if __name__ == "__main__":
    result = main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
    if dist.get_rank() == 0:
        print("LOSSES " + json.dumps(result), flush=True)
    dist.destroy_process_group()
