"""Scale-out on torch.distributed: data parallel (DDP, FSDP2), tensor parallel, and pipeline parallel with
cross-stage caching of block representations (docs/method.md §7).

- ``pipeline``: the model cut into chunks, ``torch.distributed.pipelining`` stages and schedules,
  the cross-stage cache and its byte accounting;
- ``runtime``: the strategies the Trainer drives (one process, data parallel, pipeline);
- ``tensor``: tensor parallelism (heads and MLP units split, the depth attention replicated) on a
  (dp, tp) device mesh;
- ``state``: checkpoints in the single-process format whatever the layout;
- ``report``: the traffic table next to docs/method.md §7's formulas.
"""

# the pipeline schedules we support (importable without torch.distributed, for the CLI)
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
