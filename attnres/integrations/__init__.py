"""Bridges from attnres' models into the training engines people run at scale.

- ``attnres.integrations.torchtitan``: every residual scheme as a torchtitan model spec
  (``torchtitan.train --module attnres.integrations.torchtitan --config block_debugmodel``), with its
  parallelize function (tensor parallel, FSDP2, activation checkpointing, compile) and the AttnRes
  parameters kept out of weight decay. Needs the ``torchtitan`` extra.

Hugging Face Trainer and Accelerate need no bridge here: ``examples/hf_trainer.py`` fine-tunes a
retrofitted model (``attnres.hf.retrofit``) with ``transformers.Trainer`` directly.
"""
