"""The recipe's sections about the run's surroundings rather than its training (ours): ``profile`` (the profiler)
and ``machine`` (the machine the recipe was written for)."""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt

from hf_tune.recipe.section import Section as _Section


class ProfileSection(_Section):
    """``torch.profiler`` over training steps (``torch.profiler.schedule`` names): skip ``wait`` steps, warm up for
    ``warmup``, record ``active``; the trace, top operators and step-time shares go to ``output_dir/profile/``."""

    wait: int = Field(default=1, ge=0, description="steps skipped first (the first step carries one-off set-up)")
    warmup: int = Field(default=1, ge=0, description="steps profiled but discarded (profiler start-up)")
    active: PositiveInt = Field(default=3, description="steps recorded")
    record_shapes: bool = Field(default=True, description="input shapes of each operator, in the trace")
    with_stack: bool = Field(default=False, description="Python stacks and nn.Module names (slower)")
    profile_memory: bool = Field(default=False, description="tensor allocations")


class MachineSection(_Section):
    """The machine a recipe was written for (``hf-tune init`` writes it): ``plan`` plans for it unless told
    otherwise (``--world-size``) and says whether the estimated peak fits its GPU memory."""

    world_size: PositiveInt = Field(default=1, description="processes (GPUs) the run is launched on")
    gpu_memory_gb: PositiveFloat | None = Field(default=None, description="memory of one GPU, in GB (2**30 bytes)")
