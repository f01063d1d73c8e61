from .config import AdamConfig, MuonConfig, OptimizerConfig, SophiaHConfig, lr_schedule_fn
from .skip_steps import SkipBadSteps, SkipBadStepsState, skip_bad_steps, spike_skipped

__all__ = [
    "AdamConfig",
    "MuonConfig",
    "OptimizerConfig",
    "SkipBadSteps",
    "SkipBadStepsState",
    "SophiaHConfig",
    "lr_schedule_fn",
    "skip_bad_steps",
    "spike_skipped",
]
