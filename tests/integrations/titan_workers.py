"""Workers of tests/integrations/test_titan_parallel.py (importable by spawned children: the test
module puts this folder on sys.path before it spawns them)."""

import torch
from reference import randomize

VOCAB, BATCH, SEQ = 64, 4, 16


def model_config(residual: str, options=None):
    """``options``: further ModelConfig fields (another backbone)."""
    from attnres.model import ModelConfig

    fields = dict(vocab_size=VOCAB, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=SEQ)
    return ModelConfig(**{**fields, **(options or {})}, residual=residual)


def reference_state(residual: str, options=None) -> dict:
    """float32 weights of a plain AttnResLM, the residual parameters moved off their zero init."""
    from attnres.model import AttnResLM

    torch.manual_seed(0)
    model = AttnResLM(model_config(residual, options))
    randomize(model.residual, seed=2)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def trainer_settings(ac: bool, compile_backend: str | None, tp: int):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC

    training = TrainingConfig(seq_len=SEQ, mixed_precision_param="float32")
    parallelism = ParallelismConfig(
        tensor_parallel_degree=tp, spmd_backend="partial_dtensor", enable_sequence_parallel=False
    )
    compile_config = CompileConfig(enable=compile_backend is not None, backend=compile_backend or "inductor")
    return training, parallelism, compile_config, FullAC.Config() if ac else None


def titan_case(rank, world, case, out_path):
    """Build the spec's model on the meta device, parallelize it as torchtitan's Trainer does (tp and
    dp_shard from ``case``), init, load the reference weights, run forward + backward on this rank's
    rows; rank 0 saves the loss (averaged over data-parallel ranks) and the full gradients."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed import ParallelDims

    from attnres.integrations.torchtitan import model_spec
    from attnres.integrations.torchtitan.model import _copy_into
    from attnres.model.llama import lm_loss

    parallel_dims_module.device_type = "cpu"  # torchtitan builds its meshes on CUDA; gloo here
    tp, dp = case["tp"], world // case["tp"]
    training, parallelism, compile_config, ac = trainer_settings(case["ac"], case["compile"], tp)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=world, spmd_backend="partial_dtensor"
    )
    dims.build_mesh()
    spec = model_spec(model_config(case["residual"], case.get("options")))
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=ac,
        dump_folder="",
    )
    model.to_empty(device="cpu")
    model.init_weights()
    for name, tensor in model.state_dict().items():
        _copy_into(tensor, case["state"][name])
    model.train()
    x, y = batch()
    rows = slice(rank // tp * (BATCH // dp), (rank // tp + 1) * (BATCH // dp))
    loss = lm_loss(model(x[rows]), y[rows])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = g.detach().clone()
    shown = ("blocks.0.attn.q_proj.weight", "residual.queries")
    placements = {n: str(p.placements) for n, p in model.named_parameters() if n in shown}
    if rank == 0:
        torch.save({"loss": (total / world).item(), "grads": grads, "placements": placements}, out_path)
