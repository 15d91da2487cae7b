"""A parallel layout checked against the model before any rank starts: each tensor-parallel rank
needs an equal slice of the heads, experts and MLP widths, each pipeline stage a decoder layer."""

from __future__ import annotations

from components.models import describe_model
from components.options import bad_option


def check_tensor_parallel(model: str, ranks: int) -> None:
    """--tensor-parallel-size against the model's heads, experts and MLP widths (each rank gets an
    equal slice); names the sizes that would work."""
    from components.engine.parallel import tensor_parallel_problem

    if ranks <= 1:
        return
    cfg = describe_model(model)[1]
    problem = tensor_parallel_problem(cfg, ranks)
    if problem is not None:
        fits = [n for n in range(1, max(2, cfg.num_attention_heads) + 1) if tensor_parallel_problem(cfg, n) is None]
        raise bad_option("--tensor-parallel-size", ranks,
                         f"{problem}; this model splits over {', '.join(map(str, fits))}")


def check_pipeline_stages(model: str, stages: int) -> None:
    """--pipeline-parallel-size against the model's decoder layers (each stage needs one)."""
    layers = describe_model(model)[1].num_hidden_layers
    if stages > layers:
        raise bad_option("--pipeline-parallel-size", stages,
                         f"the model has {layers} decoder layers: at most {layers} stages")
